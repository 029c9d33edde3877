"""``vlm_agent``: a vision-language model acting in a gymnasium env whose observations are
text and images, one turn per decision (docs/agents_vlm.md).

It is ``text_agent`` (the turns, the carried conversation, the masks, the limits, the
key/value cache across turns) over ``text_vlm``'s model (a tiny LLaVA built from a
``transformers`` config with random weights, or ``model_path``: a local ``save_pretrained``
LLaVA-family model and its processor); the class derives from both and adds what images
change. The env sampler hands it ``{"text": [N], "image": uint8 [N, H, W, 3] (or [N, K, H,
W, 3]), "carry", "active"}`` (``mmrl/MiniGridText-v0``'s Dict observation).

**The conversation is token ids and images, and only grows.** An observation is a user
message whose content is its images, then its text, rendered by the processor's chat template
(or, with ``chat_template: false``, ``turn_separator``, one image placeholder per image, the
text). The text that joins a reply to the next observation and the observation to the next
generation prompt is worked out once per image count from two renderings (as text_agent
does), with the image parts inside, so the placeholders sit where the template puts them. Each
new observation is encoded on its own by the processor with its images, which expands each
placeholder exactly as it does for that image, and appended; earlier turns are never
re-tokenized. The episode's images travel with its ids in ``Sample.carry``, as the processor's
per-image tensors (``pixel_values`` [3, S, S] for LLaVA), in the order of their placeholders.

**Replay per turn** (call dim 1; fixed widths, so that waves and steps concatenate):

    prompt_ids [N, 1, C − K], prompt_mask      the history before the turn, as text_agent's
    completion_ids [N, 1, K], completion_mask  the turn
    pixel_values [N, 1, M, ...]                the history's images in order (zeros past them)
    image_count [N, 1]                         how many of the M slots hold an image (0 for a row without a turn)

with M = ``max_images`` (null: the most images ``max_context_tokens − max_new_tokens`` can
hold, at the processor's tokens per image). ``log_prob`` flattens [B, T] to rows, keeps the
rows with a turn and scores them as ``text_vlm`` scores prompts with images (one
teacher-forced pass per bucket of similar lengths, every valid image of a row handed to the
model in row order), so a recompute at the sampling weights repeats the sampling pass:
ratio 1. An episode whose next observation would pass M images ends there, truncated, as one
whose history passes the context.

**The key/value cache across turns** falls out of text_agent's: LLaVA merges the image
features into the input embeddings, so the carried key/value states of a conversation hold
its earlier images already. A turn prefills only its new tokens (the last token generated,
the new observation with its image tokens) and hands the model only the new observation's
images; a row without carried states (its first turn) gets all its images. Models whose
rotary positions follow the image layout (Qwen2-VL's multimodal RoPE) re-encode the whole
conversation every turn instead (a cached prefix loses the positions' offset).

**SFT** (``sft_loss``) takes episodes of (observation, action) turns whose observation is a
text or ``{"text": ..., "image": uint8 [H, W, 3] or [K, H, W, 3]}``, encoded as sampling
encodes them; the ``conversations`` data source reads them with their images from PNG files
beside its ``.jsonl`` (``python -m mmrl.tasks.minigrid_text.demos`` writes such demonstrations).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.core.policy import Sample
from mmrl.errors import ConfigError
from mmrl.policies.conversation import glue_texts
from mmrl.policies.text_agent.model import TextAgentPolicy
from mmrl.policies.text_lm.model import TEXT_REPLAY, TextLMPolicy
from mmrl.policies.text_vlm.model import TOKEN_OUTPUTS, TextVLMPolicy, per_image
from mmrl.policies.vlm_agent.config import VLMAgentConfig
from mmrl.registry import POLICIES

CONTRACT = {
    "train": {
        "env": {"type": "gym", "id": "mmrl/MiniGridText-v0", "num_envs": 4, "max_episode_steps": 3},
        "sampler": {"type": "env"},
        "policy": {"type": "vlm_agent", "tiny": {"hidden_size": 16, "num_heads": 2, "intermediate_size": 32}, "generation": {"max_new_tokens": 4}, "max_context_tokens": 512},
        "rewards": [{"type": "success"}],
    },
    "ratio_atol": 1e-4,
    "ratio_why": (
        "the old log-probs are deferred (the trainer's ratio is exactly 1); the provisional numbers are the key/value-cache decoding "
        "loop's, over a prefix prefilled turn by turn, which sums each token's float32 logits in another order than log_prob's one "
        "teacher-forced pass (as text_agent's and text_vlm's). Measured: 0 to 4.8e-7 over seeds 0-4 under ATEN_CPU_CAPABILITY "
        "default, avx2 and avx512"
    ),
}

Images = tuple  # one observation's images: uint8 arrays [H, W, 3]


@POLICIES.register("vlm_agent", config=VLMAgentConfig, contract=CONTRACT)
class VLMAgentPolicy(TextAgentPolicy, TextVLMPolicy):
    """A vision-language model whose decision is a turn in an env of text-and-image
    observations; the conversation (token ids and images) is its carried state."""

    config: VLMAgentConfig

    def __init__(self, config: VLMAgentConfig, spec: dict):
        self._glues: dict[int, tuple[str, str, str, str]] = {}
        self._slots: int | None = None
        super().__init__(config, spec)  # text_agent's checks, text_vlm's model
        parameters = inspect.signature(self.backend.generate).parameters
        if "model_inputs" not in parameters and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            raise ConfigError("policy.generation.backend", config.generation.backend, "its generate takes no model_inputs=, through which vlm_agent hands the model each turn's images: use builtin or a backend that takes them")

    def caches_turns(self) -> bool:
        """text_agent's test, and not a model with multimodal rotary positions (module docstring)."""
        return super().caches_turns() and not self._multimodal_rope

    # ------------------------------------------------------------------ the conversation

    def _message(self, role: str, text: str, num_images: int = 0) -> dict:
        return {"role": role, "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}

    def glue_texts(self, num_images: int = 1) -> tuple[str, str, str, str]:
        """text_agent's glue (after a turn that ended with EOS, after a turn cut without it,
        before an observation, after an observation) for an observation of ``num_images``
        images, rendered by the processor's chat template: the image placeholders are in the
        part before or after the observation's text, where the template puts them."""
        if num_images in self._glues:
            return self._glues[num_images]
        generation = self.config.generation
        if not generation.chat_template:
            glue = ("", "", self.config.turn_separator + self._image_placeholder() * num_images, "")
        else:
            glue = glue_texts(
                lambda messages, generation_prompt: self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt),
                lambda role, text: self._message(role, text, num_images if role == "user" else 0),
                generation.system_prompt, self.tokenizer.decode([self.sampling.eos_token_ids[0]]), "processor",
            )
        self._glues[num_images] = glue
        return glue

    def encode_observations(self, observations: list[tuple[str, Images, bool | None]]) -> list[tuple[list[int], list[dict[str, Tensor]]]]:
        """(token ids, per-image tensors) of each (text, images, how the previous turn ended:
        True with EOS, False cut, None for an episode's first observation): the first
        observation as text_vlm encodes a prompt (up to the first generation prompt), a later
        one as the glue after that turn, the observation as the next user message, the next
        generation prompt. The processor expands each image's placeholder and makes its
        tensors; the observations run in (at most) two processor calls."""
        out: list = [None] * len(observations)
        for first in (True, False):
            rows = [i for i, (_, _, eos) in enumerate(observations) if (eos is None) == first]
            if not rows:
                continue
            texts, images = [], []
            for i in rows:
                text, pictures, eos = observations[i]
                if first:
                    texts.append(self._prompt_text(text, len(pictures)))
                else:
                    after_eos, after_cut, before, after = self.glue_texts(len(pictures))
                    texts.append((after_eos if eos else after_cut) + before + text + after)
                images.extend(pictures)
            encoded = self.processor(
                text=texts, images=images or None, padding=True, return_tensors="pt",
                add_special_tokens=first and not self.config.generation.chat_template,
            )
            image_tensors = per_image(encoded, len(images)) if images else {}
            start = 0
            for row, i in enumerate(rows):
                count = len(observations[i][1])
                ids = encoded["input_ids"][row][encoded["attention_mask"][row].bool()].tolist()
                entries = [{name: value[start + j] for name, value in image_tensors.items() if name not in TOKEN_OUTPUTS} for j in range(count)]
                out[i] = (ids, entries)
                start += count
        return out

    def first_ids(self, observation: str) -> list[int]:
        """The tokens of a first observation without images (text_agent's interface)."""
        return self.encode_observations([(observation, (), None)])[0][0]

    def next_ids(self, observation: str, turn_ended_with_eos: bool) -> list[int]:
        """The tokens appended for a later observation without images (text_agent's interface)."""
        return self.encode_observations([(observation, (), bool(turn_ended_with_eos))])[0][0]

    def image_slots(self) -> int:
        """M, the image slots of a turn's replay: ``max_images``, at most what the history
        (``max_context_tokens − max_new_tokens``) holds at the processor's tokens per image."""
        if self._slots is None:
            blank = np.zeros((64, 64, 3), dtype=np.uint8)
            ids = self.processor(text=[self._image_placeholder()], images=[blank], return_tensors="pt")["input_ids"][0]
            tokens_per_image = max(1, int(torch.isin(ids, self._placeholder_ids).sum()))
            fit = max(1, (self.config.max_context_tokens - self.sampling.max_new_tokens) // tokens_per_image)
            self._slots = min(self.config.max_images or fit, fit)
        return self._slots

    @staticmethod
    def _row_images(images, i: int) -> Images:
        """Row i's images of the env sampler's ``image`` ([N, H, W, 3] or [N, K, H, W, 3]) as uint8 arrays."""
        if images is None:
            return ()
        row = images[i]
        row = row.detach().cpu().numpy() if isinstance(row, Tensor) else np.asarray(row)
        return tuple(row) if row.ndim == 4 else (row,)

    def _stack_images(self, rows: list[list[dict[str, Tensor]]], width: int) -> dict[str, Tensor]:
        """Per-row image tensors [R, width, ...] (zeros past a row's images) and ``image_count`` [R]."""
        like = next((row[0] for row in rows if row), None)
        shapes = {name: (tuple(v.shape), v.dtype) for name, v in like.items()} if like is not None else self._image_outputs()
        out = {name: torch.zeros((len(rows), width, *shape), dtype=dtype) for name, (shape, dtype) in shapes.items()}
        for r, row in enumerate(rows):
            for j, entry in enumerate(row):
                for name, value in entry.items():
                    if tuple(value.shape) != tuple(out[name].shape[2:]):
                        raise ValueError(f"image {j} of row {r} gives {name} of shape {tuple(value.shape)}, the others {tuple(out[name].shape[2:])}: vlm_agent's replay takes images of one size")
                    out[name][r, j] = value
        out["image_count"] = torch.tensor([len(row) for row in rows], dtype=torch.long)
        return out

    # ------------------------------------------------------------------ protocol

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """One turn for each of the N episodes in ``inputs`` (``text`` and ``image``: the env's
        new observations; ``carry``: each episode's conversation so far — token ids, images,
        with the turn cache its key/value states — None at its start; ``active``: the episodes
        still running). Returns what text_agent's ``sample`` returns, the replay with the
        history's images (module docstring)."""
        if not isinstance(inputs, dict) or "text" not in inputs:
            raise ConfigError("policy.type", self.config.type, "takes the env sampler's text-and-image observations ({'text': [...], 'image': ..., 'carry': ..., 'active': ...})")
        texts = [str(t) for t in inputs["text"]]
        n = len(texts)
        carry = inputs.get("carry") or [None] * n
        active = inputs.get("active")
        active = [True] * n if active is None else [bool(a) for a in torch.as_tensor(active).tolist()]
        budget, slots = self.sampling.max_new_tokens, self.image_slots()
        width = self.config.max_context_tokens - budget
        cached = self.caches_turns()
        states = [state.pop("kv", None) if isinstance(state, dict) else None for state in carry]  # handed over once
        new = [i for i in range(n) if carry[i] is None or active[i]]
        encoded = dict(zip(new, self.encode_observations([(texts[i], self._row_images(inputs.get("image"), i), None if carry[i] is None else carry[i]["eos"]) for i in new])))
        histories, pictures, run, fresh, past, end = [], [], [], [], [], []
        for i in range(n):
            state = carry[i]
            ids, images = (state["ids"], list(state["images"])) if state is not None else ([], [])
            if i in encoded:  # an ended episode's conversation stays as it was
                ids, images = ids + encoded[i][0], images + encoded[i][1]
            histories.append(ids)
            pictures.append(images)
            fits = len(ids) <= width and len(images) <= slots
            if active[i] and fits:
                run.append(i)
                past.append(states[i])
                # a row prefilled over its carried states takes only the new observation's images
                fresh.append(encoded[i][1] if cached and states[i] is not None else images)
            end.append(active[i] and not fits)
        most = max((len(images) for images in fresh), default=0)

        def replay_images(turns):  # the history's images of each row that took a turn
            images = self._stack_images([pictures[i] if turns[i] else [] for i in range(n)], slots)
            return {name: value.unsqueeze(1).to(self.device) for name, value in images.items()}

        return self._turn_sample(
            carry, histories, run, past if cached else None, end, generator, deterministic,
            model_inputs=self._stack_images(fresh, most) if most else None, states=[{"images": images} for images in pictures], replay_inputs=replay_images,
        )

    def _turn_scores(self, replay: dict, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """text_agent's scores of a [B, T] replay, the image tensors riding along: the turns
        with tokens, flattened to rows, go through text_lm's teacher-forced passes, which hand
        each row's valid images to the model."""
        b, t, k = replay["completion_ids"].shape
        keys = (*TEXT_REPLAY, "image_count", *(name for name in replay if name in self._image_outputs()))
        flat = {key: replay[key].flatten(0, 1) for key in keys}
        rows = (flat["completion_mask"].sum(1) > 0).nonzero().flatten()
        device = self.device
        logp = torch.zeros(b * t, k, device=device)
        entropy = torch.zeros(b * t, k, device=device) if with_entropy else None
        if rows.numel():
            picked = {key: value[rows.to(value.device)] for key, value in flat.items()}
            most = max(1, int(picked["image_count"].max()))  # the rows' images, not all M slots
            picked.update({key: value[:, :most] for key, value in picked.items() if key in self._image_outputs()})
            scored, scored_entropy = TextLMPolicy.completion_scores(self, picked, with_entropy)
            logp = logp.index_put((rows.to(device),), scored)
            if with_entropy:
                entropy = entropy.index_put((rows.to(device),), scored_entropy)
        return logp.view(b, t * k), entropy.view(b, t * k) if entropy is not None else None

    @staticmethod
    def _observation_parts(observation) -> tuple[str, Images]:
        if isinstance(observation, dict):
            image = observation.get("image")
            return str(observation["text"]), VLMAgentPolicy._row_images(None if image is None else [image], 0)
        return str(observation), ()

    def sft_loss(self, batch: dict) -> Tensor:
        """text_agent's SFT on demonstrated episodes (``batch["turns"]``: B lists of
        (observation, action) pairs), with each observation a text or ``{"text", "image"}``:
        the episode is encoded as sampling encodes it, its images handed to the model in
        order, and the mean cross-entropy of the actions' tokens (each followed by EOS) is
        taken in one teacher-forced pass."""
        eos = self.sampling.eos_token_ids[0]
        sequences, targets, pictures = [], [], []
        for episode in batch["turns"]:
            parts = [self._observation_parts(observation) for observation, _ in episode]
            contexts = self.encode_observations([(text, images, None if j == 0 else True) for j, (text, images) in enumerate(parts)])
            ids: list[int] = []
            scored: list[int] = []
            images: list = []
            for (context, entries), (_, action) in zip(contexts, episode):
                reply = self.tokenizer(str(action), add_special_tokens=False)["input_ids"] + [eos]
                ids += context + reply
                scored += [0] * len(context) + [1] * len(reply)
                images += entries
            if len(ids) > self.config.max_context_tokens:
                raise ValueError(f"a demonstrated episode of {len(ids)} tokens exceeds policy.max_context_tokens ({self.config.max_context_tokens})")
            sequences.append(ids)
            targets.append(scored)
            pictures.append(images)
        width = max(len(s) for s in sequences)
        device = self.device
        ids = torch.full((len(sequences), width), self.tokenizer.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
        scored = torch.zeros((len(sequences), width), dtype=torch.float32, device=device)
        for i, (seq, tgt) in enumerate(zip(sequences, targets)):
            ids[i, : len(seq)] = torch.tensor(seq, device=device)
            mask[i, : len(seq)] = 1
            scored[i, : len(tgt)] = torch.tensor(tgt, dtype=torch.float32, device=device)
        most = max(len(images) for images in pictures)
        image_inputs = {k: v.to(device) for k, v in self._stack_images(pictures, most).items()} if most else {}
        logits = self.forward_logits(ids, mask, **image_inputs).float()[:, :-1]
        # only the actions' positions: an image token's logit is −inf, and 0 · ∞ would be NaN
        at = scored[:, 1:].bool()
        return nn.functional.cross_entropy(logits[at], ids[:, 1:][at], reduction="sum") / at.sum().clamp(min=1)
