"""VLAs on pretrained transformers VLMs: a tiny random model of each family, written with
``save_pretrained`` and loaded through ``policy.backbone.vlm_path`` as a user's checkpoint
directory would be."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dataclasses import dataclass  # noqa: E402

from mmrl.config import from_dict, option  # noqa: E402
from mmrl.core.component_config import RewardConfig  # noqa: E402
from mmrl.core.weights import build_policy, load_pretrained, save_pretrained  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.vla.tiny_vlm import FAMILIES, TinyVLMSize, save_tiny_vlm  # noqa: E402
from mmrl.registry import POLICIES, REWARDS  # noqa: E402

INSTRUCTIONS = ["pick up the red block", "push the blue block left"]
SPEC = {
    "action_dim": 3,
    "action_low": [-1.0, -1.0, -1.0],
    "action_high": [1.0, 1.0, 1.0],
    "state_dim": 4,
    "image_shape": [2, 32, 32, 3],  # two cameras
    "instructions": INSTRUCTIONS,
}
# Sampling decodes token by token with a key/value cache and log_prob runs one teacher-forced
# pass (token VLA), or the chain's steps are recomputed in a batch of another size (flow VLA):
# float32 sums in other orders. A token's log-prob is within text_lm's documented 1e-4, and a
# chunk sums its 2 x 3 tokens; the flow chain's log-likelihood sums 3 x 2 x 3 Gaussian terms.
# Measured: at most 5e-6 over the families, under avx512.
CHUNK_ATOL = 6e-4
POLICY_TYPES = ("token_vla", "flow_vla")


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlms")
    cache = {}

    def get(family: str, **size) -> str:
        key = (family, tuple(sorted(size.items())))
        if key not in cache:
            cache[key] = str(save_tiny_vlm(family, root / f"{family}_{len(cache)}", TinyVLMSize(**size)))
        return cache[key]

    return get


@dataclass
class SampledLikelihoodConfig(RewardConfig):
    type: str = option("_test_sampled_likelihood", "registered name of this component (see `mmrl list`)")


@REWARDS.register("_test_sampled_likelihood", config=SampledLikelihoodConfig)
def sampled_likelihood(rollout, cfg):
    """Test-only: the episode's summed sampling log-prob, a reward that differs between the
    samples of a group from the first step (the tabletop's success is all 0 for a random VLA)."""
    return (rollout.old_logp * rollout.mask).sum(1)


def make(policy_type: str, vlm_path: str, spec=None, seed: int = 0, **fields):
    backbone = {"vlm_path": vlm_path, **fields.pop("backbone", {})}
    data = {"type": policy_type, "backbone": backbone, "action_chunk": 2, **fields}
    if policy_type == "flow_vla":
        data.setdefault("denoising", {"num_inference_steps": 3})
        data.setdefault("expert_hidden_size", 32)
    cfg = from_dict(POLICIES.entry(policy_type).config, data, "policy")
    torch.manual_seed(seed)
    return build_policy(cfg, spec or SPEC)


def observations(n=4, seed=1, spec=None):
    spec = spec or SPEC
    g = torch.Generator().manual_seed(seed)
    inputs = {"state": torch.randn(n, spec["state_dim"], generator=g), "instruction": [INSTRUCTIONS[i % 2] for i in range(n)]}
    inputs["image"] = torch.randint(0, 256, (n, *spec["image_shape"]), generator=g, dtype=torch.uint8)
    return inputs


def _perturb(policy, scale=0.01):
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


@pytest.mark.numerics
@pytest.mark.parametrize("policy_type", POLICY_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_samples_and_recomputes_its_log_prob(vlm_dirs, family, policy_type):
    policy = make(policy_type, vlm_dirs(family))
    assert policy.backbone.pretrained and policy.backbone.family == family
    sample = policy.sample(observations(), torch.Generator().manual_seed(0))
    assert sample.output.shape == (4, 2, 3) and sample.output.abs().max() <= 1.0
    assert sample.replay["image"].dtype == torch.uint8  # raw frames: log_prob re-runs the image processor
    recomputed = policy.log_prob(sample.replay)
    torch.testing.assert_close(recomputed, sample.logp, rtol=0, atol=CHUNK_ATOL)
    assert torch.isfinite(recomputed).all()


@pytest.mark.parametrize("policy_type", POLICY_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load_round_trip_is_exact(vlm_dirs, tmp_path, family, policy_type):
    policy = make(policy_type, vlm_dirs(family))
    _perturb(policy)
    save_pretrained(policy, tmp_path / "policy")
    loaded = load_pretrained(tmp_path / "policy")
    assert type(loaded) is type(policy) and loaded.config == policy.config
    inputs = observations()
    a = policy.sample(inputs, torch.Generator().manual_seed(4))
    b = loaded.sample(inputs, torch.Generator().manual_seed(4))
    assert torch.equal(a.output, b.output) and torch.equal(a.logp, b.logp)
    assert torch.equal(policy.log_prob(a.replay), loaded.log_prob(a.replay))


@pytest.mark.parametrize("policy_type", POLICY_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_one_grpo_step_through_the_trainer_on_the_tabletop(vlm_dirs, tmp_path, family, policy_type):
    """The env sampler feeds the tabletop's camera frames, state and instruction to the VLA
    on a pretrained VLM, and one GRPO update moves the VLM's own weights."""
    pytest.importorskip("mujoco")
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    backbone = {"vlm_path": vlm_dirs(family)}
    policy = {"type": policy_type, "action_chunk": 2, "backbone": backbone}
    if policy_type == "flow_vla":
        policy.update(denoising={"num_inference_steps": 2}, expert_hidden_size=32)
    cfg = from_dict(TrainConfig, {
        "name": "vlm_step", "seed": 0, "total_steps": 1, "run_dir": str(tmp_path / "run"),
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "kwargs": {"task": "spatial", "image_size": 32}},
        "policy": policy,
        "sampler": {"type": "env", "max_decisions": 2},
        "rewards": [{"type": "_test_sampled_likelihood"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1, "kl": {"coef": 0.0}},
        "optim": {"lr": 0.01},
        "eval": {"every": 1000, "at_start": False},
        "checkpoint": {"every": 1000},
    })
    trainer = Trainer(cfg)
    language_model = trainer.policy.backbone.language_model
    before = {name: p.detach().clone() for name, p in language_model.named_parameters()}
    trainer.train()
    moved = [name for name, p in language_model.named_parameters() if not torch.equal(p, before[name])]
    assert moved, "the update left every weight of the VLM's language model unchanged"


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_multimodal_rotary_positions_match_the_models_own_rule(vlm_dirs, family):
    """Qwen2-VL's (time, height, width) positions of the prefix, computed by the backbone, are
    those the model's get_rope_index gives the same token layout, padding included; the
    tokens after the prefix (the actions) continue from them."""
    policy = make("token_vla", vlm_dirs(family, image_size=64))
    backbone = policy.backbone
    assert backbone.image_grid == (4, 4)  # 64 / 8 patches, merged 2 x 2
    obs = policy.encode_inputs(observations(n=2))
    obs["instruction_mask"][1, 3:] = 0.0  # a shorter instruction in the second row
    _, mask = policy._prefix(obs)
    mask = torch.cat([mask, torch.ones(2, 3)], dim=1)  # three action tokens after the prefix
    image_id = policy.backbone.vlm.config.image_token_id
    fixed = torch.where(torch.isin(torch.arange(backbone.fixed_length), backbone.image_slots), image_id, backbone.fixed_ids)
    ids = torch.cat([fixed.expand(2, -1), obs["instruction_ids"], torch.zeros(2, 3, dtype=torch.long)], dim=1)
    token_type = (ids == image_id).int()
    grid = torch.tensor([[1, 8, 8]] * (2 * backbone.num_cameras))
    expected, _ = backbone.vlm.model.get_rope_index(ids, token_type, image_grid_thw=grid, attention_mask=mask.long())
    ours = backbone.positions(mask, mask.shape[1])
    valid = mask.bool()
    assert torch.equal(ours[:, valid], expected[:, valid])
    # the last new token alone (incremental decoding) gets the position of the full pass
    assert torch.equal(backbone.positions(mask, 1), ours[:, :, -1:])


def test_action_bins_take_the_last_non_special_ids_of_the_base_vocabulary(vlm_dirs):
    policy = make("token_vla", vlm_dirs("llava"), action_bins=16)
    tokenizer = policy.backbone.tokenizer.hf
    assert policy.action_vocab.tolist() == list(range(tokenizer.vocab_size - 16, tokenizer.vocab_size))
    assert not set(policy.action_vocab.tolist()) & set(tokenizer.all_special_ids)
    # the bins decode through the VLM's own embeddings and output head: no new rows
    assert policy.backbone.vlm.get_output_embeddings().weight.shape[0] == len(tokenizer)
    with pytest.raises(ConfigError, match="policy.action_bins"):
        make("token_vla", vlm_dirs("llava"), action_bins=300)


def test_a_positive_advantage_raises_the_chunks_log_prob_through_the_vlm(vlm_dirs):
    policy = make("token_vla", vlm_dirs("paligemma"))
    sample = policy.sample(observations(n=2), torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    before = policy.log_prob(sample.replay).detach()
    (-policy.log_prob(sample.replay)[0].sum()).backward()
    optimizer.step()
    assert policy.log_prob(sample.replay)[0].item() > before[0].item()


def test_vlm_layers_keeps_the_first_decoder_layers(vlm_dirs):
    full = make("flow_vla", vlm_dirs("idefics3", num_layers=3))
    short = make("flow_vla", vlm_dirs("idefics3", num_layers=3), backbone={"vlm_layers": 1})
    assert len(full.backbone.language_model.layers) == 3 and len(short.backbone.language_model.layers) == 1
    torch.testing.assert_close(short.backbone.language_model.layers[0].mlp.up_proj.weight, full.backbone.language_model.layers[0].mlp.up_proj.weight)
    sample = short.sample(observations(), torch.Generator().manual_seed(0))
    torch.testing.assert_close(short.log_prob(sample.replay), sample.logp, rtol=0, atol=CHUNK_ATOL)
    with pytest.raises(ConfigError, match="vlm_layers"):
        make("flow_vla", vlm_dirs("idefics3", num_layers=3), backbone={"vlm_layers": 4})


def test_freeze_vision_tower_leaves_only_the_vision_tower_without_gradients(vlm_dirs):
    policy = make("token_vla", vlm_dirs("llava"), backbone={"freeze_vision_tower": True})
    sample = policy.sample(observations(n=2), torch.Generator().manual_seed(0))
    policy.log_prob(sample.replay).sum().backward()
    vision = list(policy.backbone.vision_tower.parameters())
    assert vision and all(not p.requires_grad and p.grad is None for p in vision)
    assert policy.backbone.vlm.model.multi_modal_projector.linear_1.weight.grad is not None


@pytest.mark.parametrize("policy_type", POLICY_TYPES)
def test_lora_trains_adapters_only_and_the_reference_is_the_adapter_free_model(vlm_dirs, policy_type):
    policy = make(policy_type, vlm_dirs("qwen2_vl"), backbone={"lora": {"r": 4}})
    trainable = {name for name, p in policy.backbone.language_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    reference = policy.reference()
    sample = policy.sample(observations(n=2), torch.Generator().manual_seed(0))
    # LoRA starts as the identity (B = 0): policy and reference agree
    torch.testing.assert_close(reference.log_prob(sample.replay), policy.log_prob(sample.replay), rtol=0, atol=1e-6)
    with torch.no_grad():
        for name, p in policy.backbone.language_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert not torch.allclose(reference.log_prob(sample.replay), policy.log_prob(sample.replay), atol=1e-3)
    # the reference really is the adapter-free model: the base weights alone give its log-probs
    with policy.backbone.adapters_disabled():
        torch.testing.assert_close(policy.log_prob(sample.replay), reference.log_prob(sample.replay), rtol=0, atol=0)
    if policy_type == "flow_vla":  # the exact KL of the chains reads the reference's denoiser
        kl = policy.exact_kl(sample.replay, reference)
        assert kl.shape == sample.logp.shape and (kl > 0).all()


# A token's log-prob is a log-softmax of logits computed in bf16 (unit roundoff u = 2**-9): it
# moves by at most twice its logits' error, which is a few roundings of values of size <= 1
# here (<= 4u with the head's own); a chunk sums its 2 x 3 tokens: 6 x 2 x 4u ~ 0.09 nats
# (measured 1.6e-3 against float32 weights). An off-by-one token or a wrong bin moves it by ~3.
BF16_CHUNK_ATOL = 6 * 2 * 4 * 2**-9


@pytest.mark.numerics
def test_bf16_weights_sample_and_recompute(vlm_dirs):
    policy = make("token_vla", vlm_dirs("smolvlm"), backbone={"vlm_dtype": "bfloat16"})
    assert policy.backbone.language_model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert policy.action_start.dtype == torch.float32  # what mmrl adds stays float32
    sample = policy.sample(observations(), torch.Generator().manual_seed(0))
    # a cached decode and a teacher-forced pass round differently in bf16: the trainer's own
    # pass gives the ratio's old log-probs, so a first step starts from ratios of exactly 1
    assert sample.logp.dtype == torch.float32 and sample.logp_deferred
    wide = make("token_vla", vlm_dirs("smolvlm"))
    with torch.no_grad():
        wide.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in policy.state_dict().items()})
        recomputed, exact = policy.log_prob(sample.replay), wide.log_prob(sample.replay)
    torch.testing.assert_close(recomputed, exact, rtol=0, atol=BF16_CHUNK_ATOL)
    torch.testing.assert_close(sample.logp, exact, rtol=0, atol=BF16_CHUNK_ATOL)


def test_bad_vlm_paths_are_config_errors_naming_the_field(vlm_dirs, tmp_path):
    with pytest.raises(ConfigError, match="policy.backbone.vlm_path"):
        make("token_vla", str(tmp_path / "missing"))
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50)).save_pretrained(tmp_path / "text_only")
    with pytest.raises(ConfigError, match="'llama' model; supported: llava"):
        make("token_vla", str(tmp_path / "text_only"))
    with pytest.raises(ConfigError, match="policy.backbone.lora.r"):
        make("token_vla", None, backbone={"vlm_path": None, "lora": {"r": 4}})


def _tabletop_gae_config(tmp_path, policy: dict, total_steps: int = 1) -> dict:
    return {
        "name": "vla_gae", "seed": 0, "total_steps": total_steps, "run_dir": str(tmp_path / "run"),
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "kwargs": {"task": "spatial", "image_size": 32}},
        "policy": policy,
        "sampler": {"type": "env", "max_decisions": 3},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1, "kl": {"coef": 0.0},
                 "advantage": {"type": "gae", "gamma": 0.9, "lam": 0.95, "normalize": "none"}},
        # one Adam step small enough to stay first-order (Adam moves every weight by lr at its first
        # step: the whole VLM at once), its direction set by the value loss: the values must shrink
        "critic": {"type": "value_head", "value_coef": 100.0},
        "optim": {"lr": 1e-6},
        "eval": {"every": 1000, "at_start": False},
        "checkpoint": {"every": 1000},
    }


