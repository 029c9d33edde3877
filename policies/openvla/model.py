"""OpenVLA (Kim et al. 2024) from its released Hugging Face checkpoint, run as its reference
``OpenVLAForActionPrediction.predict_action`` runs it and fine-tuned with RL on the log-probs
of its action tokens.

The module tree is the checkpoint's own — ``vision_backbone.featurizer`` (+
``fused_featurizer``), ``projector``, ``language_model`` (transformers' ``LlamaForCausalLM``)
— so the file's tensor names load as they are and ``export`` writes them back the same way.

One step (``predict_action``):

    ids    = tokenize("In: What action should the robot take to {instruction}?\\nOut:") + [▁]
    embeds = [embed(ids[0]) | projector(vision_backbone(pixels)) | embed(ids[1:])]
    tok_j  = argmax_v logits_j(v)   (j = 1 … A, decoded one at a time with a KV cache)
    k_j    = clip(V - tok_j - 1, 0, B - 2),      a_n = centres[k_j]
    a      = ½ (a_n + 1)(q99 - q01) + q01   where mask, else a_n

with V = text vocab - pad_to_multiple_of (32 000 for Llama-2), B = n_action_bins edges over
[-1, 1] (B - 1 centres), ``▁`` the empty SentencePiece token (29 871 in Llama-2) that the
reference appends after ``Out:``, and q01/q99/mask the action statistics of ``unnorm_key``.

RL (SimpleVLA-RL's token policy): action tokens are sampled from the tempered distribution
over the B action ids V - B … V - 1 (the ids OpenVLA's tokenizer writes actions as), and a
step's log-prob is the sum of its A tokens' log-probs under that distribution,

    log π(a | o) = Σ_j log softmax(z_j[V-B:V] / τ)[tok_j - (V - B)],

recomputed by one teacher-forced pass (``log_prob``); ``deterministic`` is the reference's
greedy decoding over the whole vocabulary.

Several prompts of one batch differ in length: the prompt after its first token is
left-padded, the padding is masked and takes no position (positions count attended tokens),
so every row computes what the reference computes for it alone.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.core.policy import PolicyModule, Sample
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.policies.hf import require_transformers
from mmrl.policies.lora import adapters_disabled
from mmrl.policies.openvla.checkpoint import OpenVLACheckpoint, action_statistics, read_checkpoint, write_checkpoint
from mmrl.policies.openvla.config import OpenVLAConfig
from mmrl.policies.openvla.processing import PrismaticImageTransform, openvla_prompt
from mmrl.policies.vla.prismatic_vision import TIMM_VITS, PrismaticProjector, PrismaticVisionBackbone, PrismaticViT, vit_size
from mmrl.registry import POLICIES

EMPTY_TOKEN = "▁"  # SentencePiece's bare word boundary: id 29871 in Llama-2's vocabulary

# The tiny example of itself that every policy declares (tests/policies/test_contract.py).
CONTRACT = {
    "train": {
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 3, "kwargs": {"task": "spatial", "image_size": 16}},
        "sampler": {"type": "env"},
        "policy": {"type": "openvla", "unnorm_key": "tabletop"},
        "rewards": [{"type": "success"}],
    },
    "prepare": "mmrl.policies.openvla.tiny:contract_checkpoint",
    "ratio_atol": 1e-4,
    "ratio_why": "the sampling pass decodes token by token with a KV cache, log_prob runs one teacher-forced pass: float32 sums in other orders (measured 1.9e-6 per 2-token step); the trainer's deferred old log-probs come from log_prob itself, so its first ratios are exactly 1",
}


def _transformers():
    return require_transformers("vla", "an OpenVLA checkpoint")


def unnormalize(normalized: Tensor, q01: Tensor, q99: Tensor, mask: Tensor) -> Tensor:
    """OpenVLA's un-normalization: ½ (a_n + 1)(q99 - q01) + q01 where ``mask``, else a_n."""
    return torch.where(mask, 0.5 * (normalized + 1) * (q99 - q01) + q01, normalized)


