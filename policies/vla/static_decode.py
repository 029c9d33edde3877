"""Incremental decoding with a static key/value cache, for the token VLA's action tokens.

A chunk of T action tokens is decoded one token at a time after the prefix. ``transformers``
runs each such step through its whole decoder call: positions, the causal mask, the rotary
tables and a cache that grows by concatenation are rebuilt every step, about 200 operators for
a 2-layer decoder, most of them for one query row. Here the prefix runs once through the
model as before; its keys and values are copied into buffers [N, kv_heads, P + T, d] allocated
once, and every later step runs only the layers' own modules on [N, hidden] rows:

    h ← h + o_proj(attention(rotary(q_proj(n)), K, V)),  n = input_layernorm(h)
    h ← h + mlp(post_attention_layernorm(h))

with the step's keys and values written into its slot of the buffers, the rotary tables and
the masks of all T steps computed once, and attention over the P + T slots with the slots
not yet decoded (and the prefix's padding) masked out. The layer modules are the model's own
(its norms, projections, MLP, LoRA adapters), so the step computes what the model computes;
attention runs over more (masked) keys, so a hidden state may differ from the model's in the
last bits (the tests bound it, and the tokens sampled are the same).

``compile_decoder`` (the token VLA's option): :func:`decode_step` is the same step as one function
of tensors (the buffers written with ``index_copy_`` at the step's slot, the step's rotary
tables and mask picked inside), which ``torch.compile`` compiles once for all T steps of a
batch shape; :meth:`StaticDecoder.step` with ``compiled`` runs it.

It serves the Llama-layout decoders (``llama``, ``qwen2``, ``mistral``; the language model
of LLaVA, Idefics3 and SmolVLM) with ``sdpa`` attention; any other decoder keeps the
``transformers`` path (:func:`static_decoder` returns None).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

LLAMA_LAYOUT = ("llama", "qwen2", "mistral")


def static_decoder(model: nn.Module, cache, prefix_mask: Tensor, positions: Tensor) -> "StaticDecoder | None":
    """A :class:`StaticDecoder` continuing ``model`` (a ``transformers`` decoder such as
    ``LlamaModel``) after a prefix pass that filled the ``DynamicCache`` ``cache``, for the
    T = ``positions.shape[1]`` tokens that follow; None where the model is not of a layout it
    serves."""
    config = model.config
    if config.model_type not in LLAMA_LAYOUT or getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    layers = list(model.layers[: config.num_hidden_layers])
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < prefix_mask.shape[1] + positions.shape[1]:
        return None
    cached = getattr(cache, "layers", None)
    if cached is None or len(cached) != len(layers) or any(getattr(layer.self_attn, "q_norm", None) is not None for layer in layers):
        return None
    return StaticDecoder(model, layers, [(layer.keys, layer.values) for layer in cached], prefix_mask, positions)


class StaticDecoder:
    """The decoding steps after a prefix of P tokens, T at most (module docstring)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], prefix_kv: list[tuple[Tensor, Tensor]], prefix_mask: Tensor, positions: Tensor):
        self.model = model
        self.decoder_layers = layers
        self.step_tensors = None  # the compiled step's index of each step (long [1]), made on its first call
        n, p = prefix_mask.shape
        steps = positions.shape[1]
        self.dtype = prefix_kv[0][0].dtype
        self.step_index = 0
        self.layers = []
        for layer, (keys, values) in zip(layers, prefix_kv):
            k_buffer = keys.new_zeros(n, keys.shape[1], p + steps, keys.shape[-1])
            v_buffer = torch.zeros_like(k_buffer)
            k_buffer[:, :, :p] = keys
            v_buffer[:, :, :p] = values
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                {
                    "norms": (layer.input_layernorm, layer.post_attention_layernorm),
                    "q": _linear(attn.q_proj), "k": _linear(attn.k_proj), "v": _linear(attn.v_proj), "o": _linear(attn.o_proj),
                    "mlp": (_linear(mlp.gate_proj), _linear(mlp.up_proj), mlp.act_fn, _linear(mlp.down_proj)) if _llama_mlp(mlp) else mlp,
                    "shape": (attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim), "scale": attn.scaling,
                    # the step's slot of each buffer, [N, kv_heads, 1, d] views written in place
                    "cache": (k_buffer, v_buffer), "slots": (k_buffer[:, :, p:].split(1, dim=2), v_buffer[:, :, p:].split(1, dim=2)),
                }
            )
        # step j attends to the prefix's real tokens and to slots P … P + j: an additive mask
        # (0 or −inf, what attention makes of a boolean one), one per step
        slots = torch.arange(p + steps, device=prefix_mask.device)
        reach = slots[None, :] <= (p + torch.arange(steps, device=prefix_mask.device))[:, None]  # [T, P + T]
        real = torch.cat([prefix_mask > 0.5, prefix_mask.new_ones(n, steps, dtype=torch.bool)], dim=1)  # [N, P + T]
        allowed = (real[:, None, :] & reach[None]).transpose(0, 1)[:, :, None, None, :]  # [T, N, 1, 1, P + T]
        self.mask_table = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
        self.masks = self.mask_table.unbind(0)
        cos, sin = model.rotary_emb(k_buffer[:, 0, :1], positions)  # [N, T, d], in the cache's dtype
        # rotate_half(x)·sin = roll(x, d/2)·(sin with its first half negated): the tables are
        # cat(freqs, freqs), and negating a factor is exact
        half = cos.shape[-1] // 2
        signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        self.cos_table, self.sin_table = cos[:, :, None, None, :], signed[:, :, None, None, :]  # [N, T, 1, 1, d]
        self.cos, self.sin = self.cos_table.unbind(1), self.sin_table.unbind(1)  # T x [N, 1, 1, d]
        self.half = half

    def step(self, embeds: Tensor, compiled=None) -> Tensor:
        """Decoder inputs [N, hidden] of the next token → its last hidden state [N, hidden]
        (float32, after the final norm). ``compiled``: :func:`decode_step` compiled, run in place
        of the eager step."""
        j, n = self.step_index, embeds.shape[0]
        if j >= len(self.masks):
            raise IndexError(f"the static cache holds {len(self.masks)} steps after the prefix")
        self.step_index += 1
        if compiled is not None:
            if self.step_tensors is None:
                self.step_tensors = torch.arange(len(self.masks), device=embeds.device).view(-1, 1).unbind(0)
            caches = [layer["cache"] for layer in self.layers]
            return compiled(self.decoder_layers, self.model.norm, embeds, self.step_tensors[j], caches, self.cos_table, self.sin_table, self.mask_table)
        cos, sin, mask, half = self.cos[j], self.sin[j], self.masks[j], self.half
        h = embeds.to(self.dtype)
        for layer in self.layers:
            heads, kv_heads, d = layer["shape"]
            pre_norm, post_norm = layer["norms"]
            x = pre_norm(h)
            q = layer["q"](x).view(n, heads, 1, d)
            k = layer["k"](x).view(n, kv_heads, 1, d)
            q = q * cos + q.roll(half, -1) * sin
            layer["slots"][0][j].copy_(k * cos + k.roll(half, -1) * sin)
            layer["slots"][1][j].copy_(layer["v"](x).view(n, kv_heads, 1, d))
            keys, values = layer["cache"]
            if heads != kv_heads:  # grouped key/value heads: a group's queries are the rows of its one head (transformers' pack_gqa)
                q = q.view(n, kv_heads, heads // kv_heads, d)
            out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer["scale"])
            h = h + layer["o"](out.reshape(n, heads * d))
            x = post_norm(h)
            mlp = layer["mlp"]
            if isinstance(mlp, tuple):
                gate, up, act, down = mlp
                x = down(act(gate(x)) * up(x))
            else:
                x = mlp(x)
            h = h + x
        return self.model.norm(h).float()


