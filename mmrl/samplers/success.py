"""Where an env sampler's success comes from (:class:`SuccessSource`): the env's own flag,
or a learned success source (``env.success_model``): P(success) from a trained
``learned_success`` classifier (policies/learned_success) in place of the env's flag.

**The env's flag.** Each env step's success is read from the env's ``info[env.success_key]``,
by default from the first of :data:`SUCCESS_KEYS` the env reports. When a whole collection
goes by without any while success is in use (a ``success`` reward during training, always
during evaluation, whose result is the success rate), the sampler logs one warning, naming
``env.success_key``: success would otherwise read 0 silently.

**What training reads.** ``info["success"]`` of a training rollout is the env's flag; with
``env.success_model``, the learned success of each training wave; with ``env.hide_success``
alone, none. In those two cases the env's own flag moves to ``info["env_success"]`` (dropped
from a training rollout when the env reported none) and the learned one is
``info["learned_success"]``; evaluation counts the env's flag whenever the env reports one,
else the learned one. A hidden flag needs a learned source when a ``success`` reward reads
it, and both options apply to whole waves, not to partial rollouts (``rollout.over_provision``
> 1): the sampler refuses either combination.

**When the learned success is read.** After every decision (the policy's action chunk of C
env steps), on the observation the episode has reached: the next decision's observation, or,
for an episode that ended within the chunk, the observation its env returned at its last
step. The envs of a wave are scored in one batch.

**The rule.** With p_t the probability after decision t and θ the ``threshold``, the run
length r_t = (r_{t−1} + 1)·[p_t ≥ θ] (r_0 = 0) counts the consecutive decisions at or above
θ. The learned success *fires* at the first t with r_t ≥ k, k = ``debounce``; an episode
succeeds if it fires at any decision (``sampler.success_at: any``) or if r ≥ k at its last
decision (``end``). A single frame at or above θ is not enough when k > 1: learned
detectors on real robots are debounced against exactly that failure, a one-frame false
positive (a gripper passing in front of the goal, a reflection), and a policy under RL finds
and repeats whatever single frame fools the detector. Debouncing costs k − 1 decisions of
delay and misses successes that last fewer than k decisions: an env that ends its episodes
at success shows the classifier one solved frame, so give it ``debounce: 1`` or let success
not end its episodes (the tabletop: ``env.kwargs.terminate_on_success: false``).

**Ending episodes.** With ``terminates``, a training episode ends (as terminated) at the
decision where the learned success fires, as in an env whose success terminates. Evaluation
runs every episode to the env's own end, so that its true success is measured alike for
every run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
from torch import Tensor

from mmrl.core.component_config import EnvConfig, RewardConfig, SuccessModelConfig
from mmrl.errors import ConfigError
from mmrl.samplers.partial import as_numpy

# Names under which simulators report a step's success, looked up in this order when
# env.success_key is null: mmrl's envs, ManiSkill, LIBERO and Meta-World say "success";
# gymnasium-robotics (Fetch, Shadow hand) and panda-gym "is_success"; lerobot-env-so101 "succeed".
SUCCESS_KEYS = ("success", "is_success", "succeed")

logger = logging.getLogger(__name__)


def next_run(run: Tensor, probability: Tensor, threshold: float) -> Tensor:
    """r_t = (r_{t−1} + 1)·[p_t ≥ θ]: consecutive decisions at or above the threshold."""
    return (run + 1) * (probability >= threshold).to(run.dtype)


def episode_success(runs: Tensor, alive: Tensor, debounce: int, at: Literal["any", "end"]) -> Tensor:
    """Each episode's learned success from its run lengths ``runs`` [T, N] over decisions and
    ``alive`` [T, N] (decisions the episode took, a prefix of each column): r_t ≥ k at any
    alive decision (``any``) or at the last one (``end``)."""
    fired = (runs >= debounce) & alive
    if at == "any":
        return fired.any(0)
    last = (alive.sum(0) - 1).clamp(min=0)
    return fired[last, torch.arange(runs.shape[1], device=runs.device)]


def debounced_success(probabilities: Tensor, threshold: float, debounce: int, at: Literal["any", "end"] = "any", lengths: Tensor | None = None) -> Tensor:
    """The rule of the module docstring over whole sequences: ``probabilities`` [T, N] of N
    episodes, each ``lengths[i]`` decisions long (None: all T) → success [N] (bool)."""
    steps, n = probabilities.shape
    lengths = torch.full((n,), steps) if lengths is None else lengths
    alive = torch.arange(steps)[:, None] < lengths[None, :]
    run, runs = torch.zeros(n, dtype=torch.long), []
    for t in range(steps):
        run = next_run(run, probabilities[t], threshold) * alive[t]
        runs.append(run)
    return episode_success(torch.stack(runs), alive, debounce, at)


class LearnedSuccess:
    """The trained classifier of ``env.success_model``, checked against the env's observations."""

    def __init__(self, cfg: SuccessModelConfig, observation_space, field: str = "env.success_model"):
        from gymnasium import spaces

        from mmrl.core.weights import load_pretrained, resolve_weights_dir
        from mmrl.policies.learned_success import LearnedSuccessModel

        self.config = cfg
        path = Path(cfg.path)
        if not path.is_dir():
            raise ConfigError(f"{field}.path", cfg.path, "no such run or checkpoint directory (train a classifier with `mmrl train-reward` on data.type: success_frames)")
        weights = resolve_weights_dir(path)
        if not ((weights / "config.yaml").is_file() and (weights / "model.safetensors").is_file()):
            raise ConfigError(f"{field}.path", cfg.path, "holds no checkpoint (config.yaml + model.safetensors): name a run directory of `mmrl train-reward` or one of its checkpoints")
        model = load_pretrained(weights)
        if not isinstance(model, LearnedSuccessModel):
            raise ConfigError(f"{field}.path", cfg.path, f"holds a {model.config.type!r} policy, not a learned_success classifier")
        space = observation_space.spaces if isinstance(observation_space, spaces.Dict) else {}
        image, state = space.get("image"), space.get("state")
        if "instruction" not in space:
            raise ConfigError(f"{field}.path", cfg.path, f"the classifier reads image, state and instruction observations; this env's observation space is {observation_space}")
        state_dim = int(spaces.flatdim(state)) if state is not None else 0
        model.check_observations(None if image is None else image.shape, state_dim, f"{field}.path", cfg.path, "reads an env whose observations have")
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def probabilities(self, observation: dict, device) -> Tensor:
        """P(success) [N] (float32, on ``device``) of a batch of policy observations."""
        self.model.to(device)
        n = len(observation["instruction"])
        size = self.config.batch_size
        parts = [
            self.model.success_probability({k: v[i : i + size] for k, v in observation.items()})
            for i in range(0, n, size)
        ]
        return torch.cat(parts).to(device)


