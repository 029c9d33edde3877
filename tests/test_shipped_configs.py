"""Every shipped config trains: a short run of each through the command line, at its own
sizes except the number of updates and (for the tabletop) episodes per update. SFT configs
train on a few demonstrations collected here; RL configs that start from an SFT run start
from the SFT smoke run of the same family (trained once, in a directory of its own)."""

import pytest

from tests.conftest import ROOT, run_mmrl
from tests.test_vla_checkpoint_configs import CHECKPOINT_OF, cpu_overrides

CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
SHORT = ["total_steps=1", "log.progress=false", "log.tensorboard=false", "eval.at_end=false"]
# the SFT run each RL config starts from (policy.pretrained), by config name
# (a stage-2 variant such as text_arithmetic_grpo_care starts from the family's SFT run too)
SFT_OF = {name: name.split("_grpo")[0] + "_sft" for name in CONFIGS if "_grpo" in name and name.split("_grpo")[0] + "_sft" in CONFIGS}
SFT_OF["tabletop_object_flow_vla_gae"] = SFT_OF["tabletop_object_flow_vla_gae_dense"] = "tabletop_flow_vla_sft"  # value-baseline RL of the object family
SFT_OF["tabletop_object_flow_vla_gae_privileged"] = "tabletop_flow_vla_sft"
SFT_OF.pop("tabletop_spatial_smolvla_grpo", None)  # starts from the SFT run's LeRobot export (policy.checkpoint), not policy.pretrained
SFT_OF["tabletop_spatial_flow_vla_gae"] = "tabletop_spatial_flow_vla_sft"  # the spatial family's value-baseline RL
SFT_OF["tabletop_object_state_gae"] = "tabletop_object_state_sft"  # the state policy's value-baseline RL
SFT_OF["tabletop_object_state_gae_warp"] = "tabletop_object_state_sft"  # the same on MuJoCo Warp
SFT_OF["tabletop_spatial_vlm_token_vla_gae"] = "tabletop_spatial_vlm_token_vla_sft"  # RL of the VLA on mmrl's pretrained VLM
SFT_OF["image_shapes_flow_grpo"] = "image_shapes_flow_sft_words"  # the word-level generator
SFT_OF["image_shapes_flow_grpo_adversarial"] = "image_shapes_flow_sft_words"
SFT_OF["image_shapes_nft"] = "image_shapes_flow_sft_words"  # DiffusionNFT from the same generator
SFT_OF["image_text_render_nft"] = "image_text_render_sft"  # DiffusionNFT on the OCR reward from the text-rendering generator
# DSRL configs: the SFT run whose policy they steer frozen (policy.policy.pretrained)
STEERED_OF = {"tabletop_spatial_flow_dsrl": "tabletop_spatial_flow_vla_sft"}
# RL configs rewarded by a learned reward model: the reward-model config whose smoke run they score with
REWARD_MODEL_OF = {"image_shapes_flow_grpo_pairwise": "reward_shapes_single_count_pairwise"}
# RL configs rewarded by a trajectory reward model (win rate): the reward-model config whose smoke run they score with
TRAJECTORY_MODEL_OF = {"tabletop_spatial_flow_vla_grpo_trajectory": "reward_tabletop_spatial_trajectory"}
# RL configs whose env reads a learned success classifier: the classifier config whose smoke run they read
SUCCESS_MODEL_OF = {"tabletop_spatial_flow_vla_grpo_learned_success": "learned_success_tabletop_spatial"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Demonstrations of every tabletop task (one episode each)."""
    root = tmp_path_factory.mktemp("shipped")
    done = run_mmrl("collect", "--task", "all", "--episodes-per-task", "1", "--out", root / "demos", timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return root


def _start(workdir, name: str):
    """The smoke run of ``name`` that another config starts from, trained once per module."""
    run = workdir / "starts" / name
    if not (run / "checkpoints" / "latest").is_file():
        _train(workdir, name, run)
    return run


def _demos(workdir, name: str):
    """The demonstrations a tabletop SFT config trains on: state-only ones (``obs_mode:
    state``, collected here once) for a state policy's config, else the module's."""
    if "_state_" not in name:
        return workdir / "demos"
    demos = workdir / "demos_state"
    if not demos.exists():
        done = run_mmrl("collect", "--task", "object", "--episodes-per-task", "1", "--obs-mode", "state", "--out", demos, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    return demos


def _vlm(workdir, pretrained: bool):
    """scripts/pretrained_vla_tabletop.sh's VLMs, smaller in time: the random tiny SmolVLM that
    configs/tabletop_vlm_pretrain.yaml pretrains, or that config's smoke run exported."""
    import subprocess
    import sys

    if not pretrained:
        out = workdir / "vlm" / "init_smolvlm64"
        if not (out / "config.json").is_file():
            command = ["-m", "mmrl.policies.vla.tiny_vlm", "--family", "smolvlm", "--out", out, "--image-size", "64", "--patch-size", "8",
                       "--vision-hidden-size", "32", "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--intermediate-size", "128"]
            done = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-2000:]
        return out
    out = workdir / "vlm" / "pretrained_smolvlm64"
    if not (out / "config.json").is_file():
        command = ["-m", "mmrl.policies.vla.pretrained", "export", _start(workdir, "tabletop_vlm_pretrain"), "--out", out]
        done = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    return out


