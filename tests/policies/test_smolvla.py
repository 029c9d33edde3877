"""The ``smolvla`` policy: LeRobot SmolVLA directories read, run as LeRobot runs them,
fine-tuned and written back (tiny random checkpoints written by ``write_tiny_smolvla``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.errors import ConfigError
from mmrl.policies.lora import LoraOptions
from mmrl.policies.smolvla import SmolVLAConfig, SmolVLAPolicy, lerobot_actions, save_lerobot_policy, write_tiny_smolvla
from mmrl.policies.smolvla.model import resize_with_pad
from mmrl.policies.vla.lerobot_flow import EulerGridTransition
from mmrl.policies.vla.lerobot_format import normalize, read_lerobot_policy, read_lerobot_weights, resolve_vlm, unnormalize
from mmrl.registry import REWARDS
from tests.kernel_emulation import check_recompute, sampling_layout

SPEC = {"action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0], "state_dim": 4, "image_shape": [16, 16, 3], "instructions": ["push the block"]}
CAMERAS = {"image": (3, 16, 16)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny SmolVLM and a tiny SmolVLA on it (one 16 px camera, state 4, actions 2, chunk 4, 4 Euler steps)."""
    root = tmp_path_factory.mktemp("smolvla")
    policy_dir = write_tiny_smolvla(root / "policy", root / "vlm", state_dim=4, action_dim=2, cameras=CAMERAS, chunk_size=4, n_action_steps=2)
    return {"root": root, "policy": policy_dir, "vlm": root / "vlm"}


def make(dirs, spec=SPEC, **options) -> SmolVLAPolicy:
    return SmolVLAPolicy(SmolVLAConfig(checkpoint=str(dirs["policy"]), **options), spec)


def env_inputs(n: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"image": torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8), "state": torch.randn(n, 4, generator=g), "instruction": ["push the block to the left"] + ["go"] * (n - 1)}


def lerobot_observation(n: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"observation.images.image": torch.rand(n, 3, 16, 16, generator=g), "observation.state": torch.randn(n, 4, generator=g), "task": ["push the block"] + ["lift"] * (n - 1)}


# ------------------------------------------------------------------ the format


def test_loaded_weights_have_the_files_names_shapes_and_dtypes(dirs):
    policy = make(dirs)
    stored = read_lerobot_weights(dirs["policy"])
    state = policy.state_dict()
    assert set(state) == set(stored) and list(policy.lerobot_keys) == list(stored)
    for key, value in stored.items():
        assert state[key].shape == value.shape and state[key].dtype == value.dtype and torch.equal(state[key], value), key


