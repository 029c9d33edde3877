"""OpenVLA-OFT checkpoints in the layout OFT's fine-tune saves: a tiny random one, written by
``write_tiny_openvla_oft``, loaded, run against an independent re-derivation of
``predict_action``, RL- and SFT-trained, exported and reloaded."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.weights import build_policy  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.openvla.tiny import STATISTICS_DATA  # noqa: E402
from mmrl.policies.openvla_oft.tiny import write_tiny_openvla_oft  # noqa: E402
from mmrl.registry import POLICIES  # noqa: E402

INSTRUCTIONS = ["push the red block to the left", "Put the Bowl on the plate"]
SPEC = {"action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0], "image_shape": [2, 16, 16, 3], "state_dim": 4, "instructions": INSTRUCTIONS}
CHUNK = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_openvla_oft(tmp_path_factory.mktemp("oft") / "tiny")


@pytest.fixture(scope="module")
def with_adapter(tmp_path_factory):
    return write_tiny_openvla_oft(tmp_path_factory.mktemp("oft") / "adapter", lora_adapter=True)


def make(path, spec=None, **fields):
    data = {"type": "openvla_oft", "checkpoint": str(path), "unnorm_key": "tabletop", "cameras": [0, 1], "chunk_size": CHUNK, **fields}
    return build_policy(from_dict(POLICIES.entry("openvla_oft").config, data, "policy"), SPEC if spec is None else spec)


def observations(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (n, *SPEC["image_shape"]), generator=g, dtype=torch.uint8)
    state = 1.5 * torch.randn(n, 4, generator=g)  # partly outside q01/q99: the clip matters
    return {"image": image, "state": state, "instruction": [INSTRUCTIONS[i % 2] for i in range(n)]}


def _component(path, name) -> dict:
    file = next(p for p in path.iterdir() if name in p.name and "checkpoint" in p.name)
    return torch.load(file, weights_only=True)


def _safetensors(directory) -> dict:
    out = {}
    for file in sorted(p for p in directory.iterdir() if p.suffix == ".safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _perturb(policy, scale=0.05):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


# ------------------------------------------------------------------ format


def test_the_model_holds_the_checkpoints_tensors_and_the_heads_without_the_ddp_prefix(checkpoint):
    policy = make(checkpoint)
    state = policy.state_dict()
    for name, tensor in _safetensors(checkpoint).items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    for module, file in (("action_head", "action_head"), ("proprio_projector", "proprio_projector")):
        stored = _component(checkpoint, file)
        assert stored and all(k.startswith("module.") for k in stored)
        assert {f"{module}.{k[7:]}" for k in stored} == {k for k in state if k.startswith(module + ".")}
        for key, tensor in stored.items():
            assert torch.equal(state[f"{module}.{key[7:]}"].to(tensor.dtype), tensor), key


# ------------------------------------------------------------------ predict_action


def _mlp_resnet(state: dict, x: torch.Tensor) -> torch.Tensor:
    """OFT's MLPResNet from the raw state dict (keys without ``module.model.``)."""
    w = {k.removeprefix("module.model."): v.float() for k, v in state.items()}

    def ln(x, p):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], w[p + ".weight"], w[p + ".bias"], 1e-5)

    x = torch.relu(torch.nn.functional.linear(ln(x, "layer_norm1"), w["fc1.weight"], w["fc1.bias"]))
    for i in range(2):
        p = f"mlp_resnet_blocks.{i}.ffn"
        x = x + torch.relu(torch.nn.functional.linear(ln(x, p + ".0"), w[p + ".1.weight"], w[p + ".1.bias"]))
    return torch.nn.functional.linear(ln(x, "layer_norm2"), w["fc2.weight"], w["fc2.bias"])


