"""The replay buffer of losses that train from past transitions (``algo.loss: sac``): a stage
between the rollout workers and the learner, saved with the run (DESIGN §9).

A transition is one decision of an episode (an action chunk: the env executed all of it):

- ``replay``: the decision's replay as the policy wrote it (its view of the observation and
  the action it took), each entry [1, ...] per transition (one decision);
- ``next``: the replay of the observation the transition bootstraps from, without its
  action: the decision n later, or the episode's final observation;
- ``reward``: sum_{i<n} gamma^{S_i} r_{t+i}, the next n decisions' chunk rewards (each
  already discounted to its first env step by the sampler), with S_i the env steps from
  decision t to decision t+i; fewer where the episode ends first;
- ``discount``: gamma^{S_n}, gamma to the env steps from decision t to the bootstrap
  observation (gamma per decision of one env step; gamma^C for chunks of C);
- ``terminated``: the episode ended by the task within those decisions (no bootstrap). An
  episode cut by a time limit (truncated) is not terminated: its transitions bootstrap
  from the final observation, which the env sampler keeps (``info["final_replay"]``).

Storage is preallocated at the first ``add`` (``capacity`` rows per entry, on the learner's
device or the CPU) and written as a ring, after the rows :meth:`ReplayBuffer.pin` keeps.
Draws are uniform with replacement from a ``torch.Generator`` of the buffer's own, whose
state is saved with the contents: a resumed run draws what the unbroken one would have.

Why not TorchRL's replay buffers: mmrl's transitions come whole-episode from the env
sampler, with chunk discounts and n-step sums worked out once per episode here; TorchRL's
buffers draw with the process's global RNG unless given a generator per sampler, and save
to a directory format of their own beside the checkpoint. A ring of tensors with its own
generator is a few dozen lines and goes into the checkpoint's state like everything else.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mmrl.core.rollout import Rollout


def transitions(rollout: Rollout, gamma: float, n_step: int = 1) -> dict[str, Any]:
    """The transitions of a rollout of env episodes (one per valid decision, in sample then
    decision order): see the module docstring. Needs one log-prob column per decision, the
    sampler's ``step_rewards`` and ``info["decision_steps"]``, and ``info["final_replay"]``
    wherever an episode was truncated."""
    return episode_transitions(rollout.mask, rollout.step_rewards, rollout.info["decision_steps"], rollout.info["truncated"],
                               rollout.replay, rollout.info.get("final_replay"), gamma, n_step)


def episode_transitions(mask: Tensor, step_rewards: Tensor, decision_steps: Tensor, truncated: Tensor, replay: dict,
                        final: dict | None, gamma: float, n_step: int = 1) -> dict[str, Any]:
    """:func:`transitions` of B episodes given as tensors: ``mask`` [B, T] (a prefix of each
    row), each decision's chunk reward discounted to its first env step ``step_rewards`` [B, T]
    and env steps ``decision_steps`` [B, T], ``truncated`` [B], the replay [B, T, ...] and the
    replay of each truncated episode's final observation ``final`` [B, 1, ...] (or None)."""
    mask = mask.bool()
    b, t = mask.shape
    device = mask.device
    lengths = mask.sum(1)  # decisions per episode (a prefix of the row)
    reward = step_rewards.to(device, torch.float64)
    steps = decision_steps.to(device, torch.float64)
    elapsed = torch.cat([torch.zeros(b, 1, dtype=torch.float64, device=device), torch.cumsum(steps, 1)], 1)  # [B, T+1] env steps before each decision
    at = torch.arange(t, device=device).expand(b, t)
    last = (at + n_step - 1).minimum(lengths[:, None] - 1).clamp(min=0)  # the last decision each transition's sum takes in
    total = torch.zeros(b, t, dtype=torch.float64, device=device)
    for offset in range(n_step):
        i = (at + offset).clamp(max=t - 1)
        take = (at + offset) <= last
        total += torch.where(take, gamma ** (elapsed.gather(1, i) - elapsed[:, :t]) * reward.gather(1, i), 0.0)
    discount = gamma ** (elapsed.gather(1, last + 1) - elapsed[:, :t])
    ends = last == lengths[:, None] - 1
    truncated = truncated.to(device).bool()
    terminated = ends & ~truncated[:, None]
    rows, cols = mask.nonzero(as_tuple=True)
    following = (last + 1)[rows, cols]  # the bootstrap decision, or the episode's end
    if final is None and bool((ends & truncated[:, None])[rows, cols].any()):
        raise ValueError("a truncated episode's transitions bootstrap from its final observation: the sampler kept none (info['final_replay'])")

    def next_of(value: Tensor, at_final: Tensor | None) -> Tensor:
        inside = value[rows, following.clamp(max=t - 1)]
        if at_final is None:
            return inside.unsqueeze(1)
        at_end = (following >= lengths[rows]).reshape(-1, *[1] * (inside.dim() - 1))
        return torch.where(at_end.to(inside.device), at_final[rows, 0].to(inside), inside).unsqueeze(1)

    def next_tree(tree: dict, at_final: dict | None) -> dict:
        out = {}
        for k, v in tree.items():
            if k == "action":
                continue
            sub = None if at_final is None else at_final[k]
            out[k] = next_tree(v, sub) if isinstance(v, dict) else next_of(v, sub)
        return out

    return {
        "replay": _map_tree(replay, lambda v: v[rows, cols].unsqueeze(1)),
        "next": next_tree(replay, final),
        "reward": total[rows, cols].float(),
        "discount": discount[rows, cols].float(),
        "terminated": terminated[rows, cols],
    }


