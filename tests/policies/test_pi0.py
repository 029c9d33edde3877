"""The ``pi0`` and ``pi05`` policies: LeRobot π0 / π0.5 directories read, run as LeRobot 0.4.4
runs them, fine-tuned and written back (tiny random checkpoints written by ``write_tiny_pi0``)."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.errors import ConfigError
from mmrl.policies.lora import LoraOptions
from mmrl.policies.pi0 import PI0Config, PI0Policy, PI05Config, PI05Policy, lerobot_actions, save_lerobot_policy, write_tiny_pi0
from mmrl.policies.pi0.model import additive_mask, apply_rope, discretize_state, eager_attention, gemma_norm, pi05_prompt, prepare_image, resize_with_pad, rope_cos_sin
from mmrl.policies.vla.lerobot_format import normalize, read_lerobot_policy, read_lerobot_weights, unnormalize
from mmrl.registry import REWARDS
from tests.kernel_emulation import sampling_layout

SPEC = {"action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0], "state_dim": 4, "image_shape": [16, 16, 3], "instructions": ["push the block"]}
CAMERAS = {"image": (3, 16, 16)}
KINDS = ("pi0", "pi05")
CLASSES = {"pi0": (PI0Policy, PI0Config), "pi05": (PI05Policy, PI05Config)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny PaliGemma tokenizer and a tiny π0 and π0.5 on it (one 16 px camera resized to 32, state 4, actions 2, chunk 4, 4 Euler steps)."""
    root = tmp_path_factory.mktemp("pi0")
    out = {"root": root, "vlm": root / "vlm"}
    for kind in KINDS:
        out[kind] = write_tiny_pi0(root / kind, root / "vlm", state_dim=4, action_dim=2, cameras=CAMERAS, kind=kind, chunk_size=4, n_action_steps=2)
    return out


def make(dirs, kind="pi0", spec=SPEC, **options):
    policy_class, config_class = CLASSES[kind]
    return policy_class(config_class(checkpoint=str(dirs[kind]), **options), spec)


def env_inputs(n: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"image": torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8), "state": torch.randn(n, 4, generator=g), "instruction": ["push the block to the left"] + ["go"] * (n - 1)}


def lerobot_observation(n: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"observation.images.image": torch.rand(n, 3, 16, 16, generator=g), "observation.state": torch.randn(n, 4, generator=g), "task": ["push the block"] + ["lift"] * (n - 1)}


# ------------------------------------------------------------------ the format


@pytest.mark.numerics
@pytest.mark.parametrize("kind", KINDS)
def test_flow_noise_recomputes_with_ratio_one_and_leaves_the_ode_as_loaded(dirs, kind):
    from mmrl.policies.vla.lerobot_config import LeRobotDenoising

    policy = make(dirs, kind, denoising=LeRobotDenoising(transition="flow_noise"))
    assert policy.noise_head is not None
    with torch.no_grad():
        assert torch.equal(policy.sample(env_inputs(), deterministic=True).output, make(dirs, kind).sample(env_inputs(), deterministic=True).output)
    sample = policy.sample(env_inputs(), torch.Generator().manual_seed(0))
    with torch.no_grad():
        recomputed = policy.log_prob(sample.replay)
        assert torch.equal(policy.log_prob(sample.replay), recomputed)
    if not sample.logp_deferred:  # a deferred policy's sampled numbers are provisional: the learner recomputes them
        assert torch.equal(recomputed, sample.logp)
    assert not any(k.startswith("noise_head") for k in policy.lerobot_state_dict())


@pytest.mark.parametrize("kind", KINDS)
def test_loaded_weights_have_the_files_names_shapes_and_dtypes(dirs, kind):
    policy = make(dirs, kind)
    stored = read_lerobot_weights(dirs[kind])
    state = policy.state_dict()
    assert set(state) == set(stored) and list(policy.lerobot_keys) == list(stored)
    for key, value in stored.items():
        assert state[key].shape == value.shape and state[key].dtype == value.dtype and torch.equal(state[key], value), key


