import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from mmrl.config import from_dict  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.vla import InstructionTokenizer, VLABackbone, VLABackboneConfig  # noqa: E402

INSTRUCTIONS = ["Pick up the red block.", "push the blue block to the left", "Put it in the BOWL, please!"]


def tokenizer() -> InstructionTokenizer:
    return InstructionTokenizer.build(INSTRUCTIONS)


def make(spec=None, **fields) -> VLABackbone:
    torch.manual_seed(0)
    cfg = VLABackboneConfig(hidden_size=32, num_heads=2, intermediate_size=64, vision_channels=[8, 16], max_instruction_tokens=8, **fields)
    spec = spec if spec is not None else {"image_shape": [32, 32, 3], "state_dim": 4}
    return VLABackbone(cfg, spec, tokenizer().vocab_size)


def inputs(n=3, cameras=None, seed=0, texts=None):
    g = torch.Generator().manual_seed(seed)
    shape = (n, 32, 32, 3) if cameras is None else (n, cameras, 32, 32, 3)
    image = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    state = torch.randn(n, 4, generator=g)
    ids, mask = tokenizer().encode(texts or [INSTRUCTIONS[i % 3] for i in range(n)], 8)
    return image, state, ids, mask


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_reserves_pad_unk_bos_and_splits_lowercased_words_and_punctuation():
    tok = tokenizer()
    assert [tok.tokenizer.token_to_id(t) for t in ("[PAD]", "[UNK]", "[BOS]")] == [0, 1, 2]
    assert tok.tokens("Put it in the BOWL, please!") == ["put", "it", "in", "the", "bowl", ",", "please", "!"]
    # 3 specials + the 17 distinct words and punctuation marks of INSTRUCTIONS
    assert tok.vocab_size == 3 + len({w for text in INSTRUCTIONS for w in tok.tokens(text)}) == 20