def test_the_state_dict_keys_are_lerobots(dirs):
    """The module tree LeRobot's SmolVLAPolicy builds (VLAFlowMatching → SmolVLMWithExpertModel):
    the VLM under vlm_with_expert.vlm (lm_head included), the expert without embed_tokens,
    its cross-attention layers' k/v reading the VLM's kv width, five projections."""
    keys = set(make(dirs).state_dict())
    prefixes = ("model.vlm_with_expert.vlm.model.vision_model.", "model.vlm_with_expert.vlm.model.connector.", "model.vlm_with_expert.vlm.model.text_model.", "model.vlm_with_expert.lm_expert.")
    projections = {f"model.{name}.{p}" for name in ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out") for p in ("weight", "bias")}
    assert {k for k in keys if not k.startswith(prefixes)} == projections | {"model.vlm_with_expert.vlm.lm_head.weight"}
    assert "model.vlm_with_expert.vlm.model.text_model.embed_tokens.weight" in keys
    assert not any(k.startswith("model.vlm_with_expert.lm_expert.embed_tokens") for k in keys)
    stored = read_lerobot_weights(dirs["policy"])
    # tiny VLM: width 64, 4 heads of 16 (kv width 64); expert width 48 (0.75), MLP 256; layer 1 cross-attends
    assert stored["model.vlm_with_expert.lm_expert.layers.0.self_attn.k_proj.weight"].shape == (64, 48)
    assert stored["model.vlm_with_expert.lm_expert.layers.1.self_attn.k_proj.weight"].shape == (64, 64)
    assert stored["model.vlm_with_expert.lm_expert.layers.1.self_attn.q_proj.weight"].shape == (64, 48)
    assert stored["model.vlm_with_expert.lm_expert.layers.0.mlp.gate_proj.weight"].shape == (256, 48)
    assert stored["model.state_proj.weight"].shape == (64, 8) and stored["model.action_time_mlp_in.weight"].shape == (48, 96)
    assert not any(".layers.2." in k for k in keys)  # num_vlm_layers 2


def test_export_writes_the_files_it_read(dirs, tmp_path):
    policy = make(dirs)
    out = save_lerobot_policy(policy, tmp_path / "exported")
    for name in sorted(p.name for p in dirs["policy"].iterdir()):
        assert (out / name).read_bytes() == (dirs["policy"] / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in dirs["policy"].iterdir())


def test_load_export_reload_gives_the_same_actions(dirs, tmp_path):
    policy = make(dirs)
    with torch.no_grad():
        for p in policy.model.action_out_proj.parameters():  # a fine-tuned weight
            p.add_(0.01)
    out = save_lerobot_policy(policy, tmp_path / "exported")
    noise = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    theirs = lerobot_actions(str(out), lerobot_observation(), noise)
    assert torch.equal(policy.lerobot_chunk(lerobot_observation(), noise), theirs)
    assert not torch.equal(lerobot_actions(str(dirs["policy"]), lerobot_observation(), noise), theirs)
    assert json.loads((out / "config.json").read_text()) == read_lerobot_policy(dirs["policy"]).config


def test_mmrl_export_of_a_saved_policy_writes_its_trained_weights_in_lerobots_layout(dirs, tmp_path):
    from mmrl.cli import main
    from mmrl.core.weights import save_pretrained

    policy = make(dirs)
    with torch.no_grad():
        policy.model.action_out_proj.bias.add_(0.25)  # a fine-tuned weight
    save_pretrained(policy, tmp_path / "saved")
    assert main(["export", str(tmp_path / "saved"), "--format", "lerobot", "--out", str(tmp_path / "exported")]) == 0
    written = read_lerobot_weights(tmp_path / "exported")
    expected = policy.lerobot_state_dict()
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


def test_export_is_atomic_and_replaces_an_old_directory(dirs, tmp_path):
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "stale.txt").write_text("old")
    with pytest.raises(ConfigError, match="not a LeRobot policy directory"):
        save_lerobot_policy(make(dirs), tmp_path / "exported")
    (tmp_path / "exported" / "config.json").write_text("{}")
    save_lerobot_policy(make(dirs), tmp_path / "exported")
    assert not (tmp_path / "exported" / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]  # no temporary directory left


# ------------------------------------------------------------------ the math


def test_resize_with_pad_keeps_the_aspect_ratio_and_pads_left_and_top():
    image = torch.arange(8, dtype=torch.float32).view(1, 1, 2, 4)
    out = resize_with_pad(image, 4, 4, pad_value=0)
    assert out.shape == (1, 1, 4, 4)
    assert torch.equal(out[0, 0, :2], torch.zeros(2, 4)) and torch.equal(out[0, 0, 2:], image[0, 0])
    tall = torch.ones(1, 3, 8, 4)
    out = resize_with_pad(tall, 4, 4, pad_value=0)  # 8 x 4 → 4 x 2, two columns of padding on the left
    assert torch.equal(out[..., :2], torch.zeros(1, 3, 4, 2)) and torch.equal(out[..., 2:], torch.ones(1, 3, 4, 2))
    big = torch.rand(1, 3, 10, 10)
    assert torch.equal(resize_with_pad(big, 5, 5), F.interpolate(big, size=(5, 5), mode="bilinear", align_corners=False))


def test_normalization_formulas_are_lerobots():
    x = torch.tensor([[1.0, -2.0, 3.0]])
    stats = {"mean": torch.tensor([0.5, 0.0, 1.0]), "std": torch.tensor([2.0, 0.0, 0.5]), "min": torch.tensor([0.0, -2.0, 3.0]), "max": torch.tensor([2.0, 2.0, 3.0])}
    eps = 1e-8
    assert torch.equal(normalize(x, "MEAN_STD", stats, eps), (x - stats["mean"]) / (stats["std"] + eps))
    assert torch.equal(unnormalize(x, "MEAN_STD", stats, eps), x * stats["std"] + stats["mean"])  # no eps on the way back
    span = torch.tensor([2.0, 4.0, eps])  # max = min: eps
    assert torch.equal(normalize(x, "MIN_MAX", stats, eps), 2 * (x - stats["min"]) / span - 1)
    assert torch.equal(unnormalize(x, "MIN_MAX", stats, eps), (x + 1) / 2 * span + stats["min"])
    assert normalize(x, "IDENTITY", {}, eps) is x


