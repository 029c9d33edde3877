"""Reward models image-RL users train with, loaded from local directories: PickScore,
CLIPScore, the LAION aesthetic predictor v2 and HPSv2 / HPSv2.1.

Every one of them is a CLIP model: an image tower and (but for the aesthetic predictor) a
text tower whose projected, L2-normalized features are compared. Each reward is built once
per run, loads its weights from local files only (nothing is fetched from a model hub), keeps
the model frozen (eval mode, no gradients) on the reward's device (``device``, else the
training device) in ``dtype``, and scores the rollout's images in batches of ``batch_size``
under ``torch.no_grad``. Images come from ``rollout.info["images"]`` (uint8 [B, H, W, 3], RGB:
:func:`mmrl.rewards.images.rollout_images`), prompts from ``rollout.info["prompt"]``. Scores
come back as float32 on the CPU whatever the model's dtype.

Notation: f_I = the projected image features (``get_image_features``), f_T = the projected
text features of the prompt (``get_text_features``), cos = <f_I, f_T> / (|f_I| |f_T|).

- ``pickscore`` (Kirstain et al. 2023, "Pick-a-Pic: An Open Dataset of User Preferences for
  Text-to-Image Generation", arXiv:2305.01569): r = exp(logit_scale) · cos / ``scale``, the
  model's own temperature times the cosine, as the PickScore repository's inference example
  computes it and as Flow-GRPO's ``PickScoreScorer`` (``flow_grpo/pickscore_scorer.py``,
  yifan123/flow_grpo commit ac4c86e) does: the processor of
  ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (``processor_path``) on the images and on the prompt
  (``padding=True, truncation=True, max_length=77``), ``get_image_features`` /
  ``get_text_features`` L2-normalized, ``logit_scale.exp() * (text @ image.T)``, the diagonal;
  Flow-GRPO then divides by 26 ("norm to 0-1"): ``scale: 26`` reproduces its reward, the default
  1 gives the raw PickScore (about 20-23 for ordinary images).
- ``clip_score``, two variants:

  * ``hessel`` (Hessel et al. 2021, "CLIPScore: A Reference-free Evaluation Metric for Image
    Captioning", arXiv:2104.08718; ``clipscore.py`` of jmhessel/clipscore):
    r = w · max(cos, 0), w = 2.5, the caption prefixed with "A photo depicts " (the repository's
    ``CLIPCapDataset(prefix='A photo depicts')``), truncated to the context; images through the
    directory's processor (the repository's Resize(224, bicubic) + CenterCrop + CLIP's mean/std).
  * ``flow_grpo`` (Flow-GRPO's ``ClipScorer``, ``flow_grpo/clip_scorer.py``, added with its
    2025-07-28 CLIPScore reward; "based on imscore"): r = ``logits_per_image.diagonal() / 30``
    = exp(logit_scale) · cos / 30 (exp(logit_scale) = 100 for OpenAI's CLIP, so 10/3 · cos), no
    clipping at 0 and no prefix. Its images do not go through the processor: the float pixels
    in [0, 1] go through torchvision ``Resize(size["shortest_edge"])`` — *bilinear* with
    antialiasing, torchvision's default, though the processor's config says bicubic —
    ``CenterCrop(crop_size)`` and ``Normalize(image_mean, image_std)``, all read from the
    processor's config (``get_image_transform``); this module computes that transform with
    ``torch.nn.functional.interpolate`` (torchvision is not needed).
- ``aesthetic``: the LAION aesthetic predictor v2 ("improved aesthetic predictor",
  christophschuhmann/improved-aesthetic-predictor ``simple_inference.py``, as Flow-GRPO's
  ``AestheticScorer``, ``flow_grpo/aesthetic_scorer.py``, runs it with transformers):
  r = MLP(f_I / |f_I|), the image features of CLIP ViT-L/14 (``openai/clip-vit-large-patch14``
  through its own processor), L2-normalized, into the MLP head
  Linear(768, 1024) → Dropout(0.2) → Linear(1024, 128) → Dropout(0.2) → Linear(128, 64) →
  Dropout(0.1) → Linear(64, 16) → Linear(16, 1) (no activations; dropout is off in eval), whose
  state dict has the keys ``layers.{0,2,4,6,7}.{weight,bias}``
  (``sac+logos+ava1-l14-linearMSE.pth``). The widths are read off the state dict, so a head
  for another CLIP (its first layer as wide as that CLIP's projection) loads too.
- ``hpsv2``: Human Preference Score v2 / v2.1 (Wu et al. 2023, "Human Preference Score v2",
  arXiv:2306.09341; tgxs002/HPSv2 ``hpsv2/img_score.py``, which Flow-GRPO's
  ``HPSv2RewardInferencer`` copies): r = cos, HPSv2's ``image_features @ text_features.T`` on
  the normalized features of an open_clip ViT-H-14 fine-tuned on human preferences. The
  checkpoint (``HPS_v2_compressed.pt`` / ``HPS_v2.1_compressed.pt``: ``{"state_dict": ...}`` in
  open_clip's parameter names) is mapped onto a transformers ``CLIPModel`` whose sizes are read
  off the state dict (:func:`open_clip_to_transformers`), so open_clip is not needed. Text is
  tokenized as open_clip's ``tokenize`` does: <start> + BPE + <end>, cut to the context (77)
  with the last token set to <end>, padded with 0, and pooled at the argmax token id (<end>,
  the largest id of OpenAI's vocabulary). The tokenizer is a transformers ``CLIPTokenizer``
  from a local directory (``tokenizer_path``) that must hold OpenAI CLIP's BPE vocabulary
  (open_clip's ``bpe_simple_vocab_16e6``; e.g. the tokenizer files of
  ``openai/clip-vit-large-patch14`` or ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``); transformers
  cleans text by NFC normalization, whitespace collapsing and lower-casing where open_clip runs
  ``ftfy.fix_text`` and ``html.unescape`` too, so prompts with HTML entities or mojibake may
  tokenize differently. Images go through HPSv2's validation transform
  (``create_model_and_transforms(..., light_augmentation=True)`` → ``image_transform(...,
  resize_longest_max=True)``): ToTensor, then ``ResizeMaxSize(224)`` — the *longer* side scaled
  to 224 (bicubic on the float tensor, antialiased as torchvision ≥ 0.17 does by default; the
  other side ``round(side · 224 / longer)``), the rest padded with 0 around the centre — then
  OpenAI's mean/std (:func:`open_clip_preprocess`, ``resize: pad``). ``resize: crop`` is
  open_clip's ordinary validation transform instead (shorter side to 224, bicubic, centre
  crop). For square images, what generators make, both are one resize to 224 × 224. HPSv2 ran
  under CUDA autocast (float16); here the model runs in ``dtype``.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.reward import Reward, RewardContext
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.hub import CONFIG_FILES, pretrained_dir, split_hub_id
from mmrl.registry import REWARDS
from mmrl.rewards.images import rollout_images

# OpenAI CLIP's pixel mean and std (open_clip's OPENAI_DATASET_MEAN / OPENAI_DATASET_STD)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformers_module(what: str):
    """The ``transformers`` package, or an error that names the ``text`` extra."""
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("transformers", "text", what) from None
    return transformers


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def prompts_of(rollout: Rollout, reward: str) -> list[str]:
    """Each sample's prompt text, ``rollout.info["prompt"]``; a config error names the reward
    when the rollout has none (it needs ``sampler.type: prompt``)."""
    if "prompt" not in rollout.info:
        raise ConfigError("rewards", reward, f"scores each image against its prompt and needs rollout.info['prompt']: use it with sampler.type: prompt (the rollout info has {sorted(rollout.info)})")
    return [str(p) for p in rollout.info["prompt"]]


def projected(output: Any) -> Tensor:
    """The projected features from ``get_image_features`` / ``get_text_features``: a tensor
    (transformers 4) or the ``pooler_output`` of the output object (transformers 5)."""
    return output if isinstance(output, Tensor) else output.pooler_output


def l2_normalize(x: Tensor) -> Tensor:
    """x / |x|_2 along the last dimension (the references divide by ``x.norm(p=2, dim=-1)``)."""
    return x / x.norm(p=2, dim=-1, keepdim=True)


def check_dir(path: str, field: str, what: str, only: list[str] | None = None) -> Path:
    """``path`` as a directory (a local one, or a hub id's snapshot: :func:`mmrl.hub.pretrained_dir`,
    ``only`` the files it fetches), or a one-line config error naming ``field``."""
    if not path:
        raise ConfigError(field, path, f"required: {what}")
    if not Path(path).expanduser().is_dir() and split_hub_id(path) is None:
        raise ConfigError(field, path, f"no such directory, nor a hub id (org/name[@revision]); expected {what}")
    return pretrained_dir(path, field, only=only)


def check_file(path: str, field: str, what: str) -> Path:
    """``path`` as a file, or a one-line config error naming ``field``."""
    if not path:
        raise ConfigError(field, path, f"required: {what}")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(field, path, f"no such file; expected {what}")
    return p


def load_clip_model(path: str, field: str, device: torch.device, dtype: torch.dtype):
    """A transformers ``CLIPModel`` from a local ``save_pretrained`` directory (its
    ``config.json`` and weights), frozen in eval mode on ``device`` in ``dtype``."""
    transformers = transformers_module("the CLIP-based rewards")
    p = check_dir(path, field, "a save_pretrained directory of a transformers CLIPModel (config.json + model.safetensors)")
    if not (p / "config.json").is_file():
        raise ConfigError(field, path, "has no config.json; expected a local save_pretrained directory of a transformers CLIPModel")
    try:
        model = transformers.CLIPModel.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # a malformed directory: say which field holds it
        raise ConfigError(field, path, f"could not be loaded as a transformers CLIPModel ({_first_line(e)})") from e
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_clip_tokenizer(path: str, field: str):
    """A transformers ``CLIPTokenizer`` from a local directory (``tokenizer.json``, or
    ``vocab.json`` + ``merges.txt``)."""
    transformers = transformers_module("the CLIP-based rewards")
    p = check_dir(path, field, "a directory with a CLIP tokenizer (tokenizer.json, or vocab.json and merges.txt)", only=CONFIG_FILES)
    if not ((p / "tokenizer.json").is_file() or ((p / "vocab.json").is_file() and (p / "merges.txt").is_file())):
        raise ConfigError(field, path, "has no tokenizer.json nor vocab.json + merges.txt; expected a CLIP tokenizer directory")
    try:
        return transformers.CLIPTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:
        raise ConfigError(field, path, f"could not be loaded as a CLIPTokenizer ({_first_line(e)})") from e


def load_clip_image_processor(path: str, field: str):
    """The directory's CLIP image processor (``preprocessor_config.json`` or
    ``processor_config.json``): the PIL implementation where transformers has one
    (``CLIPImageProcessorPil``, transformers 5; the class transformers 4 used by default, which
    the references ran), so resize, crop and normalization are the saved config's, computed as
    the reference computed them."""
    transformers = transformers_module("the CLIP-based rewards")
    p = check_dir(path, field, "a directory with a CLIP processor (preprocessor_config.json or processor_config.json)", only=CONFIG_FILES)
    if not ((p / "preprocessor_config.json").is_file() or (p / "processor_config.json").is_file()):
        raise ConfigError(field, path, "has no preprocessor_config.json nor processor_config.json; expected a saved CLIPProcessor / CLIPImageProcessor")
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    try:
        return cls.from_pretrained(str(p), local_files_only=True)
    except Exception as e:
        raise ConfigError(field, path, f"could not be loaded as a CLIP image processor ({_first_line(e)})") from e


def load_state_dict_file(path: str, field: str) -> dict[str, Tensor]:
    """A state dict of tensors from a ``.safetensors`` file or a PyTorch pickle (``.pt``,
    ``.pth``, ``.bin``) loaded with ``torch.load(weights_only=True)``: a pickle that holds
    anything but tensors and plain containers is refused, never executed. A checkpoint of the
    form ``{"state_dict": {...}}`` (HPSv2's) is unwrapped, and a ``module.`` prefix on every key
    (a DistributedDataParallel save) removed."""
    p = check_file(path, field, "a .safetensors file or a PyTorch state dict (.pt / .pth)")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state: Any = load_file(str(p), device="cpu")
        except Exception as e:
            raise ConfigError(field, path, f"could not be read as safetensors ({_first_line(e)})") from e
    else:
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message is several lines; keep the one that names what was refused
            why = next((line.strip() for line in str(e).splitlines() if "Unsupported" in line), "")
            why = f" ({why.split('. ')[0][:160]})" if why else ""
            raise ConfigError(field, path, f"was refused by torch.load(weights_only=True): it holds pickled objects other than tensors{why}; save a plain state dict or .safetensors") from e
        except Exception as e:
            raise ConfigError(field, path, f"could not be read by torch.load ({_first_line(e)})") from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConfigError(field, path, "does not hold a state dict of tensors")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return dict(state)


def resize_shortest(pixels: Tensor, size: int, mode: str, antialias: bool = True) -> Tensor:
    """torchvision's ``Resize(size, mode)`` with an int size on float images [B, 3, H, W]: the
    shorter side scaled to ``size``, the longer to ``int(size · long / short)``; an image that
    already has that size is returned as it is (as torchvision does)."""
    h, w = pixels.shape[-2:]
    new_h, new_w = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    if (new_h, new_w) == (h, w):
        return pixels
    return F.interpolate(pixels, size=(new_h, new_w), mode=mode, align_corners=False, antialias=antialias)


def center_crop(pixels: Tensor, crop: tuple[int, int]) -> Tensor:
    """torchvision's ``CenterCrop((h, w))`` of images [..., H, W] at least that large: the
    top-left corner at ``(round((H - h) / 2), round((W - w) / 2))``."""
    h, w = pixels.shape[-2:]
    ch, cw = crop
    if ch > h or cw > w:
        raise ValueError(f"a centre crop of {ch}x{cw} does not fit an image of {h}x{w}")
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    return pixels[..., top : top + ch, left : left + cw]


@torch.no_grad()
def resize_longest_pad(pixels: Tensor, size: int, antialias: bool = True, fill: float = 0.0) -> Tensor:
    """HPSv2's ``ResizeMaxSize(size)`` on float images [B, 3, H, W]: scale s = size / max(H, W);
    when s ≠ 1 the image is resized (bicubic) to ``(round(H · s), round(W · s))`` and padded with
    ``fill`` to size × size, ``pad // 2`` before and the rest after on each axis."""
    h, w = pixels.shape[-2:]
    scale = size / float(max(h, w))
    if scale == 1.0:
        return pixels
    new_h, new_w = round(h * scale), round(w * scale)
    pixels = F.interpolate(pixels, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=antialias)
    pad_h, pad_w = size - new_h, size - new_w
    return F.pad(pixels, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=fill)


@torch.no_grad()
def open_clip_preprocess(images: np.ndarray, size: int, resize: str = "pad", antialias: bool = True, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD) -> Tensor:
    """Pixel values [B, 3, size, size] (float32) of RGB uint8 images [B, H, W, 3] as open_clip's
    validation transforms make them: ToTensor (x / 255), then ``resize``:

    - ``pad``: HPSv2's ``ResizeMaxSize`` (:func:`resize_longest_pad`: longer side to ``size``,
      bicubic, zero padding), what HPSv2's ``img_score.py`` and Flow-GRPO's HPSv2 reward use;
    - ``crop``: open_clip's ``Resize(size, bicubic)`` + ``CenterCrop(size)``
      (:func:`resize_shortest`, :func:`center_crop`);

    then ``(x - mean) / std`` per channel. The resizes run on the float tensor, as torchvision
    does after ToTensor (bicubic without clamping), antialiased when ``antialias``
    (torchvision ≥ 0.17's default for tensors; false = earlier torchvision)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    if resize == "pad":
        x = resize_longest_pad(x, size, antialias)
    elif resize == "crop":
        x = center_crop(resize_shortest(x, size, "bicubic", antialias), (size, size))
    else:
        raise ValueError(f"resize must be 'pad' or 'crop', got {resize!r}")
    m = torch.tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
    return (x - m) / s


def _size_of(value: Any) -> tuple[str, Any]:
    """A processor's ``size`` / ``crop_size`` as imscore's ``get_size`` reads it:
    ("edge", n) for ``shortest_edge``, ("hw", (h, w)) otherwise."""
    if isinstance(value, int):
        return "hw", (value, value)
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if not isinstance(value, dict):
        value = dict(vars(value))
    if value.get("height") is not None and value.get("width") is not None:
        return "hw", (int(value["height"]), int(value["width"]))
    if value.get("shortest_edge") is not None:
        return "edge", int(value["shortest_edge"])
    raise ValueError(f"unsupported image processor size {value!r}")


@torch.no_grad()
def flow_grpo_clip_pixels(images: np.ndarray, processor: Any) -> Tensor:
    """Flow-GRPO ``ClipScorer``'s pixels: the uint8 images / 255 through torchvision
    ``Resize(size)`` (bilinear, antialiased: torchvision's defaults), ``CenterCrop(crop_size)``
    and ``Normalize(image_mean, image_std)``, each only where the processor's config turns it on
    (``do_resize``, ``do_center_crop``, ``do_normalize``), as imscore's ``get_image_transform``
    builds them."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    if getattr(processor, "do_resize", False):
        kind, size = _size_of(processor.size)
        if kind == "edge":
            x = resize_shortest(x, size, "bilinear", True)
        elif tuple(x.shape[-2:]) != size:
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    if getattr(processor, "do_center_crop", False):
        x = center_crop(x, _size_of(processor.crop_size)[1])
    if getattr(processor, "do_normalize", False):
        x = (x - torch.tensor(processor.image_mean).view(1, -1, 1, 1)) / torch.tensor(processor.image_std).view(1, -1, 1, 1)
    return x


# ---------------------------------------------------------------------------------------------
# the aesthetic predictor's MLP head


AESTHETIC_LINEARS = (0, 2, 4, 6, 7)  # indices of the Linear layers in the head's nn.Sequential
AESTHETIC_DROPOUTS = {1: 0.2, 3: 0.2, 5: 0.1}  # and of its Dropout layers (off in eval mode)


class AestheticHead(nn.Module):
    """The improved aesthetic predictor's MLP (``MLP`` of ``simple_inference.py`` and of
    Flow-GRPO's ``aesthetic_scorer.py``): ``layers`` = Linear(d, 1024), Dropout(0.2),
    Linear(1024, 128), Dropout(0.2), Linear(128, 64), Dropout(0.1), Linear(64, 16),
    Linear(16, 1), with d = 768 for CLIP ViT-L/14. The widths here are the state dict's."""

    def __init__(self, widths: list[int]):
        super().__init__()
        if len(widths) != len(AESTHETIC_LINEARS) + 1:
            raise ValueError(f"the aesthetic head has {len(AESTHETIC_LINEARS)} linear layers; got widths {widths}")
        modules: list[nn.Module] = []
        linear = iter(zip(widths[:-1], widths[1:]))
        for index in range(AESTHETIC_LINEARS[-1] + 1):
            if index in AESTHETIC_LINEARS:
                modules.append(nn.Linear(*next(linear)))
            else:
                modules.append(nn.Dropout(AESTHETIC_DROPOUTS[index]))
        self.layers = nn.Sequential(*modules)

    def forward(self, embed: Tensor) -> Tensor:
        return self.layers(embed)

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor], field: str, path: str) -> "AestheticHead":
        """The head of a state dict with the keys ``layers.{0,2,4,6,7}.{weight,bias}``; its
        widths come from the weights' shapes. Other keys or shapes are a config error."""
        expected = {f"layers.{i}.{kind}" for i in AESTHETIC_LINEARS for kind in ("weight", "bias")}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ConfigError(field, path, f"is not an aesthetic-predictor head (keys layers.{{0,2,4,6,7}}.weight/bias); missing {missing[:4]}, unexpected {extra[:4]}")
        weights = [state[f"layers.{i}.weight"] for i in AESTHETIC_LINEARS]
        widths = [int(weights[0].shape[1])] + [int(w.shape[0]) for w in weights]
        if any(w.dim() != 2 for w in weights) or widths[-1] != 1 or any(int(w.shape[1]) != widths[k] for k, w in enumerate(weights)):
            raise ConfigError(field, path, f"has linear layers of shapes {[tuple(w.shape) for w in weights]}, which do not chain into one score")
        head = cls(widths)
        head.load_state_dict({k: v.float() for k, v in state.items()})
        return head