def decode_step(layers: list[nn.Module], norm: nn.Module, embeds: Tensor, index: Tensor, caches: list[tuple[Tensor, Tensor]], cos: Tensor, sin: Tensor, masks: Tensor) -> Tensor:
    """:meth:`StaticDecoder.step` as one function of tensors, for ``torch.compile``: step
    ``index`` (long [1]) of the decoder ``layers`` (and final ``norm``) on the inputs ``embeds``
    [N, hidden], writing its keys and values at slot P + index of the ``caches`` [N, kv_heads,
    P + T, d] in place, with the rotary tables ``cos`` / ``sin`` [N, T, 1, 1, d] and the additive
    ``masks`` [T, N, 1, 1, P + T] of :class:`StaticDecoder`."""
    n = embeds.shape[0]
    slot = index + (masks.shape[-1] - masks.shape[0])  # P + index
    cos, sin, mask = cos.index_select(1, index).squeeze(1), sin.index_select(1, index).squeeze(1), masks.index_select(0, index).squeeze(0)
    h = embeds.to(caches[0][0].dtype)
    for layer, (keys, values) in zip(layers, caches):
        attn = layer.self_attn
        heads, kv_heads, d = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
        half = d // 2
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(n, heads, 1, d)
        k = attn.k_proj(x).view(n, kv_heads, 1, d)
        q = q * cos + q.roll(half, -1) * sin
        keys.index_copy_(2, slot, k * cos + k.roll(half, -1) * sin)
        values.index_copy_(2, slot, attn.v_proj(x).view(n, kv_heads, 1, d))
        if heads != kv_heads:
            q = q.view(n, kv_heads, heads // kv_heads, d)
        out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
        h = h + attn.o_proj(out.reshape(n, heads * d))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return norm(h).float()


def _linear(module: nn.Module):
    """A plain ``nn.Linear`` as one matrix product on [N, in] rows with its weight transposed
    once (what ``F.linear`` does on every call); any other module (a LoRA-wrapped linear) as itself."""
    if type(module) is not nn.Linear:
        return module
    weight_t, bias = module.weight.t(), module.bias
    if bias is None:
        return lambda x: torch.mm(x, weight_t)
    return lambda x: torch.addmm(bias, x, weight_t)


def _llama_mlp(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is the Llama layout's down(act(gate(x)) · up(x)) (its class says so by name)."""
    return type(mlp).__name__ in ("LlamaMLP", "Qwen2MLP", "MistralMLP") and all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))
