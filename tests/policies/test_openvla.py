"""OpenVLA checkpoints in their released Hugging Face layout: a tiny random one, written by
``write_tiny_openvla``, loaded, run, fine-tuned and exported as a user's ``openvla-7b``
directory would be."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402

from dataclasses import dataclass  # noqa: E402

from mmrl.config import from_dict, option  # noqa: E402
from mmrl.core.component_config import RewardConfig  # noqa: E402
from mmrl.core.weights import build_policy  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.openvla.tiny import STATISTICS_DATA, write_tiny_openvla  # noqa: E402
from mmrl.registry import POLICIES, REWARDS  # noqa: E402

INSTRUCTIONS = ["push the red block to the left", "Put the Bowl on the plate"]
SPEC = {"action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0], "image_shape": [2, 16, 16, 3], "instructions": INSTRUCTIONS}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_openvla(tmp_path_factory.mktemp("openvla") / "tiny")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return write_tiny_openvla(tmp_path_factory.mktemp("openvla") / "sharded", seed=1, shards=3)


def make(path, spec=None, **fields):
    data = {"type": "openvla", "checkpoint": str(path), "unnorm_key": "tabletop", **fields}
    return build_policy(from_dict(POLICIES.entry("openvla").config, data, "policy"), SPEC if spec is None else spec)


def observations(n=3, seed=1, spec=None):
    spec = spec or SPEC
    g = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (n, *spec["image_shape"]), generator=g, dtype=torch.uint8)
    return {"image": image, "instruction": [INSTRUCTIONS[i % 2] for i in range(n)]}


def _tensors(directory) -> dict:
    out = {}
    for file in sorted(p for p in directory.iterdir() if p.suffix == ".safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({(file.name, k): f.get_tensor(k) for k in f.keys()})
            out[(file.name, "__metadata__")] = f.metadata()
    return out


def _perturb(policy, scale=0.05):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


# ------------------------------------------------------------------ format


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_the_loaded_model_holds_exactly_the_checkpoints_tensors(checkpoint, sharded, layout):
    path = checkpoint if layout == "single" else sharded
    policy = make(path)
    state = policy.state_dict()
    stored = {name: t for (_, name), t in _tensors(path).items() if name != "__metadata__"}
    assert set(state) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    assert "vision_backbone.featurizer.blocks.0.ls1.scale_factor" in state  # timm's gamma, under OpenVLA's name
    assert "vision_backbone.fused_featurizer.attn_pool.latent" in state


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_export_writes_the_same_files_tensors_and_jsons(checkpoint, sharded, tmp_path, layout):
    path = checkpoint if layout == "single" else sharded
    make(path).export("openvla", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in path.iterdir())
    ours, theirs = _tensors(tmp_path / "out"), _tensors(path)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if key[1] == "__metadata__":
            assert ours[key] == value
        else:
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    for file in path.iterdir():
        if file.suffix == ".json":
            assert json.loads((tmp_path / "out" / file.name).read_text()) == json.loads(file.read_text()), file.name


def test_load_export_reload_gives_the_same_actions(checkpoint, tmp_path):
    policy = make(checkpoint)
    _perturb(policy)
    policy.export("openvla", tmp_path / "trained")
    reloaded = make(tmp_path / "trained")
    inputs = observations()
    # the export stores bf16 like the source: compare against the trained weights as stored
    with torch.no_grad():
        policy.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in policy.state_dict().items()})
    a, b = policy.sample(inputs, deterministic=True), reloaded.sample(inputs, deterministic=True)
    assert torch.equal(a.output, b.output) and torch.equal(a.replay["action_tokens"], b.replay["action_tokens"])
    s = policy.sample(inputs, torch.Generator().manual_seed(5))
    assert torch.equal(policy.log_prob(s.replay), reloaded.log_prob(s.replay))


# ------------------------------------------------------------------ predict_action


def _reference_actions(policy, inputs, stats) -> np.ndarray:
    """predict_action re-derived, one sample at a time: the unpadded prompt with the empty
    token, patches after <s>, greedy full-vocabulary decoding without a cache (a full pass
    per token), then the reference's token → bin centre → un-normalization in NumPy."""
    lm = policy.language_model
    embed = lm.get_input_embeddings()
    camera = policy.config.cameras[0]
    rows = []
    for image, text in zip(inputs["image"], inputs["instruction"]):
        ids = policy.tokenizer(f"In: What action should the robot take to {text.lower()}?\nOut:")["input_ids"]
        assert ids[0] == policy.tokenizer.bos_token_id
        ids = torch.tensor([ids + [policy.empty_id]])
        pixels = policy.pixel_values(image[camera][None, None])
        with torch.no_grad():
            patches = policy.projector(policy.vision_backbone(pixels))
            words = embed(ids)
            seq = torch.cat([words[:, :1], patches, words[:, 1:]], dim=1)
            tokens = []
            for _ in range(policy.action_dim):
                token = lm(inputs_embeds=seq).logits[0, -1].argmax().item()
                tokens.append(token)
                seq = torch.cat([seq, embed(torch.tensor([[token]]))], dim=1)
        rows.append(tokens)
    tokens = np.array(rows)
    bins = np.linspace(-1, 1, 256)
    centers = (bins[:-1] + bins[1:]) / 2.0
    vocab = 512  # text vocab 576 - pad_to_multiple_of 64
    normalized = centers[np.clip(vocab - tokens - 1, 0, centers.shape[0] - 1)]
    mask = np.array(stats.get("mask", [True] * tokens.shape[1]))
    high, low = np.array(stats["q99"]), np.array(stats["q01"])
    return np.where(mask, 0.5 * (normalized + 1) * (high - low) + low, normalized), tokens


