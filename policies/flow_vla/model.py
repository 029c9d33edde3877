"""Flow-matching VLA (π0 style), fine-tuned with Flow-SDE or Flow-Noise log-likelihoods (πRL).

Architecture (π0, Black et al. 2024, "π0: A Vision-Language-Action Flow Model for General
Robot Control", in miniature):

- the shared backbone (``mmrl.policies.vla.backbone``) reads the prefix
  [camera patches | state | instruction] and returns its hidden states H [N, P, hidden];
- the action expert is a small transformer over the C tokens of a noisy action chunk
  x ∈ R^{C×A} (normalized units): token i = MLP([W·x_i + pos_i, time features of σ]),
  then ``expert_layers`` blocks of self-attention over the chunk and cross-attention to H
  (padding masked), then a linear head giving the velocity v ∈ R^{C×A}. π0's expert
  attends to the prefix's keys/values inside the same transformer; cross-attention to the
  prefix's hidden states plays that role here. The prefix — the backbone pass and each
  expert block's prefix keys/values — is computed once per chunk and reused by every
  denoising step, in sampling and in ``log_prob``.

Time convention (rectified flow; openpi's implementation of π0, SD3, Flow-GRPO): with
x0 the expert chunk and ε ~ N(0, I),

    x_σ = (1 − σ)·x0 + σ·ε,     target velocity v = ε − x0,

σ = 1 is pure noise and sampling integrates dx = v dσ from σ = 1 down to 0 in K Euler
steps over the (optionally shifted) sigmas. π0's paper writes τ = 1 − σ. ``sft_loss`` is
the flow-matching loss ‖vθ(x_σ, σ, o) − (ε − x0)‖², averaged over valid actions, with
σ from π0's Beta(1.5, 1) (more weight on noisy times) or uniform.

RL (πRL, Chen et al. 2025, "πRL: Online RL Fine-tuning for Flow-based Vision-Language-
Action Models"): the chain is made stochastic so that the chunk has a likelihood
(``policy.denoising``, :mod:`mmrl.denoising`):

- ``transition: flow_sde``: the flow's marginal-preserving SDE with noise level a
  (:func:`mmrl.denoising.flow_sde_step`, Flow-GRPO's formula); ``flow_cps`` its
  coefficient-preserving variant;
- ``flow_noise``: the ODE step's mean with a std from a learned noise head on the
  expert's output tokens, squashed log-uniformly into ``noise_std_range``
  (:func:`mmrl.denoising.flow_noise_step`).

``stochastic_steps: all`` makes every step stochastic; ``random`` one step per chunk,
chosen uniformly at random (kept in the replay), the others ODE; ``window`` /
``window_size: N`` restricts to the first N (high-noise) steps. By default
(``logp_granularity: chain``) one chunk is one decision (k = 1): its log-prob is the joint
log-likelihood Σ_k log N(x_{k+1}; μ_k, σ_k²) of the stochastic steps (the initial noise's
density does not depend on the parameters and is left out). The env action is the final
latent clipped to [−1, 1], mapped to env units (center + half_range·a_n); the log-prob is
that of the unclipped chain. ``deterministic=True`` integrates the ODE from x = 0, so the
action depends on the observation only.

Replay per call: ``image`` uint8 [N, 1, …], ``state`` [N, 1, D], ``instruction_ids`` /
``instruction_mask`` [N, 1, L], and the chain in :mod:`mmrl.denoising`'s layout (``chain``:
``latents`` [N, 1, W + 1, C, A], ``step_index`` / ``stochastic`` [N, 1, W]).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mmrl.denoising import learned_noise_std, provisional_logp_why, sinusoidal_embedding, sinusoidal_periods
from mmrl.errors import ConfigError
from mmrl.policies.flow_vla.config import FlowVLAConfig
from mmrl.policies.vla.action_chunk import ActionChunkPolicy
from mmrl.policies.vla.backbone import encode_observations, pooled_prefix_state
from mmrl.policies.vla.pretrained import VLM_LAYOUTS, AdapterFreeReference, build_backbone, export_vlm, vlm_export_formats
from mmrl.policies.vla.tokenizer import InstructionTokenizer
from mmrl.registry import POLICIES


def _linear(layer: nn.Linear, x: Tensor, weight_t: Tensor | None) -> Tensor:
    """``layer(x)`` with the weight transposed beforehand (``weight_t``, once per chunk, see
    :meth:`ActionExpert.memory`): on a contiguous input the same matrix product ``F.linear``
    runs, without transposing the weight on every call of every denoising step."""
    if weight_t is None or layer.bias is None or not x.is_contiguous():
        return layer(x)
    if x.dim() == 2:
        return torch.addmm(layer.bias, x, weight_t)
    return torch.addmm(layer.bias, x.view(-1, x.shape[-1]), weight_t).view(*x.shape[:-1], weight_t.shape[1])


class ExpertBlock(nn.Module):
    """Pre-norm transformer block of the action expert: self-attention over the chunk's
    tokens, cross-attention to the prefix, MLP. The prefix's keys/values depend only on the
    observation, so :meth:`memory_kv` computes them once per chunk for all denoising steps."""

    def __init__(self, hidden: int, heads: int, intermediate: int, memory_dim: int | None = None):
        super().__init__()
        self.heads = heads
        self.self_norm = nn.LayerNorm(hidden)
        self.self_qkv = nn.Linear(hidden, 3 * hidden)
        self.self_out = nn.Linear(hidden, hidden)
        self.cross_norm = nn.LayerNorm(hidden)
        self.cross_q = nn.Linear(hidden, hidden)
        self.cross_kv = nn.Linear(memory_dim or hidden, 2 * hidden)
        self.cross_out = nn.Linear(hidden, hidden)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, intermediate), nn.GELU(), nn.Linear(intermediate, hidden))

    def _split(self, x: Tensor, length: int) -> Tensor:
        """[B, S, hidden] or rows [B·S, hidden] (S = ``length``) → [B, heads, S, hidden / heads]."""
        return x.view(-1, length, self.heads, x.shape[-1] // self.heads).transpose(1, 2)

    def _merge(self, x: Tensor) -> Tensor:
        """[B, heads, S, d] → rows [B·S, heads·d]."""
        return x.transpose(1, 2).reshape(-1, x.shape[1] * x.shape[-1])

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the (normalized) prefix states [N, P, hidden], each [N, heads, P, d]."""
        k, v = self.cross_kv(memory).chunk(2, dim=-1)
        return self._split(k, k.shape[1]), self._split(v, v.shape[1])

    def forward(self, h: Tensor, kv: tuple[Tensor, Tensor], attend: Tensor, weights: dict | None = None) -> Tensor:
        """h: the rows [B·C, hidden] of B chunks of C tokens; kv from :meth:`memory_kv` (the B
        chunks' rows); attend [B, 1, 1, P] (bool, or additive: 0 or −inf); ``weights`` the
        transposed weights of :meth:`ActionExpert.memory` (None: transposed here). The norms,
        linear layers and residuals act on each token's row alone, so they run on the rows
        as they are, and only attention sees the chunks."""
        t = weights.get if weights is not None else (lambda layer: None)
        chunk = h.shape[0] // kv[0].shape[0]
        q, k, v = self._split(_linear(self.self_qkv, self.self_norm(h), t(self.self_qkv)), chunk).chunk(3, dim=-1)
        h = h + _linear(self.self_out, self._merge(nn.functional.scaled_dot_product_attention(q, k, v)), t(self.self_out))
        q = self._split(_linear(self.cross_q, self.cross_norm(h), t(self.cross_q)), chunk)
        h = h + _linear(self.cross_out, self._merge(nn.functional.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=attend)), t(self.cross_out))
        up, act, down = self.mlp
        return h + _linear(down, act(_linear(up, self.mlp_norm(h), t(up))), t(down))


