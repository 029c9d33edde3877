"""PickScore, CLIPScore, the LAION aesthetic predictor and HPSv2 (rewards/clip_scores.py) on
tiny random CLIP models saved in the references' own layouts, each checked against the
reference's formula written out here (transformers / plain torch, not mmrl's code)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.reward import RewardContext, build_reward  # noqa: E402
from mmrl.core.rollout import OldLogProbs, Rollout  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.registry import REWARDS  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

OPENAI_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
OPENAI_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
WORDS = ["a", "photo", "depicts", "red", "blue", "cat", "dog", "on", "the", "table", "of", "green", "sign", "and", "big"]
PROMPTS = ["a red cat", "a blue dog on the table", "a photo of a green sign", "big dog", "the cat and the dog"]
LONG_PROMPT = " ".join(["a big red dog and a small blue cat on the green table"] * 9)  # > 77 tokens
WIDTH, HEADS, PROJ = 32, 2, 16


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP's reversible map of the 256 bytes onto printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def write_tokenizer(directory) -> None:
    """A tiny CLIP BPE vocabulary: every byte alone and word-final ("x</w>"), the merges that
    spell WORDS, and <|startoftext|>, <|endoftext|> last (as in OpenAI's vocabulary, where
    <|endoftext|> is the largest id)."""
    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    merges = []
    for word in WORDS:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merged = pieces[0] + pieces[1]
            if f"{pieces[0]} {pieces[1]}" not in merges:
                merges.append(f"{pieces[0]} {pieces[1]}")
                vocab.setdefault(merged, len(vocab))
            pieces = [merged] + pieces[2:]
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")


def tiny_clip(tokenizer, seed: int) -> transformers.CLIPModel:
    """A random CLIPModel: 32-wide towers of 2 layers and 2 heads, 32x32 images of 8x8
    patches, a 77-token context, 16-dimensional projections, exact GELU (open_clip's)."""
    torch.manual_seed(seed)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
                         max_position_embeddings=77, hidden_act="gelu", bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS, image_size=32, patch_size=8, hidden_act="gelu"),
        projection_dim=PROJ,
    )
    model = transformers.CLIPModel(config).eval()
    with torch.no_grad():  # biases and layer norms away from their initial 0 / 1, so the mapping is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "layrnorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip_scores")
    write_tokenizer(root / "tok")
    tokenizer = transformers.CLIPTokenizer(str(root / "tok" / "vocab.json"), str(root / "tok" / "merges.txt"))
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = transformers.CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    clip = tiny_clip(tokenizer, 0)
    clip.save_pretrained(root / "clip")
    processor.save_pretrained(root / "clip")
    processor.save_pretrained(root / "processor_only")
    tokenizer.save_pretrained(root / "tokenizer")

    # the aesthetic head: Linear(16, 1024) Dropout Linear(1024, 128) Dropout Linear(128, 64) Dropout Linear(64, 16) Linear(16, 1)
    torch.manual_seed(1)
    widths = [PROJ, 1024, 128, 64, 16, 1]
    head = {}
    for index, (a, b) in zip((0, 2, 4, 6, 7), zip(widths[:-1], widths[1:])):
        head[f"layers.{index}.weight"] = torch.randn(b, a) / a**0.5
        head[f"layers.{index}.bias"] = 0.1 * torch.randn(b)
    safetensors_torch.save_file(head, str(root / "head.safetensors"))
    torch.save(head, root / "head.pth")

    # HPSv2: another tiny CLIP, written in open_clip's parameter names
    hps = tiny_clip(tokenizer, 2)
    torch.save({"state_dict": to_open_clip(hps.state_dict())}, root / "hps.pt")

    rng = np.random.RandomState(0)
    images = rng.randint(0, 256, (5, 40, 48, 3)).astype(np.uint8)  # non-square: resize and crop both matter
    return {"root": root, "tokenizer": tokenizer, "clip": clip, "hps": hps, "head": head, "images": images}