@pytest.mark.parametrize("unnorm_key", ["tabletop", "bridge_orig"])
def test_greedy_actions_are_predict_actions(checkpoint, unnorm_key):
    dim = len(STATISTICS_DATA[unnorm_key]["action"]["q01"])
    spec = dict(SPEC, action_dim=dim, action_low=[-1.0] * dim, action_high=[1.0] * dim)
    policy = make(checkpoint, spec=spec, unnorm_key=unnorm_key)
    _perturb(policy, 0.5)  # sharper logits: fewer near-ties between the two computations
    inputs = observations(n=4, spec=spec)
    expected, tokens = _reference_actions(policy, inputs, STATISTICS_DATA[unnorm_key]["action"])
    sample = policy.sample(inputs, deterministic=True)
    assert sample.replay["action_tokens"][:, 0].tolist() == tokens.tolist()
    assert sample.output.shape == (4, 1, dim)
    np.testing.assert_array_equal(sample.output[:, 0].numpy(), expected.astype(np.float32))
    if unnorm_key == "bridge_orig":  # the gripper is not normalized (mask false): a bin centre as it is
        assert (sample.output[:, 0, -1].abs() <= 1).all()


def test_images_are_resized_with_pillow_bicubic_and_normalized_per_featurizer(checkpoint):
    from PIL import Image

    policy = make(checkpoint)
    frame = observations(n=1)["image"][0, 0]
    pixels = policy.pixel_values(frame[None, None])[0]
    resized = np.asarray(Image.fromarray(frame.numpy()).resize((28, 28), Image.BICUBIC), dtype=np.float32) / 255
    processor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    for i, params in enumerate(processor["tvf_normalize_params"]):  # DINOv2 first, SigLIP second
        expected = (torch.from_numpy(resized).permute(2, 0, 1) - torch.tensor(params["mean"])[:, None, None]) / torch.tensor(params["std"])[:, None, None]
        torch.testing.assert_close(pixels[3 * i : 3 * i + 3], expected, rtol=0, atol=1e-6)


