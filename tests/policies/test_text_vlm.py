import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("PIL")

from mmrl.config import from_dict, option  # noqa: E402
from mmrl.core.component_config import RewardConfig  # noqa: E402
from mmrl.core.rollout import OldLogProbs, Rollout  # noqa: E402
from mmrl.core.weights import build_policy, load_pretrained, save_pretrained  # noqa: E402
from mmrl.data.prompts import ImagePrompt  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.text_vlm import TextVLMConfig, TextVLMPolicy  # noqa: E402
from mmrl.registry import POLICIES, REWARDS  # noqa: E402
from tests.conftest import ROOT, run_mmrl  # noqa: E402

TINY = {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}
# the key/value-cache loop against one teacher-forced pass, or passes over other rows: float32
# sums in other orders, within docs/text.md's 1e-4 per token (measured here: at most 4.8e-7
# under ATEN_CPU_CAPABILITY default, avx2 and avx512)
PER_TOKEN_ATOL = 1e-4


def make(seed: int = 0, tiny: dict | None = None, **fields) -> TextVLMPolicy:
    data = {"type": "text_vlm", "tiny": {**TINY, **(tiny or {})}, **fields}
    torch.manual_seed(seed)
    return build_policy(from_dict(TextVLMConfig, data, "policy"), {})


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(n: int, seed: int = 0, size: int = 32) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def prompts() -> list:
    """Prompts of different lengths: one image, two images (a clip's frames), none, one."""
    a, b, c = images(3)
    return [
        ImagePrompt("How many circles are in the image?", (a,)),
        ImagePrompt("Hi", (b, c)),
        "No image here, just text.",
        ImagePrompt("What colour is the square?", (c,)),
    ]


def test_registered_and_built_as_a_tiny_llava_whose_prompts_hold_one_token_per_patch():
    assert POLICIES.entry("text_vlm").config is TextVLMConfig
    policy = make(vision={"image_size": 32, "patch_size": 8}, generation={"max_new_tokens": 4})
    model = policy.language_model
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert type(model.model.vision_tower).__name__ == "CLIPVisionModel"
    image_token = policy.tokenizer.convert_tokens_to_ids("<image>")
    assert model.config.image_token_id == image_token and len(policy.tokenizer) == 260
    ids, inputs = policy._encode_inputs(prompts())
    assert [seq.count(image_token) for seq in ids] == [16, 32, 0, 16]  # (32 / 8)^2 tokens per image
    assert inputs["pixel_values"].shape == (4, 2, 3, 32, 32) and inputs["image_count"].tolist() == [1, 2, 0, 1]
    assert (inputs["pixel_values"][0, 1] == 0).all()  # padding past a prompt's images


