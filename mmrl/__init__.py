"""mmrl: group-relative reinforcement learning for generative policies.

Text LLMs, vision-language-action robot policies and diffusion/flow generators share one
training loop and one group-relative policy-gradient core (:mod:`mmrl.algo`).
"""

import os as _os

__version__ = "0.1.0"

# In a source checkout the sub-packages ``mmrl.envs``, ``mmrl.policies``, ``mmrl.rewards`` and
# ``mmrl.configs`` live beside ``mmrl/`` (top-level ``envs/``, ``policies/`` ...); an installed
# wheel has them inside ``mmrl/``. Adding the checkout root to the package path makes both
# layouts import the same way, including from the repository root with a wheel installed.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "envs")) and _os.path.isfile(
    _os.path.join(_root, "envs", "__init__.py")
):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