def to_open_clip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers CLIPModel state dict in open_clip's names and shapes (the inverse of the
    mapping under test): q, k, v fused into ``attn.in_proj_*``, projections transposed."""
    out = {
        "visual.conv1.weight": sd["vision_model.embeddings.patch_embedding.weight"],
        "visual.class_embedding": sd["vision_model.embeddings.class_embedding"],
        "visual.positional_embedding": sd["vision_model.embeddings.position_embedding.weight"],
        "visual.proj": sd["visual_projection.weight"].t().contiguous(),
        "token_embedding.weight": sd["text_model.embeddings.token_embedding.weight"],
        "positional_embedding": sd["text_model.embeddings.position_embedding.weight"],
        "text_projection": sd["text_projection.weight"].t().contiguous(),
        "logit_scale": sd["logit_scale"],
    }
    for ours, theirs in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm"), ("ln_final", "text_model.final_layer_norm")):
        for kind in ("weight", "bias"):
            out[f"{ours}.{kind}"] = sd[f"{theirs}.{kind}"]
    for ours, theirs in (("visual.transformer.resblocks", "vision_model.encoder.layers"), ("transformer.resblocks", "text_model.encoder.layers")):
        for i in range(2):
            a, b = f"{ours}.{i}.", f"{theirs}.{i}."
            out[a + "attn.in_proj_weight"] = torch.cat([sd[b + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            out[a + "attn.in_proj_bias"] = torch.cat([sd[b + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            for x, y in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                for kind in ("weight", "bias"):
                    out[a + f"{x}.{kind}"] = sd[b + f"{y}.{kind}"]
    return {k: v.clone() for k, v in out.items()}


def rollout(images: np.ndarray, prompts: list[str] | None = None) -> Rollout:
    n = len(images)
    info = {"images": torch.from_numpy(np.ascontiguousarray(images))}
    if prompts is not None:
        info["prompt"] = list(prompts)
    return Rollout(group_id=torch.zeros(n, dtype=torch.long), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={}, info=info)


def reward(name: str, **options):
    return build_reward(from_dict(REWARDS.entry(name).config, {"type": name, **options}), RewardContext())


def feats(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def reference_clip(directory):
    """The reference's own loading: CLIPProcessor and CLIPModel from the directory."""
    return transformers.CLIPProcessor.from_pretrained(str(directory)), transformers.CLIPModel.from_pretrained(str(directory)).eval()


# ------------------------------------------------------------------------------------- PickScore


def pickscore_reference(directory, images, prompts, scale):
    """Flow-GRPO's PickScoreScorer.__call__ (and PickScore's inference example)."""
    processor, model = reference_clip(directory)
    with torch.no_grad():
        image_inputs = processor(images=list(images), padding=True, truncation=True, max_length=77, return_tensors="pt")
        text_inputs = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        image_embs = feats(model.get_image_features(pixel_values=image_inputs["pixel_values"]))
        image_embs = image_embs / image_embs.norm(p=2, dim=-1, keepdim=True)
        text_embs = feats(model.get_text_features(**text_inputs))
        text_embs = text_embs / text_embs.norm(p=2, dim=-1, keepdim=True)
        scores = model.logit_scale.exp() * (text_embs @ image_embs.T)
        return scores.diag() / scale


def test_pickscore_is_the_flow_grpo_formula(assets):
    root, images = assets["root"], assets["images"]
    got = reward("pickscore", path=str(root / "clip"), scale=26.0)(rollout(images, PROMPTS))
    assert got.dtype == torch.float32 and got.shape == (5,)
    torch.testing.assert_close(got, pickscore_reference(root / "clip", images, PROMPTS, 26.0), rtol=1e-5, atol=1e-5)
    raw = reward("pickscore", path=str(root / "clip"), processor_path=str(root / "processor_only"))(rollout(images, PROMPTS))
    torch.testing.assert_close(raw, 26.0 * got, rtol=1e-5, atol=1e-5)


def test_pickscore_a_batch_of_five_equals_five_single_calls(assets):
    root, images = assets["root"], assets["images"]
    scorer = reward("pickscore", path=str(root / "clip"))
    batch = scorer(rollout(images, PROMPTS))
    singles = torch.cat([scorer(rollout(images[i : i + 1], PROMPTS[i : i + 1])) for i in range(5)])
    torch.testing.assert_close(batch, singles, rtol=1e-5, atol=1e-5)
    chunked = reward("pickscore", path=str(root / "clip"), batch_size=2)(rollout(images, PROMPTS))
    torch.testing.assert_close(batch, chunked, rtol=1e-5, atol=1e-5)