def test_images_go_before_the_text_inside_the_user_turn_after_the_system_message():
    chat = make(generation={"chat_template": True, "system_prompt": "Answer with one word."})
    assert chat._prompt_text("Hi", 2) == (
        "<|im_start|>system\nAnswer with one word.<|im_end|>\n<|im_start|>user\n<image><image>Hi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert make()._prompt_text("Hi", 1) == "<image>Hi" and make()._prompt_text("Hi", 0) == "Hi"


@pytest.mark.parametrize(
    ("temperature", "top_p", "dtype", "chat_template"),
    [(1.0, 1.0, "float32", False), (0.7, 0.9, "float32", True), (1.5, 0.8, "float32", True), (0.8, 0.9, "bfloat16", True)],
)
def test_log_prob_of_the_replay_equals_old_logp_exactly_after_sampling(temperature, top_p, dtype, chat_template):
    """Ratio exactly 1 before any update, under temperature and top-p, with prompts of
    different lengths (and image counts) padded on the left."""
    policy = make(dtype=dtype, generation={"max_new_tokens": 8, "temperature": temperature, "top_p": top_p, "chat_template": chat_template, "old_logp": "recompute"})
    sample = policy.sample(prompts(), generator(0))
    lengths = sample.replay["prompt_mask"].sum(1)
    assert len(set(lengths.tolist())) == 4 and (sample.replay["prompt_mask"][:, -1] == 1).all()  # left-padded
    logp = policy.log_prob(sample.replay)
    assert torch.equal(logp, sample.logp)
    assert torch.equal(torch.exp(logp - sample.logp) * sample.mask, sample.mask)
    assert (sample.logp <= 0).all() and torch.isfinite(sample.entropy).all()


@pytest.mark.numerics
def test_the_image_reaches_the_model_and_the_decoding_loop_sees_what_log_prob_sees():
    policy = make(generation={"max_new_tokens": 6})
    a, b = images(2, seed=3)
    sample = policy.sample([ImagePrompt("What is this?", (a,))], generator(0))
    swapped = dict(sample.replay)
    _, other = policy._encode_inputs([ImagePrompt("What is this?", (b,))])
    swapped["pixel_values"] = other["pixel_values"]
    assert not torch.allclose(policy.log_prob(swapped), sample.logp, atol=1e-4)  # another image, other log-probs
    # the key/value-cache loop's own log-probs (the backend's) agree with the teacher-forced pass
    backend = make(generation={"max_new_tokens": 6, "old_logp": "backend"})
    fast = backend.sample([ImagePrompt("What is this?", (a,))], generator(0))
    assert fast.output == sample.output and torch.allclose(fast.logp, policy.log_prob(sample.replay), atol=PER_TOKEN_ATOL, rtol=0)


def test_the_image_placeholder_is_never_sampled_even_when_the_model_favours_it():
    policy = make(generation={"max_new_tokens": 8})
    image_token = policy.tokenizer.convert_tokens_to_ids("<image>")
    bias = torch.zeros(len(policy.tokenizer))
    bias[image_token] = 50.0
    head = policy.language_model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: out + bias)
    sample = policy.sample(prompts(), generator(0))
    handle.remove()
    assert not (sample.replay["completion_ids"][sample.mask.bool()] == image_token).any()
    assert torch.isfinite(sample.logp).all()


class _RecordingBackend:
    """A stand-in for a serving engine: mmrl's own loop, recording what it was given."""

    calls: list = []

    def __init__(self, policy):
        from mmrl.policies.text_lm import BuiltinBackend

        self.inner = BuiltinBackend(policy)

    def generate(self, prompt_ids, options, generator, deterministic, model_inputs=None):
        _RecordingBackend.calls.append(model_inputs)
        return self.inner.generate(prompt_ids, options, generator, deterministic, model_inputs=model_inputs)


def test_a_generation_backend_plugged_in_by_import_path_gets_the_images_as_model_inputs():
    _RecordingBackend.calls.clear()
    policy = make(generation={"max_new_tokens": 5, "backend": f"{__name__}:_RecordingBackend", "old_logp": "recompute"})
    sample = policy.sample(prompts(), generator(0))
    (given,) = _RecordingBackend.calls
    assert given["image_count"].tolist() == [1, 2, 0, 1] and given["pixel_values"].shape == (4, 2, 3, 32, 32)
    assert torch.equal(given["pixel_values"], sample.replay["pixel_values"])
    assert torch.equal(policy.log_prob(sample.replay), sample.logp)
    reference = make(generation={"max_new_tokens": 5}).sample(prompts(), generator(0))
    assert sample.output == reference.output  # the same loop, given the same inputs


def test_a_prompts_completion_does_not_depend_on_the_other_prompts_of_its_batch():
    policy = make(generation={"max_new_tokens": 8})
    batch = prompts()
    together = policy.sample(batch, deterministic=True).output
    alone = [policy.sample([p], deterministic=True).output[0] for p in batch]
    assert together == alone


