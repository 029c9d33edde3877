"""``text_agent``: a causal LM acting in a gymnasium env, one turn per decision (docs/agents.md).

The env sampler that runs robots runs the agent: the env's observation and action are text
(``gymnasium.spaces.Text``), every decision is one turn of the agent, and the turn's tokens
are that decision's log-prob columns. Between turns the conversation lives in the policy's
carried state (``PolicyModule.carries_state``): the env sampler hands each call's
``Sample.carry`` back to the next call of the same episodes, and knows nothing of tokens.

**Token in, token out.** The carry is each episode's conversation as token ids. A turn
appends the env's new observation, encoded on its own, and generates after it; earlier turns
are never re-tokenized, so the tokens the loss scores are exactly the tokens sampled (a
re-tokenized history can merge or split tokens at turn boundaries and change their
log-probs). With ``generation.chat_template`` the observation is a user message of the
tokenizer's chat template and each turn the assistant's reply: what the template puts between
the end of an assistant reply and the next generation prompt is worked out once from two
renderings of a short conversation, so the history grows by appending. A template that
re-renders earlier turns (one that strips the reasoning of past replies) cannot be appended
to and is refused. Without a chat template the transcript is the first observation (encoded
as ``text_lm`` encodes a prompt), then each turn followed by ``turn_separator`` and the next
observation.

**Masks.** Only the agent's own tokens are decisions: each turn's tokens (up to and including
its EOS, or the token completing a stop string) are columns with mask 1; the env's tokens sit
in the prompt of the next turn and are never scored.

**The key/value cache across turns** (``turn_cache``). Beside its token ids an episode's
carry holds the key/value states of its tokens but the last one generated (whose states the
decoding loop never computes), per layer [H, L, D]. The next turn prefills only the tokens
after them (that last token, the env's new tokens) over them: the backend left-pads the
rows' states into one batched cache, so a row has padding between its past and its new
tokens, which the attention mask excludes and the position ids (counted from the mask)
skip. The sampled tokens are those of re-encoding up to the float rounding of a prefix
computed in pieces rather than in one pass; the replay, ``log_prob`` and the trainer's
recompute do not change. A cache is handed over once: the call that reads it takes it out of
the carry it was given (the env sampler keeps every call's ``Sample``), and an episode that
has ended (or ends for a full context) carries none. The carry lives for one wave only;
nothing of it reaches the replay or a checkpoint. A backend whose ``generate`` takes no
``past``/``keep_cache`` (or a model whose cache layers are not plain growing ones) re-encodes.

**Limits.** ``generation.max_new_tokens`` per turn, ``max_context_tokens`` for the history plus
one turn (an episode whose history leaves no room for another turn ends there, truncated:
``Sample.end``), and the env sampler's ``max_decisions`` or the env's time limit for turns.

**Replay per turn** (call dim 1; fixed widths, so the waves and steps of a run concatenate):

    prompt_ids [N, 1, C − K], prompt_mask      the history before the turn (left-padded)
    completion_ids [N, 1, K], completion_mask  the turn (right-padded)

with C = ``max_context_tokens`` and K = ``max_new_tokens``; ``log_prob`` scores the turns of
a [B, T] replay as ``text_lm`` scores completions (rows of similar lengths together, each cut
to its real lengths, so the padding costs nothing) and returns [B, T·K].
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from mmrl.core.policy import Sample
from mmrl.errors import ConfigError
from mmrl.policies.conversation import glue_texts
from mmrl.policies.text_agent.config import TextAgentConfig
from mmrl.policies.text_lm.model import TEXT_REPLAY, TextLMPolicy, left_aligned
from mmrl.registry import POLICIES

CONTRACT = {
    "train": {
        "env": {"type": "gym", "id": "mmrl/GuessNumber-v0", "num_envs": 4, "max_episode_steps": 3},
        "sampler": {"type": "env"},
        "policy": {"type": "text_agent", "tiny": {"hidden_size": 16, "num_heads": 2, "intermediate_size": 32}, "generation": {"max_new_tokens": 4}, "max_context_tokens": 192},
        "rewards": [{"type": "success"}],
    },
    "ratio_atol": 1e-4,
    "ratio_why": (
        "the old log-probs are deferred (the trainer's ratio is exactly 1); the provisional numbers are the key/value-cache decoding "
        "loop's, which sums each token's float32 logits in another order than log_prob's one teacher-forced pass (as text_lm's, docs/text.md)"
    ),
}

@POLICIES.register("text_agent", config=TextAgentConfig, contract=CONTRACT)
class TextAgentPolicy(TextLMPolicy):
    """A causal LM whose decision is a turn in a text env; the conversation is its carried state."""

    carries_state = True

    def __init__(self, config: TextAgentConfig, spec: dict):
        if spec.get("action_space") != "text":
            raise ConfigError("policy.type", config.type, "acts in text: it needs an env whose observations and actions are text (gymnasium Text spaces, e.g. mmrl/GuessNumber-v0) under the env sampler")
        super().__init__(config, spec)
        self._glue: tuple[str, str, str, str] | None = None
        self.glue_texts()  # a template that cannot be appended to is refused now, not mid-run
        self._caches_turns: bool | None = None

    def caches_turns(self) -> bool:
        """Whether turns carry their key/value cache: ``turn_cache`` is on, the backend's
        ``generate`` takes ``past`` and ``keep_cache``, and the model's cache layers are plain
        growing ones (a sliding-window or otherwise special layer cannot be padded and cut)."""
        if not self.config.turn_cache:
            return False
        if self._caches_turns is None:
            from transformers.cache_utils import DynamicLayer

            parameters = inspect.signature(self.backend.generate).parameters
            layers = getattr(self.new_cache(), "layers", None)
            self._caches_turns = (
                "past" in parameters and "keep_cache" in parameters
                and layers is not None and all(type(layer) is DynamicLayer for layer in layers)
            )
        return self._caches_turns

    def renew_carry(self, carry: list) -> list:
        """Episodes that go on under new weights (partial rollouts) keep their token ids but
        not their key/value states, which the old weights computed: their next turn re-encodes
        the history, so it is sampled from the new weights alone."""
        return [{k: v for k, v in state.items() if k != "kv"} if isinstance(state, dict) else state for state in carry]

    # ------------------------------------------------------------------ the conversation

    def glue_texts(self) -> tuple[str, str, str, str]:
        """(after a turn that ended with EOS, after a turn cut without it, before an
        observation, after an observation): the text that joins a turn to the next observation
        and that observation to the next generation prompt."""
        if self._glue is not None:
            return self._glue
        generation = self.config.generation
        if not generation.chat_template:
            self._glue = ("", "", self.config.turn_separator, "")
            return self._glue
        self._glue = glue_texts(
            lambda messages, generation_prompt: self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt),
            lambda role, text: {"role": role, "content": text},
            generation.system_prompt, self.tokenizer.decode([self.sampling.eos_token_ids[0]]), "tokenizer",
        )
        return self._glue

    def first_ids(self, observation: str) -> list[int]:
        """The tokens of an episode's first observation, up to the first generation prompt."""
        return self.encode_prompts([observation])[0]

    def next_ids(self, observation: str, turn_ended_with_eos: bool) -> list[int]:
        """The tokens appended after a turn: the template's close of that turn (the part the
        model did not generate), the observation as the next message, the next generation
        prompt."""
        after_eos, after_cut, before, after = self.glue_texts()
        text = (after_eos if turn_ended_with_eos else after_cut) + before + observation + after
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ protocol

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """One turn for each of the N episodes in ``inputs`` (``text``: the env's new
        observations; ``carry``: each episode's conversation so far (token ids, with ``turn_cache`` its key/value states), None at its start;
        ``active``: the episodes still running — the others generate nothing). Returns the
        turns' texts (without the final EOS) as ``output``, per-token ``logp``/``entropy``/
        ``mask`` [N, K], the replay (module docstring), the grown conversations as ``carry``
        and, as ``end``, the episodes whose history leaves no room for a turn."""
        if not isinstance(inputs, dict) or "text" not in inputs:
            raise ConfigError("policy.type", self.config.type, "takes the env sampler's text observations ({'text': [...], 'carry': ..., 'active': ...})")
        texts = [str(t) for t in inputs["text"]]
        n = len(texts)
        carry = inputs.get("carry") or [None] * n
        active = inputs.get("active")
        active = [True] * n if active is None else [bool(a) for a in torch.as_tensor(active).tolist()]
        budget = self.sampling.max_new_tokens
        width = self.config.max_context_tokens - budget
        cached = self.caches_turns()
        histories, run, end, past = [], [], [], []
        for i, (text, state) in enumerate(zip(texts, carry)):
            # handed over once: the previous Sample's carry lets go of it (ended episodes' too)
            states = state.pop("kv", None) if isinstance(state, dict) else None
            if state is None:
                ids = self.first_ids(text)
            elif active[i]:
                ids = state["ids"] + self.next_ids(text, state["eos"])
            else:  # an ended episode: its conversation stays as it was
                ids = state["ids"]
            histories.append(ids)
            fits = len(ids) <= width
            if active[i] and fits:
                run.append(i)
                past.append(states)
            end.append(active[i] and not fits)
        return self._turn_sample(carry, histories, run, past if cached else None, end, generator, deterministic)

    def _turn_sample(
        self, carry: list, histories: list[list[int]], run: list[int], past: list | None, end: list[bool], generator, deterministic: bool,
        model_inputs: dict | None = None, states: list[dict] | None = None, replay_inputs=None,
    ) -> Sample:
        """The turns of the rows ``run`` generated after their ``histories`` (over their carried
        key/value states ``past`` when the turn cache is on, else None), and the call's Sample:
        the grown conversations as carry (each row's ``states`` entries added: a VLM agent's
        images), the replay (plus ``replay_inputs(turns)``, added before it is scored) and the
        log-probs.
        ``model_inputs``: what the generation pass also hands the model (images)."""
        n, budget = len(histories), self.sampling.max_new_tokens
        width = self.config.max_context_tokens - budget
        turns: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        entropies: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        kept: list = [None] * n
        if run:
            prompts = [histories[i] for i in run]
            extra = {"model_inputs": model_inputs} if model_inputs else {}
            if past is not None:
                generated = self.backend.generate(prompts, self.sampling, generator, deterministic, past=past, keep_cache=True, **extra)
            else:
                generated = self.backend.generate(prompts, self.sampling, generator, deterministic, **extra)
            for k, i in enumerate(run):
                turns[i], logps[i], reasons[i] = generated.token_ids[k], generated.logp[k], generated.finish_reason[k]
                entropies[i] = generated.entropy[k] if generated.entropy is not None else [0.0] * len(turns[i])
                if past is not None and generated.cache is not None:
                    kept[i] = generated.cache[k]
        next_carry = []
        for i in range(n):
            ended_with_eos = reasons[i] == "eos" if reasons[i] is not None else (carry[i]["eos"] if carry[i] is not None else True)
            state = {"ids": histories[i] + turns[i], "eos": ended_with_eos, **(states[i] if states is not None else {})}
            next_carry.append({**state, "kv": kept[i]} if kept[i] is not None else state)
        replay = self._turn_replay([h[-width:] for h in histories], turns, width)
        if replay_inputs is not None:
            replay.update(replay_inputs(turns))
        mask = replay["completion_mask"][:, 0].float()
        if self.config.generation.old_logp == "recompute":
            logp, entropy = self._turn_scores(replay, with_entropy=True)
        else:
            logp, entropy = (torch.tensor([row + [0.0] * (budget - len(row)) for row in values], device=mask.device) for values in (logps, entropies))
        outputs = [self.tokenizer.decode(t[:-1] if reasons[i] == "eos" else t, skip_special_tokens=True) for i, t in enumerate(turns)]
        return Sample(
            output=outputs, logp=logp, replay=replay, mask=mask, entropy=entropy,
            info={"turns": outputs, "finish_reason": reasons},
            logp_deferred=self.config.generation.old_logp == "deferred",
            carry=next_carry,
            end=torch.tensor(end, dtype=torch.bool),
        )

    def _turn_replay(self, prompts: list[list[int]], turns: list[list[int]], width: int) -> dict[str, Tensor]:
        """The replay of one call (module docstring): fixed widths, call dim 1."""
        n, budget, pad = len(prompts), self.sampling.max_new_tokens, self.tokenizer.pad_token_id
        prompt_ids = torch.full((n, width), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, width), dtype=torch.long)
        completion_ids = torch.full((n, budget), pad, dtype=torch.long)
        completion_mask = torch.zeros((n, budget), dtype=torch.long)
        for i, (prompt, turn) in enumerate(zip(prompts, turns)):
            if prompt:
                prompt_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
                prompt_mask[i, width - len(prompt):] = 1
            if turn:
                completion_ids[i, : len(turn)] = torch.tensor(turn, dtype=torch.long)
                completion_mask[i, : len(turn)] = 1
        device = self.device
        replay = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids, "completion_mask": completion_mask}
        return {key: value.unsqueeze(1).to(device) for key, value in replay.items()}

    def _turn_scores(self, replay: dict, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """log q'(token) (and the entropy of q') [B, T·K] of every turn token of a [B, T]
        replay; the turns without tokens (ended episodes, padding) run in no pass."""
        b, t, k = replay["completion_ids"].shape
        flat = {key: replay[key].flatten(0, 1) for key in TEXT_REPLAY}
        rows = (flat["completion_mask"].sum(1) > 0).nonzero().flatten()
        device = self.device
        logp = torch.zeros(b * t, k, device=device)
        entropy = torch.zeros(b * t, k, device=device) if with_entropy else None
        if rows.numel():
            scored, scored_entropy = self.completion_scores({key: value[rows] for key, value in flat.items()}, with_entropy)
            logp = logp.index_put((rows.to(device),), scored)
            if with_entropy:
                entropy = entropy.index_put((rows.to(device),), scored_entropy)
        return logp.view(b, t * k), entropy.view(b, t * k) if entropy is not None else None

    def log_prob(self, replay: dict) -> Tensor:
        """log q'(token) [B, T·K] of every turn token of the replayed turns under the current
        parameters (0 on padding and on turns without tokens)."""
        return self._turn_scores(replay)[0]

    @property
    def value_feature_dim(self) -> int:
        """Width of :meth:`value_features` (``critic.type: value_head``): the LM's hidden size."""
        return int(self.language_model.config.get_text_config().hidden_size)

    def value_features(self, replay: dict) -> Tensor:
        """[B, T·K, hidden]: for each turn token, the LM's last hidden state at the position
        that predicts it (the state of the conversation before the token, as PPO for language
        models reads a value), with its gradient: a value head on it shares the LM. 0 on the
        turns without tokens. GAE runs over these token columns (mmrl.algo.value.TokenLayout)."""
        b, t, k = replay["completion_ids"].shape
        flat = {key: replay[key].flatten(0, 1) for key in TEXT_REPLAY}
        rows = (flat["completion_mask"].sum(1) > 0).nonzero().flatten()
        device = self.device
        width = self.value_feature_dim
        if not rows.numel():
            return torch.zeros(b, t * k, width, device=device)
        part = {key: value[rows].to(device) for key, value in flat.items()}
        prompt, prompt_mask = left_aligned(part["prompt_ids"], part["prompt_mask"], self.tokenizer.pad_token_id)
        ids = torch.cat([prompt, part["completion_ids"]], dim=1)
        mask = torch.cat([prompt_mask, part["completion_mask"].to(prompt_mask.dtype)], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.language_model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True, logits_to_keep=1)
        states = out.hidden_states[-1][:, -k - 1 : -1]  # position P-1+j precedes turn token j
        features = torch.zeros(b * t, k, states.shape[-1], device=device, dtype=states.dtype).index_put((rows.to(device),), states)
        return features.view(b, t * k, -1)

    def sft_loss(self, batch: dict) -> Tensor:
        """Supervised fine-tuning on demonstrated episodes: ``batch["turns"]``, B lists of
        (observation, action) pairs, encoded as the agent's conversations are (each action
        followed by EOS, so the model learns to end a turn); the mean cross-entropy of the
        actions' tokens, in one teacher-forced pass per episode (the observations are context)."""
        eos = self.sampling.eos_token_ids[0]
        sequences, targets = [], []
        for episode in batch["turns"]:
            ids: list[int] = []
            scored: list[int] = []
            for j, (observation, action) in enumerate(episode):
                context = self.first_ids(observation) if j == 0 else self.next_ids(observation, True)
                reply = self.tokenizer(str(action), add_special_tokens=False)["input_ids"] + [eos]
                ids += context + reply
                scored += [0] * len(context) + [1] * len(reply)
            if len(ids) > self.config.max_context_tokens:
                raise ValueError(f"a demonstrated episode of {len(ids)} tokens exceeds policy.max_context_tokens ({self.config.max_context_tokens})")
            sequences.append(ids)
            targets.append(scored)
        width = max(len(s) for s in sequences)
        device = self.device
        ids = torch.full((len(sequences), width), self.tokenizer.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
        scored = torch.zeros((len(sequences), width), dtype=torch.float32, device=device)
        for i, (seq, tgt) in enumerate(zip(sequences, targets)):
            ids[i, : len(seq)] = torch.tensor(seq, device=device)
            mask[i, : len(seq)] = 1
            scored[i, : len(tgt)] = torch.tensor(tgt, dtype=torch.float32, device=device)
        logits = self.forward_logits(ids, mask).float()[:, :-1]
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(len(sequences), -1)
        weight = scored[:, 1:]
        return (ce * weight).sum() / weight.sum().clamp(min=1.0)