# ---------------------------------------------------------------------------------------------
# open_clip's ViT CLIP (HPSv2) as a transformers CLIPModel


def _resblock_count(state: dict[str, Tensor], prefix: str) -> int:
    indices = {int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix)}
    if indices != set(range(len(indices))) or not indices:
        raise ValueError(f"the state dict's {prefix}N blocks are not numbered 0..N-1: {sorted(indices)[:8]}")
    return len(indices)


def _map_resblock(state: dict[str, Tensor], src: str, dst: str, out: dict[str, Tensor]) -> None:
    """open_clip's ``ResidualAttentionBlock`` (``ln_1``, ``attn`` = nn.MultiheadAttention with a
    fused ``in_proj`` of q, k, v stacked in that order, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``) →
    transformers' ``CLIPEncoderLayer`` (``layer_norm1``, ``self_attn.{q,k,v,out}_proj``,
    ``layer_norm2``, ``mlp.fc1``, ``mlp.fc2``)."""
    q, k, v = state[f"{src}attn.in_proj_weight"].chunk(3, dim=0)
    qb, kb, vb = state[f"{src}attn.in_proj_bias"].chunk(3, dim=0)
    for name, w, b in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
        out[f"{dst}self_attn.{name}.weight"] = w
        out[f"{dst}self_attn.{name}.bias"] = b
    pairs = {
        "attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2",
        "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
    }
    for a, b_ in pairs.items():
        out[f"{dst}{b_}.weight"] = state[f"{src}{a}.weight"]
        out[f"{dst}{b_}.bias"] = state[f"{src}{a}.bias"]