def test_positive_advantage_raises_that_completions_log_prob_after_one_adam_step():
    policy = make(generation={"max_new_tokens": 8})
    sample = policy.sample(prompts(), generator(0))
    advantage = torch.tensor([0.0, 1.0, 0.0, 0.0])[:, None]
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    loss = -(policy.log_prob(sample.replay) * advantage * sample.mask).sum() / sample.mask.sum()
    loss.backward()
    patches = policy.vision_tower.get_input_embeddings().weight
    assert patches.grad is not None and patches.grad.abs().sum() > 0  # the image's path trains too
    optimizer.step()
    after = (policy.log_prob(sample.replay).detach() * sample.mask).sum(1)
    before = (sample.logp * sample.mask).sum(1)
    assert after[1] > before[1] + 0.1


def test_freeze_vision_tower_keeps_its_weights_out_of_training():
    policy = make(freeze_vision_tower=True)
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and not any("vision_tower" in name for name in trainable)
    assert any("multi_modal_projector" in name for name in trainable)


def test_lora_trains_only_the_adapters_and_the_reference_is_the_model_without_them():
    pytest.importorskip("peft")
    policy = make(generation={"max_new_tokens": 8, "old_logp": "recompute"}, lora={"r": 4, "alpha": 8})
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert any("vision_tower" in name for name in trainable) and any("language_model" in name for name in trainable)
    reference = policy.reference()
    reference.requires_grad_(False).eval()
    assert list(reference.parameters()) == []  # no copy of the weights

    sample = policy.sample(prompts(), generator(0))
    assert torch.equal(policy.log_prob(sample.replay), sample.logp)
    base = {name: p.detach().clone() for name, p in policy.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    advantage = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    (-(policy.log_prob(sample.replay) * advantage * sample.mask).sum() / sample.mask.sum()).backward()
    optimizer.step()

    assert all(torch.equal(p, base[name]) for name, p in policy.named_parameters() if name in base)
    moved = policy.log_prob(sample.replay).detach()
    assert not torch.allclose(moved, sample.logp, atol=1e-4)
    ref_logp = reference.log_prob(sample.replay)
    assert torch.allclose(ref_logp, sample.logp, atol=1e-6)  # the base model = the policy before its adapters moved (B = 0 added zeros)
    assert torch.equal(policy.log_prob(sample.replay).detach(), moved)  # the adapters are back on


@pytest.mark.learning
def test_sft_loss_on_image_prompts_teaches_answers_that_depend_on_the_image(learning_seed, learned):
    """Two images, one question: the model must read the image to answer.

    Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): greedy answers right 1 to 1 (>= 1).
    """
    policy = make(seed=learning_seed, generation={"max_new_tokens": 6})
    red, blue = np.zeros((32, 32, 3), np.uint8), np.zeros((32, 32, 3), np.uint8)
    red[..., 0], blue[..., 2] = 220, 220
    batch = {"prompt": [ImagePrompt("Colour?", (red,)), ImagePrompt("Colour?", (blue,))], "completion": ["red", "blue"]}
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    assert policy.sft_loss(batch).item() == pytest.approx(math.log(260), rel=0.05)  # near uniform at first
    for _ in range(80):
        loss = policy.sft_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    greedy = policy.sample(batch["prompt"], deterministic=True)
    learned(sum(a == b for a, b in zip(greedy.output, ["red", "blue"])) / 2, 1.0, name="greedy answers right")


@pytest.mark.numerics
def test_log_prob_of_replays_concatenated_across_sample_calls():
    """Rollout.cat pads prompts and per-row images of calls of different widths; log_prob
    realigns the prompts and takes each row's own images."""
    policy = make(generation={"max_new_tokens": 6})
    parts = []
    for seed, batch in enumerate([prompts()[:2], ["text only", "no images in this call"], prompts()[2:], [ImagePrompt("x", tuple(images(3, seed=5)))]]):
        sample = policy.sample(batch, generator(seed))
        parts.append(Rollout(group_id=torch.zeros(len(batch), dtype=torch.long), old=OldLogProbs(sample.logp), mask=sample.mask, replay=sample.replay))
    rollout = Rollout.cat(parts)
    assert rollout.replay["pixel_values"].shape[1] == 3 and rollout.replay["image_count"].tolist() == [1, 2, 0, 0, 0, 1, 3]
    # old_logp: deferred, so these are the decoding loop's numbers
    assert torch.allclose(policy.log_prob(rollout.replay), rollout.old_logp, atol=PER_TOKEN_ATOL, rtol=0)
    rows = rollout[torch.tensor([6, 1, 3])]  # a minibatch
    assert torch.allclose(policy.log_prob(rows.replay), rows.old_logp, atol=PER_TOKEN_ATOL, rtol=0)


def test_save_and_load_pretrained_round_trip_exactly(tmp_path):
    policy = make(generation={"max_new_tokens": 6, "temperature": 0.9})
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_pretrained(policy, tmp_path / "ckpt")
    loaded = load_pretrained(tmp_path / "ckpt")
    assert type(loaded) is TextVLMPolicy
    a, b = policy.sample(prompts(), generator(2)), loaded.sample(prompts(), generator(2))
    assert a.output == b.output and torch.equal(a.logp, b.logp)


@pytest.mark.numerics
def test_loads_a_vision_language_model_and_processor_saved_with_save_pretrained(tmp_path):
    """What a user with real weights has: the model's and the processor's save_pretrained."""
    original = make(seed=4, generation={"max_new_tokens": 6})
    original.language_model.save_pretrained(tmp_path / "hf")
    original.processor.save_pretrained(tmp_path / "hf")
    policy = make(model_path=str(tmp_path / "hf"), generation={"max_new_tokens": 6, "chat_template": True})
    assert type(policy.processor).__name__ == "LlavaProcessor" and policy.processor.image_token == "<image>"
    ids = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        assert torch.equal(policy.language_model(input_ids=ids).logits, original.language_model(input_ids=ids).logits)
    sample = policy.sample(prompts(), generator(0))
    logp = policy.log_prob(sample.replay)
    # old_logp: deferred, so sample.logp are the decoding loop's: the documented float32 bound
    assert sample.logp_deferred and float(((logp - sample.logp) * sample.mask).abs().max()) <= 1e-4
    assert torch.equal(original.log_prob(sample.replay), logp)  # the same model, the same inputs: bit for bit


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    from mmrl.policies.vla.tiny_vlm import save_tiny_vlm

    root = tmp_path_factory.mktemp("qwen")
    return {family: str(save_tiny_vlm(family, root / family)) for family in ("qwen2_vl", "qwen2_5_vl")}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_model_with_multimodal_rotary_positions_samples_with_the_models_own_positions(qwen_dirs, family):
    """Qwen2-VL / Qwen2.5-VL (tokenizer and image processor saved with save_pretrained; their
    full processor needs torchvision): the full pass gives exactly the logits of the model's
    own forward, which computes its (time, height, width) positions from the image grids;
    plain 1-D positions would give others. The decoding loop continues those positions
    (ratio 1 on recompute, the backend's log-probs within the float32 bound)."""
    policy = make(model_path=qwen_dirs[family], generation={"max_new_tokens": 6, "old_logp": "recompute"})
    assert policy.processor.image_token == "<|image_pad|>"
    sample = policy.sample(prompts(), generator(0))
    assert torch.equal(policy.log_prob(sample.replay), sample.logp)
    backend = make(model_path=qwen_dirs[family], generation={"max_new_tokens": 6, "old_logp": "backend"})
    fast = backend.sample(prompts(), generator(0))
    assert fast.output == sample.output
    assert float(((policy.log_prob(fast.replay) - fast.logp) * fast.mask).abs().max()) <= PER_TOKEN_ATOL

    prompt_ids, inputs = policy._encode_inputs(prompts()[:1])
    ids = torch.tensor(prompt_ids)
    mask = torch.ones_like(ids)
    ours = policy.forward_logits(ids, mask, **inputs)
    grid = inputs["image_grid_thw"][0]
    pixels = inputs["pixel_values"][0, 0, : int(grid[0].prod())]
    with torch.no_grad():
        theirs = policy.language_model(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == policy.language_model.config.image_token_id).int()).logits
        flat = policy.language_model(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid, position_ids=torch.arange(ids.shape[1])[None]).logits
    finite = torch.isfinite(ours)  # the image placeholder is masked out of completions
    assert torch.equal(ours[finite], theirs[finite])
    assert not torch.allclose(ours[finite], flat[finite], atol=1e-4)