@pytest.mark.parametrize("kind", KINDS)
def test_the_state_dict_keys_are_lerobots(dirs, kind):
    """The module tree LeRobot's PI0Pytorch / PI05Pytorch builds under transformers 4.5x: SigLIP
    under vision_tower.vision_model, the projector, Gemma, the expert without word embeddings;
    π0: state_proj and the action-time MLP; π0.5: the time MLP and adaptive expert norms."""
    keys = set(make(dirs, kind).state_dict())
    pg, ex = "model.paligemma_with_expert.paligemma.", "model.paligemma_with_expert.gemma_expert."
    assert pg + "model.vision_tower.vision_model.embeddings.patch_embedding.weight" in keys
    assert pg + "model.vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight" in keys
    assert pg + "model.vision_tower.vision_model.post_layernorm.weight" in keys
    assert pg + "model.multi_modal_projector.linear.weight" in keys and pg + "model.language_model.layers.1.mlp.down_proj.weight" in keys
    assert (pg + "model.language_model.embed_tokens.weight" in keys) != (pg + "lm_head.weight" in keys)  # one tensor, the file's name
    assert ex + "lm_head.weight" in keys and not any(k.startswith(ex + "model.embed_tokens") for k in keys)
    heads = {"pi0": ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out"), "pi05": ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")}[kind]
    assert {k for k in keys if not k.startswith("model.paligemma_with_expert.")} == {f"model.{n}.{p}" for n in heads for p in ("weight", "bias")}
    stored = read_lerobot_weights(dirs[kind])
    assert stored[ex + "model.layers.0.self_attn.q_proj.weight"].shape == (64, 48)  # 8 heads of 8 over the expert's 48
    assert stored[ex + "model.layers.0.self_attn.k_proj.weight"].shape == (8, 48)  # one kv head
    assert stored[pg + "model.multi_modal_projector.linear.weight"].shape == (64, 32)
    if kind == "pi05":
        assert stored[ex + "model.layers.0.input_layernorm.dense.weight"].shape == (144, 48) and ex + "model.norm.dense.bias" in stored
        assert not any(k.startswith(ex) and k.endswith("layernorm.weight") for k in keys) and ex + "model.norm.weight" not in keys
    else:
        assert stored["model.action_time_mlp_in.weight"].shape == (48, 96) and stored["model.state_proj.weight"].shape == (48, 8)


def test_lerobots_key_renames_are_applied(dirs, tmp_path):
    """LeRobot's from_pretrained renames time_mlp_* to action_time_mlp_* for π0 (and adds a missing model. prefix)."""
    from safetensors.torch import save_file

    out = tmp_path / "renamed"
    shutil.copytree(dirs["pi0"], out)
    stored = read_lerobot_weights(out)
    renamed = {(k.replace("model.action_time_mlp_", "time_mlp_") if "action_time_mlp_" in k else k): v for k, v in stored.items()}
    save_file(renamed, str(out / "model.safetensors"))
    policy = PI0Policy(PI0Config(checkpoint=str(out)), SPEC)
    assert torch.equal(policy.model.action_time_mlp_in.weight, stored["model.action_time_mlp_in.weight"])


@pytest.mark.parametrize("kind", KINDS)
def test_export_writes_the_files_it_read(dirs, kind, tmp_path):
    out = save_lerobot_policy(make(dirs, kind), tmp_path / "exported")
    for name in sorted(p.name for p in dirs[kind].iterdir()):
        assert (out / name).read_bytes() == (dirs[kind] / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in dirs[kind].iterdir())


@pytest.mark.parametrize("kind", KINDS)
def test_load_export_reload_gives_the_same_actions(dirs, kind, tmp_path):
    policy = make(dirs, kind)
    with torch.no_grad():
        for p in policy.model.action_out_proj.parameters():  # a fine-tuned weight
            p.add_(0.01)
    out = save_lerobot_policy(policy, tmp_path / "exported")
    noise = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    theirs = lerobot_actions(str(out), lerobot_observation(), noise)
    assert torch.equal(policy.lerobot_chunk(lerobot_observation(), noise), theirs)
    assert not torch.equal(lerobot_actions(str(dirs[kind]), lerobot_observation(), noise), theirs)
    assert json.loads((out / "config.json").read_text()) == read_lerobot_policy(dirs[kind]).config