def test_action_tokens_follow_openvlas_action_tokenizer(checkpoint):
    """actions → ids is np.digitize over the 256 edges (id = V - bin), and decoding a bin's id
    gives its centre back; the 256 action ids are the top of the base vocabulary."""
    policy = make(checkpoint)
    assert (policy.first_action_id, policy.vocab_size) == (256, 512)
    a_n = torch.linspace(-1, 1, 1001, dtype=torch.float64)
    q01, q99 = policy.q01, policy.q99
    actions = torch.stack([0.5 * (a_n + 1) * (q99[i] - q01[i]) + q01[i] for i in range(2)], dim=-1)
    ids = policy.actions_to_tokens(actions)
    normalized = np.clip(2 * (actions.numpy() - q01.numpy()) / (q99.numpy() - q01.numpy() + 1e-8) - 1, -1, 1)
    assert ids.tolist() == (512 - np.digitize(normalized, np.linspace(-1, 1, 256))).tolist()
    # V - 256 (only an action of exactly q99 gets it) decodes as V - 257 does: bin 255 is clipped to the last centre
    centres = torch.arange(257, 512)
    assert torch.equal(policy.tokens_to_actions(torch.tensor([256, 256])), policy.tokens_to_actions(torch.tensor([257, 257])))
    assert torch.equal(policy.actions_to_tokens(policy.tokens_to_actions(torch.stack([centres, centres], -1))), torch.stack([centres, centres], -1))


# ------------------------------------------------------------------ RL


@pytest.mark.numerics
@pytest.mark.parametrize("granularity", ["chunk", "token"])
def test_recompute_gives_ratio_one(checkpoint, granularity):
    policy = make(checkpoint, logp_granularity=granularity, temperature=1.3)
    sample = policy.sample(observations(), torch.Generator().manual_seed(0))
    assert sample.logp_deferred and sample.logp.shape == ((3, 1) if granularity == "chunk" else (3, 2))
    assert ((sample.replay["action_tokens"] >= 256) & (sample.replay["action_tokens"] < 512)).all()  # sampled among the action ids
    with torch.no_grad():
        exact = policy.log_prob(sample.replay)
    again = policy.log_prob(sample.replay)
    assert torch.equal(exact, again.detach())
    torch.testing.assert_close(exact, sample.logp, rtol=0, atol=1e-4)


def test_a_positive_advantage_raises_the_sampled_tokens_log_prob(checkpoint):
    policy = make(checkpoint)
    sample = policy.sample(observations(n=2), torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    before = policy.log_prob(sample.replay).detach()
    (-policy.log_prob(sample.replay)[0].sum()).backward()
    optimizer.step()
    assert policy.log_prob(sample.replay)[0].item() > before[0].item()


@dataclass
class SampledLikelihoodConfig(RewardConfig):
    type: str = option("_test_openvla_likelihood", "registered name of this component (see `mmrl list`)")


@REWARDS.register("_test_openvla_likelihood", config=SampledLikelihoodConfig)
def sampled_likelihood(rollout, cfg):
    """Test-only: the episode's summed sampling log-prob, a reward that differs within a group
    from the first step (the tabletop's success is all 0 for a random policy)."""
    return (rollout.old_logp * rollout.mask).sum(1)


def test_one_train_update_on_the_tabletop(checkpoint, tmp_path):
    pytest.importorskip("mujoco")
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    cfg = from_dict(TrainConfig, {
        "name": "openvla_step", "seed": 0, "total_steps": 1, "run_dir": str(tmp_path / "run"),
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "kwargs": {"task": "spatial", "image_size": 16}},
        "policy": {"type": "openvla", "checkpoint": str(checkpoint), "unnorm_key": "tabletop"},
        "sampler": {"type": "env", "max_decisions": 2},
        "rewards": [{"type": "_test_openvla_likelihood"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1, "kl": {"coef": 0.0}},
        "optim": {"lr": 1e-3},
        "eval": {"every": 1000, "at_start": False},
        "checkpoint": {"every": 1000},
    })
    trainer = Trainer(cfg)
    language_model = trainer.policy.language_model
    before = {name: p.detach().clone() for name, p in language_model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[name]) for name, p in language_model.named_parameters())