def test_positive_advantage_raises_a_qwen2_vl_completions_log_prob(qwen_dirs):
    policy = make(model_path=qwen_dirs["qwen2_vl"], generation={"max_new_tokens": 5})
    sample = policy.sample(prompts(), generator(1))
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    before = policy.log_prob(sample.replay).detach()
    (-(policy.log_prob(sample.replay)[0] * sample.mask[0]).sum()).backward()
    optimizer.step()
    after = policy.log_prob(sample.replay).detach()
    assert ((after[0] - before[0]) * sample.mask[0]).sum() > 0


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"policy\.model_path"):
        make(model_path=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"policy\.vision\.patch_size"):
        make(vision={"image_size": 32, "patch_size": 5})
    with pytest.raises(ConfigError, match=r"policy\.gguf_file"):
        make(model_path=str(tmp_path), gguf_file="model.gguf")
    with pytest.raises(ConfigError, match=r"policy\.type"):
        make().sample(torch.tensor([0, 1]))


@pytest.fixture(scope="module")
def shapes_qa(tmp_path_factory):
    from mmrl.tasks.shapes_qa.world import write_prompt_sets

    pytest.importorskip("cv2")
    out = tmp_path_factory.mktemp("shapes_qa")
    write_prompt_sets(out, num_train=8, num_eval=4)
    return out