def _train(workdir, name: str, run):
    overrides = list(SHORT)
    if name.startswith("tabletop_"):
        rl = name.endswith("_dsrl") or "_grpo" in name or "_gae" in name
        overrides += ["env.num_envs=8", "algo.groups_per_step=1"] if rl else [f"data.path={_demos(workdir, name)}", "data.batch_size=8"]
    if name.startswith("reward_shapes"):  # pairs written by their documented command, smaller
        pairs = workdir / f"{name}_pairs"
        if not pairs.exists():
            from mmrl.tasks.shapes.pairs import write_shapes_pairs

            import yaml

            size = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["policy"]["image_size"]
            write_shapes_pairs(pairs, size=size, num_train=8, num_held_out=4, set_size=4 if "_set_" in name else 0)
        overrides += [f"data.path={pairs}", "data.batch_size=4"]
    if name.startswith("learned_success_"):  # frames labelled with the success of the state each shows (labels: step), so recorded
        # as the config's own episodes are, from an env whose success does not end them: the expert's (the approach, then
        # solved states) and a very noisy expert's failures. The module's demos end at success and show no solved state.
        episodes = workdir / "success_episodes"
        if not episodes.exists():
            from mmrl.commands.collect import collect

            for noise, keep_failures in ((0.0, False), (5.0, True)):
                collect(["spatial"], 1, episodes, env_kwargs={"terminate_on_success": False}, noise=noise, keep_failures=keep_failures, append=noise > 0)
        overrides += [f"data.path={episodes}", "data.held_out=0", "data.batch_size=8"]
    if name.startswith("reward_tabletop_"):  # trajectory pairs: the expert's successes and episodes cut after 2 steps (failures)
        pairs = workdir / f"{name}_pairs"
        if not pairs.exists():
            episodes = workdir / "trajectory_episodes"
            for flags in ([], ["--max-episode-steps", "2", "--keep-failures", "--append"]):
                done = run_mmrl("collect", "--task", "spatial", "--episodes-per-task", "1", "--out", episodes, *flags, timeout=900)
                assert done.returncode == 0, done.stderr[-2000:]
            from mmrl.commands.pairs import write_episode_pairs

            write_episode_pairs(pairs, episodes, held_out_fraction=0.0)
        overrides += [f"data.path={pairs}", "data.batch_size=4"]
    if name.startswith("tabletop_spatial_smolvla_"):  # the SmolVLA pipeline: a start written from the demos, RL and DSRL from the SFT run's export
        import importlib.util

        start = workdir / "smolvla_start"
        if not (start / "policy" / "config.json").is_file():
            spec = importlib.util.spec_from_file_location("write_smolvla_start", ROOT / "scripts" / "write_smolvla_start.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.write_start(workdir / "demos", start / "policy")
        section = "policy.policy" if name.endswith("_dsrl") else "policy"  # DSRL steers the SmolVLA frozen, in policy.policy
        overrides += [f"{section}.vlm_dir={start / 'smolvlm'}"]
        if name.endswith("_sft"):
            overrides += [f"policy.checkpoint={start / 'policy'}"]
        else:
            exported = workdir / "smolvla_sft_export"
            if not (exported / "config.json").is_file():
                done = run_mmrl("export", _start(workdir, "tabletop_spatial_smolvla_sft"), "--format", "lerobot", "--out", exported, timeout=600)
                assert done.returncode == 0, done.stderr[-2000:]
            overrides += [f"{section}.checkpoint={exported}"]
    if name == "tabletop_vlm_pretrain" or name.startswith("tabletop_spatial_vlm_token_vla_"):  # the VLA on mmrl's own pretrained VLM
        overrides.append(f"policy.backbone.vlm_path={_vlm(workdir, pretrained=name != 'tabletop_vlm_pretrain')}")
    if name == "maniskill_pushcube_rlpd":  # demonstrations of the config's own env, by its scripted expert (as `make train` collects them)
        demos = workdir / "demos_pushcube"
        if not demos.exists():
            done = run_mmrl("collect", "--config", ROOT / "configs" / f"{name}.yaml", "--episodes-per-task", "2", "--out", demos, timeout=900)
            assert done.returncode == 0, done.stderr[-2000:]
        overrides.append(f"algo.loss.demos={demos}")
    if name in CHECKPOINT_OF:  # a released VLA checkpoint's config: a tiny checkpoint of its format, shrunk for a CPU
        overrides += cpu_overrides(name, workdir / "checkpoints" / name)
    if name in SFT_OF:
        overrides.append(f"policy.pretrained={_start(workdir, SFT_OF[name])}")
    if name in STEERED_OF:
        overrides.append(f"policy.policy.pretrained={_start(workdir, STEERED_OF[name])}")
    if name in TRAJECTORY_MODEL_OF:
        overrides.append(f"rewards=[{{type: pairwise_preference, model: {_start(workdir, TRAJECTORY_MODEL_OF[name])}, mode: win_rate}}]")
    if name in SUCCESS_MODEL_OF:
        overrides.append(f"env.success_model.path={_start(workdir, SUCCESS_MODEL_OF[name])}")
    if name in REWARD_MODEL_OF:
        model = _start(workdir, REWARD_MODEL_OF[name])
        overrides.append(f"rewards=[{{type: pairwise_preference, model: {model}, mode: pointwise}}, {{type: shapes_geneval, mode: strict, min_fill: 0.6, weight: 0.0}}]")
    proc = run_mmrl("train", ROOT / "configs" / f"{name}.yaml", "--run-dir", run, *overrides, timeout=1800)
    assert proc.returncode == 0, (name, proc.stderr[-3000:])
    assert (run / "checkpoints" / "latest").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_trains(workdir, name):
    """Each config trains in a run directory of its own, whatever ran before it."""
    _train(workdir, name, workdir / "runs" / name)
