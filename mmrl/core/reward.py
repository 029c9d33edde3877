"""Reward components: built once per run, called on a whole rollout batch.

A reward is registered in :data:`mmrl.registry.REWARDS` with a typed config (a subclass of
:class:`~mmrl.core.component_config.RewardConfig`). It is either

- a :class:`Reward` subclass: constructed once per run with its config and a
  :class:`RewardContext` (device, run directory, seed), so it can load a model from a local
  path or a run directory, keep it on a device, batch its work and keep state across steps;
  it may declare that it needs the policy or the reference model (consistency rewards do);
- or a plain function ``(rollout, cfg) -> Tensor[B]``, wrapped by :class:`FunctionReward`.

Either way the call is ``reward(rollout, policy=..., reference=...) -> Tensor[B]`` for the
B samples of a rollout. A :class:`Reward` that sets ``learns`` also learns while the policy
does: after each step's samples are scored, ``update`` sees them (an adversarial
discriminator: the policy's current samples are its negatives); its state, parameters and
optimizer included, goes into checkpoints. A rollout from the prompt sampler carries each sample's prompt
record in ``rollout.info`` (``prompt``, ``answer``, ``metadata``); an env rollout carries the
episode stats (``success``, ``return``, ``length``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from mmrl.core.component_config import RewardConfig
from mmrl.core.reward_aggregation import aggregate_rewards
from mmrl.core.rollout import Rollout


@dataclass
class RewardContext:
    """What a reward may use when it is built: where to put a model and where the run lives."""

    device: torch.device = torch.device("cpu")
    run_dir: Path | None = None
    seed: int = 0

    def device_for(self, cfg: RewardConfig) -> torch.device:
        """The reward's own ``device`` if its config sets one, else the training device."""
        return torch.device(cfg.device) if cfg.device else self.device


class Reward:
    """Base of reward components with state (a model, a running statistic).

    Subclasses set ``needs_policy`` / ``needs_reference`` when their score depends on the
    policy being trained or on its reference model; the trainer then passes them (unwrapped,
    in eval mode, under ``torch.no_grad``). ``state_dict`` / ``load_state_dict`` go into
    checkpoints, so a stateful reward resumes exactly.
    """

    needs_policy: ClassVar[bool] = False
    needs_reference: ClassVar[bool] = False
    # a reward that learns during RL (an adversarial discriminator): ``update`` runs on each
    # step's samples after they are scored; its parameters and optimizer are its state
    learns: ClassVar[bool] = False

    def __init__(self, cfg: RewardConfig, context: RewardContext):
        self.config = cfg
        self.context = context

    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        raise NotImplementedError

    def update(self, rollout: Rollout, scores: Tensor, *, step: int, dist: Any) -> dict[str, float]:
        """Learn from ``rollout``, this process's samples of a step, after they were scored
        (``scores`` [B], this component's column). Only components that set ``learns`` are
        called. ``dist`` holds the collectives over learner processes (``sizes``,
        ``gather_rows``, ``sum``): a component whose update reads every process's samples (or
        all-reduces its gradients) keeps N processes = 1 process. Returns metrics (logged as
        ``reward_update/<name>/<key>``)."""
        raise NotImplementedError(f"{type(self).__name__} sets learns but has no update")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FunctionReward(Reward):
    """A plain function ``fn(rollout, cfg) -> Tensor[B]`` as a reward component. A function
    that also takes ``policy`` or ``reference`` keyword arguments gets them."""

    def __init__(self, fn: Callable[..., Tensor], cfg: RewardConfig, context: RewardContext):
        super().__init__(cfg, context)
        self.fn = fn
        params = inspect.signature(fn).parameters
        self.wants = {name for name in ("policy", "reference") if name in params}

    @property
    def needs_policy(self) -> bool:  # type: ignore[override]
        return "policy" in self.wants

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        return "reference" in self.wants

    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        extra = {"policy": policy, "reference": reference}
        return self.fn(rollout, self.config, **{k: extra[k] for k in self.wants})


def build_reward(cfg: RewardConfig, context: RewardContext, field: str = "rewards") -> Reward:
    """The registered component named by ``cfg.type``, built once with ``context``."""
    from mmrl.registry import REWARDS

    obj = REWARDS.get(cfg.type, f"{field}.type")
    if isinstance(obj, type) and issubclass(obj, Reward):
        return obj(cfg, context)
    return FunctionReward(obj, cfg, context)



