"""The vision side of Prismatic VLMs (OpenVLA, OpenVLA-OFT): timm ViTs, their fused
featurizer and the projector, under the parameter names the released Hugging Face
checkpoints use — no timm, no torchvision.

The checkpoints name their vision weights ``vision_backbone.featurizer.*`` (and, for a fused
backbone, ``vision_backbone.fused_featurizer.*``), each a timm ``VisionTransformer`` (timm
0.9.x, which OpenVLA pins) built with ``num_classes=0``:

- ``patch_embed.proj`` (a P×P, stride-P convolution), then the prefix tokens: ``cls_token``
  [1, 1, D] and ``reg_token`` [1, R, D] where the model has them;
- ``pos_embed``: with ``no_embed_class`` (DINOv2) it covers the patches only and is added
  before the prefix tokens are prepended; otherwise it covers [prefix, patches] and is added
  after;
- ``blocks.N``: ``x + ls1(attn(norm1(x)))``, ``x + ls2(mlp(norm2(x)))``; ``attn.qkv`` and
  ``attn.proj``, ``mlp.fc1`` / ``mlp.fc2`` with GELU (exact erf, SigLIP included: timm's
  default, which OpenVLA does not override; CLIP uses quick GELU), LayerNorm eps 1e-6, and
  LayerScale ``ls1`` / ``ls2`` where the model has it — timm calls its parameter ``gamma``;
  Hugging Face's loader rewrites names containing ``gamma``, so OpenVLA renames it
  ``scale_factor`` (kept here);
- ``norm`` (final LayerNorm) and, for SigLIP, ``attn_pool.*`` (attention pooling): in the
  checkpoint, unused by the features.

Prismatic's features are the output of the second-to-last block (timm
``get_intermediate_layers(n={depth - 2})``, no final norm) without the prefix tokens (class
and register tokens): [B, patches, D]. A fused backbone reads a 6-channel image (3 channels
per featurizer, each normalized its own way) and concatenates the two featurizers' patch
features along the channel axis: [B, patches, D1 + D2]. OpenVLA-OFT's several images are
6·K channels, featurized one image at a time and concatenated along the patch axis.

Sizes come from the checkpoint's tensors (embed dim, depth, MLP width, patch size, grid);
the timm model id fixes what the tensors cannot tell (heads, prefix tokens, activation), so a
tiny random checkpoint in the released layout builds tiny ViTs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ViTFamily:
    """What a timm ViT id fixes beyond the sizes its weights show."""

    num_heads: int
    class_token: bool = True
    reg_tokens: int = 0
    no_embed_class: bool = False
    pre_norm: bool = False  # CLIP: LayerNorm before the blocks, no patch-embedding bias
    attn_pool: bool = False  # SigLIP's "map" pooling head (in the checkpoint, unused)
    activation: str = "gelu"


# timm ids that Prismatic configs name (configuration_prismatic.VISION_BACKBONE_TO_TIMM_ID)
TIMM_VITS = {
    "vit_large_patch14_reg4_dinov2.lvd142m": ViTFamily(num_heads=16, reg_tokens=4, no_embed_class=True),
    "vit_so400m_patch14_siglip_224": ViTFamily(num_heads=16, class_token=False, attn_pool=True),
    "vit_so400m_patch14_siglip_384": ViTFamily(num_heads=16, class_token=False, attn_pool=True),
    "vit_large_patch14_clip_224.openai": ViTFamily(num_heads=16, pre_norm=True, activation="quick_gelu"),
    "vit_large_patch14_clip_336.openai": ViTFamily(num_heads=16, pre_norm=True, activation="quick_gelu"),
    "vit_large_patch16_224.augreg_in21k_ft_in1k": ViTFamily(num_heads=16),
}
LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ViTSize:
    """The sizes of one featurizer, read from its tensors."""

    embed_dim: int
    depth: int
    mlp_dim: int
    patch_size: int
    grid: int  # patches per side
    pool_mlp_dim: int = 0


def vit_size(shapes: dict[str, tuple[int, ...]], prefix: str, family: ViTFamily) -> ViTSize:
    """The sizes of the featurizer whose tensors are ``shapes[prefix + name]``."""
    embed_dim, _, patch, _ = shapes[prefix + "patch_embed.proj.weight"]
    depth = 1 + max(int(k[len(prefix) + 7 :].split(".")[0]) for k in shapes if k.startswith(prefix + "blocks."))
    mlp_dim = shapes[prefix + "blocks.0.mlp.fc1.weight"][0]
    positions = shapes[prefix + "pos_embed"][1] - (0 if family.no_embed_class else int(family.class_token) + family.reg_tokens)
    grid = math.isqrt(positions)
    if grid * grid != positions:
        raise ValueError(f"{prefix}pos_embed covers {positions} patches, not a square grid")
    pool_mlp = shapes[prefix + "attn_pool.mlp.fc1.weight"][0] if family.attn_pool else 0
    return ViTSize(embed_dim, depth, mlp_dim, patch, grid, pool_mlp)


def _activation(name: str) -> nn.Module:
    if name == "quick_gelu":
        return QuickGELU()
    return nn.GELU()


class QuickGELU(nn.Module):
    """x · σ(1.702 x) (CLIP's activation)."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, dim: int, bias: bool):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.proj(pixels).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, activation: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = _activation(activation)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LayerScale(nn.Module):
    """Per-channel scale; ``scale_factor`` is timm's ``gamma`` under OpenVLA's name."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale_factor = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale_factor


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int, layer_scale: bool, activation: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attn = Attention(dim, num_heads)
        self.ls1 = LayerScale(dim) if layer_scale else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.mlp = Mlp(dim, mlp_dim, activation)
        self.ls2 = LayerScale(dim) if layer_scale else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class AttentionPool(nn.Module):
    """SigLIP's attention-pooling head (timm ``AttentionPoolLatent``): held so the checkpoint's
    ``attn_pool.*`` tensors load and export; Prismatic's features never pass through it."""

    def __init__(self, dim: int, mlp_dim: int, activation: str):
        super().__init__()
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.mlp = Mlp(dim, mlp_dim, activation)


class PrismaticViT(nn.Module):
    """One timm ViT of a Prismatic vision backbone; ``forward`` gives the patch features of
    the second-to-last block."""

    def __init__(self, family: ViTFamily, size: ViTSize, layer_scale: bool):
        super().__init__()
        if size.depth < 2:
            raise ValueError(f"a Prismatic featurizer reads its second-to-last block: depth must be >= 2, got {size.depth}")
        d = size.embed_dim
        self.family, self.size = family, size
        self.num_prefix_tokens = int(family.class_token) + family.reg_tokens
        self.patch_embed = PatchEmbed(size.patch_size, d, bias=not family.pre_norm)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if family.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, family.reg_tokens, d)) if family.reg_tokens else None
        positions = size.grid**2 + (0 if family.no_embed_class else self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.randn(1, positions, d) * 0.02)
        self.norm_pre = nn.LayerNorm(d, eps=LAYER_NORM_EPS) if family.pre_norm else nn.Identity()
        self.blocks = nn.Sequential(*[Block(d, family.num_heads, size.mlp_dim, layer_scale, family.activation) for _ in range(size.depth)])
        self.norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.attn_pool = AttentionPool(d, size.pool_mlp_dim, family.activation) if family.attn_pool else None

    @property
    def image_size(self) -> int:
        return self.size.grid * self.size.patch_size

    @property
    def num_patches(self) -> int:
        return self.size.grid**2

    def forward(self, pixels: Tensor) -> Tensor:
        """[B, 3, S, S] normalized pixels → patch features [B, grid², D]."""
        x = self.patch_embed(pixels)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if self.family.no_embed_class:
            x = torch.cat([*prefix, x + self.pos_embed], dim=1)
        else:
            x = torch.cat([*prefix, x], dim=1) + self.pos_embed
        x = self.norm_pre(x)
        # blocks after the second-to-last cannot change its output: they are not run
        for block in self.blocks[: self.size.depth - 1]:
            x = block(x)
        return x[:, self.num_prefix_tokens :]