def test_mmrl_export_of_a_saved_policy_writes_its_trained_weights_in_lerobots_layout(dirs, tmp_path):
    from mmrl.cli import main
    from mmrl.core.weights import save_pretrained

    policy = make(dirs, "pi05")
    with torch.no_grad():
        policy.model.action_out_proj.bias.add_(0.25)  # a fine-tuned weight
    save_pretrained(policy, tmp_path / "saved")
    assert main(["export", str(tmp_path / "saved"), "--format", "lerobot", "--out", str(tmp_path / "exported")]) == 0
    written = read_lerobot_weights(tmp_path / "exported")
    expected = policy.lerobot_state_dict()
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


# ------------------------------------------------------------------ the math


def test_resize_with_pad_centres_the_image_with_minus_one():
    image = torch.arange(8, dtype=torch.float32).view(1, 2, 4, 1) / 10  # [B, H, W, C]: 2 x 4
    out = resize_with_pad(image, 4, 4)  # 2 x 4 fits: one row of -1 above, one below
    assert out.shape == (1, 4, 4, 1)
    assert torch.equal(out[0, 0, :, 0], -torch.ones(4)) and torch.equal(out[0, 3, :, 0], -torch.ones(4)) and torch.equal(out[0, 1:3], image[0])
    odd = resize_with_pad(torch.zeros(1, 4, 1, 1), 4, 4)  # 4 x 1 → 3 columns of padding: 1 left, 2 right
    assert torch.equal(odd[0, :, :, 0], torch.tensor([[-1.0, 0.0, -1.0, -1.0]] * 4))
    big = torch.rand(1, 10, 10, 3)
    assert torch.equal(resize_with_pad(big, 5, 5), F.interpolate(big.permute(0, 3, 1, 2), size=(5, 5), mode="bilinear", align_corners=False).clamp(-1, 1).permute(0, 2, 3, 1))


def test_image_preparation_pads_before_the_rescaling_as_lerobot_does():
    """LeRobot pads [0, 1] images with −1 and then maps x → 2x − 1: padded pixels end at −3."""
    image = torch.rand(2, 3, 16, 8)
    out = prepare_image(image, (16, 16))
    assert out.shape == (2, 3, 16, 16) and torch.equal(out[..., :4], torch.full((2, 3, 16, 4), -3.0))
    torch.testing.assert_close(out[..., 4:12], image * 2 - 1)
    same = torch.rand(1, 3, 16, 16)
    assert torch.equal(prepare_image(same, (16, 16)), same * 2.0 - 1.0)


def test_rope_norm_and_attention_are_transformers_gemmas():
    from transformers import GemmaConfig
    from transformers.models.gemma import modeling_gemma as mg

    config = GemmaConfig(hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=1, num_hidden_layers=1, intermediate_size=32, vocab_size=16)
    positions = torch.tensor([[0, 1, 2, 5, 9], [3, 4, 4, 7, 30]])
    x = torch.randn(2, 5, 8)
    cos, sin = mg.GemmaRotaryEmbedding(config)(x, positions)
    ours = rope_cos_sin(positions, 8)
    assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin)
    q, k = torch.randn(2, 8, 5, 8), torch.randn(2, 1, 5, 8)
    ref_q, ref_k = mg.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(apply_rope(q, *ours), ref_q) and torch.equal(apply_rope(k, *ours), ref_k)
    norm = mg.GemmaRMSNorm(64)
    with torch.no_grad():
        norm.weight.normal_()
    h = torch.randn(2, 5, 64)
    out, gate = gemma_norm(norm, h)
    assert torch.equal(out, norm(h)) and gate is None
    attn = mg.GemmaAttention(config, 0)
    mask = torch.rand(2, 5, 5) > 0.3
    mask[:, :, 0] = True
    v = torch.randn(2, 1, 5, 8)
    expected, _ = mg.eager_attention_forward(attn, q, k, v, additive_mask(mask), attn.scaling)
    assert torch.equal(eager_attention(q, k, v, additive_mask(mask), 8**-0.5), expected.reshape(2, 5, -1))