def open_clip_to_transformers(state: dict[str, Tensor], vision_head_width: int = 80, text_head_width: int = 64):
    """(``CLIPConfig``, state dict of ``CLIPModel``) for an open_clip ViT CLIP state dict (the
    ``CLIP`` class with its own text transformer, as HPSv2's ViT-H-14).

    Sizes are read off the tensors: vision width and patch from ``visual.conv1.weight``
    [W, 3, P, P], image size from ``visual.positional_embedding`` [(S/P)² + 1, W], layers from
    the ``visual.transformer.resblocks.N`` numbering, MLP width from ``mlp.c_fc``, text width
    and vocabulary from ``token_embedding.weight``, context length from
    ``positional_embedding``, the projection from ``text_projection`` [W_t, E] and
    ``visual.proj`` [W, E]. Head counts are width / head width (open_clip's ``head_width``:
    ViT-H-14's image tower has 80, 1280 / 80 = 16 heads; its text tower 16 heads of 64).
    Activations are exact GELU (open_clip's ``nn.GELU``; ViT-H-14 is not a QuickGELU model)
    and layer norms use eps 1e-5 (``nn.LayerNorm``'s). A key this mapping does not know
    (LayerScale, attentional pooling, patch norm: architectures HPSv2 does not use) is an
    error rather than silently dropped."""
    transformers = transformers_module("the hpsv2 reward")
    need = ["visual.conv1.weight", "visual.class_embedding", "visual.positional_embedding", "visual.ln_pre.weight", "visual.ln_post.weight",
            "visual.proj", "token_embedding.weight", "positional_embedding", "ln_final.weight", "text_projection", "logit_scale"]
    missing = [k for k in need if k not in state]
    if missing:
        raise ValueError(f"not an open_clip ViT CLIP state dict: missing {missing}")
    conv = state["visual.conv1.weight"]
    v_width, patch = int(conv.shape[0]), int(conv.shape[-1])
    grid = math.isqrt(int(state["visual.positional_embedding"].shape[0]) - 1)
    if grid * grid + 1 != state["visual.positional_embedding"].shape[0]:
        raise ValueError(f"visual.positional_embedding has {state['visual.positional_embedding'].shape[0]} rows, not a square grid + 1")
    v_layers = _resblock_count(state, "visual.transformer.resblocks.")
    t_layers = _resblock_count(state, "transformer.resblocks.")
    vocab, t_width = (int(n) for n in state["token_embedding.weight"].shape)
    context = int(state["positional_embedding"].shape[0])
    embed = int(state["text_projection"].shape[1])
    if int(state["visual.proj"].shape[1]) != embed:
        raise ValueError(f"visual.proj projects to {state['visual.proj'].shape[1]} and text_projection to {embed}")
    for width, head_width, tower in ((v_width, vision_head_width, "image"), (t_width, text_head_width, "text")):
        if width % head_width:
            raise ValueError(f"the {tower} tower's width {width} is not a multiple of its head width {head_width}")
    config = transformers.CLIPConfig(
        vision_config=dict(
            hidden_size=v_width, intermediate_size=int(state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
            num_hidden_layers=v_layers, num_attention_heads=v_width // vision_head_width, image_size=grid * patch,
            patch_size=patch, num_channels=int(conv.shape[1]), hidden_act="gelu", layer_norm_eps=1e-5, projection_dim=embed,
        ),
        text_config=dict(
            vocab_size=vocab, hidden_size=t_width, intermediate_size=int(state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
            num_hidden_layers=t_layers, num_attention_heads=t_width // text_head_width, max_position_embeddings=context,
            hidden_act="gelu", layer_norm_eps=1e-5, projection_dim=embed,
        ),
        projection_dim=embed,
    )
    out: dict[str, Tensor] = {
        "vision_model.embeddings.patch_embedding.weight": conv,
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "visual_projection.weight": state["visual.proj"].t(),
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_projection.weight": state["text_projection"].t(),
        "logit_scale": state["logit_scale"].reshape(()),
    }
    for src, dst in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm"), ("ln_final", "text_model.final_layer_norm")):
        out[f"{dst}.weight"], out[f"{dst}.bias"] = state[f"{src}.weight"], state[f"{src}.bias"]
    for i in range(v_layers):
        _map_resblock(state, f"visual.transformer.resblocks.{i}.", f"vision_model.encoder.layers.{i}.", out)
    for i in range(t_layers):
        _map_resblock(state, f"transformer.resblocks.{i}.", f"text_model.encoder.layers.{i}.", out)
    used = set(need) | {"visual.ln_pre.bias", "visual.ln_post.bias", "ln_final.bias", "attn_mask"}
    used |= {k for k in state if k.startswith(("visual.transformer.resblocks.", "transformer.resblocks."))
             and k.split(".resblocks.")[1].split(".", 1)[1] in _RESBLOCK_KEYS}
    unknown = sorted(set(state) - used)
    if unknown:
        raise ValueError(f"open_clip parameters this mapping does not know: {unknown[:6]}{' ...' if len(unknown) > 6 else ''}")
    return config, out


_RESBLOCK_KEYS = {f"{m}.{kind}" for m in ("attn.out_proj", "ln_1", "ln_2", "mlp.c_fc", "mlp.c_proj") for kind in ("weight", "bias")} | {"attn.in_proj_weight", "attn.in_proj_bias"}


def clip_model_from_open_clip(state: dict[str, Tensor], vision_head_width: int, text_head_width: int):
    """A transformers ``CLIPModel`` holding an open_clip state dict's weights (float32, CPU),
    built on the meta device so that no random initialization of the full model is paid."""
    transformers = transformers_module("the hpsv2 reward")
    config, mapped = open_clip_to_transformers(state, vision_head_width, text_head_width)
    with torch.device("meta"):
        model = transformers.CLIPModel(config)
    model.load_state_dict({k: v.float().contiguous() for k, v in mapped.items()}, strict=True, assign=True)
    # the embeddings' position ids are non-persistent buffers, not in any state dict: rebuild them
    for embeddings in (model.vision_model.embeddings, model.text_model.embeddings):
        n = embeddings.position_embedding.weight.shape[0]
        embeddings.register_buffer("position_ids", torch.arange(n).expand((1, -1)), persistent=False)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"CLIPModel tensors not filled from the open_clip state dict: {left[:6]}")
    return model


# ---------------------------------------------------------------------------------------------
# configs


@dataclass
class ClipDirectoryConfig(RewardConfig):
    """Options shared by the rewards on a transformers CLIP directory (not itself registered)."""

    path: str = option("", "directory or hub id (org/name[@revision]) of the transformers CLIPModel (config.json + weights)")
    processor_path: str | None = option(None, "directory or hub id of its CLIPProcessor (tokenizer + preprocessor_config.json); null: path")
    batch_size: int = option(32, "images scored per forward pass", ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "dtype the model runs in (scores are returned as float32)")

    def validate(self, path: str) -> None:
        if not self.path:
            raise ConfigError(f"{path}.path" if path else "path", self.path, "required: a local save_pretrained directory of a transformers CLIPModel")


@dataclass
class PickScoreConfig(ClipDirectoryConfig):
    """PickScore (Kirstain et al. 2023): exp(logit_scale) * cos(image, prompt) of the PickScore CLIP, divided by scale."""

    type: str = option("pickscore", "registered name of this component (see `mmrl list`)")
    path: str = option("", "directory or hub id (org/name[@revision]) of the PickScore CLIPModel (yuvalkirstain/PickScore_v1)")
    processor_path: str | None = option(None, "directory or hub id of the processor PickScore was trained with (laion/CLIP-ViT-H-14-laion2B-s32B-b79K); null: path")
    scale: float = option(1.0, "the score is divided by this (1: raw PickScore; Flow-GRPO's reward divides by 26)", gt=0)
    max_length: int = option(77, "prompt tokens kept, start and end tokens included (longer prompts are truncated)", ge=2)


@dataclass
class ClipScoreConfig(ClipDirectoryConfig):
    """CLIPScore: w * max(cos, 0) with the caption prefix 'A photo depicts' (Hessel et al. 2021), or Flow-GRPO's logits / 30."""

    type: str = option("clip_score", "registered name of this component (see `mmrl list`)")
    path: str = option("", "directory or hub id (org/name[@revision]) of the CLIPModel (openai/clip-vit-large-patch14 for Flow-GRPO; Hessel et al. used ViT-B/32)")
    variant: Literal["hessel", "flow_grpo"] = option("hessel", "hessel: w * max(cos, 0), prefix 'A photo depicts ', images through the processor; flow_grpo: exp(logit_scale) * cos / 30, bilinear-resized images as Flow-GRPO's ClipScorer")
    w: float = option(2.5, "CLIPScore's weight w of the hessel variant (2.5 in the paper)", gt=0)
    prefix: str | None = option(None, "text put before each prompt; null: the variant's ('A photo depicts ' for hessel, none for flow_grpo)")
    max_length: int = option(77, "prompt tokens kept, start and end tokens included (longer prompts are truncated)", ge=2)


@dataclass
class AestheticConfig(ClipDirectoryConfig):
    """The LAION aesthetic predictor v2: an MLP head on CLIP ViT-L/14's L2-normalized image embedding (about 1-10)."""

    type: str = option("aesthetic", "registered name of this component (see `mmrl list`)")
    path: str = option("", "directory or hub id (org/name[@revision]) of the CLIPModel the head was trained on (openai/clip-vit-large-patch14)")
    head_path: str = option("", "the MLP head's state dict (layers.{0,2,4,6,7}.weight/bias): a .safetensors file or a .pth (sac+logos+ava1-l14-linearMSE.pth), loaded with torch.load(weights_only=True)")

    def validate(self, path: str) -> None:
        super().validate(path)
        if not self.head_path:
            raise ConfigError(f"{path}.head_path" if path else "head_path", self.head_path, "required: the aesthetic MLP head's state dict (.safetensors or .pth)")


@dataclass
class HPSv2Config(RewardConfig):
    """HPSv2 / HPSv2.1: the cosine of an open_clip ViT-H-14 checkpoint's normalized image and prompt features."""

    type: str = option("hpsv2", "registered name of this component (see `mmrl list`)")
    path: str = option("", "the HPS checkpoint in open_clip's parameter names: HPS_v2.1_compressed.pt / HPS_v2_compressed.pt (torch.load(weights_only=True)) or a .safetensors")
    tokenizer_path: str = option("", "directory or hub id of a transformers CLIPTokenizer with OpenAI CLIP's BPE vocabulary (e.g. the tokenizer files of openai/clip-vit-large-patch14)")
    vision_head_width: int = option(80, "width of one attention head of the image tower (open_clip's head_width; ViT-H-14: 80, i.e. 16 heads)", ge=1)
    text_head_width: int = option(64, "width of one attention head of the text tower (ViT-H-14: 1024 / 16 heads = 64)", ge=1)
    resize: Literal["pad", "crop"] = option("pad", "pad: HPSv2's ResizeMaxSize (longer side to the image size, zero padding); crop: shorter side to it and a centre crop (open_clip's usual validation transform)")
    antialias: bool = option(True, "antialias the bicubic resize of the float image (torchvision >= 0.17's default, which Flow-GRPO's torchvision 0.21 has)")
    batch_size: int = option(32, "images scored per forward pass", ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "dtype the model runs in (HPSv2 ran under CUDA float16 autocast; scores are returned as float32)")

    def validate(self, path: str) -> None:
        for name, what in (("path", "the HPS checkpoint file (HPS_v2.1_compressed.pt)"), ("tokenizer_path", "a local CLIPTokenizer directory with OpenAI CLIP's vocabulary")):
            if not getattr(self, name):
                raise ConfigError(f"{path}.{name}" if path else name, getattr(self, name), f"required: {what}")


# ---------------------------------------------------------------------------------------------
# rewards


class ClipDirectoryReward(Reward):
    """Base of the rewards on a transformers ``CLIPModel`` directory: loads the model (frozen,
    on the reward's device, in ``dtype``), the tokenizer and the image processor once."""

    def __init__(self, cfg: ClipDirectoryConfig, context: RewardContext):
        super().__init__(cfg, context)
        self.device = context.device_for(cfg)
        self.dtype = DTYPES[cfg.dtype]
        processor_path = cfg.processor_path or cfg.path
        processor_field = f"rewards.{cfg.type}.processor_path" if cfg.processor_path else f"rewards.{cfg.type}.path"
        # the directories first, so that a missing one is named before anything loads
        check_dir(cfg.path, f"rewards.{cfg.type}.path", "a save_pretrained directory of a transformers CLIPModel")
        check_dir(processor_path, processor_field, "a directory with a CLIP processor", only=CONFIG_FILES)
        self.model = load_clip_model(cfg.path, f"rewards.{cfg.type}.path", self.device, self.dtype)
        self.image_processor = load_clip_image_processor(processor_path, processor_field)
        self.tokenizer = self._load_tokenizer(processor_path, processor_field)

    def _load_tokenizer(self, path: str, field: str):
        return load_clip_tokenizer(path, field)

    def pixels(self, images: np.ndarray) -> Tensor:
        """Pixel values [n, 3, S, S] of uint8 RGB images [n, H, W, 3] through the directory's
        image processor, on the model's device and dtype."""
        pixel_values = self.image_processor(images=list(images), return_tensors="pt")["pixel_values"]
        return pixel_values.to(device=self.device, dtype=self.dtype)

    def image_features(self, pixel_values: Tensor) -> Tensor:
        """L2-normalized projected image features (float32) of pixel values."""
        return l2_normalize(projected(self.model.get_image_features(pixel_values=pixel_values)).float())

    def text_features(self, prompts: list[str], max_length: int) -> Tensor:
        """L2-normalized projected text features (float32) of prompts tokenized with
        ``padding=True, truncation=True, max_length`` (the references' call)."""
        tokens = self.tokenizer(prompts, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(self.device)
        return l2_normalize(projected(self.model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])).float())

    def batches(self, n: int):
        step = self.config.batch_size
        return [slice(start, min(start + step, n)) for start in range(0, n, step)]