class PrismaticVisionBackbone(nn.Module):
    """``featurizer`` (+ ``fused_featurizer``): [B, 3·F·K, S, S] → [B, K·patches, ΣD]
    for F featurizers and K images."""

    def __init__(self, featurizers: list[PrismaticViT], num_images: int = 1):
        super().__init__()
        self.featurizer = featurizers[0]
        self.fused_featurizer = featurizers[1] if len(featurizers) > 1 else None
        self.num_images = num_images
        self.embed_dim = sum(f.size.embed_dim for f in featurizers)

    @property
    def featurizers(self) -> list[PrismaticViT]:
        return [f for f in (self.featurizer, self.fused_featurizer) if f is not None]

    @property
    def num_patches(self) -> int:
        """Patch tokens per image."""
        return self.featurizer.num_patches

    def forward(self, pixels: Tensor) -> Tensor:
        per_image = 3 * len(self.featurizers)
        features = []
        for image in torch.split(pixels, per_image, dim=1):
            parts = torch.split(image, 3, dim=1)
            features.append(torch.cat([f(p) for f, p in zip(self.featurizers, parts)], dim=2))
        return torch.cat(features, dim=1)


class PrismaticProjector(nn.Module):
    """Patch features → language-model embeddings: ``fc1 → GELU → fc2`` for one featurizer;
    the fused backbone's ``fc1 (×4 width) → GELU → fc2 → GELU → fc3``."""

    def __init__(self, fused: bool, vision_dim: int, llm_dim: int):
        super().__init__()
        self.fused = fused
        if fused:
            self.fc1 = nn.Linear(vision_dim, 4 * vision_dim)
            self.fc2 = nn.Linear(4 * vision_dim, llm_dim)
            self.fc3 = nn.Linear(llm_dim, llm_dim)
        else:
            self.fc1 = nn.Linear(vision_dim, llm_dim)
            self.fc2 = nn.Linear(llm_dim, llm_dim)

    def forward(self, features: Tensor) -> Tensor:
        x = self.fc2(nn.functional.gelu(self.fc1(features)))
        return self.fc3(nn.functional.gelu(x)) if self.fused else x