def test_adaptive_norm_is_openpis():
    from mmrl.policies.pi0.model import AdaRMSNorm, gated_residual

    norm = AdaRMSNorm(6, 4, 1e-6)
    with torch.no_grad():
        norm.dense.weight.normal_()
        norm.dense.bias.normal_()
    x, cond = torch.randn(2, 3, 6), torch.randn(2, 4)
    out, gate = gemma_norm(norm, x, cond)
    scale, shift, g = norm.dense(cond)[:, None].chunk(3, dim=-1)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, normed * (1 + scale) + shift)
    assert torch.equal(gate, g)
    assert torch.equal(gated_residual(x, out, gate), x + out * gate) and torch.equal(gated_residual(x, out, None), x + out)
    again, _ = gemma_norm(norm, x, (cond[[1, 0]], torch.tensor([1, 0])))  # distinct conditions + row index (each row on its own)
    torch.testing.assert_close(again, out)


def test_pi05_state_tokens_and_prompt_are_lerobots():
    state = torch.tensor([[-1.5, -1.0, -0.999, 0.0, 0.5, 0.99999, 1.0, 2.0]])
    bins = discretize_state(state)
    assert bins[0].tolist() == np.digitize(state.numpy()[0], np.linspace(-1, 1, 257)[:-1]).__sub__(1).tolist()
    assert bins[0].tolist() == [-1, 0, 0, 128, 192, 255, 255, 255]
    assert pi05_prompt("  pick_up the\ncube ", [1, 2]) == "Task: pick up the cube, State: 1 2;\nAction: "


def test_quantile_normalization_is_lerobots():
    x = torch.tensor([[0.0, 3.0]])
    stats = {"q01": torch.tensor([-1.0, 3.0]), "q99": torch.tensor([1.0, 3.0])}
    span = torch.tensor([2.0, 1e-8])
    assert torch.equal(normalize(x, "QUANTILES", stats, 1e-8), 2 * (x - stats["q01"]) / span - 1)
    assert torch.equal(unnormalize(x, "QUANTILES", stats, 1e-8), (x + 1.0) * span / 2.0 + stats["q01"])


@pytest.mark.parametrize("kind", KINDS)
def test_lerobot_chunk_is_the_reference_euler_loop(dirs, kind):
    """lerobot_actions through mmrl's chain equals LeRobot's sample_actions loop written out
    over the same model pieces (dt = −1/K from t = 1), and depends only on the noise."""
    policy = make(dirs, kind).eval()
    obs, noise = lerobot_observation(), torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    out = lerobot_actions(str(dirs[kind]), obs, noise)
    assert out.shape == (2, 4, 2) and out.dtype == torch.float32
    assert torch.equal(out, lerobot_actions(str(dirs[kind]), obs, noise))
    assert not torch.equal(out, lerobot_actions(str(dirs[kind]), obs, noise + 0.1))
    with torch.no_grad():
        ids, mask = policy.tokenize(obs["task"], obs["observation.state"])
        text = policy.tokenizer.decode(ids[0][mask[0]])
        assert text == "push the block\n" if kind == "pi0" else text.startswith("Task: push the block, State: ") and text.endswith(";\nAction: ")
        cond = policy.lerobot_prefix({"observation.images.image": obs["observation.images.image"]}, obs["observation.state"], ids, mask)
        x, steps = noise.clone(), policy.arch.num_inference_steps
        dt = -1.0 / steps
        for step in range(steps):
            t = torch.tensor(1.0 + step * dt, dtype=torch.float32).expand(2)
            x = x + dt * policy.model.velocity(x, t, cond["prefix"], cond["pad"], cond["state"])
        expected = policy.unnormalizer.unnormalize("action", x[:, :, :2])
    assert torch.equal(out, expected)
    if kind == "pi0":
        stats = policy.unnormalizer.stats["action"]
        assert torch.equal(expected, x[:, :, :2] * stats["std"] + stats["mean"])


