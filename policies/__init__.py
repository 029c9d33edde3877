"""Policy families, one folder each (``<name>/config.py`` + ``<name>/model.py``).

A family registers itself (``@POLICIES.register``) in its own module; the registry imports
every module of this package on first lookup, so a new family is its folder alone.

Families share code through shared ground, never through each other: the modules at this
package's top (``hf``, ``tiny_tokenizers``, ``diffusers_common``, ``conversation``, ``lora``)
and the folders in :data:`SHARED_FOLDERS`. A family may also build on the families named in
:data:`BASE_FAMILIES` (and on theirs), through their public names only.
tests/policies/test_layering.py holds every import under ``policies/`` to this.
"""

SHARED_FOLDERS = ("vla",)  # what every VLA family builds on: backbones, action chunks, LeRobot and Prismatic formats

BASE_FAMILIES = {
    "learned_success": ("reward_model",),
    "openvla_oft": ("openvla",),
    "reward_model": ("text_lm",),  # its prompt encoder is text_lm's tiny decoder
    "text_agent": ("text_lm",),
    "text_vlm": ("text_lm",),
    "vlm_agent": ("text_agent", "text_vlm"),
}