def reward_names(types: list[str]) -> list[str]:
    """The components' metric names (``reward/<name>``): each one's type, numbered from the
    second of one type on (``shapes_geneval``, ``shapes_geneval_2``), so that no column
    hides another."""
    names: list[str] = []
    for kind in types:
        n = types[: len(names)].count(kind)
        names.append(kind if n == 0 else f"{kind}_{n + 1}")
    return names


class RewardSet:
    """The run's reward components, built once: ``score`` gives the [B, K] columns of a
    rollout, ``combine`` the one reward per sample that advantages and filters see
    (:func:`mmrl.core.reward_aggregation.aggregate_rewards`)."""

    def __init__(self, cfgs: list[RewardConfig], aggregation: str, context: RewardContext, log_tamed_threshold: str = "mean"):
        self.configs = list(cfgs)
        self.components = [build_reward(cfg, context, f"rewards[{i}]") for i, cfg in enumerate(self.configs)]
        self.names = reward_names([cfg.type for cfg in self.configs])
        self.weights = [cfg.weight for cfg in self.configs]
        self.aggregation = aggregation
        self.log_tamed_threshold = log_tamed_threshold
        self.needs_policy = any(c.needs_policy for c in self.components)
        self.needs_reference = any(c.needs_reference for c in self.components)

    def score(self, rollout: Rollout, *, policy: Any = None, reference: Any = None, step: int | None = None) -> Tensor:
        """[B, K] float32 on the CPU, one column per component; a non-finite value is an error
        naming the component."""
        from mmrl.errors import NonFiniteError, call_user_code

        columns = []
        for k, (name, component) in enumerate(zip(self.names, self.components)):
            kwargs = {}
            if component.needs_policy:
                kwargs["policy"] = policy
            if component.needs_reference:
                kwargs["reference"] = reference
            # what the component raises is named as the reward's fault (mmrl.errors.UserCodeError)
            r = call_user_code(f"reward {name!r}", component, rollout, where={"reward": f"rewards[{k}]"}, **kwargs)
            r = torch.as_tensor(r, dtype=torch.float32).reshape(-1).cpu()
            if r.numel() != rollout.batch_size:
                raise ValueError(f"reward {name!r} returned {r.numel()} values for {rollout.batch_size} samples")
            bad = ~torch.isfinite(r)
            if bad.any():
                where = f"step {step + 1}: " if step is not None else ""
                raise NonFiniteError(f"{where}reward '{name}' is {r[bad][0].item()} for {int(bad.sum())} of {r.numel()} samples")
            columns.append(r)
        return torch.stack(columns, dim=1)

    @property
    def learns(self) -> bool:
        return any(c.learns for c in self.components)

    def update(self, rollout: Rollout, scores: Tensor, *, step: int, dist: Any) -> dict[str, float]:
        """Let the components that learn during RL (``Reward.learns``) learn from the scored
        ``rollout`` (``scores`` the [B, K] columns ``score`` gave); their metrics, named
        ``reward_update/<name>/<key>``."""
        from mmrl.errors import call_user_code

        out: dict[str, float] = {}
        for k, (name, component) in enumerate(zip(self.names, self.components)):
            if component.learns:
                metrics = call_user_code(f"the update of reward {name!r}", component.update, rollout, scores[:, k], where={"reward": f"rewards[{k}]"}, step=step, dist=dist)
                for key, value in metrics.items():
                    out[f"reward_update/{name}/{key}"] = float(value)
        return out

    def combine(self, rewards: Tensor, group_id: Tensor, gather_rows: Any = None) -> Tensor:
        """One reward per sample from the [B, K] columns, by the configured aggregation.
        ``gather_rows`` (the collectives' row gather; every process calls it together) gives
        the batch statistics that ``log_tamed`` reads from all processes' rows; the other
        aggregations are per sample or per group and gather nothing."""
        population = gather_rows(rewards) if gather_rows is not None and self.aggregation == "log_tamed" else None
        return aggregate_rewards(rewards, group_id, self.weights, self.aggregation, threshold=self.log_tamed_threshold, population=population)

    def state_dict(self) -> dict[str, Any]:
        return {f"{i}:{name}": c.state_dict() for i, (name, c) in enumerate(zip(self.names, self.components))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, (name, c) in enumerate(zip(self.names, self.components)):
            c.load_state_dict(state.get(f"{i}:{name}", {}))