def test_the_padding_length_of_the_task_does_not_change_the_actions(dirs):
    policy = make(dirs).eval()
    obs, noise = lerobot_observation(), torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    chunks = []
    for padding in ("longest", "max_length"):
        policy.tokenizer_settings["padding"] = padding
        chunks.append(policy.lerobot_chunk(obs, noise))
    torch.testing.assert_close(chunks[0], chunks[1], rtol=1e-5, atol=1e-5)


def test_an_absent_camera_is_an_empty_image(dirs, tmp_path):
    """LeRobot fills every image feature the batch lacks with a −1 image whose tokens are masked out."""
    out = tmp_path / "two"
    write_tiny_pi0(out, dirs["vlm"], state_dim=4, action_dim=2, cameras={"image": (3, 16, 16), "wrist": (3, 16, 16)})
    policy = PI0Policy(PI0Config(checkpoint=str(out), cameras=["observation.images.image"]), SPEC)
    obs = lerobot_observation()
    ids, mask = policy.tokenize(obs["task"])
    cond = policy.lerobot_prefix({"observation.images.image": obs["observation.images.image"]}, obs["observation.state"], ids, mask)
    patches = (32 // 8) ** 2
    assert cond["pad"].shape[1] == 2 * patches + 16 and not cond["pad"][:, patches : 2 * patches].any() and cond["pad"][:, :patches].all()


# ------------------------------------------------------------------ RL


@pytest.mark.numerics
@pytest.mark.parametrize("kind", KINDS)
def test_flow_sde_chunks_recompute_with_ratio_one(dirs, kind):
    policy = make(dirs, kind)
    for seed in range(2):
        sample = policy.sample(env_inputs(3, seed), torch.Generator().manual_seed(seed))
        assert sample.output.shape == (3, 2, 2)  # n_action_steps 2 of chunk 4, the env's 2 action dims
        assert sample.replay["chain"]["latents"].shape == (3, 1, 5, 4, 8)  # K = the checkpoint's 4 steps, [chunk, max_action_dim]
        with torch.no_grad(), sampling_layout(policy):  # one denoiser call per step, as sampling
            recomputed = policy.log_prob(sample.replay)
        assert torch.equal(recomputed, sample.logp)
    final = sample.replay["chain"]["latents"][:, 0, -1]
    assert torch.equal(sample.output, policy.latents_to_actions(final)[:, :2])


@pytest.mark.parametrize("kind", KINDS)
def test_a_positive_advantage_raises_the_chunks_log_prob(dirs, kind):
    torch.manual_seed(0)
    policy = make(dirs, kind, train_expert_only=True)
    sample = policy.sample(env_inputs(), torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
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
    for _ in range(5):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert loss().item() < first


def test_training_scope_follows_the_checkpoint_and_the_options(dirs):
    policy = make(dirs)  # the checkpoint: everything trains (LeRobot's defaults)
    pw = policy.model.paligemma_with_expert
    assert pw.vision_model.embeddings.patch_embedding.weight.requires_grad and pw.language_model.layers[0].mlp.up_proj.weight.requires_grad
    assert not pw.gemma_expert.lm_head.weight.requires_grad
    frozen = make(dirs, freeze_vision_encoder=True)
    assert not any(p.requires_grad for p in frozen.model.paligemma_with_expert.vision_model.parameters())
    assert frozen.model.paligemma_with_expert.language_model.layers[0].mlp.up_proj.weight.requires_grad
    expert = make(dirs, train_expert_only=True)
    assert not any(p.requires_grad for p in expert.model.paligemma_with_expert.paligemma.parameters())
    assert all(p.requires_grad for p in expert.model.paligemma_with_expert.expert_model.parameters())


def test_imitation_batch_gives_the_whole_chunk_back_in_env_units(dirs):
    policy = make(dirs, "pi05")
    sample = policy.sample(env_inputs(2), torch.Generator().manual_seed(0))
    batch = policy.imitation_batch(sample.replay)
    assert batch["actions"].shape == (2, 4, 2)
    x0 = policy.actions_to_latents(batch["actions"])
    torch.testing.assert_close(x0[..., :2], sample.replay["chain"]["latents"][:, 0, -1, :, :2], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(policy.sft_loss(batch))


def test_value_features_pool_the_prefix(dirs):
    policy = make(dirs)
    sample = policy.sample(env_inputs(2), torch.Generator().manual_seed(0))
    features = policy.value_features(sample.replay)
    assert features.shape == (2, 1, policy.value_feature_dim) == (2, 1, 64)
    features.sum().backward()
    assert policy.model.paligemma_with_expert.language_model.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("kind", KINDS)
def test_lora_reference_is_the_loaded_model_and_export_merges_the_adapters(dirs, kind, tmp_path):
    torch.manual_seed(0)
    policy = make(dirs, kind, lora=LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), lora_on="both")
    plain = make(dirs, kind)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or not n.startswith("model.paligemma_with_expert.gemma_expert.model") for n in trainable)
    sample = plain.sample(env_inputs(2), torch.Generator().manual_seed(0))
    reference = policy.reference()
    assert torch.equal(reference.log_prob(sample.replay), plain.log_prob(sample.replay).detach())
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
        moved = policy.log_prob(sample.replay)
    assert not torch.equal(moved, reference.log_prob(sample.replay))
    out = save_lerobot_policy(policy, tmp_path / "merged")
    assert set(read_lerobot_weights(out)) == set(read_lerobot_weights(dirs[kind]))
    torch.testing.assert_close(lerobot_actions(str(out), lerobot_observation(), torch.zeros(2, 4, 8)), policy.lerobot_chunk(lerobot_observation(), torch.zeros(2, 4, 8)), rtol=1e-4, atol=1e-4)


def test_a_bfloat16_paligemma_loads_and_samples(dirs):
    policy = make(dirs, "pi05", vlm_dtype="bfloat16")
    pw = policy.model.paligemma_with_expert
    assert pw.language_model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert pw.vision_model.embeddings.patch_embedding.weight.dtype == torch.float32 and pw.language_model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert policy.model.action_out_proj.weight.dtype == torch.float32 and pw.expert_model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    sample = policy.sample(env_inputs(2), torch.Generator().manual_seed(0))
    assert torch.isfinite(sample.output).all() and torch.isfinite(sample.logp).all() and sample.logp.dtype == torch.float32


# ------------------------------------------------------------------ errors


def _edit(dirs, tmp_path, file: str, change, kind="pi0") -> str:
    out = tmp_path / "edited"
    shutil.copytree(dirs[kind], out)
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
        ("config.json", lambda c: c.update(type="smolvla"), "type"),
        ("config.json", lambda c: c.update(paligemma_variant="gemma_300m"), "paligemma_variant"),
        ("config.json", lambda c: c.update(action_expert_variant="gemma_7b"), "action_expert_variant"),
        ("config.json", lambda c: c.update(action_expert_variant="gemma_300m"), "action_expert_variant"),
        ("config.json", lambda c: c.update(image_resolution=[32, 16]), "image_resolution"),
        ("config.json", lambda c: c.update(rtc_config={"enabled": True}), "rtc_config"),
        ("config.json", lambda c: c.pop("num_inference_steps"), "num_inference_steps"),
        ("config.json", lambda c: c["output_features"]["action"].update(shape=[3]), "output_features.action.shape"),
        ("policy_preprocessor_step_5_normalizer_processor.safetensors", lambda p: p.unlink(), "policy_preprocessor_step_5_normalizer_processor.safetensors"),
        ("policy_postprocessor.json", lambda c: c["steps"][0].pop("state_file"), "action"),
        ("model.safetensors", lambda p: p.unlink(), "model.safetensors"),
    ],
)
def test_bad_checkpoints_are_refused_in_one_line(dirs, tmp_path, file, change, words):
    directory = _edit(dirs, tmp_path, file, change)
    with pytest.raises(ConfigError) as e:
        PI0Policy(PI0Config(checkpoint=directory), SPEC)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_pi05_directory_is_not_a_pi0_and_needs_its_state_prompt(dirs, tmp_path):
    with pytest.raises(ConfigError, match="type"):
        PI0Policy(PI0Config(checkpoint=str(dirs["pi05"])), SPEC)
    directory = _edit(dirs, tmp_path, "policy_preprocessor.json", lambda c: c["steps"].pop(3), kind="pi05")
    with pytest.raises(ConfigError, match="pi05_prepare_state_tokenizer_processor_step"):
        PI05Policy(PI05Config(checkpoint=directory), SPEC)