def test_encode_starts_with_bos_pads_truncates_and_maps_unknown_words_to_unk():
    tok = tokenizer()
    ids, mask = tok.encode(["pick up the RED block.", "pick up the zebra", "", "push the blue block to the left now please"], 6)
    word = tok.tokenizer.token_to_id
    assert ids[0].tolist() == [2, word("pick"), word("up"), word("the"), word("red"), word("block")]  # "." truncated
    assert ids[1].tolist() == [2, word("pick"), word("up"), word("the"), 1, 0]
    assert ids[2].tolist() == [2, 0, 0, 0, 0, 0]
    assert mask.tolist()[1:3] == [[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert ids.dtype == torch.long and mask.dtype == torch.float32 and ids[3].ne(0).all()


def test_vocabulary_does_not_depend_on_the_order_of_the_instructions():
    a = InstructionTokenizer.build(INSTRUCTIONS)
    b = InstructionTokenizer.build(list(reversed(INSTRUCTIONS)) + INSTRUCTIONS[:1])
    assert a.tokenizer.get_vocab() == InstructionTokenizer.build(list(INSTRUCTIONS)).tokenizer.get_vocab()
    assert set(a.tokenizer.get_vocab()) == set(b.tokenizer.get_vocab())


def test_tokenizer_saves_as_tokenizer_json_and_loads_back_identically(tmp_path):
    tok = tokenizer()
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = InstructionTokenizer.load(tmp_path)
    assert loaded.to_json() == tok.to_json() and loaded.vocab_size == tok.vocab_size
    texts = INSTRUCTIONS + ["an unseen instruction, surely"]
    for a, b in zip(tok.encode(texts, 12), loaded.encode(texts, 12)):
        assert torch.equal(a, b)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        InstructionTokenizer.load(tmp_path / "missing")


# ---------------------------------------------------------------- backbone


@pytest.mark.parametrize("cameras", [None, 2])
def test_prefix_holds_patch_tokens_of_every_camera_then_state_then_instruction(cameras):
    spec = {"image_shape": [32, 32, 3] if cameras is None else [cameras, 32, 32, 3], "state_dim": 4}
    backbone = make(spec)
    image, state, ids, mask = inputs(cameras=cameras)
    embeds, prefix_mask = backbone.prefix(image, state, ids, mask)
    # 32x32 -> two stride-2 convs -> 8x8 cells per camera
    patches = (cameras or 1) * 64
    assert backbone.num_patch_tokens == patches and backbone.prefix_length() == patches + 1 + 8
    assert embeds.shape == (3, patches + 1 + 8, 32) and prefix_mask.shape == (3, patches + 1 + 8)
    assert prefix_mask[:, : patches + 1].eq(1).all() and torch.equal(prefix_mask[:, patches + 1 :], mask)
    hidden = backbone(embeds, prefix_mask)
    assert hidden.shape == embeds.shape and torch.isfinite(hidden).all()


def test_patch_grid_pools_the_feature_map_to_fewer_tokens():
    backbone = make(patch_grid=4)
    embeds, _ = backbone.prefix(*inputs())
    assert backbone.grid == (4, 4) and embeds.shape[1] == 16 + 1 + 8


def test_coord_channels_let_patches_of_a_uniform_image_tell_where_they_are():
    image = torch.full((1, 32, 32, 3), 128, dtype=torch.uint8)
    for coords in (False, True):
        backbone = make(coord_channels=coords)
        with torch.no_grad():
            backbone.patch_position.zero_()
            backbone.camera_embedding.zero_()
            tokens = backbone.encode_images(image)[0].view(*backbone.grid, -1)
        inner = tokens[1:-1, 1:-1]  # cells away from the zero padding of the convs
        spread = (inner - inner[0, 0]).abs().max().item()
        assert (spread > 1e-3) == coords, (coords, spread)


def test_keypoint_tokens_follow_a_bright_spot_across_the_image():
    backbone = make(keypoints=4, vision_norm="none", spec={"image_shape": [2, 32, 32, 3], "state_dim": 4})
    assert backbone.num_patch_tokens == 2 * (8 * 8 + 4)
    image, state, ids, mask = inputs(2, cameras=2)
    embeds, _ = backbone.prefix(image, state, ids, mask)
    assert embeds.shape[1] == backbone.prefix_length(ids.shape[1])
    with torch.no_grad():  # one keypoint map that fires on red: its token moves with a red spot
        backbone.keypoint_maps.weight.zero_()
        backbone.keypoint_maps.bias.zero_()
        for block in backbone.vision:  # channel 0 passes the red channel's centre tap through
            block["conv"].weight.zero_()
            block["conv"].bias.zero_()
            block["conv"].weight[0, 0, 1, 1] = 1.0
        backbone.keypoint_maps.weight[0, 0] = 50.0
    spots = []
    for x in (4, 24):  # pixels the two stride-2 centre taps see
        img = torch.zeros(1, 2, 32, 32, 3, dtype=torch.uint8)
        img[0, :, 16, x, 0] = 255
        features = img[:, 0].permute(0, 3, 1, 2).float() / 255.0
        for block in backbone.vision:
            features = block["act"](block["norm"](block["conv"](features)))
        attention = torch.softmax(backbone.keypoint_maps(features).flatten(2), dim=-1)
        spots.append((attention @ backbone.keypoint_grid)[0, 0])
    assert spots[0][0] < -0.5 and spots[1][0] > 0.5 and abs(spots[0][1]) < 0.3


@pytest.mark.parametrize("film", [False, True])
def test_film_makes_the_image_tokens_depend_on_the_instruction(film):
    backbone = make(film=film, keypoints=2)
    image, state, _, _ = inputs(2)
    image = image[:1].expand(2, -1, -1, -1)
    ids, mask = tokenizer().encode([INSTRUCTIONS[0], INSTRUCTIONS[1]], 8)
    if film:  # FiLM starts as the identity; give it weights as training would
        with torch.no_grad():
            for layer in backbone.film:
                layer.weight.normal_(0, 0.5)
    embeds, _ = backbone.prefix(image, state[:1].expand(2, -1), ids, mask)
    patches = embeds[:, : backbone.num_patch_tokens]
    assert (not torch.allclose(patches[0], patches[1], atol=1e-6)) == film
    embeds.sum().backward()
    if film:
        assert all(layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0 for layer in backbone.film)


def test_each_camera_and_the_state_change_the_features_and_padding_does_not():
    backbone = make({"image_shape": [2, 32, 32, 3], "state_dim": 4})
    image, state, ids, mask = inputs(cameras=2)

    def last_real_hidden(image, state, ids):
        embeds, m = backbone.prefix(image, state, ids, mask)
        return backbone(embeds, m)[:, -8:][mask.bool()]

    with torch.no_grad():
        base = last_real_hidden(image, state, ids)
        other_camera = image.clone()
        other_camera[:, 1] = 255 - other_camera[:, 1]
        assert not torch.allclose(last_real_hidden(other_camera, state, ids), base, atol=1e-4)
        assert not torch.allclose(last_real_hidden(image, state + 1.0, ids), base, atol=1e-4)
        repadded = torch.where(mask.bool(), ids, torch.full_like(ids, 5))  # garbage under the padding mask
        torch.testing.assert_close(last_real_hidden(image, state, repadded), base, atol=1e-5, rtol=1e-5)


@pytest.mark.numerics
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_incremental_decoding_with_the_cache_equals_one_full_pass(attn):
    backbone = make(attn_implementation=attn)
    embeds, mask = backbone.prefix(*inputs())
    extra = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = backbone(torch.cat([embeds, extra], 1), torch.cat([mask, torch.ones(3, 4)], 1))
        cache = backbone.new_cache()
        steps = [backbone(embeds, mask, cache)]
        running = mask
        for j in range(4):
            running = torch.cat([running, torch.ones(3, 1)], 1)
            steps.append(backbone(extra[:, j : j + 1], running, cache))
    # the key/value cache against one pass: float32 sums in another order (measured: at most 2.4e-7)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_state_only_and_instruction_only_backbones():
    state_only = make({"state_dim": 4})
    _, state, ids, mask = inputs()
    embeds, m = state_only.prefix(None, state, ids, mask)
    assert embeds.shape == (3, 1 + 8, 32) and state_only.num_patch_tokens == 0
    words_only = make({})
    embeds, m = words_only.prefix(None, None, ids, mask)
    assert embeds.shape == (3, 8, 32) and torch.isfinite(words_only(embeds, m)).all()
    with pytest.raises(ValueError, match="image"):
        make().prefix(None, state, ids, mask)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "gemma"])