def test_the_euler_grid_is_lerobots():
    """t_k = float32(1 + k·dt), dt = −1/K, and the deterministic step x + dt·v."""
    for k in (3, 4, 10):
        transition = EulerGridTransition(k, "flow_ode", 0.5, "flow_grpo")
        dt = -1.0 / k
        assert torch.equal(transition.model_time(torch.arange(k)), torch.tensor([1.0 + i * dt for i in range(k)], dtype=torch.float32))
        x, v = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
        mean, std = transition.mean_std(torch.zeros(2, dtype=torch.long), x, v, torch.zeros(2, dtype=torch.bool))
        assert torch.equal(mean, x + dt * v) and not std.any()


def test_lerobot_chunk_is_the_reference_euler_loop(dirs):
    """lerobot_actions through mmrl's chain equals LeRobot's sample_actions loop written out
    over the same model pieces, and depends only on the noise."""
    policy = make(dirs).eval()
    obs, noise = lerobot_observation(), torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    out = lerobot_actions(str(dirs["policy"]), obs, noise)
    assert out.shape == (2, 4, 2) and out.dtype == torch.float32
    assert torch.equal(out, lerobot_actions(str(dirs["policy"]), obs, noise))
    assert not torch.equal(out, lerobot_actions(str(dirs["policy"]), obs, noise + 0.1))
    with torch.no_grad():
        ids, mask = policy.tokenize(obs["task"])
        assert policy.tokenizer.decode(ids[0][mask[0]]) == "push the block\n"
        cond = policy.lerobot_prefix({"observation.images.image": obs["observation.images.image"]}, obs["observation.state"], ids, mask)
        x, steps = noise.clone(), policy.arch.num_steps
        dt = -1.0 / steps
        for step in range(steps):
            t = torch.tensor(1.0 + step * dt, dtype=torch.float32).expand(2)
            x = x + dt * policy.model.velocity(x, t, cond["memory"], cond["pad"])
        stats = policy.unnormalizer.stats["action"]
        expected = x[:, :, :2] * stats["std"] + stats["mean"]
    assert torch.equal(out, expected)


def test_the_padding_length_of_the_task_does_not_change_the_actions(dirs):
    policy = make(dirs).eval()
    obs, noise = lerobot_observation(), torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    chunks = []
    for padding in ("longest", "max_length"):
        policy.tokenizer_settings["padding"] = padding
        chunks.append(policy.lerobot_chunk(obs, noise))
    torch.testing.assert_close(chunks[0], chunks[1], rtol=1e-5, atol=1e-5)


def test_state_is_normalized_with_the_checkpoints_statistics(dirs):
    policy = make(dirs)
    stats = policy.normalizer.stats["observation.state"]
    assert torch.equal(stats["mean"], torch.tensor([0.5, 0.6, 0.7, 0.8]))
    state = torch.randn(3, 4)
    assert torch.equal(policy.normalizer.normalize("observation.state", state), (state - stats["mean"]) / (stats["std"] + 1e-8))


# ------------------------------------------------------------------ RL


@pytest.mark.numerics
def test_flow_sde_chunks_recompute_with_ratio_one(dirs):
    policy = make(dirs)
    sample = policy.sample(env_inputs(), torch.Generator().manual_seed(0))
    assert sample.output.shape == (3, 2, 2)  # n_action_steps 2 of chunk 4, the env's 2 action dims
    assert sample.replay["chain"]["latents"].shape == (3, 1, 5, 4, 8)  # K = the checkpoint's 4 steps, [chunk, max_action_dim]
    with torch.no_grad(), sampling_layout(policy):  # one denoiser call per step, as sampling
        recomputed = policy.log_prob(sample.replay)
    assert torch.equal(recomputed, sample.logp)
    final = sample.replay["chain"]["latents"][:, 0, -1]
    assert torch.equal(sample.output, policy.latents_to_actions(final)[:, :2])