@REWARDS.register("pickscore", config=PickScoreConfig)
class PickScoreReward(ClipDirectoryReward):
    """PickScore: r = exp(logit_scale) · cos(f_I, f_T) / scale (see the module docstring)."""

    @torch.no_grad()
    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        images = rollout_images(rollout, "pickscore")
        prompts = prompts_of(rollout, "pickscore")
        cfg: PickScoreConfig = self.config
        logit_scale = self.model.logit_scale.float().exp()
        out = []
        for rows in self.batches(len(prompts)):
            cos = (self.image_features(self.pixels(images[rows])) * self.text_features(prompts[rows], cfg.max_length)).sum(-1)
            out.append((logit_scale * cos / cfg.scale).cpu())
        return torch.cat(out).float()


@REWARDS.register("clip_score", config=ClipScoreConfig)
class ClipScoreReward(ClipDirectoryReward):
    """CLIPScore of image and prompt: w · max(cos, 0) (hessel) or exp(logit_scale) · cos / 30 (flow_grpo).

    The two variants, their caption prefix and their image transforms are in the module
    docstring."""

    @torch.no_grad()
    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        images = rollout_images(rollout, "clip_score")
        cfg: ClipScoreConfig = self.config
        prefix = cfg.prefix if cfg.prefix is not None else ("A photo depicts " if cfg.variant == "hessel" else "")
        prompts = [prefix + p for p in prompts_of(rollout, "clip_score")]
        out = []
        for rows in self.batches(len(prompts)):
            if cfg.variant == "flow_grpo":
                pixels = flow_grpo_clip_pixels(images[rows], self.image_processor).to(device=self.device, dtype=self.dtype)
            else:
                pixels = self.pixels(images[rows])
            cos = (self.image_features(pixels) * self.text_features(prompts[rows], cfg.max_length)).sum(-1)
            if cfg.variant == "flow_grpo":
                out.append((self.model.logit_scale.float().exp() * cos / 30.0).cpu())
            else:
                out.append((cfg.w * cos.clamp(min=0)).cpu())
        return torch.cat(out).float()