def test_lora_trains_adapters_the_reference_is_the_loaded_model_and_export_merges_them(checkpoint, tmp_path):
    base = make(checkpoint)
    policy = make(checkpoint, lora={"r": 4})
    trainable = {name for name, p in policy.language_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    sample = policy.sample(observations(), torch.Generator().manual_seed(0))
    reference = policy.reference()
    with torch.no_grad():
        expected = base.log_prob(sample.replay)
    # equal weights; peft's wrapped layers round differently by ~1e-6 (as in test_vla_pretrained)
    torch.testing.assert_close(reference.log_prob(sample.replay), expected, rtol=0, atol=1e-5)
    with torch.no_grad():
        for name, p in policy.language_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert not torch.allclose(policy.log_prob(sample.replay), reference.log_prob(sample.replay), atol=1e-3)
    torch.testing.assert_close(reference.log_prob(sample.replay), expected, rtol=0, atol=1e-5)
    policy.export("openvla", tmp_path / "merged")
    merged = make(tmp_path / "merged")
    assert set(merged.state_dict()) == set(base.state_dict())
    layer = policy.language_model.model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = layer.base_layer.weight + (16.0 / 4) * b @ a  # W + (alpha / r) B A
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(merged.state_dict()[name], expected.detach().to(torch.bfloat16).float())


def test_sft_loss_falls_on_a_demonstration(checkpoint):
    policy = make(checkpoint)
    batch = {**observations(n=2), "actions": torch.tensor([[[0.3, -0.2]], [[-0.5, 0.6]]]), "action_mask": torch.ones(2, 1)}
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    first = policy.sft_loss(batch)
    first.backward()
    optimizer.step()
    assert policy.sft_loss(batch).item() < first.item()


# ------------------------------------------------------------------ bad input


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_bad_inputs_are_one_line_config_errors(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="policy.checkpoint") as e:
        make(tmp_path / "missing")
    _one_line(e)
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ConfigError, match="model_type 'llava'"):
        make(tmp_path / "llava")
    with pytest.raises(ConfigError, match="name one of: bridge_orig, tabletop") as e:
        make(checkpoint, unnorm_key=None)
    _one_line(e)
    with pytest.raises(ConfigError, match="they hold: bridge_orig, tabletop"):
        make(checkpoint, unnorm_key="libero_spatial")
    with pytest.raises(ConfigError, match="7-dim actions, the env's are 2-dim"):
        make(checkpoint, unnorm_key="bridge_orig")
    with pytest.raises(ConfigError, match="policy.cameras") as e:
        make(checkpoint, cameras=[2])
    _one_line(e)
    with pytest.raises(ConfigError, match="gives none"):
        make(checkpoint, spec={k: v for k, v in SPEC.items() if k != "image_shape"})
    no_stats = tmp_path / "no_stats"
    shutil.copytree(checkpoint, no_stats)
    (no_stats / "dataset_statistics.json").unlink()
    config = json.loads((no_stats / "config.json").read_text())
    config.pop("norm_stats")
    (no_stats / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="dataset_statistics.json") as e:
        make(no_stats)
    _one_line(e)


def test_mmrl_export_writes_a_saved_policy_in_the_openvla_layout(checkpoint, tmp_path):
    from mmrl.core.weights import save_pretrained
    from mmrl.commands.export import export_policy

    policy = make(checkpoint)
    _perturb(policy)
    save_pretrained(policy, tmp_path / "saved")
    export_policy(tmp_path / "saved", "openvla", tmp_path / "out")
    exported = make(tmp_path / "out").state_dict()
    for name, tensor in policy.state_dict().items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16).float()), name


def test_the_libero_gripper_is_sent_as_openvlas_libero_evaluation_sends_it(checkpoint):
    """gripper: libero — the last dim g ∈ [0, 1] (1 = open) goes to the env as −sign(2g − 1)
    (LIBERO: −1 open, +1 close); the other dims and the log-probs are untouched, and a
    demonstration's env actions come back to the model's gripper (−1 → 1, +1 → 0)."""
    plain, libero = make(checkpoint), make(checkpoint, gripper="libero")
    inputs = observations(n=6)
    a = plain.sample(inputs, torch.Generator().manual_seed(2))
    b = libero.sample(inputs, torch.Generator().manual_seed(2))
    assert torch.equal(a.replay["action_tokens"], b.replay["action_tokens"]) and torch.equal(a.logp, b.logp)
    assert torch.equal(a.output[..., :-1], b.output[..., :-1])
    assert torch.equal(b.output[..., -1], -torch.sign(2 * a.output[..., -1] - 1))
    env = torch.tensor([[0.3, -1.0], [0.1, 1.0]])
    assert torch.equal(libero.from_env(env)[:, -1], torch.tensor([1.0, 0.0])) and torch.equal(libero.from_env(env)[:, 0], env[:, 0])
    assert torch.equal(libero.to_env(libero.from_env(env)), env)
