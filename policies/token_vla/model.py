"""Discrete-token VLA: binned actions predicted autoregressively as tokens (OpenVLA style).

Every action dimension is normalized to [-1, 1] (env = center + half_range * a_n where the
env's bounds are finite; unbounded dimensions are used as they are and binned over [-1, 1])
and cut into B uniform bins; bin k decodes to its centre

    a_n = -1 + (2k + 1) / B,        k = clip(floor((a_n + 1) / 2 * B), 0, B - 1).

One decision is one action chunk of C actions × A dimensions = C·A tokens, generated after
the backbone's prefix (cameras, state, instruction; see ``mmrl.policies.vla.backbone``):

    [prefix] [start] [tok_1] … [tok_{CA-1}]   →   logits of tok_1 … tok_CA

The input at slot j is the embedding of the previous action token (a learned start vector
for j = 0) plus a learned slot embedding of (chunk index, dimension) = divmod(j, A); one
linear head over the B bins serves every slot. This follows OpenVLA (Kim et al. 2024,
"OpenVLA: An Open-Source Vision-Language-Action Model"), which discretizes each dimension into
256 bins and predicts them as language-model tokens, and its chunked variant OpenVLA-OFT;
RL fine-tuning of such a policy with group-relative advantages is SimpleVLA-RL (Li et al.
2025).

The decision's log-prob is the sum of its token log-probs under the tempered distribution
softmax(logits / temperature):

    log π(chunk | o) = Σ_{j=1}^{CA} log softmax(z_j / τ)[tok_j],

and its entropy is the sum of the per-token entropies (the entropy of the chunk's
distribution given the sampled prefix of tokens). Sampling decodes token by token with a
static key/value cache of the chunk's slots (``decode_cache``, ``mmrl.policies.vla.static_decode``);
``log_prob`` recomputes all C·A tokens in one teacher-forced pass, equal to the sampling
log-prob up to float rounding. ``compile_decoder`` runs the decoding steps after the prefix
through ``torch.compile`` (``mmrl.policies.vla.static_decode.decode_step``); ``log_prob`` stays
eager, so the trainer's deferred old log-probs give ratios of exactly 1.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn

from mmrl.core.policy import PolicyModule, Sample
from mmrl.errors import ConfigError
from mmrl.policies.token_vla.config import TokenVLAConfig
from mmrl.policies.vla.action_chunk import CompiledSteps, compiled_callable
from mmrl.policies.vla.backbone import encode_observations, pooled_prefix_state
from mmrl.policies.vla.pretrained import VLM_LAYOUTS, AdapterFreeReference, build_backbone, export_vlm, vlm_export_formats
from mmrl.policies.vla.static_decode import decode_step
from mmrl.policies.vla.tokenizer import FILE_NAME as TOKENIZER_FILE
from mmrl.policies.vla.tokenizer import InstructionTokenizer
from mmrl.registry import POLICIES


def action_bins(a_n: Tensor, bins: int) -> Tensor:
    """Bin ids of normalized actions: clip(floor((a_n + 1) / 2 * B), 0, B - 1)."""
    return torch.floor((a_n.clamp(-1.0, 1.0) + 1.0) / 2.0 * bins).long().clamp(0, bins - 1)


def bin_centers(bins: int) -> Tensor:
    """The normalized action each of the B bins decodes to: -1 + (2k + 1) / B."""
    return -1.0 + (2 * torch.arange(bins, dtype=torch.float32) + 1) / bins


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
CONTRACT = {
    "train": {  # images, state and instructions: the tabletop at 16 px
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 4, "kwargs": {"task": "spatial", "image_size": 16}},
        "sampler": {"type": "env"},
        "policy": {"type": "token_vla", "action_chunk": 2, "action_bins": 8,
                   "backbone": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "vision_channels": [4], "patch_grid": 2,
                                "max_instruction_tokens": 6}},
        "rewards": [{"type": "success"}],
    },
}


@POLICIES.register("token_vla", config=TokenVLAConfig, contract=CONTRACT)
class TokenVLAPolicy(PolicyModule):
    """Vision-language-action transformer emitting action chunks as binned tokens."""

    def __init__(self, config: TokenVLAConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        self.action_dim = int(spec["action_dim"])
        self.chunk = config.action_chunk
        self.num_tokens = self.chunk * self.action_dim
        self.bins = config.action_bins
        self.max_words = config.backbone.max_instruction_tokens

        self.tokenizer, self.backbone = build_backbone(config.backbone, spec, list(spec.get("instructions") or []))
        hd = self.backbone.hidden_size
        if self.backbone.pretrained:
            # OpenVLA's tokenization: bin k is vocabulary id action_vocab[k], one of the least-used
            # ids, so the VLM's own embeddings and output head score the action tokens
            self.register_buffer("action_vocab", self.backbone.least_used_token_ids(self.bins), persistent=False)
            with torch.no_grad():
                start = self.backbone.token_embeddings(self.backbone.text_start_id())
            self.action_start = nn.Parameter(start.clone())
            self.action_slot = nn.Parameter(torch.zeros(self.num_tokens, hd))  # starts as OpenVLA's plain token inputs
        else:
            self.action_embedding = nn.Embedding(self.bins, hd)
            nn.init.normal_(self.action_embedding.weight, std=0.02)
            self.action_start = nn.Parameter(torch.randn(hd) * 0.02)
            self.action_slot = nn.Parameter(torch.randn(self.num_tokens, hd) * 0.02)  # one per (chunk index, dim)
            self.action_head = nn.Linear(hd, self.bins)
            nn.init.normal_(self.action_head.weight, std=0.02)
            nn.init.zeros_(self.action_head.bias)

        low = torch.as_tensor(spec.get("action_low", [-math.inf] * self.action_dim), dtype=torch.float32)
        high = torch.as_tensor(spec.get("action_high", [math.inf] * self.action_dim), dtype=torch.float32)
        finite = torch.isfinite(low) & torch.isfinite(high)
        # Derived from the spec and config, not learned: kept out of the saved weights.
        self.register_buffer("action_center", torch.where(finite, (low + high) / 2, 0.0), persistent=False)
        self.register_buffer("action_half_range", torch.where(finite, (high - low) / 2, 1.0), persistent=False)
        self.register_buffer("bin_centers", bin_centers(self.bins), persistent=False)
        self._compiled_steps = CompiledSteps()  # compile_decoder's compiled step (a cache, not state)

    # ------------------------------------------------------------------ actions <-> tokens

    def tokens_to_actions(self, tokens: Tensor) -> Tensor:
        """Token ids [..., C*A] → env-unit actions [..., C, A] (bin centres)."""
        a_n = self.bin_centers[tokens].view(*tokens.shape[:-1], self.chunk, self.action_dim)
        return self.action_center + self.action_half_range * a_n

    def actions_to_tokens(self, actions: Tensor) -> Tensor:
        """Env-unit actions [..., C, A] → token ids [..., C*A] (clipped to the range)."""
        a_n = (actions.to(self.action_center.device, torch.float32) - self.action_center) / self.action_half_range
        return action_bins(a_n, self.bins).flatten(-2)

    # ------------------------------------------------------------------ forward pieces

    def encode_inputs(self, inputs) -> dict[str, Tensor]:
        """The policy's tensors for a batch of observations (what replay stores, without
        the decision dim): uint8 image, float state, instruction token ids and mask."""
        return encode_observations(self.backbone, self.tokenizer, inputs, self.action_center.device, self.max_words)

    def _prefix(self, obs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return self.backbone.prefix(obs.get("image"), obs.get("state"), obs["instruction_ids"], obs["instruction_mask"])

    def _embed_actions(self, tokens: Tensor) -> Tensor:
        """Decoder inputs of action bins ``tokens`` (their vocabulary ids' embeddings on a
        pretrained VLM)."""
        if self.backbone.pretrained:
            return self.backbone.token_embeddings(self.action_vocab[tokens])
        return self.action_embedding(tokens)

    def _action_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the B bins from decoder states [..., hidden] (on a pretrained VLM, its
        output head's rows of the action vocabulary ids)."""
        if self.backbone.pretrained:
            weight, bias = self.backbone.output_rows(self.action_vocab)
            return nn.functional.linear(hidden, weight.float(), None if bias is None else bias.float())
        return self.action_head(hidden)

    def _step_logits(self):
        """``_action_logits`` of the decoding loop's [N, hidden] rows, its weight picked, cast and
        transposed once per call: the matrix product ``F.linear`` runs (addmm, or mm without bias)."""
        weight, bias = self.backbone.output_rows(self.action_vocab) if self.backbone.pretrained else (self.action_head.weight, self.action_head.bias)
        weight_t, bias = weight.float().t(), None if bias is None else bias.float()
        return (lambda hidden: torch.mm(hidden, weight_t)) if bias is None else (lambda hidden: torch.addmm(bias, hidden, weight_t))

    def _action_inputs(self, tokens: Tensor) -> Tensor:
        """Decoder inputs of the C*A action slots given the chunk's tokens [M, C*A]:
        slot j holds the embedding of token j-1 (the start vector for j = 0) + slot j's embedding."""
        start = self.action_start.expand(tokens.shape[0], 1, -1)
        previous = self._embed_actions(tokens[:, :-1])
        return torch.cat([start, previous], dim=1) + self.action_slot

    def _logits(self, obs: dict[str, Tensor], tokens: Tensor) -> Tensor:
        """Teacher-forced logits [M, C*A, bins] of the chunk ``tokens`` [M, C*A] (untempered)."""
        embeds, mask = self._prefix(obs)
        m, p = mask.shape
        seq = torch.cat([embeds, self._action_inputs(tokens)], dim=1)
        full_mask = torch.cat([mask, mask.new_ones(m, self.num_tokens)], dim=1)
        hidden = self.backbone(seq, full_mask)
        return self._action_logits(hidden[:, p:])

    # ------------------------------------------------------------------ protocol

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """``inputs``: {"image": uint8 [N, (K,) H, W, 3], "state": [N, D], "instruction":
        N strings} (the keys the env has) or a state tensor [N, D]. Returns env actions
        [N, C, A], logp / entropy [N, 1] (sums over the C*A tokens; [N, C*A], one per token,
        with ``logp_granularity: token``), replay {image,
        state, instruction_ids, instruction_mask, action_tokens [N, 1, C*A]}.
        ``deterministic`` takes the most likely bin of every token (greedy decoding)."""
        obs = self.encode_inputs(inputs)
        embeds, mask = self._prefix(obs)
        n = embeds.shape[0]
        cache = self.backbone.new_cache()
        x = (self.action_start + self.action_slot[0]).expand(n, 1, -1)
        mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
        hidden = self.backbone(torch.cat([embeds, x], dim=1), mask, cache)[:, -1]
        # the prefix's keys/values move into a cache of all the chunk's slots (static_decode.py);
        # None: this decoder keeps transformers' growing cache
        decoder = self.backbone.static_decoder(cache, mask, self.num_tokens - 1) if self.config.decode_cache == "static" and self.num_tokens > 1 else None
        # compile_decoder: each step after the prefix through torch.compile; log_prob stays eager
        compiled = compiled_callable(self._compiled_steps, "decoder", decode_step, embeds.device) if decoder is not None and self.config.compile_decoder else None
        slots = self.action_slot.unbind(0)
        temperature = self.config.temperature
        action_logits = self._step_logits()
        tokens, step_log_probs = [], []
        for j in range(self.num_tokens):
            logits = action_logits(hidden)
            log_probs = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)  # x / 1 is x
            if deterministic:
                token = log_probs.argmax(-1)
            else:
                device = generator.device if generator is not None else log_probs.device
                token = torch.multinomial(log_probs.exp().to(device), 1, generator=generator).squeeze(1).to(log_probs.device)
            tokens.append(token)
            step_log_probs.append(log_probs)
            if j + 1 < self.num_tokens:
                x = self._embed_actions(token) + slots[j + 1]
                if decoder is not None:
                    hidden = decoder.step(x, compiled)
                else:
                    mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
                    hidden = self.backbone(x.unsqueeze(1), mask, cache)[:, -1]
        tokens_t = torch.stack(tokens, dim=1)
        replay = {k: v.unsqueeze(1) for k, v in obs.items()}
        replay["action_tokens"] = tokens_t.unsqueeze(1)
        log_probs = torch.stack(step_log_probs, 1)  # [N, C*A, bins]: the per-token numbers in one pass each
        logp = log_probs.gather(-1, tokens_t.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        if self.config.logp_granularity == "chunk":
            logp, entropy = logp.sum(1, keepdim=True), entropy.sum(1, keepdim=True)
        deferred = not deterministic and self.config.old_logp == "deferred"  # the trainer's teacher-forced pass replaces logp
        return Sample(output=self.tokens_to_actions(tokens_t), logp=logp, replay=replay, entropy=entropy, logp_deferred=deferred)

    def log_prob(self, replay: dict) -> Tensor:
        """Log-probs [N, T] of the replayed chunks (replay tensors [N, T, ...]) under the
        current parameters ([N, T*C*A], token by token, with ``logp_granularity: token``):
        one teacher-forced pass over the N*T chunks."""
        tokens = replay["action_tokens"]
        n, t = tokens.shape[:2]
        flat = {k: v.reshape(n * t, *v.shape[2:]) for k, v in replay.items()}
        tokens = flat.pop("action_tokens").to(self.action_center.device)
        log_probs = torch.log_softmax(self._logits(flat, tokens) / self.config.temperature, dim=-1)
        per_token = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if self.config.logp_granularity == "token":
            return per_token.view(n, t * self.num_tokens)
        return per_token.sum(-1).view(n, t)

    def sft_loss(self, batch: dict) -> Tensor:
        """Behaviour cloning: masked mean cross-entropy of the expert's binned action tokens
        (teacher forcing, untempered logits). ``batch``: image/state/instruction as in
        ``sample``, "actions" [B, C, A] in env units, optional "action_mask" [B, C]."""
        obs = self.encode_inputs(batch)
        tokens = self.actions_to_tokens(batch["actions"])
        logits = self._logits(obs, tokens)
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none").view_as(tokens).float()
        action_mask = batch.get("action_mask")
        if action_mask is None:
            return ce.mean()
        weight = action_mask.to(ce.device, ce.dtype).repeat_interleave(self.action_dim, dim=1)
        return (ce * weight).sum() / weight.sum().clamp(min=1.0)

    @property
    def value_feature_dim(self) -> int:
        """Width of :meth:`value_features` (a ``critic.type: value_head`` reads them)."""
        if self.config.logp_granularity != "chunk":
            raise ConfigError("policy.logp_granularity", self.config.logp_granularity, "a value head gives one value per decision, an action chunk: use chunk with critic.type value_head")
        return self.backbone.hidden_size

    def value_features(self, replay: dict) -> Tensor:
        """The backbone's pooled prefix state [N, T, hidden] of each replayed observation
        (:func:`~mmrl.policies.vla.backbone.pooled_prefix_state`), with its gradient: a value
        head on it shares the backbone with the policy."""
        n, t = replay["action_tokens"].shape[:2]
        flat = {k: v.reshape(n * t, *v.shape[2:]) for k, v in replay.items() if k != "action_tokens"}
        embeds, mask = self._prefix(flat)
        return pooled_prefix_state(self.backbone(embeds, mask), mask).view(n, t, -1)

    def imitation_batch(self, replay: dict) -> dict:
        """The N·T replayed chunks as a ``sft_loss`` batch: observations and the actions the
        sampled tokens decode to (bin centres, so ``sft_loss`` bins them back to the same
        tokens)."""
        tokens = replay["action_tokens"]
        flat = {k: v.flatten(0, 1) for k, v in replay.items() if k != "action_tokens"}
        flat["actions"] = self.tokens_to_actions(tokens.flatten(0, 1).to(self.action_center.device))
        return flat

    def reference(self):
        """With LoRA on a pretrained VLM, this policy with its adapters disabled; otherwise
        None (the trainer keeps a frozen copy of the initial weights)."""
        return AdapterFreeReference(self) if getattr(self.backbone, "lora", False) else None

    export_layouts = VLM_LAYOUTS

    def export_formats(self) -> dict[str, str]:
        return vlm_export_formats(self)

    def export(self, fmt: str, out) -> None:
        export_vlm(self, out)

    def save_extra(self, directory) -> None:
        if not self.backbone.pretrained:  # a pretrained VLM's tokenizer is in its own directory
            self.tokenizer.save(directory)

    def load_extra(self, directory) -> None:
        """The saved tokenizer replaces the one built from the spec (its vocabulary sizes
        the instruction embeddings whose weights follow)."""
        if self.backbone.pretrained:
            return
        if not (Path(directory) / TOKENIZER_FILE).is_file():
            raise ConfigError("policy.pretrained", str(directory), f"no {TOKENIZER_FILE}: expected a directory saved from a token_vla policy")
        self.tokenizer = InstructionTokenizer.load(directory)
        self.backbone.resize_instruction_vocab(self.tokenizer.vocab_size)
