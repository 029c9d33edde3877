"""Partial rollouts (``rollout.over_provision`` o > 1, APRIL): the metrics both samplers log,
and the env sampler's episodes in flight. (The prompt sampler's groups in flight are text
prefixes, kept in :mod:`mmrl.samplers.prompt`.)

**Env episodes.**
A process holding groups [f, f + L) of a step keeps P = ⌈(f + L)·o⌉ − ⌈f·o⌉ groups of G
episodes in flight, one env each (``env.num_envs`` ≥ P·G; envs beyond step along, masked).
A collection steps them all, one policy call per decision for every env, and stops at the
first decision boundary where L groups have ended every episode; the step trains on those
(the oldest first). The others keep their envs: the next collection goes on stepping them
from where they are, under the weights of then, while the envs of the groups that left are
reset (gymnasium's ``reset_mask``) with fresh groups. Each decision is tagged with the
policy version that sampled it (``info["decision_version"]``), and a sample's
``policy_version`` is its first decision's.

A policy that ``carries_state`` (a language agent's conversation) keeps each env's carry
across collections: a fresh episode starts with none, and an episode that goes on has it
passed through ``policy.renew_carry`` first, since an update came between (the agent drops
its key/value states there, which the old weights computed). APRIL by turn: an unfinished
conversation waits for the next collection at a turn boundary. With GiGPO's state groups each
decision's observation is keyed as a whole wave keys it.

A fresh group's reset seed is ``group_seed(seed, step, g)`` with g its index among the
step's fresh groups (from ⌈f·o⌉ at the first collection, from f later), as whole waves seed
theirs. What is in flight lives in the simulator, which cannot be checkpointed: ``--resume``
and an evaluation on the same env (``workers: 0``) start the groups in flight afresh (counted
in ``partial/restarted``).
"""

from __future__ import annotations

import hashlib
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmrl.core.rollout import Rollout
from mmrl.core.sampler import group_seed
from mmrl.errors import ConfigError, UserCodeError


def partial_metrics(rollout: Rollout) -> dict[str, torch.Tensor]:
    """Per trained sample: ``partial/resumed_rate`` (begun in an earlier step),
    ``partial/steps_in_flight`` and ``partial/version_span`` (newest minus oldest version of its
    decisions); empty for a rollout that is not partial."""
    if "steps_in_flight" not in rollout.info:
        return {}
    spans = rollout.info["steps_in_flight"].cpu()
    tags, mask = rollout.info["decision_version"].cpu(), rollout.mask.cpu() > 0
    newest = tags.masked_fill(~mask, -1).amax(1)
    return {
        "partial/resumed_rate": (spans > 1).float(),
        "partial/steps_in_flight": spans.float(),
        "partial/version_span": (newest - rollout.policy_version.cpu()).clamp(min=0).float(),
    }


def _rows(x, row: int):
    if isinstance(x, dict):
        return {k: _rows(v, row) for k, v in x.items()}
    return x[row : row + 1]


