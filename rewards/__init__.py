"""Reward functions ``(rollout, cfg) -> Tensor[B]``, registered by name.

Importing this package registers every built-in reward; a new module is one import line
below.
"""

from mmrl.rewards import consistency  # noqa: F401  (registration)
from mmrl.rewards import env  # noqa: F401  (registration)
from mmrl.rewards import images  # noqa: F401  (registration)
from mmrl.rewards import pairwise  # noqa: F401  (registration)
from mmrl.rewards import shapes  # noqa: F401  (registration)
from mmrl.rewards import text  # noqa: F401  (registration)
from mmrl.rewards import toy  # noqa: F401  (registration)
from mmrl.rewards import video  # noqa: F401  (registration)