class WaveScores:
    """The learned success over one wave of ``num_envs`` episodes: each decision's run
    lengths, fed by :meth:`score` after every decision."""

    def __init__(self, source: LearnedSuccess, num_envs: int, device):
        self.source, self.device = source, device
        self.run = torch.zeros(num_envs, dtype=torch.long, device=device)
        self.runs: list[Tensor] = []
        self.decisions = torch.zeros(num_envs, dtype=torch.long, device=device)

    def score(self, observation: dict, scored) -> Tensor:
        """Scores the observations each episode reached after a decision (``scored``: the
        envs whose episode took it); returns whether the learned success fires now [N]."""
        scored = torch.as_tensor(scored, device=self.device).long()
        p = self.source.probabilities(observation, self.device)
        self.run = next_run(self.run, p, self.source.config.threshold) * scored
        self.runs.append(self.run)
        self.decisions += scored
        return (self.run >= self.source.config.debounce) & scored.bool()

    def episode_success(self, at: Literal["any", "end"]) -> Tensor:
        """Each episode's learned success [N] (bool) by the rule of the module docstring."""
        if not self.runs:
            return torch.zeros_like(self.decisions, dtype=torch.bool)
        runs = torch.stack(self.runs)
        alive = torch.arange(len(runs), device=self.device)[:, None] < self.decisions[None, :]
        return episode_success(runs, alive, self.source.config.debounce, at)


def success_metrics(info: dict) -> dict[str, Tensor]:
    """Per-episode success metrics of a rollout: ``success_rate``, the env's own flag whenever
    it has one (``env_success`` when training reads another), else the success training
    read; with a learned source, ``learned_success_rate`` and ``success_agreement`` (learned
    == env's)."""
    out = {}
    success = info.get("env_success", info.get("success"))
    if success is not None:
        out["success_rate"] = success
    if "learned_success" in info:
        out["learned_success_rate"] = info["learned_success"]
        if "env_success" in info:
            out["success_agreement"] = (info["learned_success"] == info["env_success"]).float()
    return out