class EpisodesInFlight:
    """The groups in flight of one :class:`~mmrl.samplers.env.EnvSampler` and their envs."""

    def __init__(self, sampler, over_provision: float, seed: int):
        self.sampler, self.o, self.seed = sampler, over_provision, seed
        self.groups: list[dict[str, Any]] = []  # in flight, oldest first: {"born", "envs": [env index] * G}
        self.episodes: dict[int, dict[str, Any]] = {}  # env index -> the records of its episode
        self.obs = None
        self.reset_seeds: list[int | None] = [None] * sampler.num_envs  # env index -> the reset seed of its episode
        self.started = False  # the first collection has taken its ⌈·o⌉ groups
        self.restarted = 0
        self.carry: list | None = None  # a policy that carries_state: env index -> its episode's carry

    def drop(self) -> None:
        """Forget the groups in flight (their envs are about to be reset by someone else)."""
        if self.groups:
            self.restarted += len(self.groups)
        self.groups, self.episodes, self.obs, self.carry = [], {}, None, None

    def collect(self, policy, num_groups: int, group_size: int, step: int, group_offset: int, version: int) -> Rollout:
        s = self.sampler
        provision = math.ceil((group_offset + num_groups) * self.o) - math.ceil(group_offset * self.o)
        if s.num_envs < provision * group_size:
            raise ConfigError(
                "env.num_envs", s.num_envs,
                f"partial rollouts (rollout.over_provision {self.o:g}) keep {provision} groups x {group_size} episodes in flight, one env each: use at least {provision * group_size}",
            )
        first = math.ceil(group_offset * self.o) if not self.started else group_offset
        self.started = True
        busy = {e for g in self.groups for e in g["envs"]}
        free = [e for e in range(s.num_envs) if e not in busy]
        fresh = provision - len(self.groups)
        seeds = [0] * s.num_envs
        reset = np.zeros(s.num_envs, dtype=bool)
        for j in range(fresh):
            envs = free[j * group_size : (j + 1) * group_size]
            seed = group_seed(self.seed, step, first + j) % 2**31
            for e in envs:
                seeds[e], reset[e] = seed, True
                self.reset_seeds[e] = seed
                self.episodes[e] = {"decisions": [], "versions": [], "keys": [], "reward": [], "term": [], "trunc": [], "success": [], "chunk": [], "alive": True}
            self.groups.append({"born": step, "envs": envs})
        carries = policy.carries_state
        if carries:
            # the episodes that go on were carried under the weights before the last update
            self.carry = [None] * s.num_envs if self.carry is None else policy.renew_carry(list(self.carry))
            for e in np.flatnonzero(reset).tolist():
                self.carry[e] = None  # a fresh episode starts without one
        if reset.any():
            self._reset(seeds, reset)
        generator = torch.Generator().manual_seed(group_seed(self.seed, step, group_offset))
        device = device_of(policy)
        cap = s.config.max_decisions
        no_success = np.zeros(s.num_envs, dtype=bool)
        while self._finished() < num_groups:
            live = [e for e, ep in self.episodes.items() if ep["alive"]]
            if s.state_keys:
                for e in live:
                    self.episodes[e]["keys"].append(state_key(observation_row(self.obs, e)))
            active = np.zeros(s.num_envs, dtype=bool)
            active[live] = True
            sample = s.sample(policy, self.obs, device, generator, carry=self.carry, active=active)
            if carries:
                self.carry = sample.carry
            actions = s.actions(sample)
            ended_by_policy = s.ended_by_policy(sample)
            for e in live:
                self.episodes[e]["decisions"].append((sample, e))
                self.episodes[e]["versions"].append(version)
            for j, action in enumerate(actions):
                self.obs, reward, term, trunc, info = s.env_call("step", self.reset_seeds, action)
                s.env_steps += s.num_envs
                reward, term, trunc = as_numpy(reward), as_numpy(term), as_numpy(trunc)
                if ended_by_policy is not None:  # truncated before this step: its outcome does not count
                    reward, term, trunc = reward * ~ended_by_policy, term & ~ended_by_policy, trunc | ended_by_policy
                success = as_numpy(s.success_source.flags(info, no_success))
                for e in live:
                    ep = self.episodes[e]
                    if not ep["alive"]:
                        continue
                    ep["reward"].append(reward[e : e + 1])
                    ep["term"].append(term[e : e + 1])
                    ep["trunc"].append(trunc[e : e + 1])
                    ep["success"].append(success[e : e + 1])
                    ep["chunk"].append(j)
                    if term[e] or trunc[e]:
                        ep["alive"] = False
                        ep["final_obs"] = observation_row(self.obs, e) if s.bootstrap else None
                if not any(self.episodes[e]["alive"] for e in live):
                    break
            if cap is not None:
                for e in live:
                    if self.episodes[e]["alive"] and len(self.episodes[e]["decisions"]) >= cap:
                        self.episodes[e]["alive"] = False  # cut: truncated
                        self.episodes[e]["final_obs"] = observation_row(self.obs, e) if s.bootstrap else None
        done = [g for g in self.groups if all(not self.episodes[e]["alive"] for e in g["envs"])][:num_groups]
        self.groups = [g for g in self.groups if g not in done]
        parts, finals = [], []
        for k, g in enumerate(done):
            for e in g["envs"]:
                ep = self.episodes.pop(e)
                finals.append(ep["final_obs"])
                part = self._episode_rollout(ep)
                parts.append(part.with_(group_id=torch.full((1,), group_offset + k, dtype=torch.long, device=part.group_id.device),
                                        info={**part.info, "steps_in_flight": torch.tensor([step - g["born"] + 1])}))
        rollout = Rollout.cat(parts)
        if s.bootstrap:
            rollout.info["final_replay"] = s.final_replay(policy, stack_observation_rows(finals), device)
        return rollout

    def _finished(self) -> int:
        return sum(1 for g in self.groups if all(not self.episodes[e]["alive"] for e in g["envs"]))

    def _reset(self, seeds: list[int], mask: np.ndarray) -> None:
        s = self.sampler
        if self.obs is None or mask.all():
            self.obs, _ = s.env_call("reset", self.reset_seeds, seed=seeds)
            return
        try:
            self.obs, _ = s.env_call("reset", self.reset_seeds, seed=seeds, options={"reset_mask": mask})
        except UserCodeError as e:
            # a vector env that cannot reset some envs refuses the option itself (no env index);
            # an env of it that raises is the simulator's fault
            if "env_index" in e.where or not isinstance(e.__cause__, (TypeError, ValueError)):
                raise
            raise ConfigError("rollout.over_provision", self.o, f"partial rollouts reset some envs while others run on, which this vector env cannot ({e.error}); use 1") from None

    def _episode_rollout(self, ep: dict[str, Any]) -> Rollout:
        decisions = [
            SimpleNamespace(logp=sample.logp[row : row + 1], replay=_rows(sample.replay, row), mask=None if sample.mask is None else sample.mask[row : row + 1],
                            entropy=None if sample.entropy is None else sample.entropy[row : row + 1], logp_deferred=sample.logp_deferred)
            for sample, row in ep["decisions"]
        ]
        part = self.sampler._wave_rollout(decisions, 1, ep["reward"], ep["term"], ep["trunc"], ep["success"], ep["chunk"])
        k = decisions[0].logp.shape[1]
        tags = torch.tensor(ep["versions"], dtype=torch.long).repeat_interleave(k)[None]
        info = {**part.info, "decision_version": tags.to(part.mask.device)}
        if ep["keys"]:  # a decision's state key on each of its columns, as a whole wave keys them
            info["state_keys"] = torch.tensor(ep["keys"], dtype=torch.long).repeat_interleave(k)[None].to(part.mask.device)
        return part.with_(policy_version=tags[:, 0].clone(), info=info)