@pytest.mark.parametrize("policy_type,backbone", [(t, b) for t in POLICY_TYPES for b in ("miniature", "qwen2_vl")] + [("token_vla", "smolvlm_bf16")])
def test_a_value_head_on_the_pooled_backbone_state_learns_towards_the_returns(vlm_dirs, tmp_path, policy_type, backbone):
    """GAE with a value head on a VLA: one value per action chunk from the backbone's pooled
    prefix state. All tabletop returns of a random VLA are 0, so the update pulls the values
    of its batch towards 0, through the head and the shared backbone."""
    pytest.importorskip("mujoco")
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    if backbone == "miniature":
        backbone_cfg = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 16], "patch_grid": 4}
    elif backbone == "smolvlm_bf16":  # the VLM in bf16, its value head in float32
        backbone_cfg = {"vlm_path": vlm_dirs("smolvlm"), "vlm_dtype": "bfloat16"}
    else:
        backbone_cfg = {"vlm_path": vlm_dirs(backbone)}
    policy = {"type": policy_type, "action_chunk": 2, "backbone": backbone_cfg}
    if policy_type == "flow_vla":
        policy["denoising"] = {"num_inference_steps": 2}
    trainer = Trainer(from_dict(TrainConfig, _tabletop_gae_config(tmp_path, policy)))
    learner, seen = trainer.learner, {}
    learn = learner.learn

    def learn_and_measure(rollout, *args, **kwargs):
        def values():
            return learner.critic(learner.policy, rollout.replay).detach()

        seen["before"], seen["first_weight"] = values(), next(learner.policy.backbone.parameters()).detach().clone()
        out = learn(rollout, *args, **kwargs)
        seen["after"] = values()
        return out

    learner.learn = learn_and_measure
    head_before = [p.detach().clone() for p in learner.critic.parameters()]
    trainer.train()
    assert all(p.dtype == torch.float32 for p in learner.critic.parameters())
    assert all(not torch.equal(p, q) for p, q in zip(learner.critic.parameters(), head_before))
    if backbone == "smolvlm_bf16":  # a step of 1e-6 is below bf16's resolution: only the head moves
        return
    assert seen["after"].square().mean() < seen["before"].square().mean()
    assert not torch.equal(next(learner.policy.backbone.parameters()), seen["first_weight"])