def demo_transitions(episodes: list, policy, gamma: float, n_step: int = 1, source: str = "algo.loss.demos") -> dict[str, Any]:
    """The transitions of demonstrated episodes (:class:`mmrl.demos.Episode`) as ``policy``
    would have written them (``demo_replay``): decision j of an episode executes its actions
    jC .. jC + C − 1 (C·A = ``policy.action_values`` for A-valued env actions), observed at
    state jC, with the chunk's rewards discounted to its first step. An episode bootstraps
    from its ``final_state`` unless ``terminated``; a remainder of fewer than C steps is cut
    off and bootstraps from the state it starts at; without a final state the last decision
    is dropped (nothing to bootstrap it from). Shapes that do not fit the policy are a
    :class:`~mmrl.errors.ConfigError` naming ``source``."""
    from mmrl.errors import ConfigError

    if not episodes:
        raise ConfigError(source, "[]", "no demonstrated episodes: collect some with `mmrl collect`")
    values, a = policy.action_values, int(episodes[0].action.shape[1])
    if not values or values % a:
        raise ConfigError(source, f"{a}-valued actions", f"the policy's decisions take {values} action values: chunks of C env actions of {values} / C values")
    c = values // a
    keep, rows = [], []
    for e, episode in enumerate(episodes):
        if episode.action.shape[1] != a:
            raise ConfigError(source, f"episode {e}: {episode.action.shape[1]}-valued actions", f"every episode's actions have the first episode's {a} values")
        k = len(episode) // c
        if k * c == len(episode) and not episode.terminated and episode.final_state is None:
            k -= 1
        if k > 0:
            keep.append(episode)
            rows.append(k)
    if not keep:
        raise ConfigError(source, f"{len(episodes)} episodes", f"none is long enough for one transition of {c}-step chunks")
    b, t = len(keep), max(rows)
    obs, actions, rewards, finals, final_rows = [], [], torch.zeros(b, t, dtype=torch.float64), [], []
    discounts = torch.tensor([gamma**i for i in range(c)], dtype=torch.float64)
    for i, (episode, k) in enumerate(zip(keep, rows)):
        obs.append(torch.from_numpy(episode.state[: k * c : c]))
        actions.append(torch.from_numpy(episode.action[: k * c]).view(k, c, a))
        rewards[i, :k] = (torch.from_numpy(episode.reward[: k * c]).view(k, c).double() * discounts).sum(1)
        if k * c < len(episode):
            finals.append(torch.from_numpy(episode.state[k * c]))
            final_rows.append(i)
        elif not episode.terminated:
            finals.append(torch.from_numpy(episode.final_state))
            final_rows.append(i)
    flat = policy.demo_replay({"state": torch.cat(obs)}, torch.cat(actions))
    width = policy.critic_inputs(flat).shape[-1]
    if policy.critic_input_dim is not None and width != policy.critic_input_dim:
        raise ConfigError(source, f"{keep[0].state.shape[1]}-valued states", f"the policy observes {policy.critic_input_dim} values")
    lengths = torch.tensor(rows)
    mask = torch.arange(t)[None] < lengths[:, None]
    at_rows, at_cols = mask.nonzero(as_tuple=True)

    def pad(v: Tensor) -> Tensor:
        out = torch.zeros(b, t, *v.shape[2:], dtype=v.dtype, device=v.device)
        out[at_rows, at_cols] = v[:, 0]
        return out

    replay = _map_tree(flat, pad)
    final = None
    if finals:
        given = policy.demo_replay({"state": torch.stack(finals)}, None)
        index = torch.tensor(final_rows)

        def place(v: Tensor) -> Tensor:
            out = torch.zeros(b, *v.shape[1:], dtype=v.dtype, device=v.device)
            out[index] = v
            return out

        final = _map_tree(given, place)
    truncated = torch.zeros(b, dtype=torch.bool)
    truncated[final_rows] = True
    return episode_transitions(mask.float(), rewards, torch.full((b, t), float(c)), truncated, replay, final, gamma, n_step)


