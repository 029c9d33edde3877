"""The configs that fine-tune a released VLA checkpoint on LIBERO or ManiSkill
(configs/libero_spatial_smolvla_grpo.yaml, configs/libero_spatial_openvla_grpo.yaml,
configs/libero_spatial_openvla_oft_grpo.yaml, configs/libero_spatial_pi05_grpo.yaml, configs/maniskill_pickcube_smolvla_grpo.yaml): each runs one update through the command line
on a tiny random checkpoint of its format whose features match the env (cameras, state and
action dims, statistics key), shrunk for a CPU; the run's export loads back as that policy.

``CHECKPOINT_OF`` (config name -> writer of its tiny checkpoint, returning the overrides that
name it) and ``cpu_overrides`` are also what tests/test_shipped_configs.py runs these configs
with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_mmrl

pytestmark = pytest.mark.filterwarnings("ignore:__array_wrap__:DeprecationWarning")  # inside ManiSkill

# the LeRobot LIBERO image keys (agentview, wrist), in the config's env.cameras order
LIBERO_SMOLVLA_CAMERAS = {"image": (3, 256, 256), "image2": (3, 256, 256)}
# what ManiSkill's PickCube-v1 gives with obs_mode rgb (base_camera; agent qpos, qvel, is_grasped, tcp_pose, goal_pos)
PICKCUBE_STATE_DIM, PICKCUBE_ACTION_DIM = 29, 7


def _libero_statistics() -> dict:
    """A 7-dim ``libero_spatial`` dataset (the released LIBERO fine-tunes' key), gripper unmasked as in OpenVLA's."""
    from mmrl.policies.openvla.tiny import STATISTICS_DATA

    return {"libero_spatial": STATISTICS_DATA["bridge_orig"]}


def libero_smolvla(directory: Path) -> list[str]:
    """A tiny SmolVLA shaped like LeRobot's LIBERO fine-tunes: images ``image`` and ``image2``,
    state 8, actions 7, chunk 50 (LeRobot's default); the overrides that name it."""
    from mmrl.policies.smolvla import write_tiny_smolvla

    out = write_tiny_smolvla(directory / "smolvla", directory / "smolvlm", state_dim=8, action_dim=7, cameras=LIBERO_SMOLVLA_CAMERAS, chunk_size=50, n_action_steps=50)
    return [f"policy.checkpoint={out}", f"policy.vlm_dir={directory / 'smolvlm'}"]


def libero_pi05(directory: Path) -> list[str]:
    """A tiny π0.5 shaped like a LeRobot LIBERO fine-tune: images ``image`` and ``image2``,
    state 8, actions 7, chunk 50; the overrides that name it."""
    from mmrl.policies.pi0.tiny import write_tiny_pi0

    out = write_tiny_pi0(directory / "pi05", directory / "paligemma", state_dim=8, action_dim=7, cameras=LIBERO_SMOLVLA_CAMERAS, kind="pi05", chunk_size=50, n_action_steps=50)
    return [f"policy.checkpoint={out}", f"policy.vlm_dir={directory / 'paligemma'}"]


def libero_openvla(directory: Path) -> list[str]:
    """A tiny OpenVLA with a 7-dim ``libero_spatial`` statistics entry; the overrides that name it."""
    from mmrl.policies.openvla.tiny import write_tiny_openvla

    return [f"policy.checkpoint={write_tiny_openvla(directory / 'openvla', statistics=_libero_statistics())}"]


def libero_openvla_oft(directory: Path) -> list[str]:
    """A tiny OpenVLA-OFT with a 7-dim action / 8-dim proprio ``libero_spatial_no_noops`` entry
    (LIBERO's eef state), its L1 head and proprio projector files; the overrides that name it."""
    from mmrl.policies.openvla.tiny import STATISTICS_DATA
    from mmrl.policies.openvla_oft.tiny import write_tiny_openvla_oft

    entry = dict(STATISTICS_DATA["bridge_orig"])
    entry["proprio"] = {"mean": [0.0] * 8, "std": [1.0] * 8, "max": [1.0] * 8, "min": [-1.0] * 8, "q01": [-1.0] * 8, "q99": [1.0] * 8}
    key = "libero_spatial_no_noops"
    return [f"policy.checkpoint={write_tiny_openvla_oft(directory / 'openvla_oft', unnorm_key=key, statistics={key: entry})}"]


def maniskill_smolvla(directory: Path) -> list[str]:
    """A tiny SmolVLA for PickCube-v1 from rgb: one camera, state 29 (max_state_dim 32, as
    SmolVLA's), actions 7; the overrides that name it."""
    from mmrl.policies.smolvla import write_tiny_smolvla

    out = write_tiny_smolvla(
        directory / "smolvla", directory / "smolvlm", state_dim=PICKCUBE_STATE_DIM, action_dim=PICKCUBE_ACTION_DIM,
        cameras={"image": (3, 128, 128)}, chunk_size=50, n_action_steps=50, max_state_dim=32,
    )
    return [f"policy.checkpoint={out}", f"policy.vlm_dir={directory / 'smolvlm'}"]


# config name -> (writer of its tiny checkpoint, export format, policy type)
CHECKPOINT_OF = {
    "libero_spatial_smolvla_grpo": libero_smolvla,
    "libero_spatial_openvla_grpo": libero_openvla,
    "libero_spatial_openvla_oft_grpo": libero_openvla_oft,
    "libero_spatial_pi05_grpo": libero_pi05,
    "maniskill_pickcube_smolvla_grpo": maniskill_smolvla,
}
EXPORT = {"libero_spatial_smolvla_grpo": "lerobot", "libero_spatial_openvla_grpo": "openvla", "libero_spatial_openvla_oft_grpo": "openvla_oft", "libero_spatial_pi05_grpo": "lerobot", "maniskill_pickcube_smolvla_grpo": "lerobot"}

# one update on a CPU: 2 envs, one group of 2, short episodes, small images, no evaluation
CPU = [
    "total_steps=1", "log.progress=false", "log.tensorboard=false", "eval.at_start=false", "eval.at_end=false",
    "env.num_envs=2", "env.vectorization=sync", "env.max_episode_steps=4", "algo.groups_per_step=1", "algo.group_size=2",
    "algo.num_minibatches=1", "algo.micro_batches=1",
]
ENV_CPU = {
    "libero": ["env.image_size=32", "env.settle_steps=0"],
    "maniskill": ["env.image_size=32"],
}


def cpu_overrides(name: str, directory: Path) -> list[str]:
    """The tiny checkpoint of config ``name`` written under ``directory``, and the overrides
    that name it and shrink the run to one update on a CPU."""
    import yaml

    env_type = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["env"]["type"]
    return [*CPU, *ENV_CPU[env_type], *CHECKPOINT_OF[name](directory)]


def _one_update(name: str, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    proc = run_mmrl("train", ROOT / "configs" / f"{name}.yaml", "--run-dir", run, *cpu_overrides(name, tmp_path / "checkpoint"), timeout=900)
    assert proc.returncode == 0, (name, proc.stderr[-3000:])
    assert (run / "checkpoints" / "latest").is_file()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("loss/policy" in m for m in metrics), metrics
    return run


def _loads_back(name: str, exported: Path, tmp_path: Path) -> None:
    """The exported directory is a checkpoint of the config's policy type: the config's own
    policy section, pointed at it, builds a policy for the env's spec."""
    import yaml

    from mmrl.config import from_dict
    from mmrl.core.weights import build_policy
    from mmrl.registry import POLICIES

    section = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["policy"]
    section = {**section, "checkpoint": str(exported)}
    if section["type"] in ("smolvla", "pi05"):
        section["vlm_dir"] = str(tmp_path / "checkpoint" / ("smolvlm" if section["type"] == "smolvla" else "paligemma"))
        state_dim = 8 if name.startswith("libero") else PICKCUBE_STATE_DIM
        cameras = 2 if name.startswith("libero") else 1
        image = [cameras, 32, 32, 3] if cameras > 1 else [32, 32, 3]
        spec = {"action_dim": 7, "action_low": [-1.0] * 7, "action_high": [1.0] * 7, "state_dim": state_dim, "image_shape": image, "instructions": ["pick up the black bowl"]}
    else:
        image = [2, 32, 32, 3] if section["type"] == "openvla_oft" else [32, 32, 3]
        spec = {"action_dim": 7, "action_low": [-1.0] * 7, "action_high": [1.0] * 7, "state_dim": 8, "image_shape": image, "instructions": ["pick up the black bowl"]}
    policy = build_policy(from_dict(POLICIES.entry(section["type"]).config, section, "policy"), spec)
    assert type(policy).__name__ == {"smolvla": "SmolVLAPolicy", "pi05": "PI05Policy", "openvla": "OpenVLAPolicy", "openvla_oft": "OpenVLAOFTPolicy"}[section["type"]]


def _libero():
    pytest.importorskip("libero.libero", reason="LIBERO is not installed (pip install 'mmrl[libero]')")
    pytest.importorskip("transformers")


def _maniskill():
    pytest.importorskip("mani_skill", reason="mani_skill is not installed (pip install 'mmrl[maniskill]')")
    pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(CHECKPOINT_OF))
def test_the_config_names_a_placeholder_checkpoint_and_the_env_it_was_made_for(name):
    import yaml

    from mmrl.hub import split_hub_id

    cfg = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    checkpoint = cfg["policy"]["checkpoint"]
    # a placeholder the user replaces, or the released checkpoint's hub id (fetched on first use)
    assert checkpoint.startswith("checkpoints/") or split_hub_id(checkpoint) is not None
    assert not (ROOT / checkpoint).exists()
    assert cfg["env"]["type"] == ("libero" if name.startswith("libero") else "maniskill")


# ~35-45 s each on 2 cores: one in the default suite, the others with the slow runs
QUICK = "libero_spatial_smolvla_grpo"


@pytest.mark.parametrize("name", [n if n == QUICK else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CHECKPOINT_OF)])
def test_one_update_from_a_tiny_checkpoint_then_export_loads_back(name, tmp_path):
    (_libero if name.startswith("libero") else _maniskill)()
    run = _one_update(name, tmp_path)
    exported = tmp_path / "exported"
    proc = run_mmrl("export", run, "--format", EXPORT[name], "--out", exported, timeout=600)
    assert proc.returncode == 0, (name, proc.stderr[-3000:])
    assert (exported / "config.json").is_file()
    _loads_back(name, exported, tmp_path)
