"""Sampling of text completions: the sampling distribution, the generation-backend
interface, and mmrl's own decoding loop (the default backend).

**The sampling distribution.** With logits z over the vocabulary, temperature τ and
nucleus mass p, a token is drawn from

    π_τ(v) = softmax(z / τ)_v,
    N_p    = {v : π_τ(v) ≥ π_τ(v_(k))},   k = max{j : Σ_{i<j} π_τ(v_(i)) < p}

(v_(1), v_(2), … the tokens from the most likely down; N_p is the smallest set of most
likely tokens whose mass reaches p, ties at its edge included), renormalized over N_p:

    q(v) = π_τ(v) / Σ_{u ∈ N_p} π_τ(u)   for v ∈ N_p, else 0.

``old_logp`` and ``log_prob`` are log-probs of this distribution q — the one the tokens were
actually drawn from — not of the model's raw softmax. When ``log_prob`` recomputes them under
changed parameters, the nucleus is recomputed from the new logits and widened to contain the
replayed token a, so a token the new nucleus would exclude keeps a finite log-prob:

    log q'(a) = log π_τ(a) − log Σ_{u ∈ N_p ∪ {a}} π_τ(u).

Right after sampling a ∈ N_p, so the widening changes nothing and the ratio is exactly 1.

**Backends.** A :class:`GenerationBackend` turns prompts (token ids) into completions (token
ids, per-token log-probs of q, why each ended). :class:`BuiltinBackend` is mmrl's own loop
over the model with its key/value cache, drawing every token with ``torch.multinomial`` from
the caller's generator, so a seed gives the same completions. A serving engine plugs in
through ``policy.generation.backend: 'package.module:factory'`` (docs/text.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor


def nucleus_mask(probs: Tensor, top_p: float) -> Tensor:
    """Bool mask [..., V] of the nucleus N_p of each distribution ``probs`` [..., V]:
    v ∈ N_p ⇔ p_v ≥ p_(k), k = max{j : Σ_{i<j} p_(i) < top_p} (sorted descending)."""
    if top_p >= 1.0:
        # every token: a float cumulative sum can pass 1 before the last token
        return torch.ones_like(probs, dtype=torch.bool)
    ranked = probs.sort(dim=-1, descending=True).values
    inside = (ranked.cumsum(-1) - ranked) < top_p
    cutoff = ranked.masked_fill(~inside, float("inf")).amin(dim=-1, keepdim=True)
    return probs >= cutoff


def sampling_log_probs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """log q [..., V] (−inf outside the nucleus) of logits [..., V]: log π_τ(v) − log Σ_{u∈N_p} π_τ(u)."""
    log_pi = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return log_pi
    masked = log_pi.masked_fill(~nucleus_mask(log_pi.exp(), top_p), float("-inf"))
    return masked - masked.logsumexp(dim=-1, keepdim=True)


def token_log_probs(logits: Tensor, tokens: Tensor, temperature: float, top_p: float, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log q'(a) of the tokens [...] under logits [..., V], with the nucleus widened to hold
    each token: log π_τ(a) − log Σ_{u ∈ N_p ∪ {a}} π_τ(u) (see the module docstring); and, if
    asked, the entropy −Σ_v q'(v) log q'(v) of that distribution."""
    log_pi = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        with torch.no_grad():  # which tokens count is a choice, not a function to differentiate
            keep = nucleus_mask(log_pi.exp(), top_p)
            keep.scatter_(-1, tokens.unsqueeze(-1), True)
        masked = log_pi.masked_fill(~keep, float("-inf"))
        log_pi = masked - masked.logsumexp(dim=-1, keepdim=True)
    logp = log_pi.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    probs = log_pi.exp()
    return logp, -(probs * log_pi.masked_fill(probs == 0, 0.0)).sum(-1)


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Token ids [N, L] padded on the left with ``pad_token_id`` and their mask [N, L] (1 = token)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes its key/value cache: transformers 5.24
    renamed ``past_key_values`` to ``cache`` (the old name warns); earlier versions know only
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class SamplingOptions:
    """What a backend needs to sample completions the way the policy scores them."""

    max_new_tokens: int
    temperature: float
    top_p: float
    eos_token_ids: tuple[int, ...]  # a completion ends with (and keeps) the first of these it samples
    pad_token_id: int
    stop_strings: tuple[str, ...] = ()  # a completion also ends at the token completing one of these


FINISH_REASONS = ("eos", "stop", "length")
PAUSED = "paused"  # a partial rollout's unfinished completion (``stop`` ended the call first)


@dataclass
class Generation:
    """Completions of N prompts. ``token_ids[i]`` are the generated tokens of prompt i, up to
    and including the EOS token or the token that completes a stop string, at most
    ``max_new_tokens``; ``logp[i]`` their log-probs under the sampling distribution q;
    ``finish_reason[i]`` is "eos", "stop" or "length" (the budget ran out: truncated), or
    "paused" when the caller's ``stop`` ended the call first (partial rollouts);
    ``entropy[i]``, if the backend reports it, the entropy of q at each of those tokens."""

    token_ids: list[list[int]]
    logp: list[list[float]]
    finish_reason: list[str]
    entropy: list[list[float]] | None = None
    # with ``keep_cache`` (:meth:`BuiltinBackend.generate`): per prompt, the key/value states
    # of its tokens (prompt, prefix, completion but its last token, whose states are never
    # computed) as a tuple over layers of (keys, values) [H, L, D]; None where not available
    cache: list | None = None