@REWARDS.register("aesthetic", config=AestheticConfig)
class AestheticReward(ClipDirectoryReward):
    """The LAION aesthetic predictor v2: r = MLP(f_I / |f_I|) (see the module docstring)."""

    def __init__(self, cfg: AestheticConfig, context: RewardContext):
        field = f"rewards.{cfg.type}.head_path"
        check_file(cfg.head_path, field, "the aesthetic MLP head's state dict (.safetensors or .pth)")
        super().__init__(cfg, context)
        head = AestheticHead.from_state_dict(load_state_dict_file(cfg.head_path, field), field, cfg.head_path)
        width = head.layers[0].in_features
        embed = self.model.config.projection_dim
        if width != embed:
            raise ConfigError(field, cfg.head_path, f"takes {width}-wide embeddings but the CLIP at {cfg.path} projects to {embed} (the LAION head is for CLIP ViT-L/14: 768)")
        self.head = head.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)

    def _load_tokenizer(self, path: str, field: str):
        return None  # the aesthetic score reads no text

    @torch.no_grad()
    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        images = rollout_images(rollout, "aesthetic")
        out = []
        for rows in self.batches(len(images)):
            embed = self.image_features(self.pixels(images[rows]))
            out.append(self.head(embed.to(self.dtype)).squeeze(1).float().cpu())
        return torch.cat(out)


