"""Toy policies that exercise the core on the two generative modalities it was built for.

- ``categorical_sequence``: decisions are tokens of an autoregressive model (an LLM in
  miniature).
- ``gaussian_chain``: decisions are the Gaussian transitions of a denoising chain
  x_T → … → x_0 ("denoising as an MDP", DDPO / Flow-GRPO in miniature), built on
  :mod:`mmrl.denoising` like every denoising policy.

Both are conditioned on an integer prompt id in [0, spec["num_prompts"]), supplied by the
``prompt`` sampler. Random noise is drawn on the CPU from the caller's generator and then
moved to the model's device, so a seed draws the same noise on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mmrl.core.policy import PolicyModule, Sample
from mmrl.denoising import DenoisingPolicy, learned_noise_std, sinusoidal_embedding
from mmrl.errors import ConfigError
from mmrl.policies.toy.config import CategoricalSequenceConfig, GaussianChainConfig
from mmrl.registry import POLICIES


def _num_prompts(spec: dict, policy_type: str) -> int:
    n = spec.get("num_prompts")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(
            "policy.type", policy_type, f"is conditioned on prompt ids; use it with `sampler.type: prompt` (the sampler's spec gave num_prompts={n!r})"
        )
    return n


def _gumbel(shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
    """Gumbel(0, 1) noise: argmax(logits + g) is an exact draw from softmax(logits)."""
    u = torch.rand(shape, generator=generator).clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
SEQUENCE_CONTRACT = {
    "train": {
        "sampler": {"type": "prompt"},
        "policy": {"type": "categorical_sequence", "hidden": 8, "seq_len": 4},
        "rewards": [{"type": "token_fraction", "token": 3}],
    },
    "ratio_atol": 1e-5,
    "ratio_why": (
        "sampling steps the GRU one token at a time (its input and hidden products over N rows a step), log_prob runs it teacher-forced "
        "(the input products of all L positions as one GEMM of N x L rows), and some BLAS kernels (MKL on AVX512 Intel Xeons) sum a row "
        "in an order chosen from the row count: 2.4e-7 measured there (log-probs about 2.5), 0 on AMD EPYC, up to 2.4e-7 under "
        "MMRL_SHAPE_KERNELS=1 over seeds 0-2"
    ),
}


@POLICIES.register("categorical_sequence", config=CategoricalSequenceConfig, contract=SEQUENCE_CONTRACT)
class CategoricalSequencePolicy(PolicyModule):
    """Autoregressive token model (prompt + previous token + position → GRU → logits)."""

    def __init__(self, config: CategoricalSequenceConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        h = config.hidden
        self.prompt_embedding = nn.Embedding(_num_prompts(spec, "categorical_sequence"), h)
        self.token_embedding = nn.Embedding(config.vocab_size + 1, h)  # the last row is begin-of-sequence
        self.position_embedding = nn.Embedding(config.seq_len, h)
        self.gru = nn.GRU(h, h, batch_first=True)
        self.head = nn.Linear(h, config.vocab_size)
        self.to(getattr(torch, config.dtype))

    @property
    def bos_token(self) -> int:
        return self.config.vocab_size

    def _embed(self, prompt: Tensor, previous: Tensor, start: int) -> Tensor:
        """GRU inputs for positions start … start+l−1, given the l previous tokens [N, l]."""
        positions = torch.arange(start, start + previous.shape[1], device=previous.device)
        return self.prompt_embedding(prompt)[:, None] + self.token_embedding(previous) + self.position_embedding(positions)[None]

    def log_prob(self, replay: dict) -> Tensor:
        """log π(token_l | prompt, tokens_<l) for every position, one teacher-forced pass: [B, L]."""
        prompt, tokens = replay["prompt"], replay["tokens"]
        bos = torch.full_like(tokens[:, :1], self.bos_token)
        hidden, _ = self.gru(self._embed(prompt, torch.cat([bos, tokens[:, :-1]], 1), 0))
        logp = torch.log_softmax(self.head(hidden), -1)
        return logp.gather(-1, tokens[..., None]).squeeze(-1)

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """Generate ``seq_len`` tokens per prompt id in ``inputs`` [N].

        With ``eos_token`` set, the positions after the first EOS are padded with EOS and
        masked out (the EOS itself is a valid decision); samples without any EOS are flagged
        ``info["truncated"]``.
        """
        device = self.head.weight.device
        prompt = torch.as_tensor(inputs, dtype=torch.long, device=device)
        n, length, eos = prompt.shape[0], self.config.seq_len, self.config.eos_token
        noise = None if deterministic else _gumbel((n, length, self.config.vocab_size), generator).to(device, self.head.weight.dtype)
        previous = torch.full((n, 1), self.bos_token, dtype=torch.long, device=device)
        ended = torch.zeros(n, dtype=torch.bool, device=device)
        state = None
        tokens, logps, entropies, masks = [], [], [], []
        for pos in range(length):
            hidden, state = self.gru(self._embed(prompt, previous, pos), state)
            logp = torch.log_softmax(self.head(hidden[:, 0]), -1)
            token = logp.argmax(-1) if deterministic else (logp + noise[:, pos]).argmax(-1)
            masks.append((~ended).float())
            if eos is not None:
                token = torch.where(ended, torch.full_like(token, eos), token)
                ended = ended | (token == eos)
            tokens.append(token)
            logps.append(logp.gather(-1, token[:, None]).squeeze(-1))
            entropies.append(-(logp.exp() * logp).sum(-1))
            previous = token[:, None]
        tokens_t = torch.stack(tokens, 1)
        truncated = ~ended if eos is not None else torch.zeros(n, dtype=torch.bool, device=device)
        return Sample(
            output=tokens_t,
            logp=torch.stack(logps, 1),
            replay={"prompt": prompt, "tokens": tokens_t},
            mask=torch.stack(masks, 1),
            entropy=torch.stack(entropies, 1),
            info={"tokens": tokens_t, "truncated": truncated},
        )


CHAIN_CONTRACT = {  # the tiny example of itself (see SEQUENCE_CONTRACT)
    "train": {
        "sampler": {"type": "prompt"},
        "policy": {"type": "gaussian_chain", "hidden": 8, "denoising": {"num_inference_steps": 4}},
        "rewards": [{"type": "target_distance", "target": 2.0}],
    },
}


@POLICIES.register("gaussian_chain", config=GaussianChainConfig, contract=CHAIN_CONTRACT)
class GaussianChainPolicy(DenoisingPolicy):
    """A conditional denoising chain built on mmrl.denoising; each stochastic step is one decision.

    The denoiser is an MLP over [x, time features, prompt embedding] that predicts what the
    configured transition needs: ε for ``ddim`` / ``ddpm``, the velocity v for the flow
    transitions (and, for ``flow_noise``, a std from a second head). Schedule, transition,
    stochastic steps, log-probs and the replay layout all come from ``config.denoising``.
    The output layer starts small, so the untrained flow chain stays near its noise x_init
    instead of drifting at random.
    """

    keeps_sampling_graph = True

    def __init__(self, config: GaussianChainConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        h, dim = config.hidden, config.dim
        outputs = 2 * dim if config.denoising.transition == "flow_noise" else dim
        self.sample_in = nn.Linear(dim, h)
        self.time_mlp = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h))
        self.prompt_embedding = nn.Embedding(_num_prompts(spec, "gaussian_chain"), h)
        self.net = nn.Sequential(nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, outputs))
        with torch.no_grad():  # a small output at init (see the class docstring)
            self.net[-1].weight.mul_(0.1)
            self.net[-1].bias.zero_()

    def _model_output(self, x: Tensor, time: Tensor, prompt: Tensor):
        options = self.denoising
        # flow times are σ ∈ [0, 1]; diffusion times are training timesteps, scaled to [0, 1)
        scale = 1.0 if options.transition.startswith("flow") else 1.0 / options.num_train_timesteps
        features = self.time_mlp(sinusoidal_embedding(time * scale, self.config.hidden))
        out = self.net(self.sample_in(x) + features + self.prompt_embedding(prompt))
        if options.transition != "flow_noise":
            return out
        v, raw_std = out.chunk(2, dim=-1)
        return v, learned_noise_std(raw_std, options.noise_std_range)

    def _denoiser(self, prompt: Tensor):
        def denoise(x: Tensor, time: Tensor, rows: Tensor):
            return self._model_output(x, time, prompt[rows])

        return denoise

    def chain_denoiser(self, replay: dict):
        return self._denoiser(replay["prompt"])

    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False, keep_graph: bool = False) -> Sample:
        """Run the chain for each prompt id in ``inputs`` [N]; ``deterministic`` takes the
        deterministic update at every step (x_init is still drawn from ``generator``).
        ``keep_graph``: the log-probs keep the autograd graph (``keeps_sampling_graph``)."""
        device = self.sample_in.weight.device
        prompt = torch.as_tensor(inputs, dtype=torch.long, device=device)
        x_init = torch.randn((prompt.shape[0], self.config.dim), generator=generator).to(device)
        out = self.sample_chain(self._denoiser(prompt), x_init, generator, deterministic, keep_graph=keep_graph)
        return Sample(
            output=out.final,
            logp=out.logp,
            replay={"prompt": prompt, "chain": out.chain},
            mask=out.mask,
            entropy=out.entropy,
            info={"sample": out.final},
            logp_deferred=out.deferred,
        )
