"""OpenVLA-OFT (Kim, Finn, Liang 2025) from its released checkpoint directory, run as its
reference ``OpenVLAForActionPrediction.predict_action`` (moojink/openvla-oft,
``prismatic/extern/hf/modeling_prismatic.py``) runs it, RL-fine-tuned through its discrete
action tokens.

The VLA is OpenVLA's (``mmrl.policies.openvla``: the same files, module tree and image
processor); OFT adds the L1 head and the proprio projector (``heads.py``, read from their
``.pt`` files, ``checkpoint.py``). With T = K·A placeholders for a chunk of K actions of A dims
(``constants.py``: LIBERO K = 8, A = 7, proprio 8), one step is ONE forward pass:

    ids    = tokenize("In: What action should the robot take to {instruction}?\\nOut:") + [▁]
    seq    = [embed(<s>) | P(images) | π(p_n) | embed(ids[1:]) | 0 × T | embed(</s>)]
    h      = Llama(seq) with FULL BIDIRECTIONAL attention (padding keys masked), positions 0…L-1
    h_act  = h[j - 1] for the T placeholder positions j   (the usual one-token shift)

- P(images): the fused featurizers per image, images concatenated along the patch axis in the
  env camera order (LIBERO: agentview, then wrist), then the projector.
- π(p_n): the proprio token, appended after the patches; p_n = clip(where(mask,
  2 (p - lo) / (hi - lo + 1e-8) - 1, p), -1, 1) (``normalize_proprio``).
- The placeholders are token id 1 whose embeddings are multiplied by 0 (``input_embeddings *
  ~all_actions_mask``): zero vectors; the stop token ``</s>`` (id 2) keeps its embedding.
- Bidirectional attention is not in the modeling file: OFT pins a transformers fork
  (moojink/transformers-openvla-oft) whose Llama SDPA attention replaces the causal mask by its
  last row (every query sees every non-padding key) and passes ``is_causal=False``. mmrl
  gives transformers' Llama the same 4-D mask.
- ``action_head: l1``: a_n = L1Head(h_act reshaped [K, A·D]) (``L1RegressionActionHead``).
  ``action_head: tokens``: tok = argmax over the whole vocabulary of lm_head(h_act), then
  OpenVLA's bins: a_n = centres[clip(V - tok - 1, 0, B - 2)].
- a = where(mask, ½ (a_n + 1)(hi - lo + 1e-8) + lo, a_n) (``_unnormalize_actions``; note the
  1e-8 OpenVLA does not add), with lo/hi = q01/q99 (``bounds_q99``: LIBERO, Bridge) or
  min/max (``bounds``: ALOHA) of the ``unnorm_key`` statistics.

RL (``action_head: tokens``, SimpleVLA-RL's recipe for OFT): the T tokens are sampled at once
from the tempered softmax over the B = 256 action ids at their positions, and

    log π(chunk | o) = Σ_j log softmax(z_j[V-B:V] / τ)[tok_j - (V - B)];

the placeholders do not depend on the tokens, so ``log_prob`` is the same single pass.
The L1 head is deterministic: it has no likelihood, and RL with it is refused when the run
is built (``likelihood_refusal``; ``sample`` outside evaluation and ``log_prob`` raise the
same one-line error). SFT: OFT's L1 loss on normalized
chunks (``l1``) or the action tokens' cross-entropy (``tokens``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.core.policy import Sample
from mmrl.denoising import provisional_logp_why
from mmrl.errors import ConfigError
from mmrl.policies.openvla.checkpoint import OpenVLACheckpoint
from mmrl.policies.openvla.model import OpenVLAPolicy
from mmrl.policies.openvla_oft.checkpoint import adapter_deltas, find_component, read_component, write_component
from mmrl.policies.openvla_oft.config import OpenVLAOFTConfig
from mmrl.policies.openvla_oft.heads import L1RegressionActionHead, ProprioProjector
from mmrl.registry import POLICIES

PLACEHOLDER_ID = 1  # the id OFT writes at the action positions (embedding then zeroed)
STOP_ID = 2  # OFT's STOP_INDEX, Llama-2's "</s>"

CONTRACT = {
    "train": {
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 4, "kwargs": {"task": "spatial", "image_size": 16}},
        "sampler": {"type": "env"},
        "policy": {"type": "openvla_oft", "unnorm_key": "tabletop", "action_head": "tokens", "chunk_size": 2, "cameras": [0]},
        "rewards": [{"type": "success"}],
    },
    "prepare": "mmrl.policies.openvla_oft.tiny:contract_checkpoint",
    "ratio_atol": 1e-4,
    "ratio_why": provisional_logp_why("up to 1.1e-5 (log-probs up to 22) under MMRL_SHAPE_KERNELS=1 over seeds 0-2"),
}


def oft_unnormalize(normalized: Tensor, low: Tensor, high: Tensor, mask: Tensor) -> Tensor:
    """OFT's un-normalization: ½ (a_n + 1)(hi - lo + 1e-8) + lo where ``mask``, else a_n."""
    return torch.where(mask, 0.5 * (normalized + 1) * (high - low + 1e-8) + low, normalized)