@runtime_checkable
class GenerationBackend(Protocol):
    """Samples completions for a text policy. ``generate`` is called once per
    ``policy.sample`` call, with the policy's parameters as they are now (an engine that keeps
    its own copy of the weights refreshes it from ``policy.model`` first). A vision-language
    policy (``text_vlm``) also passes ``model_inputs=``: the prompts' image tensors, one row per
    prompt (docs/text.md); a backend for text policies alone need not take it."""

    def generate(self, prompt_ids: list[list[int]], options: SamplingOptions, generator: torch.Generator | None, deterministic: bool) -> Generation: ...


class BuiltinBackend:
    """mmrl's own decoding loop: one batched pass over the left-padded prompts, then one token
    per step for every unfinished completion with the model's key/value cache, until every
    completion has ended or the budget is spent. A completion that ends leaves the batch (its
    rows of the cache and mask are dropped), so the last steps run on the few long
    completions only. Tokens are drawn with ``torch.multinomial`` from the caller's generator
    (greedy with ``deterministic``) over the distributions of all N rows — an ended row draws
    from a placeholder — so the generator advances the same way whichever rows have ended and
    the same seed gives the same completions. Position ids count each row's own tokens, so
    left padding changes nothing. Besides each token's log-prob it reports the entropy of q
    at each step (``Generation.entropy``)."""

    def __init__(self, policy):
        self.policy = policy

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        options: SamplingOptions,
        generator: torch.Generator | None,
        deterministic: bool,
        model_inputs: dict[str, Tensor] | None = None,
        prefixes: list[list[int]] | None = None,
        stop: Callable[[list[int]], bool] | None = None,
        past: list | None = None,
        keep_cache: bool = False,
    ) -> Generation:
        """Completions of ``prompt_ids``. Partial rollouts (``rollout.over_provision``) pass
        ``prefixes``, the tokens each row already generated in earlier calls (they join the
        prompt, count against ``max_new_tokens`` and are not returned), and ``stop``, called
        with the rows that have ended so far whenever some end: when it returns true the call
        ends there and the rows still running are "paused".

        A language agent's turns (docs/agents.md) pass ``past``: per row, None or the
        key/value states of the first L tokens of its prompt (as ``Generation.cache`` returns
        them); only the rest of the row is prefilled, over those states (at least its last
        token). The rows' states are left-padded to the longest into one cache, the new tokens
        after them, so a row may have padding between its past and its new tokens: the mask
        excludes it and positions count the row's own tokens. ``keep_cache`` returns each row's
        states in ``Generation.cache``, taken as the row leaves the batch."""
        device = self.policy.device
        n, budget = len(prompt_ids), options.max_new_tokens
        prefixes = prefixes if prefixes is not None else [[] for _ in range(n)]
        remaining = [budget - len(p) for p in prefixes]
        if min(remaining, default=1) < 1:
            raise ValueError(f"a prefix of {budget - min(remaining)} tokens leaves nothing of max_new_tokens {budget}")
        sequences = [list(a) + list(b) for a, b in zip(prompt_ids, prefixes)]
        if past is not None and any(p is not None for p in past):
            ids, mask, cache = self._over_past(sequences, past, options.pad_token_id, device)
        else:
            ids, mask = (t.to(device) for t in left_pad(sequences, options.pad_token_id))
            cache = self.policy.new_cache()
        horizon = max(remaining)
        row_budget = torch.tensor(remaining, device=device)
        kept: list | None = [None] * n if keep_cache else None
        # the extra inputs (images) enter with the prompts; the cache holds them from then on
        logits = self.policy.forward_logits(ids, mask, cache=cache, logits_to_keep=1, **{k: v.to(device) for k, v in (model_inputs or {}).items()})[:, -1]
        eos = torch.tensor(options.eos_token_ids, dtype=torch.long, device=device)
        stop_window = max((len(s.encode("utf-8")) for s in options.stop_strings), default=0) + 1
        out_tokens = torch.full((n, horizon), options.pad_token_id, dtype=torch.long, device=device)
        out_logp = torch.zeros((n, horizon), device=device)
        out_entropy = torch.zeros((n, horizon), device=device)
        lengths = list(remaining)
        reasons = ["length"] * n
        ended_rows: list[int] = []
        rows = torch.arange(n, device=device)  # the original row of each row still in the batch
        probs = None  # [N, V] sampling distributions of every row (placeholder rows for the ended ones)
        whole = True  # no row has left the batch yet
        for t in range(horizon):
            log_q = sampling_log_probs(logits, options.temperature, options.top_p)
            q = log_q.exp()
            if deterministic:
                token = log_q.argmax(-1)
            else:
                on = generator.device if generator is not None else log_q.device
                if whole:
                    token = torch.multinomial(q.to(on), 1, generator=generator).squeeze(1).to(device)
                else:
                    if probs is None:
                        probs = torch.ones((n, log_q.shape[-1]), device=on)
                    probs[rows.to(on)] = q.to(on)
                    token = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(device)[rows]
            at = rows if not whole else slice(None)
            out_tokens[at, t] = token
            out_logp[at, t] = log_q.gather(-1, token[:, None]).squeeze(1)
            out_entropy[at, t] = -torch.where(q > 0, q * log_q, 0.0).sum(-1)  # 0 · log 0 = 0 outside the nucleus
            ended = torch.isin(token, eos)
            for i in ended.nonzero().flatten().tolist():
                reasons[rows[i]] = "eos"
            if options.stop_strings:
                # a stop string of b bytes spans at most b tokens: decode one more than the longest
                live = (~ended).nonzero().flatten()
                tails = out_tokens[rows[live], max(0, t + 1 - stop_window) : t + 1].tolist()
                if t + 1 < stop_window:  # the window reaches back into the prefix
                    tails = [prefixes[r][len(prefixes[r]) - (stop_window - t - 1) :] + tail if prefixes[r] else tail for r, tail in zip(rows[live].tolist(), tails)]
                for i, text in zip(live.tolist(), self.policy.tokenizer.batch_decode(tails)):
                    if any(s in text for s in options.stop_strings):
                        reasons[rows[i]] = "stop"
                        ended[i] = True
            ended |= row_budget[rows] == t + 1  # the row's budget is spent ("length" unless it ended otherwise)
            if t + 1 == horizon:
                break
            if ended.any():
                for i in ended.nonzero().flatten().tolist():
                    lengths[rows[i]] = t + 1
                    ended_rows.append(int(rows[i]))
                    if kept is not None:
                        kept[int(rows[i])] = _row_states(cache, mask, i)
                keep = (~ended).nonzero().flatten()
                if stop is not None and keep.numel() and stop(ended_rows):
                    for i in keep.tolist():
                        lengths[rows[i]], reasons[rows[i]] = t + 1, PAUSED
                    break
                if probs is not None:
                    probs[rows[ended].to(probs.device)] = 1.0
                if keep.numel() == 0:
                    break
                rows, token, mask, whole = rows[keep], token[keep], mask[keep], False
                cache.reorder_cache(keep)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits = self.policy.forward_logits(token[:, None], mask, cache=cache, logits_to_keep=1)[:, -1]
        if kept is not None:  # the rows still in the batch when the loop ended
            for i, r in enumerate(rows.tolist()):
                if kept[r] is None:
                    kept[r] = _row_states(cache, mask, i)
        steps, step_logp, step_entropy = out_tokens.tolist(), out_logp.tolist(), out_entropy.tolist()
        return Generation(
            token_ids=[row[:k] for row, k in zip(steps, lengths)],
            logp=[row[:k] for row, k in zip(step_logp, lengths)],
            finish_reason=reasons,
            entropy=[row[:k] for row, k in zip(step_entropy, lengths)],
            cache=kept,
        )

    def _over_past(self, sequences: list[list[int]], past: list, pad_token_id: int, device) -> tuple[Tensor, Tensor, object]:
        """(new token ids [N, S], mask [N, P + S], a cache holding the rows' past states
        [N, ·, P, ·]): row i's L_i cached states right-aligned in the first P columns (P the
        longest L_i), its other tokens right-aligned in the last S (the longest rest)."""
        done = [0 if p is None else min(int(p[0][0].shape[-2]), len(s) - 1) for p, s in zip(past, sequences)]
        ids, new_mask = left_pad([s[k:] for s, k in zip(sequences, done)], pad_token_id)
        width = max(done)
        past_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, k in enumerate(done):
            if k:
                past_mask[row, width - k :] = 1
        cache = self.policy.new_cache()
        if width:
            like = next(p for p, k in zip(past, done) if k)
            for layer, (k0, v0) in enumerate(like):
                keys = k0.new_zeros((len(sequences), k0.shape[0], width, k0.shape[-1]), device=device)
                values = v0.new_zeros((len(sequences), v0.shape[0], width, v0.shape[-1]), device=device)
                for row, (p, k) in enumerate(zip(past, done)):
                    if k:
                        keys[row, :, width - k :] = p[layer][0][:, :k]
                        values[row, :, width - k :] = p[layer][1][:, :k]
                cache.update(keys, values, layer)
        return ids.to(device), torch.cat([past_mask, new_mask], dim=1).to(device), cache


def _row_states(cache, mask: Tensor, i: int) -> tuple | None:
    """The key/value states of row ``i`` of a batched cache without its padding: a tuple over
    layers of (keys, values) [H, L, D] (copies, so the batch's tensors can go); None when a
    layer holds none (a model whose layers share states)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(getattr(layer, "is_initialized", False) and layer.keys is not None for layer in layers):
        return None
    real = mask[i].bool()
    if real.shape[0] != layers[0].keys.shape[-2]:
        return None
    return tuple((layer.keys[i][:, real], layer.values[i][:, real]) for layer in layers)
