"""A learned success source (``env.success_model``): P(success) from a trained
``learned_success`` classifier (policies/learned_success) in place of an env's own flag.

**When it is read.** After every decision (the policy's action chunk of C env steps), on
the observation the episode has reached: the next decision's observation, or, for an
episode that ended within the chunk, the observation its env returned at its last step. The
envs of a wave are scored in one batch.

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

from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from mmrl.core.component_config import SuccessModelConfig
from mmrl.errors import ConfigError


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
