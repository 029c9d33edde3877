"""``learned_success``: a success classifier over one observation (camera images, proprio
state, instruction) → logit of P(success), trained by ``mmrl train-reward`` on labelled
frames (``data.type: success_frames``) and read by the env sampler as an env's success
(``env.success_model``; docs/learned_success.md)."""

from mmrl.policies.learned_success.config import LearnedSuccessConfig
from mmrl.policies.learned_success.model import LearnedSuccessModel, balanced_bce  # registers learned_success

__all__ = ["LearnedSuccessConfig", "LearnedSuccessModel", "balanced_bce"]