def test_weights_that_do_not_fit_are_refused(dirs, tmp_path):
    from safetensors.torch import save_file

    def drop(path):
        state = read_lerobot_weights(path.parent)
        state.pop("model.action_out_proj.bias")
        save_file(state, str(path))

    with pytest.raises(ConfigError, match="missing.*action_out_proj.bias"):
        PI0Policy(PI0Config(checkpoint=_edit(dirs, tmp_path, "model.safetensors", drop)), SPEC)


def test_env_mismatches_and_bad_options_name_the_field(dirs):
    with pytest.raises(ConfigError, match="output_features.action.shape"):
        make(dirs, spec={**SPEC, "action_dim": 3, "action_low": [-1.0] * 3, "action_high": [1.0] * 3})
    with pytest.raises(ConfigError, match="policy.cameras"):
        make(dirs, cameras=["observation.images.top"])
    with pytest.raises(ConfigError, match="observation.state"):
        make(dirs, spec={**SPEC, "state_dim": 5})
    with pytest.raises(ConfigError, match="policy.n_action_steps"):
        make(dirs, n_action_steps=5)
    with pytest.raises(ConfigError, match="policy.checkpoint"):
        PI0Policy(PI0Config(), SPEC)
    with pytest.raises(ConfigError, match="policy.vlm_dir"):
        make(dirs, vlm_dir=str(dirs["root"] / "nowhere"))


