"""Pairwise (Bradley–Terry) reward models over images, image sets and text.

A reward model maps (prompt, item) to a scalar score s. Under the Bradley–Terry model the
probability that item w is preferred to item l for the same prompt is σ(s_w − s_l), so
training on preference pairs minimises

    L = −log σ(s_w − s_l) = softplus(s_l − s_w)                       (:func:`bradley_terry_loss`)

averaged over the batch. That loss is the model's ``sft_loss``: a reward model is a
:class:`~mmrl.core.policy.PolicyModule` that the loop trains with ``algo.type: sft`` on a
``preferences`` data source (``mmrl train-reward``), and whose checkpoints are ordinary
policy directories (config.yaml + model.safetensors). It generates nothing: ``sample`` and
``log_prob`` are errors.

- ``bt_image``: a CNN over one uint8 RGB image (inputs in [−1, 1] plus two coordinate
  planes), every conv layer FiLM-conditioned on a prompt vector (per-channel scale and
  shift), mean- and max-pooled, then an MLP on [image features, prompt vector]. The prompt
  vector is a bidirectional GRU over hashed word embeddings (CRC-32 of each lower-cased word
  into ``prompt.buckets`` rows): no vocabulary file, and held-out prompts that recombine
  known words (the shapes world's compositional split) encode like training ones.
- ``bt_image_set``: the same image tower; a *pairwise* head scores two images of one prompt
  from the symmetric features [f_i + f_j, |f_i − f_j|, prompt], and a set of K images scores
  the mean over its K(K−1)/2 pairs (PaCo-RL: an image set's score averages all its pairs).
  As a reward, sample i of a group scores the mean of its pairs with its group peers.
- ``bt_text``: a tiny ``transformers`` decoder built from a config (random weights) with
  mmrl's byte-level tokenizer, reading ``prompt + separator + completion + EOS``; a linear
  head on the last (EOS) position's hidden state gives the score.
- ``bt_trajectory``: a robot episode given its instruction, for trajectory-level preferences
  as in GRAPE (Zhang et al., 2024: successes over failures, cheaper successes over costlier
  ones). The episode is read as K keyframes (:func:`mmrl.demos.keyframes`): at each, the
  camera images go through the ``bt_image`` tower (FiLM-conditioned on the instruction
  vector; several cameras' features side by side), and with the proprioceptive state, the
  segment's mean action and mean action norm and the keyframe's place k/(K−1) an MLP gives
  a per-keyframe embedding e_k. Pooled over time, [mean_k e_k, max_k e_k, e_K (the last
  observation, which shows the outcome), instruction vector, log T (the episode's length)]
  → MLP → the score.
"""

from __future__ import annotations

import re
import zlib
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmrl.core.policy import PolicyModule
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.policies.reward_model.config import BTImageConfig, BTImageSetConfig, BTTextConfig, BTTrajectoryConfig, PromptEncoderConfig
from mmrl.policies.reward_model.inputs import input_kind
from mmrl.registry import POLICIES

_WORD = re.compile(r"[a-z0-9]+")


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> Tensor:
    """L = mean_n −log σ(s_w,n − s_l,n) = mean_n softplus(s_l,n − s_w,n) (Bradley & Terry, 1952)."""
    return F.softplus(rejected - chosen).mean()


def random_shift(images: Tensor, shift: int) -> Tensor:
    """Images [..., H, W, C] each shifted by up to ``shift`` pixels: edge-padded by
    ``shift``, then cropped back to size at a uniform random offset (DrQ, Kostrikov et al.
    2020). The reward models' augmentation against over-fitting a few dozen labelled
    episodes; ``shift`` 0 returns ``images``."""
    if not shift:
        return images
    shape = images.shape
    x = images.reshape(-1, *shape[-3:]).permute(0, 3, 1, 2).float()  # [M, C, H, W]
    m, _, h, w = x.shape
    padded = F.pad(x, (shift, shift, shift, shift), mode="replicate")
    dy, dx = torch.randint(0, 2 * shift + 1, (2, m), device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # [M, H, 1]
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]  # [M, 1, W]
    cropped = padded[torch.arange(m, device=x.device)[:, None, None], :, rows, cols]  # [M, H, W, C]
    return cropped.to(images.dtype).reshape(shape)