def test_a_long_prompt_is_truncated_as_by_hand(assets):
    root, images, tokenizer = assets["root"], assets["images"], assets["tokenizer"]
    ids = tokenizer(LONG_PROMPT)["input_ids"]
    assert len(ids) > 77
    # by hand: <start>, the first 75 BPE tokens, <end>
    cut = torch.tensor([ids[:76] + [tokenizer.eos_token_id]])
    processor, model = reference_clip(root / "clip")
    with torch.no_grad():
        text = feats(model.get_text_features(input_ids=cut))
        image = feats(model.get_image_features(pixel_values=processor(images=[images[0]], return_tensors="pt")["pixel_values"]))
        expected = model.logit_scale.exp() * F.cosine_similarity(text, image)
    got = reward("pickscore", path=str(root / "clip"))(rollout(images[:1], [LONG_PROMPT]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    hessel = reward("clip_score", path=str(root / "clip"), prefix="")(rollout(images[:1], [LONG_PROMPT]))
    torch.testing.assert_close(hessel, 2.5 * (expected / model.logit_scale.exp()).clamp(min=0), rtol=1e-5, atol=1e-5)


def test_dtype_and_device(assets):
    root, images = assets["root"], assets["images"]
    full = reward("pickscore", path=str(root / "clip"))(rollout(images, PROMPTS))
    scorer = reward("pickscore", path=str(root / "clip"), dtype="bfloat16", device="cpu")
    params = list(scorer.model.parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" and not p.requires_grad for p in params)
    assert not scorer.model.training
    half = scorer(rollout(images, PROMPTS))
    assert half.dtype == torch.float32 and half.device.type == "cpu"
    # bf16 keeps ~3 significant digits: the cosine to ~1e-2, times exp(logit_scale) = 14.3
    torch.testing.assert_close(half, full, rtol=0.0, atol=0.4)
    assert not torch.equal(half, full)


# ------------------------------------------------------------------------------------- CLIPScore


def test_clip_score_hessel_is_w_times_the_clipped_cosine_with_the_caption_prefix(assets):
    root = assets["root"]
    rng = np.random.RandomState(5)
    images = rng.randint(0, 256, (8, 36, 30, 3)).astype(np.uint8)
    prompts = (PROMPTS + ["red", "blue sign", "dog"])[:8]
    processor, model = reference_clip(root / "clip")
    with torch.no_grad():  # clipscore.py: get_clip_score, w * clip(sum(normalize(img) * normalize(cap)), 0)
        image = feats(model.get_image_features(pixel_values=processor(images=list(images), return_tensors="pt")["pixel_values"]))
        caption = processor(text=["A photo depicts " + p for p in prompts], padding=True, truncation=True, max_length=77, return_tensors="pt")
        text = feats(model.get_text_features(**caption))
        cos = ((image / image.norm(dim=1, keepdim=True)) * (text / text.norm(dim=1, keepdim=True))).sum(1)
    assert (cos < 0).any() and (cos > 0).any(), "the seed should give cosines of both signs"
    got = reward("clip_score", path=str(root / "clip"))(rollout(images, prompts))
    torch.testing.assert_close(got, 2.5 * cos.clamp(min=0), rtol=1e-5, atol=1e-5)
    w1 = reward("clip_score", path=str(root / "clip"), w=1.0, batch_size=3)(rollout(images, prompts))
    torch.testing.assert_close(w1, cos.clamp(min=0), rtol=1e-5, atol=1e-5)


def test_clip_score_flow_grpo_is_logits_over_30_on_bilinear_resized_pixels(assets):
    root, images = assets["root"], assets["images"]
    processor, model = reference_clip(root / "clip")
    # Flow-GRPO's ClipScorer: uint8 / 255, T.Resize(32) (bilinear, antialias), T.CenterCrop(32), T.Normalize
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0  # [5, 3, 40, 48]
    x = F.interpolate(x, size=(32, int(32 * 48 / 40)), mode="bilinear", align_corners=False, antialias=True)  # [5, 3, 32, 38]
    x = x[..., :, 3:35]  # left = round((38 - 32) / 2) = 3
    x = (x - OPENAI_MEAN) / OPENAI_STD
    with torch.no_grad():
        texts = processor(text=PROMPTS, padding="max_length", truncation=True, max_length=77, return_tensors="pt")  # openai tokenizer: model_max_length 77
        expected = model(pixel_values=x, **texts).logits_per_image.diagonal() / 30
    got = reward("clip_score", path=str(root / "clip"), variant="flow_grpo")(rollout(images, PROMPTS))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- aesthetic


def test_aesthetic_is_the_mlp_on_the_normalized_image_embedding_from_either_file(assets):
    root, images, head = assets["root"], assets["images"], assets["head"]
    processor, model = reference_clip(root / "clip")
    with torch.no_grad():  # Flow-GRPO's AestheticScorer: normalize(get_image_features) -> MLP (dropout off)
        embed = feats(model.get_image_features(pixel_values=processor(images=list(images), return_tensors="pt")["pixel_values"]))
        h = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
        for index in (0, 2, 4, 6, 7):
            h = h @ head[f"layers.{index}.weight"].T + head[f"layers.{index}.bias"]
        expected = h.squeeze(1)
    from_safetensors = reward("aesthetic", path=str(root / "clip"), head_path=str(root / "head.safetensors"))
    assert from_safetensors.tokenizer is None and not from_safetensors.head.training
    got = from_safetensors(rollout(images))  # no prompt needed
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    from_pth = reward("aesthetic", path=str(root / "clip"), head_path=str(root / "head.pth"), batch_size=2)(rollout(images, PROMPTS))
    torch.testing.assert_close(from_pth, got, rtol=1e-6, atol=1e-6)


class Payload:
    """A pickled object that is not a tensor: weights_only must refuse it."""

    def __reduce__(self):
        return (print, ("this must never run",))


def test_aesthetic_refuses_a_pth_with_pickled_objects_and_a_head_of_another_width(assets, tmp_path):
    root = assets["root"]
    bad = tmp_path / "evil.pth"
    torch.save({**assets["head"], "extra": Payload()}, bad)
    with pytest.raises(ConfigError, match=r"rewards\.aesthetic\.head_path.*weights_only") as err:
        reward("aesthetic", path=str(root / "clip"), head_path=str(bad))
    assert "\n" not in str(err.value)
    wide = {k: v for k, v in assets["head"].items()}
    wide["layers.0.weight"] = torch.randn(1024, 768)
    safetensors_torch.save_file(wide, str(tmp_path / "l14.safetensors"))
    with pytest.raises(ConfigError, match="768"):
        reward("aesthetic", path=str(root / "clip"), head_path=str(tmp_path / "l14.safetensors"))


# ------------------------------------------------------------------------------------- HPSv2


def open_clip_transformer(sd, prefix, x, heads, mask=None):
    """open_clip's Transformer of ResidualAttentionBlocks (nn.MultiheadAttention), x [B, L, W]."""
    width = x.shape[-1]
    i = 0
    while f"{prefix}{i}.ln_1.weight" in sd:
        p = f"{prefix}{i}."
        h = F.layer_norm(x, (width,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"]).transpose(0, 1)
        attn, _ = F.multi_head_attention_forward(
            h, h, h, width, heads, sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"], None, None, False, 0.0,
            sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"], training=False, need_weights=False, attn_mask=mask,
        )
        x = x + attn.transpose(0, 1)
        h = F.layer_norm(x, (width,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"])
        x = x + F.linear(F.gelu(F.linear(h, sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])), sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
        i += 1
    return x


def open_clip_encode_image(sd, pixels):
    """open_clip VisionTransformer.forward: patches, class token, positions, ln_pre, blocks, ln_post(CLS) @ proj."""
    patch = sd["visual.conv1.weight"].shape[-1]
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=patch).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(x.shape[0], 1, -1), x], dim=1) + sd["visual.positional_embedding"]
    x = F.layer_norm(x, (WIDTH,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    x = open_clip_transformer(sd, "visual.transformer.resblocks.", x, HEADS)
    return F.layer_norm(x[:, 0], (WIDTH,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"]) @ sd["visual.proj"]


def open_clip_encode_text(sd, tokens):
    """open_clip CLIP.encode_text: causal blocks, ln_final, the argmax token's state @ text_projection."""
    length = tokens.shape[1]
    x = sd["token_embedding.weight"][tokens] + sd["positional_embedding"]
    mask = torch.full((length, length), float("-inf")).triu(1)
    x = open_clip_transformer(sd, "transformer.resblocks.", x, HEADS, mask)
    x = F.layer_norm(x, (WIDTH,), sd["ln_final.weight"], sd["ln_final.bias"])
    return x[torch.arange(x.shape[0]), tokens.argmax(dim=-1)] @ sd["text_projection"]


def open_clip_tokenize(tokenizer, texts, context=77):
    """open_clip's tokenize: [sot] + bpe + [eot], cut to the context with the last set to eot, zeros after."""
    out = torch.zeros(len(texts), context, dtype=torch.long)
    for i, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"]  # <|startoftext|> ... <|endoftext|>
        if len(ids) > context:
            ids = ids[:context]
            ids[-1] = tokenizer.eos_token_id
        out[i, : len(ids)] = torch.tensor(ids)
    return out


def hps_pixels_by_hand(images):
    """HPSv2's preprocess_val on the 40x48 test images: ToTensor, ResizeMaxSize(32): scale
    32/48, size (round(26.67), 32) = (27, 32), bicubic antialiased; 5 rows of zero padding,
    2 above and 3 below; then OpenAI's mean/std."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    resized = F.interpolate(x, size=(27, 32), mode="bicubic", align_corners=False, antialias=True)
    canvas = torch.zeros(len(images), 3, 32, 32)
    canvas[:, :, 2:29, :] = resized
    return (canvas - OPENAI_MEAN) / OPENAI_STD


def test_hpsv2_maps_an_open_clip_checkpoint_and_scores_its_cosine(assets):
    root, images, tokenizer, hps = assets["root"], assets["images"], assets["tokenizer"], assets["hps"]
    prompts = PROMPTS[:4] + [LONG_PROMPT]
    sd = torch.load(root / "hps.pt", weights_only=True)["state_dict"]
    assert sd["visual.transformer.resblocks.0.attn.in_proj_weight"].shape == (3 * WIDTH, WIDTH)
    assert sd["visual.proj"].shape == (WIDTH, PROJ) and sd["text_projection"].shape == (WIDTH, PROJ)
    scorer = reward("hpsv2", path=str(root / "hps.pt"), tokenizer_path=str(root / "tokenizer"), vision_head_width=16, text_head_width=16)
    assert all(not p.requires_grad for p in scorer.model.parameters()) and not scorer.model.training
    got = scorer(rollout(images, prompts))

    pixels = hps_pixels_by_hand(images)
    tokens = open_clip_tokenize(tokenizer, prompts)
    with torch.no_grad():
        # HPSv2 img_score.py: normalized image_features @ text_features.T, the diagonal
        image = F.normalize(open_clip_encode_image(sd, pixels), dim=-1)
        text = F.normalize(open_clip_encode_text(sd, tokens), dim=-1)
        expected = torch.diagonal(image @ text.T)
        # the same through the tiny transformers CLIPModel the checkpoint was written from
        hf_image = F.normalize(feats(hps.get_image_features(pixel_values=pixels)), dim=-1)
        hf_text = F.normalize(feats(hps.get_text_features(input_ids=tokens)), dim=-1)
        hf_cos = (hf_image * hf_text).sum(-1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, hf_cos, rtol=1e-5, atol=1e-5)
    single = torch.cat([scorer(rollout(images[i : i + 1], prompts[i : i + 1])) for i in range(5)])
    torch.testing.assert_close(single, got, rtol=1e-5, atol=1e-5)


def test_hpsv2_preprocessing_resizes_the_longer_side_and_pads_or_crops_the_shorter(assets):
    from mmrl.rewards.clip_scores import open_clip_preprocess

    images = assets["images"]  # 40 x 48
    torch.testing.assert_close(open_clip_preprocess(images, 32, "pad"), hps_pixels_by_hand(images), rtol=0, atol=1e-6)
    # open_clip's Resize(32, bicubic) + CenterCrop(32): shorter side 40 -> 32, longer int(32 * 48 / 40) = 38, columns 3..34
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    x = F.interpolate(x, size=(32, 38), mode="bicubic", align_corners=False, antialias=True)[..., 3:35]
    torch.testing.assert_close(open_clip_preprocess(images, 32, "crop"), (x - OPENAI_MEAN) / OPENAI_STD, rtol=0, atol=1e-6)
    # a tall image: 48 x 40 -> (32, round(26.67) = 27) columns, 2 left and 3 right of padding
    tall = np.ascontiguousarray(images.transpose(0, 2, 1, 3))
    padded = open_clip_preprocess(tall, 32, "pad")
    fill = ((0 - OPENAI_MEAN) / OPENAI_STD).view(1, 3, 1)
    torch.testing.assert_close(padded[..., :, :2], fill.expand(5, 3, 32).unsqueeze(-1).expand(5, 3, 32, 2))
    torch.testing.assert_close(padded[..., :, 29:], fill.expand(5, 3, 32).unsqueeze(-1).expand(5, 3, 32, 3))
    # an image of the model's size passes unresized
    square = images[:, :32, :32]
    torch.testing.assert_close(open_clip_preprocess(square, 32, "pad"), (torch.from_numpy(square).permute(0, 3, 1, 2).float() / 255 - OPENAI_MEAN) / OPENAI_STD)


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "name, options, field",
    [
        ("pickscore", {"path": "{missing}"}, "rewards.pickscore.path"),
        ("pickscore", {"path": "{clip}", "processor_path": "{missing}"}, "rewards.pickscore.processor_path"),
        ("clip_score", {"path": "{missing}"}, "rewards.clip_score.path"),
        ("clip_score", {"path": "{root}"}, "rewards.clip_score.path"),  # a directory without config.json
        ("aesthetic", {"path": "{clip}", "head_path": "{missing}"}, "rewards.aesthetic.head_path"),
        ("aesthetic", {"path": "{missing}", "head_path": "{head}"}, "rewards.aesthetic.path"),
        ("hpsv2", {"path": "{missing}", "tokenizer_path": "{tokenizer}"}, "rewards.hpsv2.path"),
        ("hpsv2", {"path": "{hps}", "tokenizer_path": "{missing}"}, "rewards.hpsv2.tokenizer_path"),
        ("hpsv2", {"path": "{head}", "tokenizer_path": "{tokenizer}"}, "rewards.hpsv2.path"),  # not an open_clip checkpoint
    ],
)
def test_a_missing_or_wrong_directory_or_file_is_a_one_line_config_error_naming_the_field(assets, name, options, field):
    root = assets["root"]
    places = {"missing": str(root / "nowhere"), "clip": str(root / "clip"), "root": str(root), "head": str(root / "head.safetensors"),
              "hps": str(root / "hps.pt"), "tokenizer": str(root / "tokenizer")}
    with pytest.raises(ConfigError) as err:
        reward(name, **{k: v.format(**places) for k, v in options.items()})
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_required_fields_and_a_rollout_without_prompts(assets):
    with pytest.raises(ConfigError, match="path"):
        from_dict(REWARDS.entry("pickscore").config, {"type": "pickscore"})
    with pytest.raises(ConfigError, match="head_path"):
        from_dict(REWARDS.entry("aesthetic").config, {"type": "aesthetic", "path": "x"})
    with pytest.raises(ConfigError, match="tokenizer_path"):
        from_dict(REWARDS.entry("hpsv2").config, {"type": "hpsv2", "path": "x.pt"})
    scorer = reward("pickscore", path=str(assets["root"] / "clip"))
    with pytest.raises(ConfigError, match="prompt"):
        scorer(rollout(assets["images"]))