def _reference_chunks(policy, inputs, head: str) -> np.ndarray:
    """predict_action re-derived, one sample at a time: the prompt with ▁, then T = K·A
    placeholder ids 1 and the stop id 2; the placeholders' embeddings zeroed; patches of
    both images then the proprio token after <s>; one pass with an all-zero 4-D mask (the
    fork's bidirectional attention, no padding); hidden states / logits at
    [NUM_PATCHES + NUM_PROMPT_TOKENS, … + T); the L1 head or argmax + bins; OFT's
    un-normalization in NumPy."""
    lm, embed = policy.language_model, policy.language_model.get_input_embeddings()
    stats = STATISTICS_DATA["tabletop"]
    p_low, p_high = np.array(stats["proprio"]["q01"]), np.array(stats["proprio"]["q99"])
    weights = policy.state_dict()  # the (perturbed) weights the policy runs, as the files name them
    projector = {k.removeprefix("proprio_projector."): v.float() for k, v in weights.items() if k.startswith("proprio_projector.")}
    head_state = {"module." + k.removeprefix("action_head."): v for k, v in weights.items() if k.startswith("action_head.")}
    t = CHUNK * 2
    rows = []
    for image, text, state in zip(inputs["image"], inputs["instruction"], inputs["state"]):
        ids = policy.tokenizer(f"In: What action should the robot take to {text.lower()}?\nOut:")["input_ids"]
        ids = ids + [policy.empty_id]
        num_prompt = len(ids) - 1
        full = torch.tensor([ids + [1] * t + [2]])
        with torch.no_grad():
            words = embed(full)
            words[:, len(ids) : len(ids) + t] = 0
            patches = policy.projector(policy.vision_backbone(policy.pixel_values(image[None])))  # cameras 0 then 1
            p = np.clip(2 * (state.double().numpy() - p_low) / (p_high - p_low + 1e-8) - 1, -1, 1)
            x = torch.from_numpy(p).float()
            token = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, projector["fc1.weight"], projector["fc1.bias"])), projector["fc2.weight"], projector["fc2.bias"])
            patches = torch.cat([patches, token[None, None]], dim=1)
            seq = torch.cat([words[:, :1], patches, words[:, 1:]], dim=1)
            out = lm(inputs_embeds=seq, attention_mask=torch.zeros(1, 1, seq.shape[1], seq.shape[1]), output_hidden_states=True)
            start = patches.shape[1] + num_prompt
            if head == "l1":
                hidden = out.hidden_states[-1][0, start : start + t]
                normalized = _mlp_resnet(head_state, hidden.reshape(CHUNK, -1)).double().numpy()
            else:
                tokens = out.logits[0, start : start + t].argmax(-1).numpy()
                edges = np.linspace(-1, 1, 256)
                centers = (edges[:-1] + edges[1:]) / 2
                normalized = centers[np.clip(512 - tokens - 1, 0, 254)].reshape(CHUNK, 2)
        rows.append(normalized)
    a_low, a_high = np.array(stats["action"]["q01"]), np.array(stats["action"]["q99"])
    return 0.5 * (np.stack(rows) + 1) * (a_high - a_low + 1e-8) + a_low


@pytest.mark.parametrize("head", ["l1", "tokens"])
def test_chunks_are_predict_actions(checkpoint, head):
    policy = make(checkpoint, action_head=head)
    _perturb(policy, 0.3)  # sharper logits: fewer near-ties between the two computations
    inputs = observations(n=3)
    expected = _reference_chunks(policy, inputs, head)
    sample = policy.sample(inputs, deterministic=True)
    assert sample.output.shape == (3, CHUNK, 2)
    if head == "l1":  # batched with left padding vs one at a time: float32 sums in other orders
        np.testing.assert_allclose(sample.output.numpy(), expected, rtol=0, atol=1e-5)
    else:
        np.testing.assert_array_equal(sample.output.numpy(), expected.astype(np.float32))