def test_a_positive_advantage_raises_the_chunks_log_prob(dirs):
    torch.manual_seed(0)
    policy = make(dirs)
    sample = policy.sample(env_inputs(), torch.Generator().manual_seed(1))
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1e-3)
    before = policy.log_prob(sample.replay).detach()
    (-(policy.log_prob(sample.replay)[0].sum())).backward()
    optimizer.step()
    with torch.no_grad():
        after = policy.log_prob(sample.replay)
    assert after[0, 0] > before[0, 0]


def test_sft_on_a_demo_chunk_lowers_the_flow_loss(dirs):
    torch.manual_seed(0)
    policy = make(dirs)
    batch = {**env_inputs(2), "actions": torch.tensor([[[0.5, -0.3]] * 4, [[-0.2, 0.4]] * 4])}
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)

    def loss() -> torch.Tensor:
        torch.manual_seed(123)  # the same times and noise each evaluation
        return policy.sft_loss(batch)

    first = loss().item()
    for _ in range(10):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert loss().item() < first


def test_imitation_batch_gives_the_whole_chunk_back_in_env_units(dirs):
    policy = make(dirs)
    sample = policy.sample(env_inputs(2), torch.Generator().manual_seed(0))
    batch = policy.imitation_batch(sample.replay)
    assert batch["actions"].shape == (2, 4, 2)
    x0 = policy.actions_to_latents(batch["actions"])
    torch.testing.assert_close(x0[..., :2], sample.replay["chain"]["latents"][:, 0, -1, :, :2], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(policy.sft_loss(batch))


def test_value_features_pool_the_vlm_prefix(dirs):
    policy = make(dirs, train_expert_only=False)
    sample = policy.sample(env_inputs(2), torch.Generator().manual_seed(0))
    features = policy.value_features(sample.replay)
    assert features.shape == (2, 1, policy.value_feature_dim) == (2, 1, 64)
    features.sum().backward()
    assert policy.model.vlm_with_expert.text_model.layers[0].self_attn.q_proj.weight.grad is not None


def test_lora_reference_is_the_loaded_model_and_export_merges_the_adapters(dirs, tmp_path):
    torch.manual_seed(0)
    policy = make(dirs, lora=LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), lora_on="both")
    plain = make(dirs)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or not n.startswith("model.vlm_with_expert.lm_expert") for n in trainable)
    sample = plain.sample(env_inputs(2), torch.Generator().manual_seed(0))
    reference = policy.reference()
    assert torch.equal(reference.log_prob(sample.replay), plain.log_prob(sample.replay).detach())
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
        moved = policy.log_prob(sample.replay)
    assert not torch.equal(moved, reference.log_prob(sample.replay))
    assert torch.equal(reference.log_prob(sample.replay), plain.log_prob(sample.replay).detach())
    out = save_lerobot_policy(policy, tmp_path / "merged")
    assert set(read_lerobot_weights(out)) == set(read_lerobot_weights(dirs["policy"]))
    torch.testing.assert_close(lerobot_actions(str(out), lerobot_observation(), torch.zeros(2, 4, 8)), policy.lerobot_chunk(lerobot_observation(), torch.zeros(2, 4, 8)), rtol=1e-4, atol=1e-4)


def test_a_bfloat16_vlm_loads_and_samples(dirs):
    policy = make(dirs, vlm_dtype="bfloat16")
    assert policy.model.vlm_with_expert.vlm.model.text_model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert policy.model.action_out_proj.weight.dtype == torch.float32
    sample = policy.sample(env_inputs(2), torch.Generator().manual_seed(0))
    assert torch.isfinite(sample.output).all() and torch.isfinite(sample.logp).all() and sample.logp.dtype == torch.float32


# ------------------------------------------------------------------ errors


def _edit(dirs, tmp_path, file: str, change) -> str:
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(dirs["policy"], out)
    if file.endswith(".json"):
        data = json.loads((out / file).read_text())
        change(data)
        (out / file).write_text(json.dumps(data))
    else:
        change(out / file)
    return str(out)