# ------------------------------------------------------------------ a training run


@dataclass
class SampledLikelihoodConfig(RewardConfig):
    type: str = option("_test_pi0_likelihood", "registered name of this component (see `mmrl list`)")


@REWARDS.register("_test_pi0_likelihood", config=SampledLikelihoodConfig)
def sampled_likelihood(rollout, cfg):
    """Test-only: the episode's summed sampling log-prob, a reward that differs within a group."""
    return (rollout.old_logp * rollout.mask).sum(1)


def test_one_update_through_the_trainer_on_the_tabletop(dirs, tmp_path):
    pytest.importorskip("mujoco")
    from mmrl.config import from_dict
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    cfg = from_dict(TrainConfig, {
        "name": "pi05_step", "seed": 0, "total_steps": 1, "run_dir": str(tmp_path / "run"),
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 4, "kwargs": {"task": "spatial", "image_size": 16}},
        "policy": {"type": "pi05", "checkpoint": str(dirs["pi05"]), "vlm_dir": str(dirs["vlm"]), "train_expert_only": True},
        "sampler": {"type": "env", "max_decisions": 2},
        "rewards": [{"type": "_test_pi0_likelihood"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1, "kl": {"coef": 0.0}},
        "optim": {"lr": 0.01},
        "eval": {"every": 1000, "at_start": False, "at_end": False},
        "log": {"progress": False, "tensorboard": False},
        "checkpoint": {"every": 1000},
    })
    trainer = Trainer(cfg)
    expert = trainer.policy.model.paligemma_with_expert.expert_model
    before = {name: p.detach().clone() for name, p in expert.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[name]) for name, p in expert.named_parameters())
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["objective/ratio"] == 1.0 and math.isfinite(metrics["loss/policy"])
