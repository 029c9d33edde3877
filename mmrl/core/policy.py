"""The ``Policy`` protocol: the only contract the core relies on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@dataclass
class Sample:
    """What one ``Policy.sample`` call returns for N inputs and T decisions each."""

    output: Any  # what the caller consumes: actions [N, C, A], token ids, final latents ...
    # [N, T] log-prob of each decision under the sampling parameters; attached to the autograd
    # graph of the parameters when ``sample`` was asked to ``keep_graph``
    logp: Tensor
    replay: dict[str, Any]  # enough to recompute ``logp`` with ``log_prob(replay)``
    mask: Tensor | None = None  # [N, T] valid decisions (None = all valid)
    entropy: Tensor | None = None  # [N, T] per-decision entropy, if the policy can tell
    info: dict[str, Any] = field(default_factory=dict)
    # ``logp`` is provisional (e.g. the decoding loop's own numbers): the exact values are
    # ``log_prob(replay)`` at the sampling parameters, which the trainer computes when it
    # first needs them (docs/architecture.md, "Deferred old log-probs")
    logp_deferred: bool = False
    # a policy that ``carries_state``: what it hands itself for its next call in the same
    # episodes (one entry per input row; a language agent's token history). The env sampler
    # keeps it for the wave and passes it back as ``inputs["carry"]``; opaque to the sampler
    carry: Any = None
    # [N] bool: rows whose episodes the policy can act no further in (a language agent's
    # context is full); the env sampler ends them as truncated without counting this step's
    # outcome (their decision's mask is the policy's, normally 0)
    end: Tensor | None = None


@runtime_checkable
class Policy(Protocol):
    def sample(self, inputs: Any, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample: ...

    def log_prob(self, replay: dict[str, Any]) -> Tensor: ...


class PolicyModule(nn.Module):
    """Base class for mmrl's own policies: ``forward`` is ``log_prob`` so that the
    distributed wrapper (DDP/FSDP) sees the training pass and synchronises its gradients."""

    config: Any = None
    # ``sample(..., keep_graph=True)`` returns ``Sample.logp`` with the autograd graph of the
    # parameters, equal in value and gradient to ``log_prob(replay)`` at the sampling
    # parameters; the trainer may then backpropagate through them instead of recomputing
    # (``algo.reuse_sampling_graph``, docs/architecture.md)
    keeps_sampling_graph: bool = False
    # ``sample(..., noise_group_size=G)`` starts each run of G consecutive samples from one
    # initial noise (DanceGRPO's shared noise within a group; sampler.shared_noise)
    shares_initial_noise: bool = False
    # ``sample(inputs)`` reads ``inputs["carry"]`` (what its previous call in the same episodes
    # returned as ``Sample.carry``; None at an episode's first decision) and ``inputs["active"]``
    # ([N] bool, the rows whose episodes are still running): a recurrent policy, or a language
    # agent whose decision is a turn and whose token history runs through the episode
    carries_state: bool = False
    # ``sample(..., final_only=True)`` keeps in the replay only what its final samples and its
    # conditioning need (a denoising chain's last latent), with zero log-probs: for a loss
    # that reads no log-probs (``needs_log_probs=False``, DiffusionNFT); the samplers ask for it
    samples_final_only: bool = False
    # a copy of it can be rebuilt in a rollout worker process (``rollout.workers`` > 0); a policy
    # that cannot says False and is refused there with a one-line error
    runs_in_worker: bool = True
    # a reward model's items: a kind registered in policies/reward_model/inputs.py
    # (``mmrl.policies.reward_model.inputs.INPUT_KINDS``), what a ``preferences`` data source
    # must hold; None or "": the model scores nothing of the kind
    input_kind: ClassVar[str | None] = None
    # the (H, W), or the side, of the images it generates, which an image data source renders
    # its images at; None: it generates no images of a fixed size
    resolution: Any = None

    def renew_carry(self, carry: list) -> list:
        """``carry`` (one entry per env row, None where no episode runs) of episodes that go on
        under new weights: with partial rollouts a collection resumes episodes an update
        interrupted. Returns what of it stays valid; by default all of it."""
        return carry

    def likelihood_refusal(self) -> Exception | None:
        """Why this policy, as configured, has no log-probs for a loss that reads them (a
        one-line ``ConfigError`` naming the option, e.g. a deterministic regression head), or
        None. The losses that read log-probs raise it when the run is built."""
        return None

    def sample(self, inputs: Any, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        raise NotImplementedError

    def log_prob(self, replay: dict[str, Any]) -> Tensor:
        raise NotImplementedError

    def sample_partial(self, inputs: Any, states: list[dict | None], generator: torch.Generator | None, stop) -> list[dict]:
        """Partial rollouts (``rollout.over_provision``): continue each input's sample from its
        state (None: from the start) until ``stop(rows that have ended)`` says enough rows
        have, and return each row's state; finished rows become a sample with
        :meth:`sample_of_states`. A policy pauses samples when it overrides this method."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause a sample and continue it (sample_partial)")

    def sample_of_states(self, inputs: Any, states: list[dict]) -> Sample:
        """The sample of finished :meth:`sample_partial` states, as :meth:`sample` returns it."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause a sample and continue it (sample_of_states)")

    @classmethod
    def check_partial_rollouts(cls, config: Any, policy: "PolicyModule | None" = None) -> None:
        """A one-line ``ConfigError`` where partial rollouts need what this configuration (or the
        built ``policy``, once there is one) lacks; called at validation and again before
        anything is sampled. Default: nothing to refuse."""

    def continuation_log_prob(self, prompts: list[str], prefixes: list[str], continuations: list[str], reduce: str = "mean") -> Tensor:
        """[B] log-likelihood of each continuation after its prompt and prefix under the
        model's own distribution, summed over its tokens or their mean (``reduce``): what a
        reward that scores answers given their reasoning reads (``grpo_care``)."""
        raise NotImplementedError(f"{type(self).__name__} gives no log-likelihood of a text continuation (continuation_log_prob)")

    # a critic (mmrl/core/critic.py) reads ``critic_inputs(replay)`` [B, T, critic_input_dim]
    # (critic.type mlp) or ``value_features(replay)`` [B, T, value_feature_dim] with their
    # gradient (critic.type value_head); None: the policy does not offer them
    critic_input_dim: int | None = None
    value_feature_dim: int | None = None

    def critic_inputs(self, replay: dict[str, Any]) -> Tensor:
        raise NotImplementedError

    # the values of one decision's action as ``rsample`` gives it (a chunk's actions × their
    # dimensions); None: the policy has no reparameterised continuous action
    action_values: int | None = None

    def rsample(self, replay: dict[str, Any], noise: Tensor | None = None, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """A fresh action for each replayed decision's observation, reparameterised: the
        normalized action [B, T, D] (D: a chunk's values, in [-1, 1]) as a differentiable
        function of the parameters and standard normal ``noise`` [B, T, D] (drawn from
        ``generator`` when None), and its log-prob [B, T] with grad. Off-policy actor-critic
        losses (``algo.loss: sac``) train through it; a policy without it is refused there."""
        raise NotImplementedError(f"{type(self).__name__} gives no reparameterised continuous action (rsample)")

    def replayed_action(self, replay: dict[str, Any]) -> Tensor:
        """The normalized action [B, T, D] each replayed decision executed, in the space
        ``rsample`` returns (a critic's action input)."""
        raise NotImplementedError(f"{type(self).__name__} cannot give its replayed actions (replayed_action)")

    def rsample_refusal(self) -> Exception | None:
        """Why this policy, as configured, cannot serve ``rsample`` to an off-policy loss (a
        one-line ``ConfigError`` naming the option), or None."""
        return None

    def demo_replay(self, inputs: Any, actions: Tensor | None) -> dict[str, Any]:
        """The replay [N, 1, ...] a decision on observations ``inputs`` (a batch as ``sample``
        takes it) that executed ``actions`` (env units [N, C, A]) would have written, so
        that demonstrations join an off-policy loss's buffer (``algo.loss.demos``); with
        ``actions`` None, the observation's part alone (a bootstrap observation). Touches no
        parameter."""
        raise NotImplementedError(f"{type(self).__name__} cannot write demonstrations as its replay (demo_replay)")

    def value_features(self, replay: dict[str, Any]) -> Tensor:
        raise NotImplementedError

    def sft_loss(self, batch: dict[str, Any]) -> Tensor:
        """Behaviour-cloning loss on demonstrations (``algo.type: sft``); ``batch`` holds the
        observations ("image", "state", "instruction" or "obs"), "actions" [B, C, A] in env
        units and "action_mask" [B, C]."""
        raise NotImplementedError(f"{type(self).__name__} has no sft_loss (behaviour cloning)")

    def imitation_batch(self, replay: dict[str, Any]) -> dict[str, Any]:
        """The decisions of a replay ([N, T, ...] tensors) as a ``sft_loss`` batch of N·T
        samples: their observations and the action chunks that were executed (env units),
        so that the policy's own behaviour can be imitated with its supervised loss
        (``algo.self_imitation.loss: sft``). Only reshapes and decodes: it touches no parameter."""
        raise NotImplementedError(f"{type(self).__name__} cannot turn its replay into a sft_loss batch (algo.self_imitation.loss: sft)")

    def exact_kl(self, replay: dict[str, Any], reference: "PolicyModule") -> Tensor:
        """KL(πθ ‖ πref) [B, T] of each replayed decision in closed form (``kl.type: exact``),
        where the policy can compute it (the Gaussian steps of a denoising chain), with
        gradient w.r.t. this policy's parameters only; ``reference`` is the frozen
        reference policy."""
        raise NotImplementedError(
            f"{type(self).__name__} has no closed-form KL to its reference (kl.type: exact); use a sampled estimator (k1, k2, k3) instead"
        )

    def activation_bytes(self, replay: dict[str, Any]) -> float | None:
        """An estimate of the bytes of the largest activation tensor ``log_prob(replay)``
        makes per sample of ``replay`` (e.g. the denoiser's widest feature map, times the
        steps one call evaluates), from which the trainer picks its gradient-accumulation
        pieces when ``algo.micro_batches`` is null; ``None`` (the default): no estimate,
        one piece."""
        return None

    def velocity(self, replay: dict[str, Any], x: Tensor, sigma: Tensor, rows: Tensor) -> Tensor:
        """A flow policy's velocity v(x, σ | c) [M, ...] at latents ``x`` [M, ...] and noise
        levels ``sigma`` [M] (x_σ = (1 − σ)·x0 + σ·ε, v = ε − x0), conditioned as the replay's
        samples ``rows`` [M] are: what a loss on final samples trains (``algo.loss: nft``)."""
        raise NotImplementedError(f"{type(self).__name__} has no flow velocity (velocity)")

    def flow_sigmas(self) -> Tensor:
        """σ_0 = 1 … σ_K = 0 [K + 1] of a flow policy's sampling steps (a loss on final
        samples draws its noise levels from them)."""
        raise NotImplementedError(f"{type(self).__name__} has no flow sampling steps (flow_sigmas)")

    def final_samples(self, replay: dict[str, Any]) -> Tensor:
        """The final samples x0 [N, ...] (latents) of the replay's samples."""
        raise NotImplementedError(f"{type(self).__name__} keeps no final samples in its replay (final_samples)")

    def forward(self, replay: dict[str, Any], mode: str = "log_prob", reference: nn.Module | None = None, sampled_logp: Tensor | None = None, **kwargs):
        # the distributed wrapper syncs gradients of what goes through forward: the RL pass
        # (log_prob, with the exact KL when asked), a flow's velocity and supervised
        # fine-tuning (sft) all do. ``sampled_logp``: the sampling pass's graph-carrying
        # log-probs stand in for log_prob(replay); passing them through forward lets the
        # wrapper see their backward
        if mode == "sft":
            return self.sft_loss(replay)
        if mode == "velocity":
            return self.velocity(replay, **kwargs)
        if mode == "rsample":
            return self.rsample(replay, **kwargs)
        logp = sampled_logp if sampled_logp is not None else self.log_prob(replay)
        if mode == "log_prob_and_kl":
            return logp, self.exact_kl(replay, reference)
        return logp

    def media(self, rollout) -> dict[str, Any]:
        """Samples worth looking at, written as files at evaluation (:mod:`mmrl.media`):
        ``{name: uint8 [N, H, W, 3] images or [N, F, H, W, 3] videos}`` of an evaluation
        rollout. Default: nothing."""
        return {}

    def save_extra(self, directory) -> None:
        """Write files the weights do not hold (e.g. a tokenizer) next to them; called by
        ``save_pretrained`` and by checkpoints."""

    def load_extra(self, directory) -> None:
        """Read what ``save_extra`` wrote; called before the weights are loaded."""

    def reference(self) -> "nn.Module | None":
        """A frozen model for KL terms; ``None`` lets the trainer keep a frozen copy of the
        initial weights."""
        return None

    # every format ``mmrl export`` can write a policy of this class in, {name: what is written}
    # (``mmrl export --help`` lists them); none: mmrl's own config.yaml + model.safetensors
    export_layouts: ClassVar[dict[str, str]] = {}

    def export_formats(self) -> dict[str, str]:
        """The formats ``mmrl export --format`` writes this policy in, as it is configured:
        ``{name: what is written}``, some of :attr:`export_layouts`. Default: all of them."""
        return dict(self.export_layouts)

    def export(self, fmt: str, out: Path) -> None:
        """Write this policy in format ``fmt`` (a key of :meth:`export_formats`) into the
        directory ``out``, which does not exist yet (``mmrl export`` renames it into place)."""
        raise NotImplementedError(f"{type(self).__name__} lists no export format")

    # the shape of one decision's initial noise that ``sample_from_noise`` starts from, and
    # the width of the observation features it hands a function choosing that noise; None:
    # the policy cannot act from a given noise
    noise_shape: tuple[int, ...] | None = None
    noise_feature_dim: int | None = None

    def sample_from_noise(self, inputs: Any, noise: Tensor | Callable[[Tensor], Tensor]) -> Sample:
        """The decision on observations ``inputs`` (a batch as ``sample`` takes it) whose
        sampling starts from the given initial noise [N, *noise_shape] instead of a draw, with
        every later step deterministic: the same noise gives the same output. ``noise`` may
        instead be a function of the observations' features [N, noise_feature_dim] (a
        fixed-width summary of each observation as this policy sees it) that returns the noise,
        so that a policy steering this one (DSRL, ``policy.type: dsrl``) reads them in the same
        pass. Returns ``Sample.output`` (env actions [N, C, A]), zero log-probs [N, 1], the
        replay of a deterministic sample, and ``info["features"]`` and ``info["noise"]``. A
        policy is capable of it when it overrides this method."""
        raise NotImplementedError(f"{type(self).__name__} cannot act from a given initial noise (sample_from_noise)")


def overrides(policy, method: str) -> bool:
    """Whether the policy (an instance or a class) implements an optional hook of
    :class:`PolicyModule`."""
    impl = getattr(policy if isinstance(policy, type) else type(policy), method, None)
    return impl is not None and impl is not getattr(PolicyModule, method, None)


# Every optional capability a run can ask of a policy, named by the hook or flag of
# :class:`PolicyModule` that declares it, and what asks for it. A policy has one when its
# class overrides the hook (a flag: sets it true) and the hook's ``<name>_refusal()``, where
# there is one, finds nothing in its configuration to refuse. The policy contract test
# (tests/policies/test_contract.py) runs each one's own checks on every registered policy
# that has it.
CAPABILITIES: dict[str, str] = {
    "rsample": "a reparameterised continuous action (rsample, replayed_action, action_values): off-policy actor-critic losses (algo.loss: sac)",
    "demo_replay": "demonstrations written as its replay: an off-policy loss's buffer seeded with them (algo.loss.demos)",
    "sample_from_noise": "a decision from a given initial noise (noise_shape, noise_feature_dim): a policy that steers it (policy.type: dsrl)",
    "imitation_batch": "its replay as a sft_loss batch: self-imitation with its supervised loss (algo.self_imitation.loss: sft)",
    "exact_kl": "the closed-form KL to its reference (algo.kl.type: exact)",
    "critic_inputs": "a separate critic's inputs (critic.type: mlp, critic_input_dim)",
    "value_features": "features for a value head (critic.type: value_head, value_feature_dim)",
    "activation_bytes": "an activation estimate per sample: the gradient-accumulation pieces (algo.micro_batches: null)",
    "keeps_sampling_graph": "sampling log-probs that keep their autograd graph (algo.reuse_sampling_graph)",
    "samples_final_only": "a replay of final samples alone, for a loss that reads no log-probs (algo.loss: nft)",
    "sample_partial": "samples paused and continued across steps (rollout.over_provision)",
    "continuation_log_prob": "the log-likelihood of a text continuation (rewards: grpo_care)",
}


def capabilities(policy) -> set[str]:
    """The names in :data:`CAPABILITIES` that ``policy`` (an instance, as configured) has."""
    have = set()
    for name in CAPABILITIES:
        declared = getattr(PolicyModule, name)
        if not (overrides(policy, name) if callable(declared) else getattr(policy, name)):
            continue
        if hasattr(PolicyModule, f"{name}_refusal") and getattr(policy, f"{name}_refusal")() is not None:
            continue
        have.add(name)
    return have