class ReplayBuffer:
    """A ring of ``capacity`` transitions on ``device``; uniform draws from its own generator."""

    def __init__(self, capacity: int, device: torch.device | str, seed: int):
        self.capacity, self.device = capacity, torch.device(device)
        self.storage: dict[str, Tensor] = {}  # flat key ("replay/obs") -> [capacity, ...]
        self.size = 0
        self.cursor = 0  # the row the next transition goes to
        self.added = 0  # transitions ever added
        self.pinned = 0  # the first rows, never overwritten (pin)
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.size

    def add(self, batch: dict[str, Any]) -> int:
        """Add the transitions of ``batch`` (a nested dict of [N, ...] tensors); returns N.
        Past the capacity the oldest are overwritten."""
        flat = _flatten(batch)
        n = next(iter(flat.values())).shape[0]
        if not self.storage:
            self.storage = {k: torch.zeros(self.capacity, *v.shape[1:], dtype=v.dtype, device=self.device) for k, v in flat.items()}
        elif set(flat) != set(self.storage):
            raise ValueError(f"transitions with entries {sorted(flat)} cannot join a buffer of {sorted(self.storage)}")
        span = self.capacity - self.pinned  # the ring's rows
        keep = min(n, span)  # more than the ring at once: the last ones stay
        rows = self.pinned + (self.cursor - self.pinned + torch.arange(keep)) % span
        for k, v in flat.items():
            self.storage[k][rows.to(self.device)] = v[n - keep :].to(self.device, self.storage[k].dtype)
        self.cursor = self.pinned + (self.cursor - self.pinned + keep) % span
        self.size = min(self.size + keep, self.capacity)
        self.added += n
        return n

    def pin(self) -> None:
        """Keep the transitions held now for good: later ones ring over the rows after them
        (demonstrations from files beside intervened transitions)."""
        if self.size >= self.capacity:
            raise ValueError(f"a full buffer of {self.capacity} transitions leaves no room after the ones it keeps")
        self.pinned = self.size

    def sample(self, batch_size: int, device: torch.device | str | None = None) -> dict[str, Any]:
        """``batch_size`` transitions drawn uniformly with replacement, on ``device`` (the
        buffer's by default)."""
        if self.size == 0:
            raise ValueError("cannot draw from an empty replay buffer")
        idx = torch.randint(self.size, (batch_size,), generator=self.generator).to(self.device)
        target = self.device if device is None else torch.device(device)
        return _unflatten({k: v[idx].to(target) for k, v in self.storage.items()})

    def state_dict(self) -> dict[str, Any]:
        """The contents (the filled rows, on the CPU), the ring's position and the generator."""
        return {
            "storage": {k: v[: self.size].cpu().clone() for k, v in self.storage.items()},
            "size": self.size, "cursor": self.cursor, "added": self.added, "capacity": self.capacity, "pinned": self.pinned,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"the checkpoint's replay buffer holds {state['capacity']} transitions, this run's {self.capacity}: resume with the same buffer_size")
        self.size, self.cursor, self.added = int(state["size"]), int(state["cursor"]), int(state["added"])
        self.pinned = int(state.get("pinned", 0))
        self.storage = {}
        for k, v in state["storage"].items():
            self.storage[k] = torch.zeros(self.capacity, *v.shape[1:], dtype=v.dtype, device=self.device)
            self.storage[k][: self.size] = v.to(self.device)
        self.generator.set_state(state["generator"])


def _map_tree(value, fn):
    return {k: _map_tree(v, fn) for k, v in value.items()} if isinstance(value, dict) else fn(value)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Tensor]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _unflatten(flat: dict[str, Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in flat.items():
        *path, leaf = key.split("/")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = v
    return out