def test_a_value_head_needs_one_column_per_chunk(tmp_path):
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    policy = {"type": "token_vla", "action_chunk": 2, "logp_granularity": "token",
              "backbone": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 16]}}
    pytest.importorskip("mujoco")
    with pytest.raises(ConfigError, match="policy.logp_granularity"):
        Trainer(from_dict(TrainConfig, _tabletop_gae_config(tmp_path, policy)))


def test_the_documented_libero_config_builds_its_policy_on_a_vlm_directory(vlm_dirs):
    """docs/vla.md's one-config fine-tuning example is a valid run config; with its vlm_path
    pointed at a tiny SmolVLM it builds the policy it describes (the LIBERO env itself is not
    started here)."""
    import re

    import yaml

    from mmrl.train.run_config import TrainConfig
    from tests.conftest import ROOT

    text = (ROOT / "docs" / "vla.md").read_text()
    data = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    data["policy"]["backbone"]["vlm_path"] = vlm_dirs("smolvlm", num_layers=4)
    data["policy"]["backbone"]["vlm_layers"] = 2
    cfg = from_dict(TrainConfig, data)
    spec = {"action_dim": 7, "action_low": [-1.0] * 7, "action_high": [1.0] * 7, "state_dim": 8, "image_shape": [2, 32, 32, 3], "instructions": ["put the bowl on the plate"]}
    policy = build_policy(cfg.policy, spec)
    assert policy.backbone.lora and len(policy.backbone.language_model.layers) == 2
    assert policy.backbone.language_model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in policy.backbone.vision_tower.parameters())
    assert policy.reference() is not None


