"""Vision-language agents: ``vlm_agent``, text_agent's turns over text_vlm's model, with an
image in each observation (docs/agents_vlm.md)."""

from mmrl.policies.vlm_agent.config import VLMAgentConfig
from mmrl.policies.vlm_agent.model import VLMAgentPolicy  # registers vlm_agent

__all__ = ["VLMAgentConfig", "VLMAgentPolicy"]