class RewardModel(PolicyModule):
    """Base of the pairwise reward models: ``score`` (prompt, item) → s; ``sft_loss`` is the
    Bradley–Terry loss of a batch of pairs ``{"prompt", "chosen", "rejected"}``.

    ``input_kind`` names the items it scores (``image``: uint8 [N, H, W, 3]; ``image_set``:
    [N, K, H, W, 3]; ``text``: a list of N completions; ``trajectory``: Trajectories), a kind
    registered in :mod:`mmrl.policies.reward_model.inputs`, which says how pair files and
    rollouts become such items; the ``preferences`` data source checks its pairs against it."""

    input_kind: ClassVar[str] = ""

    def score(self, prompts: list[str], items: Any) -> Tensor:
        raise NotImplementedError

    def group_scores(self, prompts: list[str], items: Any, group_id: Tensor) -> Tensor:
        """One score per sample of a rollout whose groups share a prompt (the reward's
        pointwise score): the sample's own score; the set model overrides it."""
        return self.score(prompts, items)

    def sft_loss(self, batch: dict[str, Any]) -> Tensor:
        n = len(batch["prompt"])
        prompts = list(batch["prompt"]) * 2
        chosen, rejected = batch["chosen"], batch["rejected"]
        # tensors concatenate with cat; lists of texts and Trajectories with +
        items = torch.cat([chosen, rejected]) if isinstance(chosen, Tensor) else chosen + rejected
        if self.training:
            items = self.augment(items)
        scores = self.score(prompts, items)  # one pass over both sides (one forward for DDP)
        return bradley_terry_loss(scores[:n], scores[n:])

    def augment(self, items: Any) -> Any:
        """Training items [2N, ...] (chosen then rejected) as the loss sees them: unchanged
        here; the image models mirror them with ``hflip``."""
        return items

    def sample(self, inputs, generator=None, deterministic: bool = False):
        raise ConfigError("policy.type", self.config.type, "is a reward model: it scores samples and generates none; train it with `mmrl train-reward` and use it through the pairwise_preference reward")

    def log_prob(self, replay):
        raise ConfigError("policy.type", self.config.type, "is a reward model: it has no decisions to take log-probs of; train it with `mmrl train-reward`")

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


def contract_pairs(model: RewardModel, generator: torch.Generator) -> dict[str, Any]:
    """Two preference pairs of random items of the kind ``model`` scores, as the
    ``preferences`` data source gives them ({"prompt", "chosen", "rejected"}): the supervised
    batch of the reward models' ``contract`` (tests/policies/test_contract.py); the items are
    the input kind's (:meth:`~mmrl.policies.reward_model.inputs.InputKind.contract_pair`)."""
    chosen, rejected = input_kind(model.input_kind, f"{model.config.type}.input_kind").contract_pair(model.config, generator)
    return {"prompt": ["a red circle left of a square", "push the blue block up"], "chosen": chosen, "rejected": rejected}


# ---------------------------------------------------------------- images


class PromptEncoder(nn.Module):
    """Hashed word embeddings → bidirectional GRU → [N, 2·dim] (both directions' last states)."""

    def __init__(self, cfg: PromptEncoderConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.buckets + 1, cfg.dim, padding_idx=0)
        self.gru = nn.GRU(cfg.dim, cfg.dim, batch_first=True, bidirectional=True)
        self.out_dim = 2 * cfg.dim

    def ids(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        cfg = self.config
        rows = [[zlib.crc32(w.encode()) % cfg.buckets + 1 for w in _WORD.findall(p.lower())][: cfg.max_words] or [0] for p in prompts]
        ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        return ids, torch.tensor([len(r) for r in rows])

    def forward(self, prompts: list[str]) -> Tensor:
        unique = list(dict.fromkeys(prompts))  # a rollout repeats each prompt G times
        ids, lengths = self.ids(unique)
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(ids.to(self.embed.weight.device)), lengths, batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)  # [2, U, dim]
        vectors = torch.cat([h[0], h[1]], dim=-1)
        index = {p: i for i, p in enumerate(unique)}
        return vectors[torch.tensor([index[p] for p in prompts], device=vectors.device)]