def test_grpo_trains_through_mmrl_train_and_evaluation_reports_accuracy_per_question_type(tmp_path, shapes_qa):
    run = tmp_path / "run"
    small = [
        "total_steps=2", "log.progress=false", "log.tensorboard=false", "policy.pretrained=null",
        f"sampler.data.train={shapes_qa / 'train.jsonl'}", f"sampler.data.eval={shapes_qa / 'held_out.jsonl'}",
        "algo.group_size=4", "algo.groups_per_step=4", "sampler.batch_groups=4",
    ]
    done = run_mmrl("train", ROOT / "configs" / "vlm_shapes_grpo.yaml", "--run-dir", run, *small, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/total" in m] == [1, 2]
    assert all(0 < m["completion_length"] <= 10 for m in metrics if "completion_length" in m)
    final = [m for m in metrics if "eval/accuracy" in m][-1]  # every held-out question once (eval_all)
    held_out = [json.loads(line) for line in (shapes_qa / "held_out.jsonl").read_text().splitlines()]
    for category in ("count", "colour", "shape", "position"):
        assert final[f"eval/accuracy/{category}/n"] == sum(r["category"] == category for r in held_out)
        assert 0 <= final[f"eval/accuracy/{category}"] <= 1
    assert (run / "checkpoints" / "latest").is_file()


@dataclass
class _VowelFractionConfig(RewardConfig):
    type: str = option("_test_vlm_vowel_fraction", "registered name of this component (see `mmrl list`)")


@REWARDS.register("_test_vlm_vowel_fraction", config=_VowelFractionConfig)
def _vowel_fraction(rollout, cfg):
    """Test-only: the fraction of a completion's characters that are vowels (a graded signal a random model gets)."""
    return torch.tensor([sum(c in "aeiou" for c in text) / max(len(text), 1) for text in rollout.info["completions"]])


def test_lora_grpo_with_a_kl_to_the_adapter_disabled_model_trains_through_the_trainer(tmp_path, shapes_qa):
    pytest.importorskip("peft")
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.metrics import read_metrics
    from mmrl.train.trainer import Trainer

    cfg = from_dict(TrainConfig, {
        "name": "vlm_lora", "seed": 0, "total_steps": 2,
        "policy": {"type": "text_vlm", "tiny": TINY, "lora": {"r": 4, "alpha": 8}, "generation": {"max_new_tokens": 4, "chat_template": True}},
        "sampler": {"type": "prompt", "data": {"train": str(shapes_qa / "train.jsonl"), "eval": str(shapes_qa / "held_out.jsonl")}, "batch_groups": 4},
        "rewards": [{"type": "exact_match", "ignore_case": True}, {"type": "_test_vlm_vowel_fraction"}],
        "algo": {"group_size": 4, "groups_per_step": 4, "num_minibatches": 2, "kl": {"type": "k3", "coef": 0.05}},
        "optim": {"lr": 1e-2}, "eval": {"episodes": 4, "at_end": False}, "log": {"progress": False, "tensorboard": False},
    })
    trainer = Trainer(cfg, tmp_path / "run")
    base = {name: p.detach().clone() for name, p in trainer.policy.named_parameters() if not p.requires_grad}
    adapters = {name: p.detach().clone() for name, p in trainer.policy.named_parameters() if p.requires_grad}
    trainer.train()
    now = dict(trainer.policy.named_parameters())
    assert all(torch.equal(now[name], value) for name, value in base.items())
    assert any(not torch.equal(now[name], value) for name, value in adapters.items())
    metrics = read_metrics(tmp_path / "run")
    assert any(m.get("kl/ref", 0) > 0 for m in metrics)  # the adapters moved the policy from the model without them


@pytest.mark.slow
@pytest.mark.learning
def test_sft_learns_to_read_the_colour_of_objects_in_images_it_has_not_seen(learning_seed, learned):
    """The vision path learns: 600 rendered single-object scenes, "What colour is the object?",
    the demo's model size; greedy answers on 120 other images (2–4 min on two shared cores)."""
    pytest.importorskip("cv2")
    import random

    from mmrl.tasks.shapes.world import COLOURS, SHAPES, ObjectGroup, Scene, render_scene

    def questions(n, seed):
        rng = random.Random(seed)
        out = []
        for i in range(n):
            colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
            image = render_scene(Scene((ObjectGroup(1, colour, shape),)), 32, seed=seed * 100_000 + i)
            out.append((ImagePrompt("What colour is the object?", (image,)), colour))
        return out

    width = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}
    policy = make(seed=learning_seed, tiny={**width, "max_position_embeddings": 128}, vision=width, generation={"max_new_tokens": 8, "chat_template": True})
    train, unseen = questions(600, 1), questions(120, 2)
    optimizer = torch.optim.Adam(policy.parameters(), lr=2e-3)
    for step in range(200):
        rows = np.random.RandomState(1000 * learning_seed + step).randint(len(train), size=64)
        loss = policy.sft_loss({"prompt": [train[i][0] for i in rows], "completion": [train[i][1] for i in rows]})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    answers = policy.sample([p for p, _ in unseen], deterministic=True).output
    accuracy = np.mean([a == colour for a, (_, colour) in zip(answers, unseen)])
    learned(accuracy, 0.9, name="accuracy on unseen images")


def test_the_processor_and_model_calls_raise_no_deprecation_or_future_warnings():
    import warnings

    policy = make(generation={"max_new_tokens": 4, "chat_template": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sample = policy.sample(prompts(), generator(0))
        policy.log_prob(sample.replay).sum().backward()
        policy.sft_loss({"prompt": prompts(), "completion": ["a", "b", "c", "d"]})
    assert not [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))], [str(w.message) for w in caught]