@pytest.mark.parametrize("policy_type", POLICY_TYPES)
def test_a_trained_vlm_exports_as_a_checkpoint_another_vla_loads(vlm_dirs, tmp_path, capsys, policy_type):
    """After SFT or RL the VLM a VLA sits on is written as a transformers directory; a new
    VLA on it reads the trained weights (the token VLA's action bins included, they are the
    VLM's own rows)."""
    from mmrl.policies.vla.pretrained import main as vla_tool

    policy = make(policy_type, vlm_dirs("paligemma"))
    _perturb(policy, scale=0.05)
    save_pretrained(policy, tmp_path / "trained")
    assert vla_tool(["export", str(tmp_path / "trained"), "--out", str(tmp_path / "vlm")]) == 0
    successor = make(policy_type, str(tmp_path / "vlm"), seed=7)
    trained, loaded = policy.backbone.vlm.state_dict(), successor.backbone.vlm.state_dict()
    assert trained.keys() == loaded.keys() and all(torch.equal(trained[k], loaded[k]) for k in trained)
    if policy_type == "token_vla":
        hidden = torch.randn(3, policy.backbone.hidden_size)
        assert torch.equal(policy._action_logits(hidden), successor._action_logits(hidden))
    miniature = make(policy_type, None, backbone={"vlm_path": None, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 16]})
    save_pretrained(miniature, tmp_path / "miniature")
    capsys.readouterr()
    assert vla_tool(["export", str(tmp_path / "miniature"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "policy.backbone.vlm_path" in err


@pytest.mark.numerics
@pytest.mark.parametrize("policy_type", POLICY_TYPES)
def test_the_first_ppo_step_under_bf16_weights_starts_from_ratio_one(vlm_dirs, tmp_path, policy_type):
    """bf16 VLM weights: the sampling pass (a wave of env observations, its own batch layout and
    the key/value cache or denoising chain) and log_prob over the replay round differently, by far
    more than in float32. The old log-probs are deferred: the first minibatch's own forward gives
    them, so every ratio of the first PPO step is 1 to the bit and a clip range of 1e-4 clips
    nothing; old_logp/sampler_gap_max reports how far the sampling pass's numbers were. The run is
    made under GEMMs whose rounding follows the row count (tests/kernel_emulation, as MKL's on an
    AVX512 Xeon), so the sampling pass and log_prob differ on every machine."""
    pytest.importorskip("mujoco")
    from tests.kernel_emulation import ShapeDependentGemm
    from mmrl.train.metrics import read_metrics
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    policy = {"type": policy_type, "action_chunk": 2, "backbone": {"vlm_path": vlm_dirs("smolvlm"), "vlm_dtype": "bfloat16"}}
    if policy_type == "flow_vla":
        policy["denoising"] = {"num_inference_steps": 2}
    cfg = {
        "name": "bf16_ratio", "seed": 0, "total_steps": 1, "run_dir": str(tmp_path / "run"),
        # dense rewards: every group has a spread, every decision an advantage
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "kwargs": {"task": "spatial", "image_size": 32, "reward_mode": "dense"}},
        "policy": policy, "sampler": {"type": "env", "max_decisions": 3}, "rewards": [{"type": "return"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1, "kl": {"coef": 0.0},
                 "objective": {"type": "ppo_clip", "eps_low": 1e-4, "eps_high": 1e-4}},
        "optim": {"lr": 1e-6}, "eval": {"every": 1000, "at_start": False, "at_end": False}, "checkpoint": {"every": 1000},
        "log": {"progress": False, "tensorboard": False},
    }
    with ShapeDependentGemm():
        Trainer(from_dict(TrainConfig, cfg)).train()
    (m,) = [r for r in read_metrics(tmp_path / "run") if "loss/policy" in r]
    assert m["adv/nonzero_fraction"] > 0 and 0 < m["old_logp/sampler_gap_max"] < 1
    assert m["objective/ratio"] == 1.0 and m["objective/clipped"] == 0.0 and m["approx_kl"] == 0.0