@pytest.mark.parametrize(
    "file,change,words",
    [
        ("config.json", lambda c: c.pop("type"), "type"),
        ("config.json", lambda c: c.update(type="act"), "type"),
        ("config.json", lambda c: c.update(adapt_to_pi_aloha=True), "adapt_to_pi_aloha"),
        ("config.json", lambda c: c.update(attention_mode="sliding"), "attention_mode"),
        ("config.json", lambda c: c["output_features"]["action"].update(shape=[3]), "output_features.action.shape"),
        ("config.json", lambda c: c["input_features"].update({"observation.images.wrist": {"type": "VISUAL", "shape": [3, 16, 16]}}), "observation.images.wrist"),
        ("policy_preprocessor_step_5_normalizer_processor.safetensors", lambda p: p.unlink(), "policy_preprocessor_step_5_normalizer_processor.safetensors"),
        ("policy_postprocessor.json", lambda c: c["steps"][0].pop("state_file"), "action"),
        ("model.safetensors", lambda p: p.unlink(), "model.safetensors"),
    ],
)
def test_bad_checkpoints_are_refused_in_one_line(dirs, tmp_path, file, change, words):
    directory = _edit(dirs, tmp_path, file, change)
    with pytest.raises(ConfigError) as e:
        SmolVLAPolicy(SmolVLAConfig(checkpoint=directory), SPEC)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_directory_that_is_not_a_lerobot_policy_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="policy.checkpoint.*config.json"):
        SmolVLAPolicy(SmolVLAConfig(checkpoint=str(tmp_path)), SPEC)


def test_env_mismatches_name_the_field(dirs):
    with pytest.raises(ConfigError, match="output_features.action.shape"):
        make(dirs, spec={**SPEC, "action_dim": 3, "action_low": [-1.0] * 3, "action_high": [1.0] * 3})
    with pytest.raises(ConfigError, match="policy.cameras"):
        make(dirs, cameras=["observation.images.top"])
    with pytest.raises(ConfigError, match="observation.state"):
        make(dirs, spec={**SPEC, "state_dim": 5})


@pytest.mark.numerics
def test_a_checkpoint_with_empty_cameras_runs_on_fewer_cameras_filling_them_as_lerobot_does(dirs, tmp_path, caplog):
    """LeRobot's SmolVLAConfig names its empty cameras as image features (empty_camera_i). Given
    the main camera only, its prepare_images takes the present cameras in the checkpoint's
    order, then at most empty_cameras images of -1 (after x2 - 1) with their mask off, and
    leaves any further missing camera out; mmrl runs the same prefix and warns once."""
    cameras = {"image": (3, 16, 16), "image2": (3, 16, 16), "empty_camera_0": (3, 16, 16)}
    out = write_tiny_smolvla(tmp_path / "policy", dirs["vlm"], state_dim=4, action_dim=2, cameras=cameras, chunk_size=4, n_action_steps=2, empty_cameras=1)
    with caplog.at_level("WARNING", logger="mmrl.policies.smolvla.model"):
        policy = SmolVLAPolicy(SmolVLAConfig(checkpoint=str(out)), SPEC).eval()
        SmolVLAPolicy(SmolVLAConfig(checkpoint=str(out)), SPEC)  # the same checkpoint and cameras: no second warning
    warned = [r.getMessage() for r in caplog.records if "empty image" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "['observation.images.image2'] filled with an empty image (-1, masked out) as LeRobot does" in warned[0]
    assert "['observation.images.empty_camera_0'] are left out" in warned[0] and policy.cameras == ["observation.images.image"]
    obs, key = lerobot_observation(), "observation.images.image"
    with torch.no_grad():
        ids, mask = policy.tokenize(obs["task"])
        ours = policy.lerobot_prefix({key: obs[key]}, obs["observation.state"], ids, mask)
        image = resize_with_pad(policy.normalizer.normalize(key, obs[key]), 32, 32, pad_value=0) * 2.0 - 1.0
        masks = [torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool)]
        state = F.pad(policy.normalizer.normalize("observation.state", obs["observation.state"]), (0, 4))
        embeds, pad, blocks = policy.model.embed_prefix([image, torch.full_like(image, -1.0)], masks, ids, mask, state, policy.special_ids)
        expected = policy.model.vlm_with_expert.prefix(embeds, pad, blocks)
    assert torch.equal(ours["hidden"], expected["hidden"]) and torch.equal(ours["pad"], pad)
    per_image = (ours["pad"].shape[1] - ids.shape[1] - 1) // 2  # two image slots, the words, the state
    assert ours["pad"][:, :per_image].all() and not ours["pad"][:, per_image : 2 * per_image].any()
    sample = policy.sample(env_inputs(), torch.Generator().manual_seed(0))
    with torch.no_grad():  # ratio exactly 1 at the sampling layout; the contract's bound with every step in one call
        check_recompute(policy, sample, atol=1e-4)