def test_the_lora_adapter_is_ignored_as_the_reference_does_or_applied_as_merge_lora_weights_and_save(checkpoint, with_adapter):
    """``ignore``: the model files as they are (the reference's inference never reads
    lora_adapter/); ``apply``: W + (α/r)·B·A on every adapted layer, vision, projector and
    language model alike."""
    plain = make(with_adapter)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), make(checkpoint).state_dict().values()))
    merged = make(with_adapter, lora_adapter="apply").state_dict()
    config = json.loads((with_adapter / "lora_adapter" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    adapter = {}
    with safe_open(str(with_adapter / "lora_adapter" / "adapter_model.safetensors"), framework="pt") as f:
        adapter = {k: f.get_tensor(k) for k in f.keys()}
    stored = _safetensors(with_adapter)
    layers = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for k in adapter if k.endswith("lora_A.weight")}
    assert any(n.startswith("vision_backbone.") for n in layers) and any(n.startswith("language_model.") for n in layers) and any(n.startswith("projector.") for n in layers)
    for layer in layers:
        a, b = adapter[f"base_model.model.{layer}.lora_A.weight"].float(), adapter[f"base_model.model.{layer}.lora_B.weight"].float()
        expected = (stored[f"{layer}.weight"].float() + scale * b @ a).to(torch.bfloat16).float()
        assert torch.equal(merged[f"{layer}.weight"], expected), layer


# ------------------------------------------------------------------ RL


@pytest.mark.numerics
@pytest.mark.parametrize("granularity", ["chunk", "token"])
def test_recompute_gives_ratio_exactly_one(checkpoint, granularity):
    policy = make(checkpoint, action_head="tokens", logp_granularity=granularity, temperature=1.3)
    sample = policy.sample(observations(), torch.Generator().manual_seed(0))
    assert sample.logp.shape == ((3, 1) if granularity == "chunk" else (3, 2 * CHUNK))
    tokens = sample.replay["action_tokens"]
    assert tokens.shape == (3, 1, 2 * CHUNK) and ((tokens >= 256) & (tokens < 512)).all()  # sampled among the action ids
    with torch.no_grad():
        exact = policy.log_prob(sample.replay)
    again = policy.log_prob(sample.replay)
    assert torch.equal(exact, again.detach()) and torch.equal(exact, sample.logp)
    # the sum of the tokens' log-probs under the tempered softmax over the 256 action ids
    logits = policy.language_model.lm_head(policy.action_hidden({k: v[:, 0] for k, v in sample.replay.items() if k != "action_tokens"}))[..., 256:512]
    expected = torch.log_softmax(logits / 1.3, -1).gather(-1, (tokens[:, 0] - 256)[..., None])[..., 0]
    torch.testing.assert_close(exact.view(3, -1).sum(-1), expected.sum(-1), rtol=0, atol=1e-5)


def test_a_positive_advantage_raises_the_sampled_chunks_log_prob(checkpoint):
    policy = make(checkpoint, action_head="tokens")
    sample = policy.sample(observations(n=2), torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    before = policy.log_prob(sample.replay).detach()
    (-policy.log_prob(sample.replay)[0].sum()).backward()
    optimizer.step()
    assert policy.log_prob(sample.replay)[0].item() > before[0].item()


def test_an_rl_run_with_the_l1_head_is_refused_in_one_line(checkpoint, tmp_path):
    pytest.importorskip("mujoco")
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    cfg = from_dict(TrainConfig, {
        "name": "oft_l1", "seed": 0, "total_steps": 1, "run_dir": str(tmp_path / "run"), "device": "cpu",
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 2, "max_episode_steps": 2, "kwargs": {"task": "spatial", "image_size": 16}},
        "policy": {"type": "openvla_oft", "checkpoint": str(checkpoint), "unnorm_key": "tabletop", "action_head": "l1", "chunk_size": CHUNK},
        "sampler": {"type": "env"}, "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 1, "kl": {"coef": 0.0}},
        "eval": {"at_start": False, "at_end": False}, "log": {"progress": False, "tensorboard": False},
    })
    with pytest.raises(ConfigError, match="policy.action_head") as e:
        Trainer(cfg)  # refused when the run is built (its loss module), before any rollout
    assert "\n" not in str(e.value) and "use tokens" in str(e.value)
    policy = make(checkpoint)
    with pytest.raises(ConfigError, match="use tokens"):
        policy.log_prob({"action_tokens": torch.zeros(1, 1, 2 * CHUNK, dtype=torch.long)})


@pytest.mark.parametrize("head", ["l1", "tokens"])
def test_sft_loss_falls_on_a_demonstration(checkpoint, head):
    policy = make(checkpoint, action_head=head)
    g = torch.Generator().manual_seed(4)
    actions = torch.rand(2, CHUNK, 2, generator=g) * 1.4 - 0.7
    batch = {**observations(n=2), "actions": actions, "action_mask": torch.tensor([[1.0] * CHUNK, [1.0] * (CHUNK - 1) + [0.0]])}
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    first = policy.sft_loss(batch)
    first.backward()
    optimizer.step()
    assert policy.sft_loss(batch).item() < first.item()
    if head == "l1":  # OFT's L1 loss on normalized actions: |head - clip(2 (a - q01)/(q99 - q01 + 1e-8) - 1)|
        with torch.no_grad():
            stats = STATISTICS_DATA["tabletop"]["action"]
            q01, q99 = torch.tensor(stats["q01"]), torch.tensor(stats["q99"])
            target = (2 * (actions - q01) / (q99 - q01 + 1e-8) - 1).clamp(-1, 1)
            predicted = policy.action_head(policy.action_hidden(policy.encode_inputs(batch)), CHUNK)
            expected = (predicted - target).abs().mean(-1)
            expected = (expected * batch["action_mask"]).sum() / batch["action_mask"].sum()
            torch.testing.assert_close(policy.sft_loss(batch), expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ export


@pytest.mark.parametrize("head", ["l1", "tokens"])
def test_load_export_reload_gives_the_same_actions_files_and_tensor_names(checkpoint, tmp_path, head):
    policy = make(checkpoint, action_head=head)
    _perturb(policy)
    policy.export("openvla_oft", tmp_path / "out")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in checkpoint.iterdir())
    ours, theirs = _safetensors(out), _safetensors(checkpoint)
    assert ours.keys() == theirs.keys() and all(ours[k].dtype == theirs[k].dtype for k in ours)
    for name in ("action_head", "proprio_projector"):
        a, b = _component(out, name), _component(checkpoint, name)
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype for k in a)
        if name == "action_head" and head == "tokens":  # not loaded: copied as it was
            assert all(torch.equal(a[k], b[k]) for k in a)
    reloaded = make(out, action_head=head)
    with torch.no_grad():  # the export stores each tensor in its source dtype
        dtypes = {**{k: v.dtype for k, v in theirs.items()}, **{f"action_head.{k[7:]}": v.dtype for k, v in _component(checkpoint, "action_head").items()}}
        policy.load_state_dict({k: v.to(dtypes.get(k, v.dtype)).float() for k, v in policy.state_dict().items()})
    inputs = observations()
    assert torch.equal(policy.sample(inputs, deterministic=True).output, reloaded.sample(inputs, deterministic=True).output)