class ImageTower(nn.Module):
    """uint8 images [N, H, W, 3] + prompt vectors [N, P] → pooled features [N, 2·C_last]."""

    def __init__(self, cfg: BTImageConfig, prompt_dim: int):
        super().__init__()
        self.image_size = cfg.image_size
        self.convs, self.norms, self.films = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        c_in = 5  # RGB + x/y coordinate planes (relations: where an object lies matters)
        for c, stride in zip(cfg.channels, cfg.strides or [2] * len(cfg.channels)):
            self.convs.append(nn.Conv2d(c_in, c, 3, stride=stride, padding=1))
            self.norms.append(nn.GroupNorm(1, c))
            self.films.append(nn.Linear(prompt_dim, 2 * c))
            c_in = c
        self.out_dim = 2 * c_in

    def forward(self, images: Tensor, prompt: Tensor) -> Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[-1] != 3 or images.shape[1:3] != (self.image_size, self.image_size):
            raise ValueError(f"the reward model scores uint8 RGB images [N, {self.image_size}, {self.image_size}, 3]; got {images.dtype} {tuple(images.shape)}")
        x = images.to(prompt.device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        n, _, h, w = x.shape
        ys = torch.linspace(-1, 1, h, device=x.device)[:, None].expand(h, w)
        xs = torch.linspace(-1, 1, w, device=x.device)[None, :].expand(h, w)
        x = torch.cat([x, torch.stack([xs, ys]).expand(n, 2, h, w)], dim=1)
        for conv, norm, film in zip(self.convs, self.norms, self.films):
            scale, shift = film(prompt).chunk(2, dim=-1)
            x = F.relu(norm(conv(x)) * (1 + scale[:, :, None, None]) + shift[:, :, None, None])
        return torch.cat([x.mean(dim=(2, 3)), x.amax(dim=(2, 3))], dim=1)


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, computes its supervised loss on the batch ``sft_batch`` names and round-trips its weights.
BT_IMAGE_CONTRACT = {"policy": {"type": "bt_image", "image_size": 16, "channels": [8, 16], "hidden": 16, "prompt": {"dim": 8, "buckets": 64}}, "sft_batch": "mmrl.policies.reward_model.model:contract_pairs"}


@POLICIES.register("bt_image", config=BTImageConfig, contract=BT_IMAGE_CONTRACT)
class BTImageModel(RewardModel):
    """Bradley–Terry reward model of one image given its prompt: FiLM-conditioned CNN + MLP."""

    input_kind = "image"

    def __init__(self, config: BTImageConfig, spec: dict | None = None):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec or {})
        self.prompt = PromptEncoder(config.prompt)
        self.tower = ImageTower(config, self.prompt.out_dim)
        self.head = nn.Sequential(nn.Linear(self._head_in(), config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1))

    def _head_in(self) -> int:
        return self.tower.out_dim + self.prompt.out_dim

    def augment(self, items: Tensor) -> Tensor:
        """With ``hflip``: each image (or set) mirrored left-right with probability 1/2 (W is
        the axis before RGB)."""
        if not self.config.hflip:
            return items
        flip = torch.rand(items.shape[0]) < 0.5
        return torch.where(flip.view(-1, *[1] * (items.dim() - 1)), items.flip(-2), items)

    def score(self, prompts: list[str], items: Tensor) -> Tensor:
        p = self.prompt(list(prompts))
        return self.head(torch.cat([self.tower(items, p), p], dim=1)).squeeze(-1)


BT_IMAGE_SET_CONTRACT = {"policy": {"type": "bt_image_set", "image_size": 16, "channels": [8, 16], "hidden": 16, "prompt": {"dim": 8, "buckets": 64}}, "sft_batch": "mmrl.policies.reward_model.model:contract_pairs"}