class SuccessSource:
    """The success of one env sampler's episodes, by the rules of the module docstring: the
    env's per-step flags, the learned source of ``env.success_model`` (``learned``, None
    without one) and which of them a rollout's ``info["success"]`` holds."""

    def __init__(self, env_cfg: EnvConfig, rewards: Sequence[RewardConfig], env_name: str, observation_space, over_provision: float):
        """Raises a :class:`~mmrl.errors.ConfigError` for a success that training cannot
        read (see the module docstring) or a classifier that does not fit the env."""
        self.key = env_cfg.success_key
        self.env_name = env_name
        self.rewarded = any(reward.type == "success" for reward in rewards)  # a success reward reads it in training
        self.hidden = env_cfg.hide_success
        self.reported = False  # whether the env reported success at any step of the current collection
        self.warned = False
        self.learned: LearnedSuccess | None = None
        model = env_cfg.success_model
        if self.hidden and model is None and self.rewarded:
            raise ConfigError("env.hide_success", True, "hides the env's success from training, but the success reward reads it: give training a learned source (env.success_model) or drop that reward")
        if (model is not None or self.hidden) and over_provision > 1:
            field, value = ("env.success_model", model.path) if model is not None else ("env.hide_success", True)
            raise ConfigError(field, value, f"applies to whole waves, not to partial rollouts (rollout.over_provision {over_provision:g}); set over_provision: 1")
        if model is not None:
            self.learned = LearnedSuccess(model, observation_space)

    def flags(self, info: dict, no_success: np.ndarray | Tensor) -> np.ndarray | Tensor:
        """The vector env's per-env success flags of one step, from ``info[env.success_key]``
        or the first of :data:`SUCCESS_KEYS` present; ``no_success`` if the step has none."""
        key = self.key or next((k for k in SUCCESS_KEYS if k in info), None)
        if key is None or key not in info:
            return no_success
        self.reported = True
        if isinstance(no_success, Tensor):
            return torch.as_tensor(info[key], device=no_success.device).bool()
        return as_numpy(info[key])

    def wave_scores(self, num_envs: int, device) -> WaveScores | None:
        """The learned success's scores of a wave of ``num_envs`` episodes (None without one)."""
        return WaveScores(self.learned, num_envs, device) if self.learned is not None else None

    def resolve(self, info: dict, scores: WaveScores | None, n: int, training: bool, at: Literal["any", "end"]) -> None:
        """``info["success"]`` of a wave's first ``n`` episodes as training reads it: with
        ``env.success_model`` the learned success in training waves, none with
        ``env.hide_success`` alone, the env's flag in evaluation; the env's own flag moves to
        ``info["env_success"]`` and the learned one is ``info["learned_success"]``. Without
        either option, ``info`` stays as it is."""
        if scores is None and not self.hidden:
            return
        info["env_success"] = info.pop("success")
        if scores is not None:
            info["learned_success"] = scores.episode_success(at)[:n].to(info["env_success"].device).float()
        if not training:
            info["success"] = info["env_success"]
        elif scores is not None:
            info["success"] = info["learned_success"]

    def finish_training(self, info: dict) -> None:
        """After a training collection: the warning of a success reward that read no flag,
        and no ``env_success`` where the env reported none (no truth to log)."""
        if self.rewarded and self.learned is None:
            self.warn_if_unreported("training collection", "the success reward is 0 for every episode")
        if "env_success" in info and not self.reported:
            del info["env_success"]

    def finish_evaluation(self, info: dict) -> tuple[Tensor, dict]:
        """After an evaluation: each episode's success (the env's flag whenever it reported
        one, else the learned success) and, with a learned source, ``learned_success_rate``,
        ``learned_successes`` and ``success_agreement`` (when the env reported a flag)."""
        self.warn_if_unreported("evaluation", "its success_rate reads 0" if self.learned is None else "its success_rate is the learned success of env.success_model")
        success = info["success"] if self.reported or self.learned is None else info["learned_success"]
        out = {}
        if self.learned is not None:
            out["learned_success_rate"] = info["learned_success"].mean().item()
            out["learned_successes"] = info["learned_success"].tolist()
            if self.reported:
                out["success_agreement"] = (info["learned_success"] == success).float().mean().item()
        return success, out

    def warn_if_unreported(self, collection: str, consequence: str) -> None:
        """One warning per sampler when a whole collection went by without a success flag:
        success would read 0 silently, e.g. for an env that names it differently."""
        if self.reported or self.warned:
            return
        self.warned = True
        looked_for = repr(self.key) if self.key else " / ".join(SUCCESS_KEYS)
        logger.warning(
            f"mmrl: warning: env {self.env_name!r} reported no success in its info during {collection} (looked for {looked_for}), "
            f"so {consequence}; if it reports success under another info key, name that key in env.success_key"
        )