class ActionExpert(nn.Module):
    """Velocity (and, for Flow-Noise, a std) of a noisy chunk given σ and the prefix's hidden states."""

    def __init__(
        self, action_dim: int, chunk: int, hidden: int, layers: int, heads: int, intermediate: int, std_range: list[float] | None, memory_dim: int | None = None
    ):
        super().__init__()
        self.hidden = hidden
        self.action_in = nn.Linear(action_dim, hidden)
        self.position = nn.Parameter(torch.randn(chunk, hidden) * 0.02)
        self.time_mix = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.memory_norm = nn.LayerNorm(memory_dim or hidden)
        self.blocks = nn.ModuleList(ExpertBlock(hidden, heads, intermediate, memory_dim) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.velocity = nn.Linear(hidden, action_dim)
        self.noise_head = None
        self.std_range = std_range
        if std_range is not None:
            self.noise_head = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, action_dim))

    def memory(self, prefix: Tensor, prefix_mask: Tensor, transposed: bool = True) -> dict:
        """What every denoising step of a chunk reuses: each block's prefix keys/values and
        the attention mask, from the prefix states [N, P, hidden] and mask [N, P]; and what
        does not depend on the chunk, computed once rather than at every step: the weights
        of the step's linear layers transposed (for ``addmm``; not with ``transposed=False``, for a
        compiled step that lays them out itself) and the time features' periods."""
        states = self.memory_norm(prefix)
        kv = [block.memory_kv(states) for block in self.blocks]
        step_linears = [m for name, m in self.named_modules() if isinstance(m, nn.Linear) and not name.endswith("cross_kv")]
        attend = (prefix_mask > 0.5)[:, None, None, :]
        return {
            "kv": kv,
            # additive (0 or −inf), as attention turns a boolean mask into at every call
            "attend": torch.zeros(attend.shape, dtype=states.dtype, device=attend.device).masked_fill(~attend, float("-inf")),
            **({"weights": {layer: layer.weight.t() for layer in step_linears}} if transposed else {}),
            "periods": sinusoidal_periods(self.hidden, device=prefix.device)[None],  # as every step's division broadcasts them
        }

    @staticmethod
    def select(memory: dict, rows: Tensor) -> dict:
        """``memory`` of the chunks ``rows`` [B] (one row per denoiser row)."""
        return {**memory, "kv": [(k[rows], v[rows]) for k, v in memory["kv"]], "attend": memory["attend"][rows]}

    def forward(self, x: Tensor, sigma: Tensor, memory: dict, rows: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """x [B, C, A], σ [B], ``memory`` from :meth:`memory` for N chunks, ``rows`` [B] the
        chunk of each row (None: row i is chunk i, or ``memory`` is already :meth:`select`-ed)
        → (v [B, C, A], std [B, C, A] or None)."""
        if rows is not None:
            memory = self.select(memory, rows)
        t = memory.get("weights", {}).get
        b, c, _ = x.shape
        tokens = _linear(self.action_in, x, t(self.action_in)) + self.position
        time = sinusoidal_embedding(sigma, self.hidden, periods=memory.get("periods")).unsqueeze(1).expand_as(tokens)
        first, act, second = self.time_mix
        rows = torch.cat([tokens, time], dim=-1).view(b * c, -1)  # every token a row from here on (ExpertBlock)
        h = _linear(second, act(_linear(first, rows, t(first))), t(second))
        for block, (k, v) in zip(self.blocks, memory["kv"]):
            h = block(h, (k, v), memory["attend"], memory.get("weights"))
        h = self.norm(h)
        std = None
        if self.noise_head is not None:
            up, act, down = self.noise_head
            std = learned_noise_std(_linear(down, act(_linear(up, h, t(up))), t(down)), self.std_range).view(b, c, -1)
        return _linear(self.velocity, h, t(self.velocity)).view(b, c, -1), std


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
CONTRACT = {
    "train": {  # images, state and instructions: the tabletop at 16 px
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 4, "kwargs": {"task": "spatial", "image_size": 16}},
        "sampler": {"type": "env"},
        "policy": {"type": "flow_vla", "action_chunk": 2, "expert_layers": 1, "expert_heads": 2, "denoising": {"num_inference_steps": 2},
                   "backbone": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "vision_channels": [4], "patch_grid": 2,
                                "max_instruction_tokens": 6}},
        "rewards": [{"type": "success"}],
    },
    "ratio_atol": 1e-4,
    "ratio_why": provisional_logp_why("9.5e-7 on an Intel Xeon (AVX512, MKL); up to 1.9e-6 (log-probs up to 8.6) under MMRL_SHAPE_KERNELS=1 over seeds 0-2"),
}