@POLICIES.register("bt_image_set", config=BTImageSetConfig, contract=BT_IMAGE_SET_CONTRACT)
class BTImageSetModel(BTImageModel):
    """Bradley–Terry reward model of an image set for one prompt: the mean pairwise score over its pairs."""

    input_kind = "image_set"

    def _head_in(self) -> int:
        return 2 * self.tower.out_dim + self.prompt.out_dim

    def pair_scores(self, features: Tensor, prompt: Tensor) -> Tensor:
        """f(i, j) for every pair of K images of each of N prompts: features [N, K, D],
        prompt [N, P] → [N, K, K], symmetric (the pair features are)."""
        n, k, d = features.shape
        a, b = features[:, :, None].expand(n, k, k, d), features[:, None, :].expand(n, k, k, d)
        p = prompt[:, None, None].expand(n, k, k, prompt.shape[-1])
        return self.head(torch.cat([a + b, (a - b).abs(), p], dim=-1)).squeeze(-1)

    def _features(self, prompts: list[str], images: Tensor) -> tuple[Tensor, Tensor]:
        n, k = images.shape[:2]
        p = self.prompt(list(prompts))
        features = self.tower(images.reshape(n * k, *images.shape[2:]), p.repeat_interleave(k, dim=0))
        return features.reshape(n, k, -1), p

    def score(self, prompts: list[str], items: Tensor) -> Tensor:
        if items.dim() != 5 or items.shape[1] < 2:
            raise ValueError(f"bt_image_set scores sets of at least 2 images, uint8 [N, K, H, W, 3]; got shape {tuple(items.shape)}")
        features, p = self._features(prompts, items)
        k = items.shape[1]
        upper = torch.triu(torch.ones(k, k, dtype=torch.bool, device=features.device), diagonal=1)
        return self.pair_scores(features, p)[:, upper].mean(-1)

    def group_scores(self, prompts: list[str], items: Tensor, group_id: Tensor) -> Tensor:
        """s_i = mean over i's group peers j ≠ i of f(i, j); the mean of s_i over a group is
        the group's set score. A group of one scores 0."""
        p = self.prompt(list(prompts))
        features = self.tower(items, p)
        out = torch.zeros(len(prompts), device=features.device)
        group_id = group_id.to(features.device)
        for g in group_id.unique():
            rows = (group_id == g).nonzero().flatten()
            if len(rows) < 2:
                continue
            pairs = self.pair_scores(features[rows][None], p[rows[:1]])[0]
            off = ~torch.eye(len(rows), dtype=torch.bool, device=pairs.device)
            out[rows] = (pairs * off).sum(1) / (len(rows) - 1)
        return out


# ---------------------------------------------------------------- text


BT_TEXT_CONTRACT = {
    "policy": {"type": "bt_text", "max_length": 32,
               "tiny": {"hidden_size": 16, "num_heads": 2, "num_layers": 1, "intermediate_size": 32, "max_position_embeddings": 32}},
    "sft_batch": "mmrl.policies.reward_model.model:contract_pairs",
}


@POLICIES.register("bt_text", config=BTTextConfig, contract=BT_TEXT_CONTRACT)
class BTTextModel(RewardModel):
    """Bradley–Terry reward model of a completion given its prompt: tiny decoder + scalar head."""

    input_kind = "text"

    def __init__(self, config: BTTextConfig, spec: dict | None = None):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec or {})
        try:
            import transformers

            from mmrl.policies.tiny_tokenizers import byte_tokenizer
        except ImportError:
            raise MissingExtraError("transformers", "text", "the text reward model") from None
        self.tokenizer = byte_tokenizer()
        tiny = config.tiny
        model_config = transformers.AutoConfig.for_model(
            tiny.arch, hidden_size=tiny.hidden_size, num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
            num_key_value_heads=tiny.num_kv_heads or tiny.num_heads, head_dim=tiny.hidden_size // tiny.num_heads,
            intermediate_size=tiny.intermediate_size, max_position_embeddings=tiny.max_position_embeddings, vocab_size=len(self.tokenizer),
            pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id, bos_token_id=None,
        )
        for name, value in vars(model_config).items():  # deterministic scores: no dropout
            if "dropout" in name and isinstance(value, float):
                setattr(model_config, name, 0.0)
        self.backbone = transformers.AutoModel.from_config(model_config, attn_implementation=config.attn_implementation)
        self.head = nn.Linear(tiny.hidden_size, 1)

    def encode(self, prompts: list[str], completions: list[str]) -> tuple[Tensor, Tensor]:
        """Right-padded ids [N, L] and mask of ``prompt + separator + completion + EOS``, the
        last ``max_length`` tokens of each."""
        texts = [f"{p}{self.config.separator}{c}" for p, c in zip(prompts, completions)]
        eos = self.tokenizer.eos_token_id
        rows = [(ids + [eos])[-self.config.max_length :] for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        ids = torch.full((len(rows), max(len(r) for r in rows)), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return ids, mask

    def score(self, prompts: list[str], items: list[str]) -> Tensor:
        if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) for t in items):
            raise ValueError(f"bt_text scores completions given as a list of strings; got {type(items).__name__}")
        ids, mask = self.encode(list(prompts), list(items))
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(ids), device=ids.device), mask.sum(1) - 1]
        return self.head(last).squeeze(-1)


