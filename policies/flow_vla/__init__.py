"""Flow-matching VLA (pi0 style): backbone + flow-matching action expert producing action chunks."""

from mmrl.policies.flow_vla.config import FlowVLAConfig
from mmrl.policies.flow_vla.model import FlowVLAPolicy  # registers flow_vla

__all__ = ["FlowVLAConfig", "FlowVLAPolicy"]