@POLICIES.register("flow_vla", config=FlowVLAConfig, contract=CONTRACT)
class FlowVLAPolicy(ActionChunkPolicy):
    """Vision-language backbone + flow-matching action expert; RL via Flow-SDE / Flow-Noise chains (πRL)."""

    obs_keys = ("image", "state", "instruction_ids", "instruction_mask")

    def __init__(self, config: FlowVLAConfig, spec: dict):
        super().__init__(config, spec)
        self.max_words = config.backbone.max_instruction_tokens

        self.tokenizer, self.backbone = build_backbone(config.backbone, spec, list(spec.get("instructions") or []))
        hd = self.backbone.hidden_size
        expert_hidden = config.expert_hidden_size or hd
        if expert_hidden % config.expert_heads or expert_hidden % 2:
            field = "expert_heads" if expert_hidden % config.expert_heads else "expert_hidden_size"
            raise ConfigError(f"policy.{field}", getattr(config, field), f"the expert's width ({expert_hidden}) must be even and split evenly into expert_heads ({config.expert_heads})")
        if self.backbone.pretrained:
            self.backbone.freeze_output_head()
        learned_noise = config.denoising.transition == "flow_noise"
        self.expert = ActionExpert(
            self.action_dim,
            self.chunk,
            expert_hidden,
            config.expert_layers,
            config.expert_heads,
            config.expert_intermediate_size or (config.backbone.intermediate_size if not self.backbone.pretrained else 2 * expert_hidden),
            config.denoising.noise_std_range if learned_noise else None,
            memory_dim=hd if expert_hidden != hd else None,
        )

    # ------------------------------------------------------------------ pieces

    def observation(self, inputs) -> dict[str, Tensor]:
        """The policy's tensors for a batch of observations (what replay stores, without the
        decision dim): uint8 image, float state, instruction token ids and mask."""
        return encode_observations(self.backbone, self.tokenizer, inputs, self.action_center.device, self.max_words)

    def _prefix_states(self, obs: dict[str, Tensor], compiled: bool = False) -> tuple[Tensor, Tensor]:
        """The backbone's hidden states [N, P, hidden] over each observation's prefix, and its mask
        (``compiled``: the backbone's pass through ``torch.compile``, :meth:`compiled_step`)."""
        # Every real instruction starts with [BOS]; forcing its slot on keeps all-padding
        # rows (right-padded replays) finite without changing real ones.
        instruction_mask = obs["instruction_mask"].clone()
        instruction_mask[:, 0] = 1.0
        embeds, mask = self.backbone.prefix(obs.get("image"), obs.get("state"), obs["instruction_ids"], instruction_mask)
        backbone = self.compiled_step("backbone", self.backbone) if compiled else self.backbone
        return backbone(embeds, mask), mask

    def prefix_memory(self, obs: dict[str, Tensor]) -> dict:
        """Run the backbone over each chunk's prefix once: the action expert's per-block
        prefix keys/values and attention mask, reused by every denoising step."""
        return self.expert.memory(*self._prefix_states(obs))

    @property
    def value_feature_dim(self) -> int:
        """Width of :meth:`value_features` (a ``critic.type: value_head`` reads them)."""
        if self.config.denoising.logp_granularity != "chain":
            raise ConfigError(
                "policy.denoising.logp_granularity", self.config.denoising.logp_granularity, "a value head gives one value per decision, an action chunk: use chain with critic.type value_head"
            )
        return self.backbone.hidden_size

    def value_features(self, replay: dict) -> Tensor:
        """The backbone's pooled prefix state [N, T, hidden] of each replayed observation
        (:func:`~mmrl.policies.vla.backbone.pooled_prefix_state`), with its gradient: a value
        head on it shares the backbone with the policy."""
        obs = {key: replay[key] for key in self.obs_keys if key in replay}
        n, t = next(iter(obs.values())).shape[:2]
        states, mask = self._prefix_states({k: v.reshape(n * t, *v.shape[2:]) for k, v in obs.items()})
        return pooled_prefix_state(states, mask).view(n, t, -1)

    def conditioning(self, obs: dict[str, Tensor]) -> dict:
        """The action expert is conditioned on the prefix (:meth:`prefix_memory`)."""
        return self.prefix_memory(obs)

    def _sampling_conditioning(self, obs: dict[str, Tensor]) -> dict:
        """:meth:`conditioning` in sampling: the prefix pass compiled under ``compile_prefix``, and
        no transposed weights for a compiled denoiser (``compile_denoiser``), which drops them."""
        return self.expert.memory(*self._prefix_states(obs, compiled=self.config.compile_prefix), transposed=not self.compiles_denoiser)

    @property
    def noise_feature_dim(self) -> int:
        return self.backbone.hidden_size

    def noise_conditioning(self, obs: dict[str, Tensor]) -> tuple[dict, Tensor]:
        """:meth:`conditioning` and the backbone's pooled prefix state [N, hidden] of the same pass."""
        states, mask = self._prefix_states(obs)
        return self.expert.memory(states, mask), pooled_prefix_state(states, mask).to(torch.float32)

    def _denoiser(self, memory: dict, compiled: bool = False):
        picked = {}  # the memory of the last rows seen: sampling hands the same rows to every step
        expert = self.expert
        if compiled:  # ``compile_denoiser``: the compiler lays out the linear layers itself (no pre-transposed weights)
            expert = self.compiled_step("expert", self.expert)
            memory = {key: value for key, value in memory.items() if key != "weights"}

        def denoise(x: Tensor, sigma: Tensor, rows: Tensor):
            if picked.get("rows") is not rows:
                picked.update(rows=rows, memory=self.expert.select(memory, rows))
            v, std = expert(x, sigma, picked["memory"])
            return v if std is None else (v, std)

        return denoise

    def sft_errors(self, memory: dict, x0: Tensor) -> Tensor:
        """The flow-matching error ‖vθ(x_σ, σ, o) − (ε − x0)‖² [B, C] of expert chunks x0
        [B, C, A] (normalized), x_σ = (1 − σ)·x0 + σ·ε, σ = 0.001 + 0.999·u with u from
        ``time_sampling``. σ and ε come from torch's global generator."""
        b = x0.shape[0]
        u = torch.rand(b, device=x0.device)
        if self.config.time_sampling == "beta":
            u = u ** (1 / 1.5)  # inverse CDF of Beta(1.5, 1): F(u) = u^1.5
        sigma = 0.001 + 0.999 * u
        eps = torch.randn_like(x0)
        s = sigma.view(b, 1, 1)
        x_sigma = (1 - s) * x0 + s * eps
        v, _ = self.expert(x_sigma, sigma, memory)
        return (v - (eps - x0)).square().mean(-1)

    # ------------------------------------------------------------------ files

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
        """The saved tokenizer replaces the one built from the spec (the embedding table
        is resized to its vocabulary before the weights are loaded)."""
        if self.backbone.pretrained:
            return
        self.tokenizer = InstructionTokenizer.load(directory)
        self.backbone.resize_instruction_vocab(self.tokenizer.vocab_size)