def observation_row(obs, e: int):
    """Env ``e``'s row of a batch of observations (array, tensor, dict of them, list)."""
    if isinstance(obs, dict):
        return {k: observation_row(v, e) for k, v in obs.items()}
    if isinstance(obs, Tensor):
        return obs[e : e + 1].clone()
    if isinstance(obs, np.ndarray):
        return obs[e : e + 1].copy()
    return [obs[e]]


def state_key(row) -> int:
    """A 64-bit key of one env's observation (:func:`observation_row`):
    equal observations (text, arrays, dicts of them) get equal keys — GiGPO's anchor states."""
    digest = hashlib.blake2b(digest_size=8)

    def feed(value):
        if isinstance(value, dict):
            for name in sorted(value):
                digest.update(str(name).encode())
                feed(value[name])
        elif isinstance(value, (Tensor, np.ndarray)):
            array = value.detach().cpu().numpy() if isinstance(value, Tensor) else value
            digest.update(str((array.shape, array.dtype.str)).encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        elif isinstance(value, (list, tuple)):
            for item in value:
                feed(item)
        else:
            digest.update(repr(value).encode())

    feed(row)
    return int.from_bytes(digest.digest(), "little", signed=True)


def stack_observation_rows(rows: list):
    """The batch of single-row observations ``rows`` (:func:`observation_row`)."""
    first = rows[0]
    if isinstance(first, dict):
        return {k: stack_observation_rows([r[k] for r in rows]) for k in first}
    if isinstance(first, Tensor):
        return torch.cat(rows)
    if isinstance(first, np.ndarray):
        return np.concatenate(rows)
    return [x for r in rows for x in r]


def as_numpy(x) -> np.ndarray:
    """numpy view of an env's or a policy's batch (a simulator's batched env may return
    torch tensors, possibly on a GPU)."""
    if isinstance(x, Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def device_of(policy) -> torch.device:
    """The device of a policy's parameters (the CPU for a policy without any)."""
    for p in getattr(policy, "parameters", lambda: iter(()))():
        return p.device
    return torch.device("cpu")