# ------------------------------------------------------------------ bad input


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_bad_inputs_are_one_line_config_errors(checkpoint, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    for file in bare.glob("*checkpoint.pt"):
        file.unlink()
    with pytest.raises(ConfigError, match="policy.action_head.*use tokens") as e:
        make(bare, use_proprio=False)
    _one_line(e)
    with pytest.raises(ConfigError, match="policy.use_proprio.*proprio_projector") as e:
        make(bare, action_head="tokens")
    _one_line(e)
    make(bare, action_head="tokens", use_proprio=False)  # OFT's token variant without proprio needs neither file
    no_proprio = tmp_path / "no_proprio_stats"
    shutil.copytree(checkpoint, no_proprio)
    stats = json.loads((no_proprio / "dataset_statistics.json").read_text())
    del stats["tabletop"]["proprio"]
    (no_proprio / "dataset_statistics.json").write_text(json.dumps(stats))
    config = json.loads((no_proprio / "config.json").read_text())
    del config["norm_stats"]["tabletop"]["proprio"]
    (no_proprio / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no proprio statistics") as e:
        make(no_proprio)
    _one_line(e)
    with pytest.raises(ConfigError, match="they hold: bridge_orig, tabletop") as e:
        make(checkpoint, unnorm_key="libero_spatial")
    _one_line(e)
    with pytest.raises(ConfigError, match="7-dim actions, the env's are 2-dim") as e:
        make(checkpoint, unnorm_key="bridge_orig")
    _one_line(e)
    with pytest.raises(ConfigError, match="policy.cameras") as e:
        make(checkpoint, cameras=[0, 2])
    _one_line(e)
    with pytest.raises(ConfigError, match="env's state is 5-dim") as e:
        make(checkpoint, spec={**SPEC, "state_dim": 5})
    _one_line(e)
    with pytest.raises(ConfigError, match="policy.action_dim"):
        make(checkpoint, action_dim=7)
