"""Shared pieces of the vision-language-action policies: image encoder, instruction tokenizer, transformer backbone."""

from mmrl.policies.vla.backbone import VLABackbone, VLABackboneConfig
from mmrl.policies.vla.tokenizer import InstructionTokenizer

__all__ = ["InstructionTokenizer", "VLABackbone", "VLABackboneConfig"]
