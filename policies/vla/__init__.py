"""Shared pieces of the action policies: image encoder, instruction tokenizer, transformer
backbone, and the base class of the denoising action-chunk policies (`ActionChunkPolicy`: bounds,
sampling, supervised loss and imitation batches of `flow_vla` and `diffusion_policy`)."""

from mmrl.policies.vla.backbone import VLABackbone, VLABackboneConfig
from mmrl.policies.vla.tokenizer import InstructionTokenizer

__all__ = ["InstructionTokenizer", "VLABackbone", "VLABackboneConfig"]
