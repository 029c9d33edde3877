"""``success_frames``: labelled frames of saved episodes, for the ``learned_success``
classifier (``mmrl train-reward``, docs/learned_success.md).

Each episode of the directories read (the mmrl-demos format of :mod:`mmrl.demos`; ``mmrl
collect --keep-failures`` writes failed episodes beside the successful ones) gives:

- its last ``last_frames`` recorded observations, labelled with the episode's outcome (1 if
  it succeeded, else 0). An episode's recorded observation t is the one seen before action
  t, so the last one is a single control step before the end: in an env whose success ends
  the episode (the tabletop), the frame that shows the solved task is never recorded, and
  the classifier learns "solved or one step from it". With ``last_frames`` k > 1 the
  positives reach k steps back, which moves the detector earlier; keep k small.
- with ``early_negatives_gap`` g, also every observation at least g steps before the end of
  a *successful* episode, labelled 0. The argument: where success ends the episode (and so
  is never reached and undone), a successful episode was not yet successful at any of its
  recorded steps, and steps well before the end are far from success too; they add on-task
  negatives (the robot moving, the object not yet placed) that failed episodes alone show
  less of. Where an env can report success and go on (success is not absorbing) the
  argument fails: leave it off.

With ``labels: step`` the labels come from the episodes' per-step success flags (``next.success``,
recorded by ``mmrl eval --save-episodes`` and ``mmrl collect``) instead: every recorded frame
t ≥ 1 is labelled with the env's success after action t − 1, the state the frame shows. Solved
states are then positives wherever the episode went on after them (an env whose success does
not end its episodes: the tabletop's ``terminate_on_success: false``), and every state short of
success is a negative, the near misses of failed episodes and the approach of successful ones
included — what a detector read under RL has to tell apart. A person labelling frames by
hand (LeRobot's reward-classifier datasets mark the frames where the task is done) gives the
same kind of labels.

Episodes are split into train and held-out by episode, within each outcome (a fraction
``held_out`` of the successes and of the failures, at least one of each; the split depends
on ``split_seed`` only), so no frame of a held-out episode is trained on.
``evaluate`` reports the held-out accuracy at P = 0.5 with its 95% Wilson interval, the
balanced accuracy ½(TPR + TNR) with a 95% interval by MOVER (Zou & Donner 2008: the Wilson
intervals of TPR and TNR recombined), TPR, TNR and the mean binary cross-entropy. The
intervals take held-out frames as independent, which they are with ``last_frames: 1`` and
without early negatives (one frame per episode); frames of one episode are not, and the
intervals are then too narrow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.config import option
from mmrl.data.sources import DataSource, DataSourceConfig
from mmrl.errors import ConfigError
from mmrl.registry import DATA_SOURCES


@dataclass
class SuccessFramesConfig(DataSourceConfig):
    type: str = option("success_frames", "data source (mmrl list data)")
    path: str | None = option(None, "a directory of episodes (mmrl collect; --keep-failures keeps the failed ones)")
    more_paths: list[str] = option(factory=list, doc="further episode directories read after path (e.g. successes and failures collected apart)")
    labels: str = option("outcome", "outcome: the last frames of each episode take its outcome; step: every frame takes the env's success flag of the state it shows (episodes recorded with next.success)", choices=("outcome", "step"))
    last_frames: int = option(1, "the last k recorded frames of each episode are labelled with its outcome", ge=1)
    early_negatives_gap: int | None = option(None, "frames at least this many steps before the end of a successful episode are negatives too (null = none; only where success ends the episode)", ge=1)
    held_out: float = option(0.2, "fraction of the successful and of the failed episodes held out for evaluation (split by episode)", ge=0.0, lt=1.0)
    split_seed: int = option(0, "seed of the held-out split (independent of the run's seed)", ge=0)
    eval_batch_size: int = option(256, "held-out frames scored per forward pass at evaluation", ge=1)


def labelled_frames(episodes: list, last_frames: int, early_negatives_gap: int | None, labels: str = "outcome") -> dict[str, Any]:
    """The labelled frames of ``episodes`` (see the module docstring): ``image`` uint8 [F, ...],
    ``state`` float32 [F, D], ``instruction`` list of F str, ``label`` float32 [F],
    ``episode`` int64 [F] (the index of each frame's episode)."""
    rows: list[tuple[int, int, float]] = []  # (episode, step, label)
    for e, episode in enumerate(episodes):
        steps = len(episode)
        if labels == "step":  # frame t shows the state action t - 1 reached; frame 0 the reset state, unlabelled
            rows += [(e, t, float(episode.step_success[t - 1])) for t in range(1, steps)]
            continue
        label = 1.0 if episode.success else 0.0
        rows += [(e, t, label) for t in range(max(0, steps - last_frames), steps)]
        if episode.success and early_negatives_gap is not None:
            rows += [(e, t, 0.0) for t in range(0, steps - early_negatives_gap) if t < steps - last_frames]
    return {
        "image": np.stack([episodes[e].image[t] for e, t, _ in rows]),
        "state": np.stack([episodes[e].state[t] for e, t, _ in rows]).astype(np.float32),
        "instruction": [episodes[e].instruction for e, _, _ in rows],
        "label": np.array([y for _, _, y in rows], dtype=np.float32),
        "episode": np.array([e for e, _, _ in rows], dtype=np.int64),
    }


def held_out_split(successes: list[bool], fraction: float, seed: int) -> np.ndarray:
    """A boolean mask over episodes: ``round(fraction · n)`` (at least 1 when fraction > 0)
    of the successful and of the failed ones, drawn by ``seed``."""
    held = np.zeros(len(successes), dtype=bool)
    if fraction == 0:
        return held
    rng = np.random.default_rng(seed)
    for outcome in (True, False):
        members = np.flatnonzero(np.array(successes) == outcome)
        take = max(1, round(fraction * len(members)))
        held[rng.permutation(members)[:take]] = True
    return held


def mover_mean_interval(p1: float, ci1: tuple[float, float], p2: float, ci2: tuple[float, float]) -> tuple[float, float]:
    """95% interval of (p1 + p2)/2 for independent proportions from their own intervals (MOVER,
    Zou & Donner 2008), θ = (p1 + p2)/2: [θ − ½·sqrt(Σ_i (p_i − l_i)²), θ + ½·sqrt(Σ_i (u_i − p_i)²)]."""
    theta = (p1 + p2) / 2
    low = theta - 0.5 * math.sqrt((p1 - ci1[0]) ** 2 + (p2 - ci2[0]) ** 2)
    high = theta + 0.5 * math.sqrt((ci1[1] - p1) ** 2 + (ci2[1] - p2) ** 2)
    return max(0.0, low), min(1.0, high)


@DATA_SOURCES.register("success_frames", config=SuccessFramesConfig)
class SuccessFrames(DataSource):
    """Labelled frames of successful and failed episodes: a ``learned_success`` classifier (mmrl train-reward)."""

    def __init__(self, cfg: SuccessFramesConfig, policy, seed: int, world: int, rank: int):
        from mmrl.demos import read_demos
        from mmrl.policies.learned_success import LearnedSuccessModel

        super().__init__(cfg, seed, world, rank)
        if not isinstance(policy, LearnedSuccessModel):
            raise ConfigError("policy.type", policy.config.type, "the success_frames source trains a success classifier: policy.type learned_success")
        episodes = []
        for field, path in [("data.path", cfg.path), *(("data.more_paths", p) for p in cfg.more_paths)]:
            if not Path(path).is_dir():
                raise ConfigError(field, path, "no such directory of episodes (mmrl collect writes one)")
            read = read_demos(path)
            if read:
                image_shape, state_dim = read[0].image.shape[1:], read[0].state.shape[1]
                policy.check_observations(image_shape, state_dim, field, path, "holds episodes with")
            episodes += read
        if cfg.labels == "step":
            if cfg.last_frames != 1 or cfg.early_negatives_gap is not None:
                field, value = ("data.last_frames", cfg.last_frames) if cfg.last_frames != 1 else ("data.early_negatives_gap", cfg.early_negatives_gap)
                raise ConfigError(field, value, "applies to labels: outcome; with labels: step every frame takes its own success flag (leave it unset)")
            if missing := sum(ep.step_success is None for ep in episodes):
                raise ConfigError("data.labels", "step", f"{missing} of {len(episodes)} episodes carry no per-step success (next.success): record them with `mmrl eval --save-episodes` or `mmrl collect`, or use labels: outcome")
        outcomes = [bool(ep.success) for ep in episodes]
        if len(set(outcomes)) < 2:
            what = ("all successful" if outcomes[0] else "all failed") if outcomes else "none"
            raise ConfigError("data.path", cfg.path, f"holds {len(episodes)} episodes, {what}: the classifier needs successes and failures (mmrl collect --keep-failures --noise 0.5 writes failures)")
        held = held_out_split(outcomes, cfg.held_out, cfg.split_seed)
        for outcome, name in ((True, "successful"), (False, "failed")):
            if not any(o == outcome and not h for o, h in zip(outcomes, held)):
                raise ConfigError("data.held_out", cfg.held_out, f"leaves no {name} episode to train on ({sum(outcomes)} successes, {len(outcomes) - sum(outcomes)} failures): collect more, or hold out 0")
        train = [ep for ep, h in zip(episodes, held) if not h]
        self.samples = self._tensors(labelled_frames(train, cfg.last_frames, cfg.early_negatives_gap, cfg.labels))
        if cfg.labels == "step" and len(set(self.samples["label"].tolist())) < 2:
            raise ConfigError("data.labels", "step", "the training frames hold one class only: a frame shows a success only if the episode went on after it "
                              "(record episodes from an env whose success does not end them, e.g. env.kwargs.terminate_on_success=false on the tabletop)")
        held_episodes = [ep for ep, h in zip(episodes, held) if h]
        self.held_out = self._tensors(labelled_frames(held_episodes, cfg.last_frames, cfg.early_negatives_gap, cfg.labels)) if held_episodes else None
        self.info = {"episodes": len(episodes), "samples": self.num_samples, "held_out_episodes": len(held_episodes)}

    @staticmethod
    def _tensors(frames: dict[str, Any]) -> dict[str, Any]:
        frames = dict(frames)
        del frames["episode"]
        return {k: (v if isinstance(v, list) else torch.from_numpy(v)) for k, v in frames.items()}

    @torch.no_grad()
    def evaluate(self, policy) -> dict[str, float]:
        """Held-out frames classified at P = 0.5 (see the module docstring for the metrics)."""
        from mmrl.core.statistics import wilson_interval
        from mmrl.policies.learned_success import balanced_bce

        if self.held_out is None:
            return {}
        frames, n = self.held_out, len(self.held_out["instruction"])
        was_training = policy.training
        policy.eval()
        logits = []
        for start in range(0, n, self.config.eval_batch_size):
            rows = slice(start, min(n, start + self.config.eval_batch_size))
            batch = {"image": frames["image"][rows].to(policy.device), "state": frames["state"][rows], "instruction": frames["instruction"][rows]}
            logits.append(policy.logits(batch).float().cpu())
        policy.train(was_training)
        s, y = torch.cat(logits), frames["label"] > 0.5
        predicted = s > 0  # P > 1/2
        correct = int((predicted == y).sum())
        positives, negatives = int(y.sum()), int((~y).sum())
        tp, tn = int((predicted & y).sum()), int((~predicted & ~y).sum())
        tpr, tnr = tp / positives, tn / negatives
        low, high = wilson_interval(correct, n)
        b_low, b_high = mover_mean_interval(tpr, wilson_interval(tp, positives), tnr, wilson_interval(tn, negatives))
        return {
            "success_accuracy": correct / n, "success_accuracy_ci_low": low, "success_accuracy_ci_high": high,
            "success_balanced_accuracy": (tpr + tnr) / 2, "success_balanced_accuracy_ci_low": b_low, "success_balanced_accuracy_ci_high": b_high,
            "success_true_positive_rate": tpr, "success_true_negative_rate": tnr,
            "held_out_frames": n, "loss/bce": float(balanced_bce(s, y.float())),
        }