def normalize(actions: Tensor, q01: Tensor, q99: Tensor, mask: Tensor) -> Tensor:
    """Its inverse on the data side (OpenVLA's BOUNDS_Q99): clip(2 (a - q01)/(q99 - q01 + 1e-8) - 1, -1, 1)."""
    return torch.where(mask, (2 * (actions - q01) / (q99 - q01 + 1e-8) - 1).clamp(-1, 1), actions)


@POLICIES.register("openvla", config=OpenVLAConfig, contract=CONTRACT)
class OpenVLAPolicy(PolicyModule):
    """An OpenVLA checkpoint: fused SigLIP + DINOv2 ViTs, MLP projector and Llama-2, 256 action bins."""

    def __init__(self, config: OpenVLAConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        tf = _transformers()
        source = read_checkpoint(config.checkpoint)
        self.source = source
        self.unnorm_key, stats = action_statistics(source.norm_stats, config.unnorm_key)
        self.action_dim = len(stats["q01"])
        env_dim = spec.get("action_dim")
        if env_dim is not None and int(env_dim) != self.action_dim:
            raise ConfigError("policy.unnorm_key", self.unnorm_key, f"its statistics are of {self.action_dim}-dim actions, the env's are {int(env_dim)}-dim")
        q01 = torch.tensor(stats["q01"], dtype=torch.float64)
        self.register_buffer("q01", q01, persistent=False)
        self.register_buffer("q99", torch.tensor(stats["q99"], dtype=torch.float64), persistent=False)
        self.register_buffer("unnorm_mask", torch.tensor(stats.get("mask", [True] * self.action_dim), dtype=torch.bool), persistent=False)
        self._check_cameras(spec)

        dtype = getattr(torch, config.vlm_dtype)
        text = source.text_config()
        with torch.device("meta"):
            featurizers = []
            for prefix, timm_id in zip(("vision_backbone.featurizer.", "vision_backbone.fused_featurizer."), source.timm_ids[: 2 if source.fused else 1]):
                family = TIMM_VITS[timm_id]
                layer_scale = f"{prefix}blocks.0.ls1.scale_factor" in source.shapes
                featurizers.append(PrismaticViT(family, vit_size(source.shapes, prefix, family), layer_scale))
            self.vision_backbone = PrismaticVisionBackbone(featurizers, num_images=len(config.cameras))
            self.projector = PrismaticProjector(source.fused, self.vision_backbone.embed_dim, int(text["hidden_size"]))
            llama_config = tf.LlamaConfig(**text)
            llama_config._attn_implementation = config.attn_implementation
            for key in ("attention_dropout", "hidden_dropout"):
                if hasattr(llama_config, key):
                    setattr(llama_config, key, 0.0)
            self.language_model = tf.LlamaForCausalLM(llama_config)
        self._load_weights(source, dtype)

        self.transform = PrismaticImageTransform.from_directory(source.path, len(featurizers))
        for f, size in zip(featurizers, self.transform.sizes):
            if f.image_size != size:
                raise ConfigError("policy.checkpoint", str(source.path), f"preprocessor_config.json resizes to {size} px, the featurizer's position table is for {f.image_size} px")
        if not (source.path / "tokenizer.json").is_file():
            raise ConfigError("policy.checkpoint", str(source.path), "no tokenizer.json (the fast tokenizer file the released checkpoints hold)")
        # the serialized pipeline itself, not AutoTokenizer: that would consult config.json's
        # auto_map (remote code) and may rebuild a Llama tokenizer's pipeline its own way
        self.tokenizer = tf.PreTrainedTokenizerFast.from_pretrained(source.path, local_files_only=True)
        self.empty_id = self.tokenizer.convert_tokens_to_ids(EMPTY_TOKEN)
        if self.empty_id is None or self.empty_id == self.tokenizer.unk_token_id:
            raise ConfigError("policy.checkpoint", str(source.path), f"its tokenizer has no {EMPTY_TOKEN!r} token (OpenVLA appends it after the prompt)")

        bins = int(source.config.get("n_action_bins", 256))
        self.vocab_size = int(text["vocab_size"]) - int(source.config.get("pad_to_multiple_of", 0))
        self.num_bins = bins
        # bin edges and centres exactly as the reference computes them (float64)
        edges = np.linspace(-1, 1, bins)
        self.register_buffer("bin_edges", torch.from_numpy(edges), persistent=False)
        self.register_buffer("bin_centers", torch.from_numpy((edges[:-1] + edges[1:]) / 2.0), persistent=False)
        self.first_action_id = self.vocab_size - bins

        if config.freeze_vision_tower:
            self.vision_backbone.requires_grad_(False)
        self.lora = config.lora.r > 0
        if self.lora:
            self._add_lora(config.lora)
        self._cache_argument = "cache" if "cache" in inspect.signature(self.language_model.model.forward).parameters else "past_key_values"
        self.max_prompt_tokens = config.max_prompt_tokens or self._longest_prompt(spec.get("instructions") or [])

    # ------------------------------------------------------------------ construction

    def _check_cameras(self, spec: dict) -> None:
        shape = spec.get("image_shape")
        if shape is None:
            raise ConfigError("policy.type", "openvla", "OpenVLA reads camera images; the env gives none (no image in its observations)")
        cameras = 1 if len(shape) == 3 else int(shape[0])
        if max(self.config.cameras) >= cameras:
            raise ConfigError("policy.cameras", self.config.cameras, f"the env gives {cameras} camera(s): indices 0..{cameras - 1}")
        if len(self.config.cameras) > 1:
            raise ConfigError("policy.cameras", self.config.cameras, "an OpenVLA checkpoint reads one image; several cameras are OpenVLA-OFT's (policy.type openvla_oft)")

    def _load_weights(self, source: OpenVLACheckpoint, dtype: torch.dtype) -> None:
        expected = set(self.state_dict())
        missing, unexpected = sorted(expected - set(source.shapes)), sorted(set(source.shapes) - expected)
        if missing or unexpected:
            raise ConfigError("policy.checkpoint", str(source.path), f"its tensors do not fit an OpenVLA model: missing {missing[:4]}, unexpected {unexpected[:4]}")
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self._checkpoint_tensors(source).items()}
        self.load_state_dict(tensors, strict=True, assign=True)
        # non-persistent buffers (the rotary frequencies) were made on the meta device
        model = self.language_model.model
        model.rotary_emb = type(model.rotary_emb)(config=self.language_model.config)
        left = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"tensors left unloaded: {left[:4]}")

    def _checkpoint_tensors(self, source: OpenVLACheckpoint) -> dict[str, Tensor]:
        """The tensors the model loads, in their stored dtypes (a subclass may change them, e.g.
        merge an adapter into them)."""
        return source.read_tensors()

    def _add_lora(self, lora) -> None:
        try:
            import peft
        except ImportError:
            raise MissingExtraError("peft", "text", "LoRA adapters (policy.lora.r > 0)") from None
        adapter = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), bias="none")
        self.language_model.requires_grad_(False)
        try:
            peft.inject_adapter_in_model(adapter, self.language_model)
        except ValueError as e:
            raise ConfigError("policy.lora.target_modules", lora.target_modules, f"must name linear layers of the language model: {e}") from None
        for name, param in self.language_model.named_parameters():
            if "lora_" in name:
                param.requires_grad_(True)

    def _prompt_ids(self, instruction: str) -> list[int]:
        ids = list(self.tokenizer(openvla_prompt(instruction))["input_ids"])
        if ids[-1] != self.empty_id:
            ids.append(self.empty_id)
        return ids

    def _longest_prompt(self, instructions: list[str]) -> int:
        return max([len(self._prompt_ids(str(t))) for t in instructions] or [64])

    # ------------------------------------------------------------------ inputs

    def encode_inputs(self, inputs) -> dict[str, Tensor]:
        """What the replay keeps of a batch of observations: the cameras' uint8 frames
        [N, K, H, W, 3] and the prompt ids / mask [N, P] (first token, then the rest
        left-padded)."""
        device = self.q01.device
        images = inputs["image"]
        if images.dim() == 4:
            images = images.unsqueeze(1)
        obs = {"image": images[:, self.config.cameras].to(device)}
        if "prompt_ids" in inputs:
            obs["prompt_ids"], obs["prompt_mask"] = inputs["prompt_ids"].to(device), inputs["prompt_mask"].to(device)
            return obs
        texts = inputs.get("instruction") or [""] * images.shape[0]
        width = self.max_prompt_tokens
        ids = torch.full((len(texts), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros(len(texts), width, dtype=torch.long)
        for row, text in enumerate(texts):
            prompt = self._prompt_ids(str(text))
            if len(prompt) > width:
                raise ConfigError("policy.max_prompt_tokens", width, f"the prompt of {str(text)!r} has {len(prompt)} tokens; raise it")
            ids[row, 0], mask[row, 0] = prompt[0], 1
            rest = prompt[1:]
            if rest:
                ids[row, width - len(rest) :] = torch.tensor(rest)
                mask[row, width - len(rest) :] = 1
        obs["prompt_ids"], obs["prompt_mask"] = ids.to(device), mask.to(device)
        return obs

    def pixel_values(self, images: Tensor) -> Tensor:
        """uint8 [N, K, H, W, 3] → the image processor's pixel values [N, K·3·F, S, S]."""
        weight = self.projector.fc1.weight
        return self.transform.batch(images).to(weight.device, weight.dtype)

    def _prefix(self, obs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """[first token | projected patches | rest of the prompt] embeddings and mask."""
        patches = self.projector(self.vision_backbone(self.pixel_values(obs["image"])))
        ids, mask = obs["prompt_ids"], obs["prompt_mask"]
        words = self.language_model.get_input_embeddings()(ids)
        embeds = torch.cat([words[:, :1], patches.to(words.dtype), words[:, 1:]], dim=1)
        full_mask = torch.cat([mask[:, :1], mask.new_ones(mask.shape[0], patches.shape[1]), mask[:, 1:]], dim=1)
        return embeds, full_mask

    def _hidden(self, embeds: Tensor, mask: Tensor, cache=None) -> Tensor:
        """Last hidden states [N, S, D] of ``embeds`` (``mask`` covers the cache too)."""
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -embeds.shape[1] :]
        model = self.language_model.model
        out = model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=cache is not None, **{self._cache_argument: cache})
        return out.last_hidden_state

    def _action_log_probs(self, hidden: Tensor) -> Tensor:
        """Tempered log-probs [..., B] over the B action ids, in float32."""
        weight = self.language_model.lm_head.weight[self.first_action_id : self.vocab_size]
        logits = nn.functional.linear(hidden.float(), weight.float())
        return torch.log_softmax(logits / self.config.temperature, dim=-1)

    def _token_log_prob(self, log_probs: Tensor, tokens: Tensor) -> Tensor:
        """log-prob of vocabulary ids ``tokens`` (-inf for an id outside the action ids)."""
        index = tokens - self.first_action_id
        inside = (index >= 0) & (index < self.num_bins)
        picked = log_probs.gather(-1, index.clamp(0, self.num_bins - 1).unsqueeze(-1)).squeeze(-1)
        return torch.where(inside, picked, torch.full_like(picked, -math.inf))

    # ------------------------------------------------------------------ actions

    def tokens_to_actions(self, tokens: Tensor) -> Tensor:
        """Vocabulary ids [..., A] → env actions [..., A] (float32): the reference's bin
        lookup and un-normalization, in float64."""
        bins = (self.vocab_size - tokens.long() - 1).clamp(0, self.bin_centers.shape[0] - 1)
        return unnormalize(self.bin_centers[bins], self.q01, self.q99, self.unnorm_mask).float()

    def to_env(self, actions: Tensor) -> Tensor:
        """The model's actions [..., A] → what the env is sent: with ``gripper: libero`` the last
        dim g ∈ [0, 1] (1 = open) becomes −sign(2g − 1), LIBERO's −1 = open / +1 = close
        (OpenVLA's ``normalize_gripper_action(binarize=True)`` then ``invert_gripper_action``)."""
        if self.config.gripper == "as_is":
            return actions
        out = actions.clone()
        out[..., -1] = -torch.sign(2 * actions[..., -1] - 1)
        return out

    def from_env(self, actions: Tensor) -> Tensor:
        """The inverse of :meth:`to_env` on binarized grippers (a demonstration's env actions →
        the model's): −1 (open) → 1, +1 (close) → 0."""
        if self.config.gripper == "as_is":
            return actions
        out = actions.clone()
        out[..., -1] = (1 - actions[..., -1].sign()) / 2
        return out

    def actions_to_tokens(self, actions: Tensor) -> Tensor:
        """Env actions [..., A] → vocabulary ids (OpenVLA's action tokenizer: np.digitize of
        the normalized action over the bin edges; id = V - bin)."""
        a_n = normalize(actions.to(self.q01.device, torch.float64), self.q01, self.q99, self.unnorm_mask).clamp(-1, 1)
        return self.vocab_size - torch.bucketize(a_n, self.bin_edges, right=True)

    # ------------------------------------------------------------------ protocol

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """``inputs``: {"image": uint8 [N, (K,) H, W, 3], "instruction": N strings}. Returns env
        actions [N, 1, A], logp / entropy [N, 1] ([N, A] with ``logp_granularity: token``),
        replay {image, prompt_ids, prompt_mask, action_tokens [N, 1, A]}. ``deterministic``:
        the reference's greedy decoding over the whole vocabulary."""
        obs = self.encode_inputs(inputs)
        embeds, mask = self._prefix(obs)
        n = embeds.shape[0]
        cache = _transformers().DynamicCache(config=self.language_model.config)
        hidden = self._hidden(embeds, mask, cache)[:, -1]
        tokens, logps, entropies = [], [], []
        for j in range(self.action_dim):
            log_probs = self._action_log_probs(hidden)
            if deterministic:
                token = self.language_model.lm_head(hidden).argmax(-1)
            else:
                device = generator.device if generator is not None else log_probs.device
                index = torch.multinomial(log_probs.exp().to(device), 1, generator=generator).squeeze(1).to(log_probs.device)
                token = index + self.first_action_id
            tokens.append(token)
            logps.append(self._token_log_prob(log_probs, token))
            entropies.append(-(log_probs.exp() * log_probs).sum(-1))
            if j + 1 < self.action_dim:
                mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
                hidden = self._hidden(self.language_model.get_input_embeddings()(token[:, None]), mask, cache)[:, -1]
        tokens_t = torch.stack(tokens, dim=1)
        replay = {k: v.unsqueeze(1) for k, v in obs.items()}
        replay["action_tokens"] = tokens_t.unsqueeze(1)
        logp, entropy = torch.stack(logps, 1), torch.stack(entropies, 1)
        if self.config.logp_granularity == "chunk":
            logp, entropy = logp.sum(1, keepdim=True), entropy.sum(1, keepdim=True)
        actions = self.to_env(self.tokens_to_actions(tokens_t)).unsqueeze(1)
        # the trainer's teacher-forced pass gives the old log-probs: ratios of exactly 1
        return Sample(output=actions, logp=logp, replay=replay, entropy=entropy, logp_deferred=not deterministic)

    def _teacher_forced(self, replay: dict) -> tuple[Tensor, Tensor]:
        """(tempered log-probs [M, A, B] of every action slot, the tokens [M, A]) of the
        N·T replayed steps, in one pass."""
        tokens = replay["action_tokens"]
        n, t = tokens.shape[:2]
        flat = {k: v.reshape(n * t, *v.shape[2:]) for k, v in replay.items()}
        tokens = flat.pop("action_tokens").to(self.q01.device)
        embeds, mask = self._prefix(flat)
        given = self.language_model.get_input_embeddings()(tokens[:, :-1])
        seq = torch.cat([embeds, given], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], self.action_dim - 1)], dim=1)
        hidden = self._hidden(seq, mask)[:, -self.action_dim :]
        return self._action_log_probs(hidden), tokens

    def log_prob(self, replay: dict) -> Tensor:
        """Log-probs [N, T] of the replayed steps ([N, T·A] with ``logp_granularity: token``)."""
        n, t = replay["action_tokens"].shape[:2]
        log_probs, tokens = self._teacher_forced(replay)
        logp = self._token_log_prob(log_probs, tokens)
        if self.config.logp_granularity == "chunk":
            return logp.sum(-1).view(n, t)
        return logp.view(n, t * self.action_dim)

    def sft_loss(self, batch: dict) -> Tensor:
        """Mean negative log-likelihood of the demonstrations' action tokens (``actions``
        [B, 1, A] in env units, tokenized as OpenVLA's action tokenizer does), over the
        action ids at temperature 1."""
        actions = batch["actions"]
        if actions.shape[1] != 1:
            raise ConfigError("policy.type", "openvla", f"OpenVLA predicts one action per step; the batch holds chunks of {actions.shape[1]}")
        tokens = self.actions_to_tokens(self.from_env(actions[:, 0].to(self.q01.device)))
        replay = {k: batch[k].unsqueeze(1) for k in ("image", "prompt_ids", "prompt_mask") if k in batch}
        if "prompt_ids" not in replay:
            replay = {k: v.unsqueeze(1) for k, v in self.encode_inputs(batch).items()}
        replay["action_tokens"] = tokens.unsqueeze(1)
        log_probs, tokens = self._teacher_forced(replay)
        log_probs = log_probs * self.config.temperature  # undo the tempering: log-softmax at τ = 1
        log_probs = torch.log_softmax(log_probs, dim=-1)
        return -self._token_log_prob(log_probs, tokens).mean()

    def imitation_batch(self, replay: dict) -> dict:
        """The replayed steps as a ``sft_loss`` batch: observations and the actions their
        tokens decode to."""
        tokens = replay["action_tokens"]
        batch = {k: v.flatten(0, 1) for k, v in replay.items() if k != "action_tokens"}
        batch["actions"] = self.to_env(self.tokens_to_actions(tokens.flatten(0, 1).to(self.q01.device))).unsqueeze(1)
        return batch

    def reference(self):
        """With LoRA, this policy with its adapters disabled; otherwise None (the trainer
        keeps a frozen copy of the initial weights)."""
        return AdapterFreeOpenVLA(self) if self.lora else None

    @contextmanager
    def adapters_disabled(self):
        with adapters_disabled(self.language_model):
            yield

    # ------------------------------------------------------------------ export

    export_layouts = {"openvla": "the checkpoint's own layout (same files, tensor names and dtypes; config, tokenizer, processor and statistics copied) with the current weights, LoRA merged"}

    def export_tensors(self) -> dict[str, Tensor]:
        """The weights under the checkpoint's names; LoRA adapters merged into their layers."""
        state = self.state_dict()
        tensors = {name.replace(".base_layer.", "."): t for name, t in state.items() if "lora_" not in name}
        if self.lora:
            with torch.no_grad():
                for name, module in self.named_modules():
                    if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
                        base = module.base_layer.weight
                        tensors[f"{name}.weight"] = (base.float() + module.get_delta_weight("default").float()).to(base.dtype)
        return tensors

    def export(self, fmt: str, out) -> None:
        if fmt != "openvla":
            raise ConfigError("--format", fmt, "openvla is the format this policy writes")
        write_checkpoint(self.source, self.export_tensors(), out)


class AdapterFreeOpenVLA(nn.Module):
    """The KL reference of an OpenVLA with LoRA adapters: the policy with them disabled
    (shares its weights without registering them)."""

    def __init__(self, policy: OpenVLAPolicy):
        super().__init__()
        object.__setattr__(self, "policy", policy)

    @torch.no_grad()
    def log_prob(self, replay: dict) -> Tensor:
        with self.policy.adapters_disabled():
            return self.policy.log_prob(replay)

    def forward(self, replay: dict) -> Tensor:
        return self.log_prob(replay)
