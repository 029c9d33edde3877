"""Policy families, one folder each (``<name>/config.py`` + ``<name>/model.py``).

Importing this package registers every built-in family; a new family is one import line
below.
"""

from mmrl.policies import diffusion_policy  # noqa: F401  (registration)
from mmrl.policies import flow_vla  # noqa: F401  (registration)
from mmrl.policies import gaussian_mlp  # noqa: F401  (registration)
from mmrl.policies import image_diffusion  # noqa: F401  (registration)
from mmrl.policies import text_lm  # noqa: F401  (registration)
from mmrl.policies import text_vlm  # noqa: F401  (registration)

from mmrl.policies import reward_model  # noqa: F401  (registration)
from mmrl.policies import token_vla  # noqa: F401  (registration)
from mmrl.policies import video_diffusion  # noqa: F401  (registration)
from mmrl.policies import toy  # noqa: F401  (registration)