def oft_normalize(values: Tensor, low: Tensor, high: Tensor, mask: Tensor) -> Tensor:
    """OFT's normalization of actions (data side) and proprio: clip(where(mask,
    2 (x - lo)/(hi - lo + 1e-8) - 1, x), -1, 1)."""
    return torch.where(mask, 2 * (values - low) / (high - low + 1e-8) - 1, values).clamp(-1, 1)


def _bounds(stats: dict, kind: str, normalization: str, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    keys = ("q01", "q99") if normalization == "bounds_q99" else ("min", "max")
    if any(k not in stats for k in keys):
        raise ConfigError("policy.normalization", normalization, f"the {kind} statistics have no {'/'.join(keys)}")
    low, high = (torch.tensor(stats[k], dtype=torch.float64) for k in keys)
    mask = torch.tensor(stats.get("mask", [True] * dim), dtype=torch.bool)
    return low, high, mask


@POLICIES.register("openvla_oft", config=OpenVLAOFTConfig, contract=CONTRACT)
class OpenVLAOFTPolicy(OpenVLAPolicy):
    """An OpenVLA-OFT checkpoint: OpenVLA's VLA, parallel decoding of a chunk, L1 head or action tokens, proprio token."""

    def __init__(self, config: OpenVLAOFTConfig, spec: dict):
        super().__init__(config, spec)
        source = self.source
        stats = source.norm_stats[self.unnorm_key]
        if config.action_dim is not None and config.action_dim != self.action_dim:
            raise ConfigError("policy.action_dim", config.action_dim, f"the {self.unnorm_key} statistics are of {self.action_dim}-dim actions")
        low, high, mask = _bounds(stats["action"], "action", config.normalization, self.action_dim)
        self.register_buffer("action_low", low, persistent=False)
        self.register_buffer("action_high", high, persistent=False)
        self.register_buffer("action_unnorm_mask", mask, persistent=False)
        self.chunk_size = int(config.chunk_size)
        self.num_action_tokens = self.chunk_size * self.action_dim
        dtype = getattr(torch, config.vlm_dtype)
        width = int(self.language_model.config.hidden_size)
        self.files: dict[str, tuple[str, bool, dict[str, Tensor]]] = {}  # module -> (file name, had module., stored tensors)

        if find_component(source.path, "vision_backbone") is not None:
            raise ConfigError("policy.checkpoint", str(source.path), "holds a vision_backbone--*checkpoint.pt: a FiLM checkpoint, whose language-conditioned ViTs are not supported")
        self.action_head = None
        if config.action_head == "l1":
            path = find_component(source.path, "action_head")
            if path is None:
                raise ConfigError("policy.action_head", "l1", f"{source.path} has no action_head--*checkpoint.pt (the L1 head's weights); use tokens for OFT's discrete action tokens")
            state, prefixed = read_component(path)
            try:
                head = L1RegressionActionHead.from_state(state)
                head.load_state_dict(state, strict=True)
            except (KeyError, RuntimeError, ValueError) as e:
                raise ConfigError("policy.checkpoint", path.name, f"not an L1RegressionActionHead state dict: {str(e).splitlines()[0]}") from None
            if head.action_dim != self.action_dim or head.model.fc1.in_features != width * self.action_dim:
                raise ConfigError("policy.action_head", "l1", f"{path.name} maps {head.model.fc1.in_features} inputs to {head.action_dim}-dim actions; the model gives {width} per token and the statistics are {self.action_dim}-dim")
            self.action_head = head.to(dtype)
            self.files["action_head"] = (path.name, prefixed, state)

        self.proprio_projector = None
        if config.use_proprio:
            path = find_component(source.path, "proprio_projector")
            if path is None:
                raise ConfigError("policy.use_proprio", True, f"{source.path} has no proprio_projector--*checkpoint.pt; use false for a checkpoint trained without proprio")
            proprio = stats.get("proprio")
            if not isinstance(proprio, dict):
                raise ConfigError("policy.use_proprio", True, f"dataset_statistics.json has no proprio statistics for {self.unnorm_key}")
            state, prefixed = read_component(path)
            if "fc1.weight" not in state:
                raise ConfigError("policy.checkpoint", path.name, "not a ProprioProjector state dict (fc1, fc2)")
            llm_dim, proprio_dim = state["fc1.weight"].shape
            projector = ProprioProjector(llm_dim, proprio_dim)
            projector.load_state_dict(state, strict=True)
            env_state = spec.get("state_dim")
            if not env_state:
                raise ConfigError("policy.use_proprio", True, "the env gives no state observation")
            if int(env_state) != proprio_dim or len(proprio.get("q01", proprio.get("min", []))) != proprio_dim:
                raise ConfigError("policy.use_proprio", True, f"{path.name} reads {proprio_dim}-dim proprio; the env's state is {int(env_state)}-dim")
            p_low, p_high, p_mask = _bounds(proprio, "proprio", config.normalization, proprio_dim)
            self.register_buffer("proprio_low", p_low, persistent=False)
            self.register_buffer("proprio_high", p_high, persistent=False)
            self.register_buffer("proprio_mask", p_mask, persistent=False)
            self.proprio_projector = projector.to(dtype)
            self.files["proprio_projector"] = (path.name, prefixed, state)

    # ------------------------------------------------------------------ construction

    def _check_cameras(self, spec: dict) -> None:
        shape = spec.get("image_shape")
        if shape is None:
            raise ConfigError("policy.type", "openvla_oft", "OpenVLA-OFT reads camera images; the env gives none (no image in its observations)")
        cameras = 1 if len(shape) == 3 else int(shape[0])
        if max(self.config.cameras) >= cameras:
            raise ConfigError("policy.cameras", self.config.cameras, f"the env gives {cameras} camera(s): indices 0..{cameras - 1}")

    def _checkpoint_tensors(self, source: OpenVLACheckpoint) -> dict[str, Tensor]:
        """The model files' tensors; with ``lora_adapter: apply``, W + s·B·A for each adapted layer."""
        tensors = source.read_tensors()
        if self.config.lora_adapter == "apply":
            for name, delta in adapter_deltas(source.path, tensors).items():
                tensors[name] = (tensors[name].float() + delta).to(tensors[name].dtype)
        return tensors

    # ------------------------------------------------------------------ inputs

    def encode_inputs(self, inputs) -> dict[str, Tensor]:
        """OpenVLA's (frames of the configured cameras, prompt ids / mask) and, with proprio,
        the env's raw state [N, S] (float32)."""
        obs = super().encode_inputs(inputs)
        if self.proprio_projector is not None:
            obs["state"] = inputs["state"].to(self.action_low.device, torch.float32)
        return obs

    def _sequence(self, obs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """[<s> | patches | proprio | rest of the prompt (left-padded) | T zero placeholders | </s>]
        embeddings and their key mask."""
        patches = self.projector(self.vision_backbone(self.pixel_values(obs["image"])))
        if self.proprio_projector is not None:
            p = oft_normalize(obs["state"].to(torch.float64), self.proprio_low, self.proprio_high, self.proprio_mask)
            weight = self.proprio_projector.fc1.weight
            patches = torch.cat([patches, self.proprio_projector(p.float().to(weight.dtype))[:, None].to(patches.dtype)], dim=1)
        ids, mask = obs["prompt_ids"], obs["prompt_mask"]
        embed = self.language_model.get_input_embeddings()
        words = embed(ids)
        n, t = ids.shape[0], self.num_action_tokens
        placeholders = embed(torch.full((n, t), PLACEHOLDER_ID, dtype=ids.dtype, device=ids.device)) * 0
        stop = embed(torch.full((n, 1), STOP_ID, dtype=ids.dtype, device=ids.device))
        embeds = torch.cat([words[:, :1], patches.to(words.dtype), words[:, 1:], placeholders, stop], dim=1)
        full_mask = torch.cat([mask[:, :1], mask.new_ones(n, patches.shape[1]), mask[:, 1:], mask.new_ones(n, t + 1)], dim=1)
        return embeds, full_mask

    def action_hidden(self, obs: dict[str, Tensor]) -> Tensor:
        """Last hidden states [N, T, D] that predict the T placeholders (each one's predecessor),
        from one bidirectional pass."""
        embeds, mask = self._sequence(obs)
        keys = mask.bool()[:, None, None, :]
        additive = torch.zeros(keys.shape, dtype=embeds.dtype, device=embeds.device).masked_fill(~keys, torch.finfo(embeds.dtype).min)
        additive = additive.expand(-1, 1, embeds.shape[1], -1)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.language_model.model(inputs_embeds=embeds, attention_mask=additive, position_ids=positions, use_cache=False)
        t = self.num_action_tokens
        return out.last_hidden_state[:, -(t + 2) : -2]

    # ------------------------------------------------------------------ actions

    def unnormalize(self, normalized: Tensor) -> Tensor:
        """Normalized actions [..., A] → env units [..., A] (float64 → float32)."""
        return oft_unnormalize(normalized.to(torch.float64), self.action_low, self.action_high, self.action_unnorm_mask).float()

    def normalize_actions(self, actions: Tensor) -> Tensor:
        """Env-unit actions [..., A] (the model's gripper convention) → OFT's normalized actions (float64)."""
        return oft_normalize(actions.to(self.action_low.device, torch.float64), self.action_low, self.action_high, self.action_unnorm_mask)

    def tokens_to_actions(self, tokens: Tensor) -> Tensor:
        """Vocabulary ids [..., T] → actions [..., K, A] (the reference's bins, OFT's un-normalization)."""
        bins = (self.vocab_size - tokens.long() - 1).clamp(0, self.bin_centers.shape[0] - 1)
        normalized = self.bin_centers[bins].view(*tokens.shape[:-1], self.chunk_size, self.action_dim)
        return self.unnormalize(normalized)

    def actions_to_tokens(self, actions: Tensor) -> Tensor:
        """Actions [..., K, A] → vocabulary ids [..., T] (OpenVLA's action tokenizer on OFT's normalization)."""
        ids = self.vocab_size - torch.bucketize(self.normalize_actions(actions), self.bin_edges, right=True)
        return ids.flatten(-2)

    def likelihood_refusal(self) -> ConfigError | None:
        return self._refuse_rl() if self.action_head is not None else None

    def _refuse_rl(self) -> ConfigError:
        return ConfigError("policy.action_head", "l1", "the L1 regression head gives one deterministic chunk and has no likelihood for RL; use tokens (OFT's discrete action tokens)")

    # ------------------------------------------------------------------ protocol

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """``inputs``: {"image": uint8 [N, (K,) H, W, 3], "instruction": N strings, "state": [N, S]}.
        Returns env actions [N, K, A] (one chunk per decision), logp / entropy [N, 1] ([N, T]
        with ``logp_granularity: token``), replay {image, prompt_ids, prompt_mask, (state),
        action_tokens [N, 1, T] | normalized_actions [N, 1, K, A]}. ``deterministic``: the
        reference's decoding (L1 head, or argmax over the whole vocabulary)."""
        if self.action_head is not None and not deterministic:
            raise self._refuse_rl()
        obs = self.encode_inputs(inputs)
        hidden = self.action_hidden(obs)
        n = hidden.shape[0]
        replay = {k: v.unsqueeze(1) for k, v in obs.items()}
        if self.action_head is not None:
            normalized = self.action_head(hidden, self.chunk_size).float()
            replay["normalized_actions"] = normalized.unsqueeze(1)
            actions = self.to_env(self.unnormalize(normalized))
            zeros = hidden.new_zeros(n, 1, dtype=torch.float32)
            return Sample(output=actions, logp=zeros, replay=replay, entropy=zeros)
        log_probs = self._action_log_probs(hidden)  # [N, T, B]
        if deterministic:
            tokens = self.language_model.lm_head(hidden).argmax(-1)
        else:
            device = generator.device if generator is not None else log_probs.device
            flat = log_probs.exp().reshape(-1, self.num_bins).to(device)
            tokens = torch.multinomial(flat, 1, generator=generator).view(n, -1).to(log_probs.device) + self.first_action_id
        logp = self._token_log_prob(log_probs, tokens)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        if self.config.logp_granularity == "chunk":
            logp, entropy = logp.sum(1, keepdim=True), entropy.sum(1, keepdim=True)
        replay["action_tokens"] = tokens.unsqueeze(1)
        actions = self.to_env(self.tokens_to_actions(tokens))
        return Sample(output=actions, logp=logp, replay=replay, entropy=entropy, logp_deferred=not deterministic)

    def _flat_obs(self, replay: dict) -> dict[str, Tensor]:
        keys = ("image", "prompt_ids", "prompt_mask", "state")
        return {k: replay[k].flatten(0, 1).to(self.action_low.device) for k in keys if k in replay}

    def log_prob(self, replay: dict) -> Tensor:
        """Log-probs [N, T] of the replayed chunks ([N, T·K·A] with ``logp_granularity: token``):
        the sampling pass itself (the placeholders do not depend on the tokens)."""
        if self.action_head is not None:
            raise self._refuse_rl()
        tokens = replay["action_tokens"]
        n, t = tokens.shape[:2]
        logp = self._token_log_prob(self._action_log_probs(self.action_hidden(self._flat_obs(replay))), tokens.flatten(0, 1).to(self.action_low.device))
        if self.config.logp_granularity == "chunk":
            return logp.sum(-1).view(n, t)
        return logp.view(n, t * self.num_action_tokens)

    def sft_loss(self, batch: dict) -> Tensor:
        """Behaviour cloning on chunks ``actions`` [B, K, A] (env units) with ``action_mask``
        [B, K]: OFT's L1 loss |L1Head(h) - a_n| on normalized actions (``l1``), or the mean
        cross-entropy of the action tokens over the action ids at τ = 1 (``tokens``)."""
        actions = batch["actions"]
        if actions.shape[1] != self.chunk_size:
            raise ConfigError("policy.chunk_size", self.chunk_size, f"the batch holds chunks of {actions.shape[1]} actions")
        device = self.action_low.device
        mask = batch.get("action_mask")
        mask = torch.ones(actions.shape[:2], device=device) if mask is None else mask.to(device, torch.float32)
        if "prompt_ids" in batch:
            obs = {k: batch[k].to(device) for k in ("image", "prompt_ids", "prompt_mask", "state") if k in batch}
        else:
            obs = self.encode_inputs(batch)
        hidden = self.action_hidden(obs)
        model_actions = self.from_env(actions.to(device))
        weights = mask.sum().clamp(min=1)
        if self.action_head is not None:
            target = self.normalize_actions(model_actions).float()
            error = (self.action_head(hidden, self.chunk_size).float() - target).abs().mean(-1)
            return (error * mask).sum() / weights
        log_probs = torch.log_softmax(self._action_log_probs(hidden) * self.config.temperature, dim=-1)
        nll = -self._token_log_prob(log_probs, self.actions_to_tokens(model_actions)).view(mask.shape[0], self.chunk_size, self.action_dim).mean(-1)
        return (nll * mask).sum() / weights

    def imitation_batch(self, replay: dict) -> dict:
        """The replayed decisions as a ``sft_loss`` batch: observations and the chunks they executed."""
        batch = self._flat_obs(replay)
        if "action_tokens" in replay:
            actions = self.tokens_to_actions(replay["action_tokens"].flatten(0, 1).to(self.action_low.device))
        else:
            actions = self.unnormalize(replay["normalized_actions"].flatten(0, 1).to(self.action_low.device))
        batch["actions"] = self.to_env(actions)
        return batch

    # ------------------------------------------------------------------ export

    export_layouts = {
        "openvla_oft": "the checkpoint's own layout: the OpenVLA files with the current weights (LoRA merged, source dtypes), the action head / proprio projector .pt files "
        "rewritten under their names (plain tensors, module. prefix kept), every other file (tokenizer, statistics, lora_adapter/) copied"
    }

    def export(self, fmt: str, out) -> None:
        from mmrl.policies.openvla.checkpoint import write_checkpoint

        if fmt != "openvla_oft":
            raise ConfigError("--format", fmt, "openvla_oft is the format this policy writes")
        tensors = self.export_tensors()
        out = write_checkpoint(self.source, {k: tensors[k] for k in self.source.weight_files}, out)
        for module, (file, prefixed, stored) in self.files.items():
            prefix = module + "."
            write_component(out / file, {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, stored, prefixed)


__all__ = ["OpenVLAOFTPolicy", "oft_normalize", "oft_unnormalize"]