@REWARDS.register("hpsv2", config=HPSv2Config)
class HPSv2Reward(Reward):
    """HPSv2 / HPSv2.1: r = cos(f_I, f_T) of an open_clip ViT-H-14 HPS checkpoint's features.

    The checkpoint runs as a transformers ``CLIPModel`` (:func:`clip_model_from_open_clip`);
    tokenization and preprocessing are open_clip's (see the module docstring)."""

    def __init__(self, cfg: HPSv2Config, context: RewardContext):
        super().__init__(cfg, context)
        self.device = context.device_for(cfg)
        self.dtype = DTYPES[cfg.dtype]
        path_field, tok_field = f"rewards.{cfg.type}.path", f"rewards.{cfg.type}.tokenizer_path"
        check_file(cfg.path, path_field, "the HPS checkpoint (HPS_v2.1_compressed.pt) in open_clip's parameter names")
        check_dir(cfg.tokenizer_path, tok_field, "a CLIPTokenizer directory with OpenAI CLIP's vocabulary", only=CONFIG_FILES)
        state = load_state_dict_file(cfg.path, path_field)
        try:
            model = clip_model_from_open_clip(state, cfg.vision_head_width, cfg.text_head_width)
        except ValueError as e:
            raise ConfigError(path_field, cfg.path, f"is not an open_clip ViT CLIP checkpoint this reward can map ({_first_line(e)})") from e
        del state
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.tokenizer = load_clip_tokenizer(cfg.tokenizer_path, tok_field)
        vocab = self.model.config.text_config.vocab_size
        eot, sot = self.tokenizer.eos_token_id, self.tokenizer.bos_token_id
        if eot is None or sot is None or len(self.tokenizer) > vocab or eot != max(self.tokenizer.get_vocab().values()):
            raise ConfigError(tok_field, cfg.tokenizer_path, f"must hold OpenAI CLIP's BPE vocabulary: <|startoftext|> and <|endoftext|> with <|endoftext|> the largest id (open_clip pools at the argmax id) and at most the model's {vocab} tokens; got {len(self.tokenizer)} tokens, end id {eot}")
        self.image_size = self.model.config.vision_config.image_size
        self.context_length = self.model.config.text_config.max_position_embeddings

    def tokens(self, prompts: list[str]) -> Tensor:
        """open_clip's ``tokenize``: [<start>, BPE..., <end>], cut to the context length with the
        last token set to <end>, padded with 0 → [n, context] (transformers' truncation keeps the
        same tokens: the first context − 2 BPE tokens between <start> and <end>)."""
        ids = self.tokenizer(prompts, truncation=True, max_length=self.context_length)["input_ids"]
        out = torch.zeros(len(ids), self.context_length, dtype=torch.long)
        for i, row in enumerate(ids):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out

    def text_features(self, tokens: Tensor) -> Tensor:
        """open_clip's ``encode_text``: the causal text transformer (no padding mask), the final
        layer norm, the state at the argmax token id (<end>), times ``text_projection``;
        L2-normalized, float32."""
        tokens = tokens.to(self.device)
        hidden = self.model.text_model(input_ids=tokens).last_hidden_state
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), tokens.argmax(dim=-1)]
        return l2_normalize(self.model.text_projection(pooled).float())

    def pixels(self, images: np.ndarray) -> Tensor:
        cfg: HPSv2Config = self.config
        return open_clip_preprocess(images, self.image_size, cfg.resize, cfg.antialias).to(device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        images = rollout_images(rollout, "hpsv2")
        prompts = prompts_of(rollout, "hpsv2")
        step = self.config.batch_size
        out = []
        for start in range(0, len(prompts), step):
            rows = slice(start, start + step)
            image = l2_normalize(projected(self.model.get_image_features(pixel_values=self.pixels(images[rows]))).float())
            out.append((image * self.text_features(self.tokens(prompts[rows]))).sum(-1).cpu())
        return torch.cat(out).float()