def test_a_missing_vlm_lists_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as e:
        resolve_vlm("HuggingFaceTB/SmolVLM2-500M-Video-Instruct", None)
    assert "Hugging Face cache" in str(e.value) and "policy.vlm_dir" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="missing config.json, tokenizer_config.json"):
        resolve_vlm("HuggingFaceTB/SmolVLM2-500M-Video-Instruct", str(tmp_path))


def test_the_vlm_is_found_by_vlm_dir_then_by_name(dirs, tmp_path):
    assert resolve_vlm("not/a-model", str(dirs["vlm"])) == dirs["vlm"]
    assert resolve_vlm(str(dirs["vlm"]), None) == dirs["vlm"]


# ------------------------------------------------------------------ a training run


@dataclass
class SampledLikelihoodConfig(RewardConfig):
    type: str = option("_test_smolvla_likelihood", "registered name of this component (see `mmrl list`)")


@REWARDS.register("_test_smolvla_likelihood", config=SampledLikelihoodConfig)
def sampled_likelihood(rollout, cfg):
    """Test-only: the episode's summed sampling log-prob, a reward that differs within a
    group from the first step (the tabletop's success is all 0 for a random policy)."""
    return (rollout.old_logp * rollout.mask).sum(1)


def test_one_update_through_the_trainer_on_the_tabletop(dirs, tmp_path):
    pytest.importorskip("mujoco")
    from mmrl.config import from_dict
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    cfg = from_dict(TrainConfig, {
        "name": "smolvla_step", "seed": 0, "total_steps": 1, "run_dir": str(tmp_path / "run"),
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 4, "kwargs": {"task": "spatial", "image_size": 16}},
        "policy": {"type": "smolvla", "checkpoint": str(dirs["policy"]), "vlm_dir": str(dirs["vlm"])},
        "sampler": {"type": "env", "max_decisions": 2},
        "rewards": [{"type": "_test_smolvla_likelihood"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1, "kl": {"coef": 0.0}},
        "optim": {"lr": 0.01},
        "eval": {"every": 1000, "at_start": False, "at_end": False},
        "log": {"progress": False, "tensorboard": False},
        "checkpoint": {"every": 1000},
    })
    trainer = Trainer(cfg)
    expert = trainer.policy.model.vlm_with_expert.lm_expert
    before = {name: p.detach().clone() for name, p in expert.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[name]) for name, p in expert.named_parameters())
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["objective/ratio"] == 1.0 and math.isfinite(metrics["loss/policy"])


@pytest.mark.numerics
def test_flow_noise_learns_a_noise_head_recomputes_with_ratio_one_and_exports_without_it(dirs, tmp_path):
    """Flow-Noise (πRL) on a LeRobot expert: mmrl's noise head on the action tokens' states
    gives each step's std; the ODE (LeRobot's inference) is unchanged, the chain's log-prob
    recomputes exactly, a positive advantage trains the head, and the export holds the
    checkpoint's tensors only."""
    from safetensors import safe_open

    from mmrl.policies.vla.lerobot_config import LeRobotDenoising

    policy = make(dirs, denoising=LeRobotDenoising(transition="flow_noise", noise_std_range=[0.05, 0.3]))
    plain = make(dirs)
    assert policy.noise_head is not None and plain.noise_head is None
    inputs = env_inputs()
    with torch.no_grad():
        assert torch.equal(policy.sample(inputs, deterministic=True).output, plain.sample(inputs, deterministic=True).output)
    sample = policy.sample(inputs, torch.Generator().manual_seed(0))
    with torch.no_grad(), sampling_layout(policy):  # one denoiser call per step, as sampling
        assert torch.equal(policy.log_prob(sample.replay), sample.logp)
    head = [p.detach().clone() for p in policy.noise_head.parameters()]
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    before = policy.log_prob(sample.replay).detach()
    (-(policy.log_prob(sample.replay)[0].sum())).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.noise_head.parameters())
    optimizer.step()
    with torch.no_grad():
        assert policy.log_prob(sample.replay)[0, 0] > before[0, 0]
    assert any(not torch.equal(a, b) for a, b in zip(head, policy.noise_head.parameters()))
    out = save_lerobot_policy(policy, tmp_path / "exported")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("noise_head") for k in f.keys())
    with safe_open(str(dirs["policy"] / "model.safetensors"), "pt") as f, safe_open(str(out / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