def test_other_decoder_families_build_and_run(arch):
    backbone = make(arch=arch)
    assert type(backbone.decoder).__name__.lower().startswith(arch)
    embeds, mask = backbone.prefix(*inputs())
    hidden = backbone(embeds, mask)
    assert hidden.shape == embeds.shape and torch.isfinite(hidden).all()


def test_decoder_has_no_token_table_and_every_parameter_gets_a_gradient():
    backbone = make()
    assert not [name for name in backbone.decoder.state_dict() if "embed_tokens" in name]
    embeds, mask = backbone.prefix(*inputs())
    backbone(embeds, mask).square().mean().backward()
    unused = [name for name, p in backbone.named_parameters() if p.grad is None]
    assert unused == []


def test_weights_round_trip_into_a_backbone_resized_to_the_saved_vocabulary(tmp_path):
    from safetensors.torch import load_file, save_file

    backbone = make()
    save_file({k: v.contiguous() for k, v in backbone.state_dict().items()}, str(tmp_path / "w.safetensors"))
    torch.manual_seed(1)
    other = VLABackbone(backbone.cfg, {"image_shape": [32, 32, 3], "state_dim": 4}, vocab_size=5)
    other.resize_instruction_vocab(tokenizer().vocab_size)
    other.load_state_dict(load_file(str(tmp_path / "w.safetensors")))
    embeds, mask = backbone.prefix(*inputs())
    with torch.no_grad():
        assert torch.equal(backbone(embeds, mask), other(*other.prefix(*inputs())))


def test_bad_backbone_config_names_the_field():
    with pytest.raises(ConfigError, match=r"policy\.backbone\.num_heads"):
        from_dict(VLABackboneConfig, {"hidden_size": 30, "num_heads": 4}, "policy.backbone")
    with pytest.raises(ConfigError, match=r"policy\.backbone\.arch"):
        from_dict(VLABackboneConfig, {"arch": "gpt-9"}, "policy.backbone")
    with pytest.raises(ConfigError, match=r"policy\.backbone\.vision_channels"):
        from_dict(VLABackboneConfig, {"vision_channels": []}, "policy.backbone")
    with pytest.raises(ConfigError, match=r"image_shape|\[H, W, 3\]"):
        make({"image_shape": [32, 32]})


# transformers warns of a deprecated argument from a decorator, attributed to the decorated
# forward's caller: torch's Module.__call__, or transformers' own wrappers of inner layers.
# Warnings attributed to mmrl, transformers or torch during mmrl's calls are escalated.
_OUR_CALLS = r"(mmrl|transformers|torch)(\.|$)"


@pytest.mark.parametrize(
    ("policy_type", "arch"), [("token_vla", arch) for arch in ("llama", "qwen2", "qwen3", "mistral", "gemma")] + [("flow_vla", "llama")]
)
def test_vla_sample_and_log_prob_call_transformers_without_deprecated_arguments(policy_type, arch):
    import warnings

    from mmrl.core.weights import build_policy
    from mmrl.registry import POLICIES

    spec = {"action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0], "state_dim": 4, "obs_dim": 4, "image_shape": [16, 16, 3], "instructions": INSTRUCTIONS}
    backbone = {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8], "max_instruction_tokens": 8, "arch": arch}
    cfg = from_dict(POLICIES.entry(policy_type).config, {"type": policy_type, "action_chunk": 2, "backbone": backbone}, "policy")
    torch.manual_seed(0)
    image, state, _, _ = inputs(n=2)
    obs = {"image": image[:, :16, :16], "state": state, "instruction": INSTRUCTIONS[:2]}
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("error", category=category, module=_OUR_CALLS)
        policy = build_policy(cfg, spec)
        sample = policy.sample(obs, torch.Generator().manual_seed(0))  # the token VLA decodes with a key/value cache
        policy.log_prob(sample.replay).sum().backward()
