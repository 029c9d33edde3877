"""What an ``image_diffusion`` denoiser is conditioned on, per architecture: class ids, or
prompts tokenized and encoded as SD 1.x / 2.x, SDXL, SD3, FLUX and Qwen-Image pipelines do,
the null condition of guidance, and the prompt cache of their embeddings.

Apart from the denoising because turning inputs into conditions is its own job, written once
per pipeline class for sampling, log-probs and SFT alike; :class:`Conditioning` is a mixin of the policy.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mmrl.errors import ConfigError

# QwenImagePipeline's prompt: its chat template, whose first 34 tokens' states are dropped, and
# its default max_sequence_length (at most 1024)
QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_DROP, QWEN_TOKENS, QWEN_MAX_TOKENS = 34, 512, 1024


# ------------------------------------------------------------------ conditions as tensors or tuples
# A class id / text-state condition is one tensor; SD3's is a tuple (token states, pooled projection).


def map_condition(fn, condition):
    return tuple(fn(c) for c in condition) if isinstance(condition, tuple) else fn(condition)


def map_condition_pair(fn, a, b):
    return tuple(fn(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else fn(a, b)


def read_prompt_files(paths: list[str]) -> list[str]:
    """The prompts of ``policy.prompt_files`` (read as the prompt sampler reads its sources)."""
    from mmrl.data.prompts import PromptDataConfig, read_records

    prompts = []
    for i, path in enumerate(paths):
        records = read_records(PromptDataConfig(train=path, answer_field=None, image_field=None), "train", f"policy.prompt_files[{i}]")
        prompts.extend(str(r.prompt) for r in records)
    return prompts


class Conditioning:
    """The conditioning half of :class:`ImageDiffusionPolicy`: it reads the policy's
    ``config``, ``kind``, ``conditioning``, text encoders, tokenizers and prompt cache."""

    def _prompt_length(self, slot: int, encoder: nn.Module, tokenizer) -> int:
        if self.kind == "qwen":  # the template's tokens, then the prompt's states (max_sequence_length)
            tokens = self.config.max_prompt_tokens or QWEN_TOKENS
            if tokens > QWEN_MAX_TOKENS:
                raise ConfigError("policy.max_prompt_tokens", tokens, f"QwenImagePipeline's max_sequence_length is at most {QWEN_MAX_TOKENS}")
            return QWEN_DROP + tokens
        if slot == 2 or (self.kind == "flux" and slot == 1):  # T5: relative positions, no limit of its own
            if self.kind == "flux" and self.config.max_t5_tokens > 512:
                raise ConfigError("policy.max_t5_tokens", self.config.max_t5_tokens, "FluxPipeline's max_sequence_length is at most 512")
            return self.config.max_t5_tokens
        positions = encoder.config.max_position_embeddings
        length = self.config.max_prompt_tokens or tokenizer.model_max_length
        if length > positions:
            raise ConfigError("policy.max_prompt_tokens", self.config.max_prompt_tokens, f"the text encoder has {positions} positions (the tokenizer's model_max_length is {tokenizer.model_max_length}); set at most {positions}")
        return length

    def _check_sd3_widths(self) -> None:
        clips = [e for e in (self.text_encoder, self.text_encoder_2) if e is not None]
        width = sum(e.config.hidden_size for e in clips)
        pooled = sum(e.config.projection_dim for e in clips)
        joint, pooled_dim = self.transformer.config.joint_attention_dim, self.transformer.config.pooled_projection_dim
        where = self.config.model_path or "policy.tiny"
        if width > joint or pooled != pooled_dim or (self.text_encoder_3 is not None and self.text_encoder_3.config.d_model != joint):
            raise ConfigError("policy.model_path", where, f"the text encoders (CLIP widths {width}, projections {pooled}) do not fit the SD3 transformer (joint_attention_dim {joint}, pooled_projection_dim {pooled_dim})")

    def _check_sdxl_widths(self) -> None:
        """SDXL's UNet takes the two CLIPs' states side by side (cross_attention_dim), and adds
        the second one's pooled projection and six time ids (projection_class_embeddings_input_dim)."""
        unet, first, second = self.unet.config, self.text_encoder.config, self.text_encoder_2.config
        width = first.hidden_size + second.hidden_size
        added = unet.addition_time_embed_dim * 6 + second.projection_dim
        if self.prompt_lengths[0] != self.prompt_lengths[1]:
            raise ConfigError("policy.max_prompt_tokens", self.config.max_prompt_tokens, f"SDXL's two tokenizers pad to {self.prompt_lengths[0]} and {self.prompt_lengths[1]} tokens; their states are joined token by token, so they must agree")
        if width != unet.cross_attention_dim or added != unet.projection_class_embeddings_input_dim:
            raise ConfigError(
                "policy.model_path", self.config.model_path,
                f"the text encoders (CLIP widths {first.hidden_size} + {second.hidden_size}, projection {second.projection_dim}) do not fit the SDXL UNet "
                f"(cross_attention_dim {unet.cross_attention_dim}, projection_class_embeddings_input_dim {unet.projection_class_embeddings_input_dim} = 6 x {unet.addition_time_embed_dim} + projection)",
            )

    def _check_flux_widths(self) -> None:
        """FLUX takes the CLIP's pooled output (pooled_projection_dim) and the T5's states
        (joint_attention_dim)."""
        flux, clip, t5 = self.transformer.config, self.text_encoder.config, self.text_encoder_2.config
        if clip.hidden_size != flux.pooled_projection_dim or t5.d_model != flux.joint_attention_dim:
            raise ConfigError(
                "policy.model_path", self.config.model_path,
                f"the text encoders (CLIP width {clip.hidden_size}, T5 width {t5.d_model}) do not fit the FLUX transformer (pooled_projection_dim {flux.pooled_projection_dim}, joint_attention_dim {flux.joint_attention_dim})",
            )


    # -------------------------------------------------------------- conditioning

    @property
    def _conditioning_field(self) -> tuple[str, str]:
        """The config field that chose the conditioning, and its value, for input errors."""
        if self.config.model_path:
            return "policy.model_path", self.config.model_path
        return "policy.tiny.conditioning", self.conditioning

    @property
    def _prompt_keys(self) -> list[str]:
        """Replay keys of the token ids of each text encoder present: prompt_ids, prompt_ids_2, prompt_ids_3."""
        encoders = (self.text_encoder, self.text_encoder_2, self.text_encoder_3)
        return [key for key, e in zip(("prompt_ids", "prompt_ids_2", "prompt_ids_3"), encoders) if e is not None]

    def _conditions(self, inputs) -> dict[str, Tensor]:
        """The replay's conditioning of the sampler's inputs: ``condition`` class ids [N], or
        token ids ``prompt_ids`` [N, L] (and ``prompt_ids_2`` / ``_3`` for SD3's other encoders)."""
        if self.conditioning == "class":
            if not isinstance(inputs, Tensor) or inputs.dtype != torch.long:
                raise ConfigError(*self._conditioning_field, f"takes condition ids (a LongTensor from a prompt sampler over conditions), got {type(inputs).__name__}")
            if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= self.null_class):
                raise ValueError(f"condition ids must lie in [0, {self.null_class}), got {inputs.tolist()}")
            return {"condition": inputs.to(self.device)}
        if self.conditioning == "text":
            if isinstance(inputs, Tensor) or not all(isinstance(p, str) for p in inputs):
                raise ConfigError(*self._conditioning_field, f"takes prompt strings (a prompt sampler over texts), got {type(inputs).__name__}")
            return self._tokenize(list(inputs))
        return {}

    def _tokenize(self, prompts: list[str]) -> dict[str, Tensor]:
        tokenizers = dict(zip(("prompt_ids", "prompt_ids_2", "prompt_ids_3"), zip((self.tokenizer, self.tokenizer_2, self.tokenizer_3), self.prompt_lengths)))
        out = {}
        for key in self._prompt_keys:
            tokenizer, length = tokenizers[key]
            texts = [QWEN_TEMPLATE.format(p) for p in prompts] if self.kind == "qwen" else prompts
            out[key] = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids.to(self.device)
        return out

    def _encode(self, ids: dict[str, Tensor]):
        """Text embeddings the denoiser attends to (no grad unless the encoders train), in the
        denoiser's dtype and on its device: the CLIP states [N, L, D] for an SD 1.x / 2.x UNet;
        for SD3 and SDXL as diffusers' pipelines build them (:meth:`_encode_texts`).

        Each distinct prompt of the batch is encoded once and alone (a batch of one), and its
        rows share that embedding: a prompt's embedding never depends on the prompts it came
        with (a linear layer's float32 result can differ in the last bit between a batch of
        one and of several), so sampling, ``log_prob`` on any minibatch and the prompt cache
        all see the same numbers. With the prompt cache the embeddings also outlive the call
        (:meth:`_cached_entries`), and the encoders run once per distinct prompt in all."""
        keys, entries = self._cached_entries(ids)
        rows = [entries[key] for key in keys]
        if isinstance(rows[0], tuple):
            return tuple(torch.cat([r[j] for r in rows]).to(self.device, self.dtype) for j in range(len(rows[0])))
        return torch.cat(rows).to(self.device, self.dtype)

    def _encode_texts(self, ids: dict[str, Tensor]):
        """The text encoders' conditioning of token ids, in the encoders' dtype: the CLIP's
        last states [N, L, D] for an SD 1.x / 2.x UNet; for SD3 as StableDiffusion3Pipeline's
        ``encode_prompt``, the tuple (token states [N, L, joint_dim], pooled [N, P]) — the
        CLIPs' penultimate states side by side, zero-padded to joint_attention_dim, then the
        T5 states (when there is a T5 encoder) after them; the CLIPs' pooled projections side
        by side; for SDXL as StableDiffusionXLPipeline's ``encode_prompt`` (no clip_skip), the
        tuple (states [N, L, D1 + D2], pooled [N, P], time ids [N, 6]) — both CLIPs'
        penultimate states side by side, text_encoder_2's pooled projection, and the
        micro-conditioning (original_size, crops_coords_top_left, target_size) of
        ``_get_add_time_ids``; for FLUX as FluxPipeline's ``encode_prompt``, the tuple (T5
        states [N, L, joint_dim], the CLIP's pooled output [N, P]). Token ids go to each encoder's device (the CPU once released)."""

        def run(encoder, key, **kwargs):
            return encoder(ids[key].to(next(encoder.parameters()).device), **kwargs)

        if self.kind == "qwen":
            return self._qwen_states(ids["prompt_ids"])
        if self.kind == "flux":  # FluxPipeline.encode_prompt: the T5's last states, the CLIP's pooled output
            pooled = run(self.text_encoder, "prompt_ids", output_hidden_states=False).pooler_output
            states = run(self.text_encoder_2, "prompt_ids_2", output_hidden_states=False)[0]
            return states, pooled.to(states.device)
        if self.kind != "sd3" and not self.sdxl:
            return run(self.text_encoder, "prompt_ids").last_hidden_state
        if self.sdxl:
            first = run(self.text_encoder, "prompt_ids", output_hidden_states=True)
            second = run(self.text_encoder_2, "prompt_ids_2", output_hidden_states=True)
            states = torch.cat([first.hidden_states[-2], second.hidden_states[-2].to(first.hidden_states[-2].device)], dim=-1)
            pooled = second.text_embeds.to(states.device)
            time_ids = torch.tensor([self.sdxl_time_ids], dtype=states.dtype, device=states.device).expand(states.shape[0], -1)
            return states, pooled, time_ids
        states, pooled = [], []
        for key, encoder in (("prompt_ids", self.text_encoder), ("prompt_ids_2", self.text_encoder_2)):
            if encoder is not None:
                out = run(encoder, key, output_hidden_states=True)
                states.append(out.hidden_states[-2])
                pooled.append(out.text_embeds)
        clip = torch.cat(states, dim=-1)
        joint = self.transformer.config.joint_attention_dim
        clip = nn.functional.pad(clip, (0, joint - clip.shape[-1]))
        if self.text_encoder_3 is not None:
            clip = torch.cat([clip, run(self.text_encoder_3, "prompt_ids_3").last_hidden_state.to(clip.device)], dim=-2)
        return clip, torch.cat(pooled, dim=-1)

    def _qwen_states(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """QwenImagePipeline's ``encode_prompt`` of templated token ids [N, 34 + T]: each row's
        tokens up to its padding through Qwen2.5-VL, its last states without the template's
        first 34, zero-padded to T (always T, so a prompt's conditioning never depends on its
        batch), and the mask of the real ones [N, T]."""
        device = next(self.text_encoder.parameters()).device
        tokens = ids.shape[1] - QWEN_DROP
        states, masks = [], []
        for row in ids.to(device):
            length = int((row != self.tokenizer.pad_token_id).sum())
            hidden = self.text_encoder(input_ids=row[None, :length], attention_mask=torch.ones(1, length, dtype=torch.long, device=device), output_hidden_states=True).hidden_states[-1]
            kept = hidden[:, QWEN_DROP:]
            states.append(nn.functional.pad(kept, (0, 0, 0, tokens - kept.shape[1])))
            masks.append((torch.arange(tokens, device=device) < kept.shape[1]).to(kept.dtype)[None])
        return torch.cat(states), torch.cat(masks)

    # -------------------------------------------------------------- the prompt cache

    def _cache_keys(self, ids: dict[str, Tensor]) -> list[bytes]:
        """One key per row: the bytes of its token ids of every tokenizer, side by side (a
        function of the prompt's text, and what the replay keeps of it)."""
        rows = torch.cat([ids[key] for key in self._prompt_keys], dim=-1).cpu()
        return [row.numpy().tobytes() for row in rows]

    def _cached_entries(self, ids: dict[str, Tensor]) -> tuple[list[bytes], dict[bytes, object]]:
        """The rows' keys and the embedding of each distinct one (in the encoders' dtype): from
        the prompt cache when it holds it, else encoded alone — with grad when the encoders
        train — and, with the cache, stored in CPU memory (the least recently used entry
        making room)."""
        cache = self._prompt_cache
        if cache is not None:
            self._fill_pending_prompts()
        grad = torch.is_grad_enabled() and self.config.train_text_encoder
        keys, entries = self._cache_keys(ids), {}
        for i, key in enumerate(keys):
            if key in entries:
                continue
            entry = cache.get(key) if cache is not None else None
            if entry is None:
                with torch.set_grad_enabled(grad):
                    entry = self._encode_texts({k: ids[k][i : i + 1] for k in self._prompt_keys})
                if cache is not None:
                    entry = map_condition(lambda c: c.detach().cpu(), entry)
                    cache.put(key, entry)
            entries[key] = entry
        return keys, entries

    def cache_prompts(self, prompts: list[str], batch_size: int = 64) -> int:
        """Encode ``prompts`` into the prompt cache (each distinct prompt once; the empty
        prompt too when guidance needs it) and return how many distinct prompts it holds for
        them. With ``release_text_encoders`` the text encoders then move to the CPU
        (:meth:`release_text_encoders`). The cache must hold them all."""
        cache = self._prompt_cache
        if cache is None:
            why = "the text encoders train (train_text_encoder)" if self.config.train_text_encoder else "the policy takes no text prompts" if self.conditioning != "text" else "it is off"
            raise ConfigError("policy.prompt_cache", self.config.prompt_cache, f"cannot cache prompts: {why}")
        distinct = list(dict.fromkeys(str(p) for p in prompts))
        if self.config.guidance_scale != 1 and not self.zero_null_prompt and "" not in distinct:
            distinct.append("")
        if len(distinct) > cache.size:
            raise ConfigError("policy.prompt_cache", cache.size, f"holds fewer prompts than the {len(distinct)} distinct prompts to cache (the empty one included)")
        self._pending_prompts = []
        for start in range(0, len(distinct), batch_size):
            self._cached_entries(self._tokenize(distinct[start : start + batch_size]))
        if self.config.release_text_encoders:
            self.release_text_encoders()
        return len(distinct)

    def _fill_pending_prompts(self) -> None:
        """The prompts of ``prompt_files``, encoded at the first encoding (when the policy is
        on its device)."""
        if self._pending_prompts:
            prompts, self._pending_prompts = self._pending_prompts, []
            self.cache_prompts(prompts)

    def release_text_encoders(self) -> None:
        """Move the text encoders to the CPU and keep them there: moving the policy (``to``,
        ``cuda``, ``half``) leaves them, so they no longer take accelerator memory. Their
        weights stay in ``state_dict`` (checkpoints are unchanged); a prompt missing from the
        cache is encoded on the CPU, its embedding then moved to the denoiser's device."""
        for encoder in (self.text_encoder, self.text_encoder_2, self.text_encoder_3):
            if encoder is not None:
                encoder.to("cpu")
        self._text_encoders_released = True

    def _apply(self, fn, recurse: bool = True):
        if not getattr(self, "_text_encoders_released", False):
            return super()._apply(fn, recurse)
        held = {name: self._modules[name] for name in ("text_encoder", "text_encoder_2", "text_encoder_3") if self._modules.get(name) is not None}
        for name in held:  # None keeps each module's place in the state dict's order
            self._modules[name] = None
        try:
            return super()._apply(fn, recurse)
        finally:
            self._modules.update(held)

    def _null(self, n: int):
        """The null condition for n rows: the null class, or the empty prompt's embedding
        (for SDXL with the pipeline's ``force_zeros_for_empty_prompt``, zero states and pooled
        embeddings beside the same time ids, as StableDiffusionXLPipeline's negative prompt)."""
        if self.conditioning == "class":
            return torch.full((n,), self.null_class, dtype=torch.long, device=self.device)
        if self.zero_null_prompt:
            unet = self.unet.config
            states = torch.zeros(n, self.prompt_lengths[0], unet.cross_attention_dim, device=self.device, dtype=self.dtype)
            pooled = torch.zeros(n, self.text_encoder_2.config.projection_dim, device=self.device, dtype=self.dtype)
            return states, pooled, torch.tensor([self.sdxl_time_ids], device=self.device, dtype=self.dtype).expand(n, -1)
        return map_condition(lambda c: c.expand(n, *c.shape[1:]), self._encode(self._tokenize([""])))

    def _embedded(self, conditions: dict[str, Tensor]):
        """The replay's conditioning → what the denoiser takes (class ids, or text embeddings)."""
        if self.conditioning == "text":
            return self._encode(conditions)
        return conditions.get("condition")