# ---------------------------------------------------------------- robot episodes


BT_TRAJECTORY_CONTRACT = {
    "policy": {"type": "bt_trajectory", "frames": 3, "image_size": 16, "channels": [8], "hidden": 16, "shift": 1, "prompt": {"dim": 8, "buckets": 64}},
    "sft_batch": "mmrl.policies.reward_model.model:contract_pairs",
}


@POLICIES.register("bt_trajectory", config=BTTrajectoryConfig, contract=BT_TRAJECTORY_CONTRACT)
class BTTrajectoryModel(RewardModel):
    """Bradley–Terry reward model of a robot episode given its instruction: keyframes, state and actions pooled over time.

    Keyframe CNN + state and actions → per-keyframe embeddings pooled over time → MLP (see
    the module docstring). Items are :class:`~mmrl.demos.Trajectories`."""

    input_kind = "trajectory"

    def __init__(self, config: BTTrajectoryConfig, spec: dict | None = None):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec or {})
        self.prompt = PromptEncoder(config.prompt)
        self.tower = ImageTower(config, self.prompt.out_dim)
        step_in = config.cameras * self.tower.out_dim + config.state_dim + config.action_dim + 1 + 1
        self.step = nn.Sequential(nn.Linear(step_in, config.hidden), nn.ReLU(), nn.Linear(config.hidden, config.hidden), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(3 * config.hidden + self.prompt.out_dim + 1, config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1))

    def augment(self, items):
        """With ``shift``: every keyframe image shifted by up to ``shift`` pixels, each
        apart (:func:`random_shift`); state and actions unchanged."""
        from mmrl.demos import Trajectories

        if not self.config.shift:
            return items
        store = items.gather("cpu")
        return Trajectories({**store, "image": random_shift(store["image"], self.config.shift)})

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per episode, the shapes of the keyframe tensors this model reads."""
        c = self.config
        image = (c.frames, c.image_size, c.image_size, 3) if c.cameras == 1 else (c.frames, c.cameras, c.image_size, c.image_size, 3)
        return {"image": image, "state": (c.frames, c.state_dim), "action": (c.frames, c.action_dim + 1)}

    def check_shapes(self, store: dict[str, Tensor], source: str) -> None:
        """A ConfigError naming both shapes unless ``store``'s episodes are what the model reads."""
        for key, want in self.expected_shapes().items():
            got = tuple(store[key].shape[1:])
            if got != want:
                c = self.config
                raise ConfigError(
                    source, f"{key} {list(got)}",
                    f"the bt_trajectory model reads {key} of shape {list(want)} per episode (frames {c.frames}, cameras {c.cameras}, image_size {c.image_size}, "
                    f"state_dim {c.state_dim}, action_dim {c.action_dim} + 1 for the action norm); train it on episodes of this env or match sampler.keep_frames to its frames",
                )

    def score(self, prompts: list[str], items) -> Tensor:
        from mmrl.demos import Trajectories

        if not isinstance(items, Trajectories):
            raise ValueError(f"bt_trajectory scores episodes given as mmrl.demos.Trajectories; got {type(items).__name__}")
        self.check_shapes(items.store, "trajectory")
        batch = items.gather(self.device)
        c = self.config
        n, k = len(items), c.frames
        p = self.prompt(list(prompts))
        images = batch["image"].reshape(n * k * c.cameras, c.image_size, c.image_size, 3)
        features = self.tower(images, p.repeat_interleave(k * c.cameras, dim=0)).reshape(n, k, -1)
        place = torch.linspace(0, 1, k, device=p.device)[None, :, None].expand(n, k, 1)
        steps = self.step(torch.cat([features, batch["state"].float(), batch["action"].float(), place], dim=-1))  # [N, K, hidden]
        length = torch.log(batch["length"].float().clamp_min(1))[:, None]
        pooled = torch.cat([steps.mean(1), steps.amax(1), steps[:, -1], p, length], dim=-1)
        return self.head(pooled).squeeze(-1)
