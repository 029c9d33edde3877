"""``EnvSampler``: episodes of a vector env as a ``Rollout`` of action-chunk decisions.

Each decision, the policy sees the observations of all envs and returns an action chunk
[N, C, A] per env; the env executes the C actions one step each (clipped to the action
bounds). A group's G copies are reset with the same seed, so they share their initial
state; their actions differ only by the policy's noise.

Episodes run in waves of at most ``num_envs``. A wave holds whole groups when
``num_envs >= G``; otherwise a group spans several waves (all reset with the group's seed).
A wave ends when all its episodes have ended (or after ``max_decisions``). The env's
auto-reset is never relied on: every wave starts with a seeded reset, and whatever an env
returns after its episode ended (gymnasium's next-step reset, a same-step reset, or more
steps of a finished episode) is masked out and never counted.

Per sample, ``info`` holds the episode's ``success`` (float; at any step or at the last
step, see ``success_at``; the env's flag or a learned one, :mod:`mmrl.samplers.success`),
``return`` (undiscounted sum of env rewards), ``length`` (env steps) and ``truncated`` (ended
by a time limit or ``max_decisions``, not by the task).
``step_rewards[b, t]`` is decision t's chunk reward discounted to its first env step,
sum_j gamma^j r_{t,j} (gamma = ``algo.advantage.gamma``, handed over as
``SamplerContext.gamma``), for step-level advantages, and ``info["decision_steps"][b, t]``
the env steps decision t took (at the last column of a decision with several log-prob
columns, 0 at the others): GAE discounts the next decision's value by gamma to that power.
An env whose Dict observation has a ``"privileged"`` entry (e.g. ``mmrl/Tabletop-v0`` with
``privileged_state``) keeps it out of the policy's view; each decision's replay holds it as
``"privileged"`` for a critic that reads it (``critic.inputs: privileged``).
An env that reports its episode's costs so far in ``info["costs"]`` (``mmrl/Tabletop-v0``:
path length, steps, collisions) gives ``info["costs"][name]``, each episode's value at its
last step (logged as ``cost/<name>``).

Whole episodes, their keyframes and evaluation videos are recorded on request
(:mod:`mmrl.samplers.recording`).

A simulator that returns torch tensors (ManiSkill's GPU backend: CUDA tensors) keeps them
where they are: actions are clipped with torch on the simulator's device and handed to it as
tensors, rewards and termination and success flags are recorded as tensors there and worked
out once per wave there, and the policy reads observations from that device (the
observation tensors move only if the policy sits on another). What crosses to the host is
one ``alive.any()`` per env step, the loop's stopping test. NumPy envs are stepped with NumPy
as before; both kinds give the same rollout from the same episodes
(tests/samplers/test_env_device.py).

Randomness of a group depends only on (run seed, step, global group index): the reset
seed is ``group_seed(seed, step, group) % 2**31`` and the policy's noise comes from a
generator seeded by the ``group_seed`` of the wave's first group (plus the index of the
wave's first copy when a group spans waves). One process and several therefore give the
same samples whenever their waves hold the same groups, e.g. when each process's groups
fill whole waves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium
import numpy as np
import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.critic import PRIVILEGED
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.core.sampler import Sampler, SamplerContext, group_seed
from mmrl.core.statistics import wilson_interval
from mmrl.errors import ConfigError, UserCodeError, call_user_code
from mmrl.interventions import IntervenerConfig, as_takeover, build_intervener
from mmrl.registry import ENVS, SAMPLERS
from mmrl.samplers.partial import EpisodesInFlight, as_numpy, device_of, observation_row, partial_metrics, stack_observation_rows, state_key
from mmrl.samplers.recording import EpisodeRecorder, TextEpisodeRecorder, VideoFrames, camera_names, check_recording, save_episodes, trajectory_info
from mmrl.samplers.success import SuccessSource, success_metrics
from mmrl.core.component_config import SamplerConfig

# Training resets use seeds below 2**31; evaluation uses seeds in [2**31, 2**32) so that
# evaluation episodes never repeat training episodes (2**32 is the largest seed numpy's
# legacy RandomState, used by some simulators, accepts).
_TRAIN_SEEDS = 2**31
_INTERVENER_STREAM = (1 << 44) + 2  # the group index reserved for the seed of an intervener's draws

logger = logging.getLogger(__name__)


@dataclass
class EnvSamplerConfig(SamplerConfig):
    """Episodes from a (vector) env; decisions are action chunks."""

    type: str = option("env", "registered name of this component (see `mmrl list`)")
    success_at: Literal["any", "end"] = option("any", "an episode succeeds if the env reports success at any step, or at its last step only")
    max_decisions: int | None = option(None, "cap on decisions per episode; episodes cut by it count as truncated (null = until the env ends them)", ge=1)
    eval_deterministic: bool = option(True, "evaluate the policy's mean action (false: sample actions, seeded, as in training)")
    keep_frames: int = option(0, "keep K keyframes of each training episode (observations, segment actions) in info['trajectory'] for a trajectory reward model (bt_trajectory); 0 = none", ge=0)
    save_eval_episodes: str | None = option(None, "write each evaluation's episodes to <this directory>/env_steps_<N> (LeRobotDataset v3 layout, mmrl/episodes.py; a language agent's as episodes.jsonl of turns); null = none")
    intervener: IntervenerConfig | None = option(None, "who may take over decisions in training (HIL-SERL, mmrl/interventions.py); null = none")

    def validate(self, path: str) -> None:
        if self.keep_frames == 1:
            raise ConfigError(f"{path}.keep_frames" if path else "keep_frames", self.keep_frames, "0 (none) or K >= 2 keyframes (the first and the last observation at least)")


@SAMPLERS.register("env", config=EnvSamplerConfig)
class EnvSampler(Sampler):
    """Groups of episodes from a gymnasium vector env; the G copies share an initial state."""

    partial_rollouts = True  # rollout.over_provision: episodes in flight keep stepping (mmrl/samplers/partial.py)
    records_step_rewards = True  # Rollout.step_rewards per decision (step-level advantages, GAE)
    records_final_replay = True  # info["final_replay"] of training rollouts with algo.advantage.bootstrap_truncated (GAE)

    def __init__(self, sampler_cfg: EnvSamplerConfig, ctx: SamplerContext):
        if ctx.env is None:
            raise ConfigError("env", None, "the env sampler needs an env section, e.g. env: {type: gym, id: mmrl/PointReach-v0}")
        self.config = sampler_cfg
        self.seed = ctx.seed
        self.gamma = ctx.gamma
        self.log_probs = ctx.log_probs  # the run's loss reads log-probs; else final samples suffice
        self.state_keys = ctx.state_keys  # key each decision's observation (GiGPO's anchor states)
        self.env = ENVS.get(ctx.env.type, "env.type")(ctx.env, ctx.seed)
        if isinstance(self.env, gymnasium.vector.SyncVectorEnv):  # each env names its index when it raises
            self.env.envs = [_IndexedEnv(env, i) for i, env in enumerate(self.env.envs)]
        self.env_name = ctx.env.id or ctx.env.type
        self.num_envs = self.env.num_envs
        space = self.env.single_action_space
        # a language agent's env: each action is the text of one turn (mmrl/tasks/guess_number)
        self.text_actions = isinstance(space, gymnasium.spaces.Text)
        self.tool_env = bool(getattr(ctx.env, "tools", None))  # its turns call tools (envs/tool_env.py)
        if not isinstance(space, gymnasium.spaces.Box) and not self.text_actions:
            self.env.close()
            raise ConfigError("env.id", ctx.env.id, f"the env sampler needs a continuous (Box) or a text (Text) action space; this env has {space}")
        self.action_low = None if self.text_actions else space.low.astype(np.float32)
        self.action_high = None if self.text_actions else space.high.astype(np.float32)
        self.max_action_length = int(space.max_length) if self.text_actions else None
        self.text_obs = isinstance(self.env.single_observation_space, gymnasium.spaces.Text)
        self.structured = _is_structured(self.env.single_observation_space)
        self.env_steps = 0  # env steps of training rollouts, masked ones included (evaluation not counted)
        # a critic bootstraps an episode cut by a time limit from its final observation's value
        self.bootstrap = ctx.bootstrap_truncated
        o = ctx.over_provision
        self.over_provision = o
        self.partial = EpisodesInFlight(self, o, self.seed) if o > 1 else None
        self.cameras = camera_names(ctx.env)
        try:
            has_images = self.structured and "image" in self.env.single_observation_space.spaces
            if self.text_actions and sampler_cfg.keep_frames:
                raise ConfigError("sampler.keep_frames", sampler_cfg.keep_frames, f"keeps keyframes of robot episodes for a trajectory reward; {self.env_name} acts in text")
            # a language agent's evaluation episodes are kept as text turns (recording.TextEpisodeRecorder)
            check_recording(sampler_cfg.keep_frames, self.partial is not None, has_images, self.env_name)
            # the env's success flag or a learned one (mmrl/samplers/success.py)
            self.success_source = SuccessSource(ctx.env, ctx.rewards, self.env_name, self.env.single_observation_space, o)
            self.intervener = self._intervener(sampler_cfg.intervener, o)
        except ConfigError:
            self.env.close()
            raise

    def _intervener(self, cfg: IntervenerConfig | None, over_provision: float):
        """The intervener of ``sampler.intervener`` (None without one), its draws seeded by
        the run seed."""
        if cfg is None:
            return None
        if self.text_actions:
            raise ConfigError("sampler.intervener", cfg.type, f"takes over action chunks of a robot env; {self.env_name} acts in text: use null")
        if over_provision > 1:
            raise ConfigError("sampler.intervener", cfg.type, f"intervenes in whole waves of episodes; partial rollouts (rollout.over_provision {over_provision}) carry episodes across steps: use 1")
        return build_intervener(cfg, group_seed(self.seed, 0, _INTERVENER_STREAM))

    def policy_spec(self) -> dict:
        space = self.env.single_observation_space
        if self.text_actions:  # a language agent: text turns out; text (and images) in
            spec = {"action_space": "text", "max_action_length": self.max_action_length}
            if self.text_obs:
                return {**spec, "observation_space": "text"}
        else:
            spec = {
                "action_dim": int(np.prod(self.action_low.shape)),
                "action_low": self.action_low.reshape(-1).tolist(),
                "action_high": self.action_high.reshape(-1).tolist(),
            }
        if not self.structured:
            return {"obs_dim": int(gymnasium.spaces.flatdim(space)), **spec}
        state = space.spaces.get("state")
        spec["state_dim"] = spec["obs_dim"] = int(gymnasium.spaces.flatdim(state)) if state is not None else 0
        if "image" in space.spaces:
            spec["image_shape"] = list(space["image"].shape)
        if "instruction" in space.spaces:
            spec["instructions"] = _env_instructions(self.env)
        if PRIVILEGED in space.spaces:
            spec["privileged_dim"] = int(gymnasium.spaces.flatdim(space[PRIVILEGED]))
        return spec

    def sample(self, policy, obs, device, generator, deterministic: bool = False, carry=None, active=None):
        """``policy.sample`` on the policy's view of ``obs`` (:meth:`observation`); an env's
        ``"privileged"`` observation (a critic's input, never the policy's) joins the
        sample's replay as ``"privileged"`` [N, 1, D]. A policy that ``carries_state`` also
        gets ``carry`` (its previous call's ``Sample.carry`` in these episodes, None at their
        start) and ``active`` ([N] bool, the rows whose episodes still run)."""
        inputs = self.observation(obs, device)
        if getattr(policy, "carries_state", False):
            inputs = dict(inputs) if isinstance(inputs, dict) else {"state": inputs}
            n = len(inputs["text"]) if "text" in inputs else next(iter(inputs.values())).shape[0]
            inputs["carry"] = carry
            inputs["active"] = torch.ones(n, dtype=torch.bool) if active is None else torch.as_tensor(active).to("cpu", torch.bool)
        options = {"final_only": True} if not self.log_probs and getattr(policy, "samples_final_only", False) else {}
        sample = policy.sample(inputs, generator, deterministic=deterministic, **options)
        if self.structured and PRIVILEGED in obs:
            sample.replay[PRIVILEGED] = _obs_tensor(obs[PRIVILEGED], device).unsqueeze(1)
        return sample

    def observation(self, obs, device) -> "Tensor | dict":
        """The policy's input for a batch of env observations: a float tensor [N, D] for flat
        observations; for image/language observations a dict {"image": uint8 [N, (K,) H, W, 3],
        "state": float32 [N, D], "instruction": list of N strings} (keys the env has); for
        text observations (a language agent's env) {"text": list of N strings}, beside the
        images of a Dict observation that also has a "text" entry."""
        if self.text_obs:
            return {"text": [str(text) for text in obs]}
        if not self.structured:
            return _obs_tensor(obs, device)
        out: dict[str, Any] = {}
        if "image" in obs:
            image = obs["image"]
            image = image.to(device, copy=True) if isinstance(image, Tensor) else torch.from_numpy(np.array(image, dtype=np.uint8)).to(device)
            out["image"] = image
        if "state" in obs:
            out["state"] = _obs_tensor(obs["state"], device)
        if "instruction" in obs:
            out["instruction"] = [str(text) for text in obs["instruction"]]
        if "text" in obs:
            out["text"] = [str(text) for text in obs["text"]]
        return out

    def env_call(self, method: str, seeds: list, *args, **kwargs):
        """``self.env.<method>(*args, **kwargs)`` (``reset`` or ``step``): what the simulator or
        an env wrapper raises comes out as a :class:`~mmrl.errors.UserCodeError` naming this
        env and, where the vector env tells it (gymnasium's SyncVectorEnv), the env index and
        its reset seed (``seeds[index]``: the seed of the episode that env is running)."""
        try:
            return call_user_code(f"env.{method}", getattr(self.env, method), *args, **kwargs)
        except UserCodeError as e:
            index = e.where.get("env_index")
            e.add(source=f"env {self.env_name!r}", reset_seed=seeds[index] if index is not None and index < len(seeds) else None)
            raise

    # ------------------------------------------------------------------ sampling

    def collect(self, policy, num_groups: int, group_size: int, step: int, group_offset: int = 0, version: int = 0) -> Rollout:
        if self.partial is not None:  # partial rollouts; ``version`` tags each decision
            return self.partial.collect(policy, num_groups, group_size, step, group_offset, version)
        seeds = [group_seed(self.seed, step, group_offset + g) for g in range(num_groups)]
        episodes = num_groups * group_size
        wave = (self.num_envs // group_size) * group_size or self.num_envs
        if episodes < self.num_envs and not getattr(self, "_warned_idle_envs", False):
            self._warned_idle_envs = True
            logger.warning(
                "env.num_envs is %d but a collection holds %d episodes: %d envs step with nothing to record (and count in env_steps); "
                "set env.num_envs to %d (each learner process and each rollout worker builds its own env)", self.num_envs, episodes, self.num_envs - episodes, episodes,
            )
        parts = []
        self.success_source.reported = False
        for start in range(0, episodes, wave):
            members = range(start, min(start + wave, episodes))
            first_group, first_copy = divmod(start, group_size)
            generator = torch.Generator().manual_seed(seeds[first_group] + first_copy)
            reset_seeds = [seeds[i // group_size] % _TRAIN_SEEDS for i in members]
            vector_steps, part, *kept = self._run_wave(policy, reset_seeds, generator, deterministic=False, final=self.bootstrap, keep=bool(self.config.keep_frames), training=True, step=step)
            if kept:
                part.info.update(trajectory_info(kept[0], self.config.keep_frames))
            self.env_steps += vector_steps * self.num_envs
            part.group_id = torch.tensor([group_offset + i // group_size for i in members], device=part.group_id.device)
            parts.append(part)
        rollout = Rollout.cat(parts)
        self.success_source.finish_training(rollout.info)
        return rollout

    def metrics(self, rollout: Rollout) -> dict[str, Tensor]:
        """Per episode: success (``success_rate``: the env's own flag whenever it reports one,
        hidden from training or not; with ``env.success_model`` also ``learned_success_rate``
        and ``success_agreement``), undiscounted return and length."""
        info = rollout.info
        costs = {f"cost/{name}": value for name, value in info.get("costs", {}).items()}
        return {**success_metrics(info), "episode_return": info["return"], "episode_length": info["length"], **costs, **partial_metrics(rollout)}

    def counters(self) -> dict[str, float]:
        if self.partial is not None:  # groups in flight started afresh (resume, evaluation on this env)
            return {"env_steps": float(self.env_steps), "partial/restarted": float(self.partial.restarted)}
        return {"env_steps": float(self.env_steps)}

    @torch.no_grad()
    def evaluate(self, policy, episodes: int, seed: int, rewards=None, videos: int = 0, keep_episodes: bool = False) -> dict[str, Any]:
        """``episodes`` episodes seeded from ``seed`` (disjoint from every training episode's
        seed), with the mean action or, if ``eval_deterministic`` is false, seeded samples.
        Success comes from the env; ``rewards`` is not needed.

        Returns the success rate with its 95% Wilson interval (``success_rate_ci_low``,
        ``success_rate_ci_high``), mean return and length, the per-episode ``successes`` (the
        env's own flag whenever it reports one, ``env.hide_success`` or not; else the learned
        one), with ``env.success_model`` also ``learned_success_rate``, ``learned_successes``
        and ``success_agreement`` (learned == env's, when the env reports one), and,
        if ``videos`` > 0, ``frames``: the camera images [T, H, W, 3] of the first ``videos``
        episodes (image observations only), with ``instructions``: each one's instruction
        (None without language observations); with ``keep_episodes``, ``kept_episodes``: every
        episode as a :class:`~mmrl.demos.Episode`. With ``save_eval_episodes`` set, the
        episodes are also written to ``<it>/env_steps_<N>`` (N: training env steps so far)."""
        if self.partial is not None:  # evaluation resets every env: the groups in flight start afresh
            self.partial.drop()
        seeds = [_TRAIN_SEEDS + group_seed(seed, 0, i) % _TRAIN_SEEDS for i in range(episodes)]
        deterministic = self.config.eval_deterministic
        generator = None if deterministic else torch.Generator().manual_seed(group_seed(seed, 1, 0))
        parts, frames, instructions, kept = [], [], [], []
        keep = keep_episodes or self.config.save_eval_episodes is not None
        self.success_source.reported = False
        for s in range(0, episodes, self.num_envs):
            record = max(0, min(videos - s, self.num_envs)) if self.structured else 0
            _, part, *recorded = self._run_wave(policy, seeds[s : s + self.num_envs], generator, deterministic, record=record, keep=keep)
            parts.append(part)
            if keep:
                kept += recorded.pop()
            if recorded:
                frames += recorded[0]
                instructions += recorded[1]
        info = Rollout.cat(parts).info
        success, learned = self.success_source.finish_evaluation(info)
        low, high = wilson_interval(success.sum().item(), episodes)
        out = {
            "success_rate": success.mean().item(),
            "success_rate_ci_low": low,
            "success_rate_ci_high": high,
            "return_mean": info["return"].mean().item(),
            "length_mean": info["length"].float().mean().item(),
            "episodes": episodes,
            "successes": success.tolist(),
        }
        out.update(learned)
        costs = info.get("costs", {})
        out.update({f"cost_{name}_mean": value.float().mean().item() for name, value in costs.items()})
        if videos:
            out["frames"], out["instructions"] = frames, instructions
        if self.config.save_eval_episodes is not None:
            save_episodes(self.config.save_eval_episodes, self.env_steps, kept, self.env, self.cameras, self.env_name, seed)
        if keep_episodes:
            out["kept_episodes"] = kept
        return out

    @torch.no_grad()
    def _run_wave(self, policy, seeds: list[int], generator: torch.Generator | None, deterministic: bool, record: int = 0, final: bool = False, keep: bool = False, training: bool = False, step: int = 0):
        """One episode per seed on the first ``len(seeds)`` envs; the other envs (a last,
        partial wave) step along, masked out. Returns (vector env steps taken, rollout), plus
        the frames and instructions of the first ``record`` episodes if ``record`` > 0.
        ``final``: keep each episode's final observation, as the policy reads it, in
        ``info["final_replay"]`` (a critic's bootstrap of an episode a time limit cut).
        ``keep``: also return the wave's episodes as :class:`~mmrl.demos.Episode` objects
        (last in the returned tuple). ``training``: a training wave, where
        ``env.hide_success`` and ``env.success_model.terminates`` apply; with
        ``env.success_model`` every decision's reached observation is scored
        (mmrl/samplers/success.py), and the ``sampler.intervener`` may take over decisions
        (:meth:`intervene`; ``step``: the training step, its clock).

        The step loop only records what the env returned; who was alive when, returns,
        success and truncation are worked out once per wave from those records."""
        n, num_envs = len(seeds), self.num_envs
        reset_seeds = seeds + seeds[:1] * (num_envs - n)
        obs, reset_info = self.env_call("reset", reset_seeds, seed=reset_seeds)
        kept = (TextEpisodeRecorder(seeds, tools=self.tool_env) if self.text_actions else EpisodeRecorder(obs, reset_info, seeds)) if keep else None
        costs: list[dict] = []
        device = device_of(policy)
        on = _tensor_device(obs)  # a simulator that returns torch tensors: bookkeeping stays on its device
        alive = torch.arange(num_envs, device=on) < n if on is not None else np.arange(num_envs) < n
        no_success = torch.zeros(num_envs, dtype=torch.bool, device=on) if on is not None else np.zeros(num_envs, dtype=bool)
        bounds = (torch.as_tensor(self.action_low, device=on), torch.as_tensor(self.action_high, device=on)) if on is not None and not self.text_actions else None
        carry = None  # a policy that carries_state: its state in this wave's episodes
        keys: list = []  # per decision, each env's state key (state_keys): a list of ints, or a tensor on the simulator's device
        samples, rewards, terminated, truncated, success, chunk_index = [], [], [], [], [], []
        intervened: list[Tensor] = []  # per decision, the [N] rows the intervener took over
        cap = self.config.max_decisions
        frames = VideoFrames(obs, record) if record else None
        # each env's observation after its episode's last step (final=True): env -> row, or on a
        # simulator's device one batch updated where episodes end (no per-env Python loop)
        last_obs: dict | _EndedRows = _EndedRows(num_envs, on) if on is not None else {}
        scores = self.success_source.wave_scores(num_envs, device)
        while alive.any() and (cap is None or len(samples) < cap):
            # the observation each episode ended at in this chunk (env -> row, or a batch on the device)
            chunk_end, scored = (_EndedRows(num_envs, on) if on is not None else {}), alive
            if self.state_keys:
                keys.append(tensor_state_keys(obs) if on is not None else [state_key(observation_row(obs, e)) for e in range(num_envs)])
            sample = self.sample(policy, obs, device, generator, deterministic, carry=carry, active=alive)
            carry = sample.carry
            if training and self.intervener is not None:
                intervened.append(self.intervene(policy, sample, obs, device, step))
            actions = self.actions(sample, on, bounds)
            samples.append(sample)
            ended_by_policy = self.ended_by_policy(sample, on)
            for j, action in enumerate(actions):
                if kept is not None:
                    kept.step(obs, action)
                obs, reward, term, trunc, info = self.env_call("step", reset_seeds, action)
                if self.text_actions and kept is not None:
                    kept.answered(obs)
                if ended_by_policy is not None:  # truncated before this step: its outcome does not count
                    reward = reward * ~ended_by_policy
                    term = term & ~ended_by_policy
                    trunc = trunc | ended_by_policy
                if "costs" in info:  # kept on the simulator's device until the wave ends (no host sync a step)
                    convert = (lambda v: torch.as_tensor(v, device=on)) if on is not None else as_numpy
                    costs.append({name: convert(value) for name, value in info["costs"].items() if not name.startswith("_")})
                if on is not None:
                    term, trunc = (torch.as_tensor(x, device=on).bool() for x in (term, trunc))
                    rewards.append(torch.as_tensor(reward, device=on))
                else:
                    term, trunc = as_numpy(term), as_numpy(trunc)
                    rewards.append(as_numpy(reward))
                terminated.append(term)
                truncated.append(trunc)
                success.append(self.success_source.flags(info, no_success))
                chunk_index.append(j)
                done = term | trunc
                if on is not None and (final or scores is not None):
                    ended = alive & done  # no host sync: the rows are kept where they end
                    last_obs.keep(ended, obs)
                    chunk_end.keep(ended, obs)
                elif (final or scores is not None) and (ended := alive & done).any():
                    for e in np.flatnonzero(ended).tolist():
                        if e < n:
                            last_obs[e] = chunk_end[e] = observation_row(obs, e)
                alive = alive & ~done
                if frames is not None:
                    frames.step(obs)
                if not alive.any():
                    break
            if scores is not None:
                if on is not None:
                    reached = chunk_end.over(obs)
                else:
                    reached = stack_observation_rows([chunk_end[e] if e in chunk_end else observation_row(obs, e) for e in range(num_envs)])
                fired = scores.score(self.observation(reached, device), scored)
                if training and scores.source.config.terminates:  # the learned success ends the episode, as a terminating env's would
                    ends = alive & (fired.to(on) if on is not None else fired.cpu().numpy())
                    terminated[-1] = terminated[-1] | ends
                    alive = alive & ~ends
        rollout = self._wave_rollout(samples, n, rewards, terminated, truncated, success, chunk_index)
        if keys:  # [n, T·k]: a decision's key on each of its log-prob columns
            per_call = rollout.num_decisions // len(samples)
            table = torch.stack(keys) if on is not None else torch.tensor(keys, dtype=torch.long)
            rollout.info["state_keys"] = table[:, :n].T.repeat_interleave(per_call, dim=1).to(rollout.mask.device)
        if intervened:  # [n, T·k]: a decision's mark on each of its log-prob columns
            per_call = rollout.num_decisions // len(samples)
            rollout.info["intervened"] = torch.stack(intervened)[:, :n].T.repeat_interleave(per_call, dim=1).to(rollout.mask.device)
        if len(costs) == len(rewards):  # the env reported its costs at every step
            if on is not None:
                last = (rollout.info["length"].to(on) - 1).clamp(min=0)
                rollout.info["costs"] = {name: torch.stack([c[name] for c in costs])[last, torch.arange(n, device=on)].double().cpu() for name in costs[0]}
            else:
                last = (rollout.info["length"].cpu() - 1).clamp(min=0).numpy()
                rollout.info["costs"] = {name: torch.from_numpy(np.array([c[name] for c in costs])[last, np.arange(n)].astype(np.float64)) for name in costs[0]}
        if final:  # episodes still running (cut by max_decisions) end at the last observation
            if on is not None:
                rows = _first_rows(last_obs.over(obs), n)
            else:
                rows = stack_observation_rows([last_obs[e] if e in last_obs else observation_row(obs, e) for e in range(n)])
            rollout.info["final_replay"] = self.final_replay(policy, rows, device)
        episodes = [kept.episodes(rollout, rewards, success if self.success_source.reported else None)] if kept is not None else []
        # after the kept episodes, which record the env's own success
        self.success_source.resolve(rollout.info, scores, n, training, self.config.success_at)
        if frames is None:
            return len(rewards), rollout, *episodes
        return len(rewards), rollout, frames.clips(rollout), frames.instructions, *episodes

    def intervene(self, policy, sample, obs, device, step: int) -> Tensor:
        """Offer one decision to the intervener (mmrl/interventions.py). In the rows it takes
        over, its actions replace ``sample.output`` and the replay becomes what the policy
        writes for the executed action (``demo_replay``); the old log-prob stays the
        proposal's, which no loss that trains from the buffer reads. Returns those rows, [N]
        bool on the CPU."""
        proposed = torch.as_tensor(sample.output)

        def takeover():
            taken = self.intervener.intervene(obs, proposed, step, self.env)
            return None if taken is None else as_takeover(taken, proposed)

        taken = call_user_code("sampler.intervener.intervene", takeover)
        if taken is None:
            return torch.zeros(proposed.shape[0], dtype=torch.bool)
        rows, actions = taken
        if bool(rows.any()):
            sample.output = torch.where(rows[:, None, None], actions, proposed)
            sample.replay = _replace_rows(sample.replay, policy.demo_replay(self.observation(obs, device), actions), rows)
        return rows.cpu()

    def actions(self, sample, on=None, bounds=None) -> list:
        """The env actions of one policy call, one batch per env step of its chunk: each
        env's text for a language agent's turn (one step), else the output clamped to the
        action space (on the simulator's device ``on`` with its ``bounds`` tensors)."""
        if self.text_actions:
            return [tuple(str(text) for text in sample.output)]
        if on is not None:
            low, high = bounds
            return list(torch.minimum(torch.maximum(sample.output.to(on), low), high).unbind(1))
        return list(np.moveaxis(np.minimum(np.maximum(as_numpy(sample.output), self.action_low), self.action_high), 1, 0))

    @staticmethod
    def ended_by_policy(sample, on=None):
        """[N] bool of the rows the policy can act no further in (``Sample.end``: a language
        agent's full context), or None: their episodes end truncated before this step, whose
        outcome does not count."""
        if sample.end is None or not bool(sample.end.any()):
            return None
        return torch.as_tensor(sample.end).to(on) if on is not None else as_numpy(sample.end).astype(bool)

    def final_replay(self, policy, obs, device) -> dict:
        """The policy's replay [n, 1, ...] of ``obs``, final observations: what a critic
        reads of them (a deterministic call: no running statistics or clocks move)."""
        return self.sample(policy, obs, device, None, deterministic=True).replay

    def _wave_rollout(self, samples: list, n: int, rewards: list, terminated: list, truncated: list, success: list, chunk_index: list) -> Rollout:
        """Per-episode stats and the [n, T] decision tensors of one wave (first ``n`` envs).
        The per-step records are NumPy arrays (host envs) or tensors on the simulator's
        device; either way they are stacked once and worked out with torch where they are.

        A policy call may return k > 1 decisions (e.g. the denoising steps of one action
        chunk); the chunk's reward then sits on the last of them."""
        if isinstance(rewards[0], Tensor):
            stack = lambda rows, dtype: torch.stack(rows)[:, :n].to(dtype)  # noqa: E731
        else:  # np.array of equal-shape rows is np.stack, several times faster for many small rows
            stack = lambda rows, dtype: torch.from_numpy(np.array(rows)[:, :n]).to(dtype)  # noqa: E731
        term = stack(terminated, torch.bool)  # [S, n] over env steps S
        trunc = stack(truncated, torch.bool)
        done = term | trunc
        # alive[s]: the episode had not ended before step s
        alive = (torch.cumsum(done.long(), 0) - done.long()) == 0
        reward = stack(rewards, torch.float64) * alive
        succ = stack(success, torch.bool) & alive
        lengths = alive.sum(0)
        last = (torch.clamp(lengths - 1, min=0), torch.arange(n, device=alive.device))
        ended = done[last]  # the alive steps are a prefix, the last one is lengths - 1
        episode_success = succ.any(0) if self.config.success_at == "any" else succ[last]
        episode_truncated = ~ended | (trunc[last] & ~term[last])  # time limit, or cut by max_decisions

        chunk_index = torch.as_tensor(chunk_index, device=alive.device)
        first_steps = torch.nonzero(chunk_index == 0).flatten()  # each decision's first env step
        num_decisions = len(samples)
        # gamma^j with Python's pow (as NumPy's), not a vectorized one that may round differently
        discount = torch.tensor([self.gamma**j for j in chunk_index.tolist()], dtype=torch.float64, device=alive.device)
        discounted = reward * discount[:, None]
        # each decision's chunk reward, summed step by step in order (as np.add.reduceat does)
        decision = torch.cumsum(chunk_index == 0, 0) - 1  # [S]: the decision of each env step
        chunk_reward = torch.zeros(num_decisions, n, dtype=torch.float64, device=alive.device)
        decision_steps = torch.zeros(num_decisions, n, dtype=torch.float64, device=alive.device)
        for j in range(int(chunk_index.max()) + 1):
            at = chunk_index == j
            chunk_reward[decision[at]] += discounted[at]
            decision_steps[decision[at]] += alive[at].to(torch.float64)
        alive_at_decision = alive[first_steps]

        logp = torch.cat([s.logp for s in samples], 1)[:n]
        k = samples[0].logp.shape[1]
        device = logp.device
        mask = alive_at_decision.T.to(device, torch.float32).repeat_interleave(k, dim=1)
        if samples[0].mask is not None:
            mask = mask * torch.cat([s.mask for s in samples], 1)[:n]
        step_rewards = torch.zeros(n, num_decisions, k, dtype=torch.float32, device=device)
        step_rewards[:, :, -1] = chunk_reward.T.to(device, torch.float32)
        # env steps from each column to the next decision: the chunk's at its last column, 0 inside
        steps = torch.zeros(n, num_decisions, k, dtype=torch.float32, device=device)
        steps[:, :, -1] = decision_steps.T.to(device, torch.float32)
        entropy = torch.cat([s.entropy for s in samples], 1)[:n] if samples[0].entropy is not None else None
        return Rollout(
            group_id=torch.zeros(n, dtype=torch.long, device=device),
            old=OldLogProbs(logp, deferred=any(s.logp_deferred for s in samples)),
            mask=mask,
            replay=_cat_replay([s.replay for s in samples], n),
            step_rewards=step_rewards.view(n, -1),
            entropy=entropy,
            info={
                "decision_steps": steps.view(n, -1),
                # the decision each column belongs to: a decision's columns (a turn's tokens,
                # masked past its end) share its step-level return (mmrl.algo.advantage)
                "decision_index": torch.arange(num_decisions, device=device).repeat_interleave(k).expand(n, -1),
                "success": episode_success.float(),
                "return": torch.cumsum(reward, 0)[-1].float(),  # summed in step order
                "length": lengths.long(),
                "truncated": episode_truncated,
            },
        )

    # ------------------------------------------------------------------ bookkeeping

    def state_dict(self) -> dict[str, Any]:
        if self.intervener is not None and hasattr(self.intervener, "state_dict"):
            return {"env_steps": self.env_steps, "intervener": self.intervener.state_dict()}
        return {"env_steps": self.env_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.env_steps = int(state.get("env_steps", 0))
        if "intervener" in state and hasattr(self.intervener, "load_state_dict"):
            self.intervener.load_state_dict(state["intervener"])

    def close(self) -> None:
        if self.intervener is not None and hasattr(self.intervener, "close"):
            self.intervener.close()
        self.env.close()


class _IndexedEnv(gymnasium.Wrapper):
    """The outermost wrapper of env ``index`` of a SyncVectorEnv: what its ``reset`` or
    ``step`` raises (the simulator's or an env wrapper's) comes out as a
    :class:`~mmrl.errors.UserCodeError` naming the index, chained from the original."""

    def __init__(self, env: gymnasium.Env, index: int):
        super().__init__(env)
        self.index = index

    def reset(self, **kwargs):
        return call_user_code("env.reset", self.env.reset, where={"env_index": self.index}, **kwargs)

    def step(self, action):
        return call_user_code("env.step", self.env.step, action, where={"env_index": self.index})


def _is_structured(space) -> bool:
    """Image and/or language observations (passed to the policy as a dict), as opposed to
    state vectors (flattened)."""
    return isinstance(space, gymnasium.spaces.Dict) and ("image" in space.spaces or "instruction" in space.spaces)


def _env_instructions(env) -> list[str]:
    """Every instruction the env can give (its ``instructions`` attribute), in order, once."""
    try:
        per_env = env.get_attr("instructions")
    except Exception:  # a simulator's own batched env: the attribute sits on the env itself
        per_env = [getattr(env, "instructions", None) or getattr(env.unwrapped, "instructions", None) or []]
    seen: dict[str, None] = {}
    for texts in per_env:
        for text in texts or []:
            seen.setdefault(str(text), None)
    return list(seen)


def _replace_rows(replay: dict, written: dict, rows: Tensor) -> dict:
    """``replay`` with the entries ``written`` has taken from it at ``rows`` [N] (the others
    kept: a policy's own extras, such as a log std cap)."""
    out = dict(replay)
    for key, value in written.items():
        if isinstance(value, dict):
            out[key] = _replace_rows(replay[key], value, rows)
        else:
            old = replay[key]
            out[key] = torch.where(rows.to(old.device).view(-1, *[1] * (old.dim() - 1)), value.to(old), old)
    return out


def _cat_replay(replays: list[dict], n: int) -> dict:
    out = {}
    for key, first in replays[0].items():
        values = [r[key] for r in replays]
        out[key] = _cat_replay(values, n) if isinstance(first, dict) else torch.cat(values, 1)[:n]
    return out


def _obs_tensor(obs, device) -> Tensor:
    """The policy's input [N, D] float32, a copy: the policy may keep it in its replay,
    and an env may reuse its observation buffer."""
    if isinstance(obs, Tensor):
        return obs.reshape(obs.shape[0], -1).to(device, torch.float32, copy=True)
    obs = _flatten(obs)
    if obs.dtype == np.float32:
        return torch.from_numpy(obs).to(device, copy=True)
    return torch.from_numpy(obs.astype(np.float32)).to(device)


def _flatten(obs) -> np.ndarray:
    """[N, ...] array, or a dict of them (state_dict observations), as [N, D]."""
    if isinstance(obs, dict):
        return np.concatenate([_flatten(v) for v in obs.values()], axis=1)
    obs = as_numpy(obs)
    return obs.reshape(obs.shape[0], -1)


class _EndedRows:
    """The observations a batch of simulator worlds ended at, kept on the simulator's device:
    ``keep(ended, obs)`` takes the rows of ``obs`` where ``ended`` [N] is set (tensor ops only,
    no host sync), ``over(obs)`` gives those rows where kept and ``obs``'s elsewhere."""

    def __init__(self, num_envs: int, device):
        self.rows = None
        self.kept = torch.zeros(num_envs, dtype=torch.bool, device=device)

    def keep(self, ended: Tensor, obs) -> None:
        # torch.where writes a new batch: a simulator may overwrite ``obs`` in place at its next step
        self.rows = _where_rows(ended, obs, obs if self.rows is None else self.rows)
        self.kept = self.kept | ended

    def over(self, obs):
        return obs if self.rows is None else _where_rows(self.kept, self.rows, obs)


def _where_rows(mask: Tensor, new, old):
    """Row-wise ``mask ? new : old`` over a batch of observations (a tensor or a dict of them)."""
    if isinstance(new, dict):
        return {k: _where_rows(mask, v, old[k]) for k, v in new.items()}
    if not isinstance(new, Tensor):  # text: rows of a list
        return [a if m else b for a, b, m in zip(new, old, mask.tolist())]
    return torch.where(mask.view(-1, *[1] * (new.dim() - 1)), new, old)


def _first_rows(obs, n: int):
    """The first ``n`` rows of a batch of observations."""
    if isinstance(obs, dict):
        return {k: _first_rows(v, n) for k, v in obs.items()}
    return obs[:n]


# fixed odd multipliers of tensor_state_keys: a key is the same in every process and run
_KEY_WEIGHTS: dict[tuple[str, int], Tensor] = {}


def tensor_state_keys(obs) -> Tensor:
    """A 64-bit key [N] of each row of a batch of device observations (a tensor or a dict of
    them), computed on their device: each row's bytes as 64-bit words, summed with fixed odd
    multipliers (wrapping), per key name. Equal rows get equal keys (GiGPO's anchor states);
    the tensor path's counterpart of :func:`~mmrl.samplers.partial.state_key`."""
    items = sorted(obs.items()) if isinstance(obs, dict) else [("", obs)]
    total = None
    for name, value in items:
        words = value.detach().contiguous().reshape(value.shape[0], -1).view(torch.uint8)
        pad = (-words.shape[1]) % 8
        if pad:
            words = torch.nn.functional.pad(words, (0, pad))
        words = words.view(torch.int64)
        key = (name, words.shape[1])
        if key not in _KEY_WEIGHTS:
            g = torch.Generator().manual_seed(int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") ^ words.shape[1])
            _KEY_WEIGHTS[key] = torch.randint(-(2**62), 2**62, (words.shape[1],), generator=g, dtype=torch.int64) * 2 + 1
        part = (words * _KEY_WEIGHTS[key].to(words.device)).sum(1)
        total = part if total is None else total * 1000003 + part
    return total


def _tensor_device(obs) -> torch.device | None:
    """The device of a simulator's torch observations (ManiSkill: its CPU or GPU backend), or
    None for NumPy observations."""
    if isinstance(obs, Tensor):
        return obs.device
    if isinstance(obs, dict):
        for value in obs.values():
            found = _tensor_device(value)
            if found is not None:
                return found
    return None

