"""Toy policies that exercise the core on the two generative modalities it was built for.

- ``categorical_sequence``: decisions are tokens of an autoregressive model (an LLM in
  miniature).
- ``gaussian_chain``: decisions are the Gaussian transitions of a denoising chain
  x_T → … → x_0 ("denoising as an MDP", DDPO / Flow-GRPO in miniature).

Both are conditioned on an integer prompt id in [0, spec["num_prompts"]), supplied by the
``prompt`` sampler. Random noise is drawn on the CPU from the caller's generator and then
moved to the model's device, so a seed draws the same noise on every device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mmrl.core.policy import PolicyModule, Sample
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


@POLICIES.register("categorical_sequence", config=CategoricalSequenceConfig)
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
        noise = None if deterministic else _gumbel((n, length, self.config.vocab_size), generator).to(device)
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


def _gaussian_logp(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(x; mean, std² I), summed (not averaged) over the last axis."""
    z = (x - mean) / std
    return (-0.5 * z.square() - torch.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)


@POLICIES.register("gaussian_chain", config=GaussianChainConfig)
class GaussianChainPolicy(PolicyModule):
    """Conditional Gaussian denoising chain; each transition x_t → x_{t−1} is one decision.

    x_T ~ N(0, I); transition k (k = 0 … T−1, from x_{T−k} to x_{T−k−1}) draws
    x_{t−1} ~ N(μθ(x_t, k, c), σ_k² I) with μθ = x_t + fθ(x_t, k, c) and a fixed geometric
    schedule σ_0 = sigma_max … σ_{T−1} = sigma_min. A transition's log-prob is summed over
    the ``dim`` sample dimensions (DDPO averages instead, which changes the right clip range).
    """

    def __init__(self, config: GaussianChainConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        h = config.hidden
        self.sample_in = nn.Linear(config.dim, h)
        self.step_embedding = nn.Embedding(config.num_steps, h)
        self.prompt_embedding = nn.Embedding(_num_prompts(spec, "gaussian_chain"), h)
        self.denoiser = nn.Sequential(nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, config.dim))
        with torch.no_grad():
            # A small residual at init: the untrained chain is x_T plus noise, not a random drift.
            self.denoiser[-1].weight.mul_(0.1)
            self.denoiser[-1].bias.zero_()
        sigmas = torch.exp(torch.linspace(math.log(config.sigma_max), math.log(config.sigma_min), config.num_steps))
        self.register_buffer("sigmas", sigmas, persistent=False)

    def _mean(self, x: Tensor, step: Tensor, prompt: Tensor) -> Tensor:
        return x + self.denoiser(self.sample_in(x) + self.step_embedding(step) + self.prompt_embedding(prompt))

    def mean_std(self, replay: dict) -> tuple[Tensor, Tensor]:
        """Every transition's Gaussian from the stored chain: mean [B, T, dim], std [B, T, 1]
        (for the closed-form KL ‖μθ − μref‖² / (2σ²) of Flow-GRPO)."""
        chain, prompt = replay["chain"], replay["prompt"]
        b, steps, dim = chain.shape[0], chain.shape[1] - 1, chain.shape[2]
        step = torch.arange(steps, device=chain.device).repeat(b)
        mean = self._mean(chain[:, :-1].reshape(b * steps, dim), step, prompt.repeat_interleave(steps))
        return mean.view(b, steps, dim), self.sigmas.view(1, steps, 1).expand(b, steps, 1)

    def log_prob(self, replay: dict) -> Tensor:
        """log N(x_{t−1}; μθ(x_t), σ_t²) of every stored transition: [B, T]."""
        mean, std = self.mean_std(replay)
        return _gaussian_logp(replay["chain"][:, 1:], mean, std)

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """Run the chain for each prompt id in ``inputs`` [N]; ``deterministic`` takes the mean
        at every transition (x_T is still drawn from ``generator``)."""
        device = self.sigmas.device
        prompt = torch.as_tensor(inputs, dtype=torch.long, device=device)
        n, steps, dim = prompt.shape[0], self.config.num_steps, self.config.dim
        noise = torch.randn((n, steps + 1, dim), generator=generator).to(device)
        x = noise[:, 0]
        chain, logps = [x], []
        for k in range(steps):
            mean = self._mean(x, torch.full((n,), k, dtype=torch.long, device=device), prompt)
            std = self.sigmas[k]
            x = mean if deterministic else mean + std * noise[:, k + 1]
            logps.append(_gaussian_logp(x, mean, std))
            chain.append(x)
        # Differential entropy of N(μ, σ² I) in `dim` dimensions; the same for every sample.
        entropy = 0.5 * dim * torch.log(2 * math.pi * math.e * self.sigmas.square())
        return Sample(
            output=x,
            logp=torch.stack(logps, 1),
            replay={"prompt": prompt, "chain": torch.stack(chain, 1)},
            entropy=entropy.expand(n, steps).clone(),
            info={"sample": x},
        )
