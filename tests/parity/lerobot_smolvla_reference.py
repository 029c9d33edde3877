#!/usr/bin/env python
"""LeRobot 0.4.4's own SmolVLA inference on a tiny random checkpoint: the reference of
tests/parity/test_lerobot_smolvla.py.

Runs in LeRobot's venv (``make lerobot-venv``: lerobot 0.4.4, torch 2.10, transformers 4.57),
never in mmrl's, and imports nothing of mmrl. ``make parity-lerobot`` runs it, then the test.

    .venv-lerobot/bin/python tests/parity/lerobot_smolvla_reference.py --vlm /tmp/lerobot_ref/vlm --out /tmp/lerobot_ref --seed 0

Writes, for each case (the main one into OUT, the others into OUT/<case>/):

- ``policy/``: a tiny random ``SmolVLAPolicy`` built by LeRobot and saved with its own
  ``save_pretrained`` (``config.json``, ``model.safetensors``), and its pre/post-processors
  from ``make_smolvla_pre_post_processors`` saved with theirs (``policy_preprocessor.json``,
  ``policy_postprocessor.json`` and the normalizers' statistics).
- ``reference.safetensors``: the raw observation (``observation.*``), the noise, the
  preprocessed batch (``pre.*``: normalized state, token ids and mask), the policy's
  intermediates (``prepared.image.<i>``: resized, padded, scaled to [-1, 1];
  ``prepared.state``: zero-padded; ``image_embedding.<i>``: vision tower + connector;
  ``prefix.*``: the prefix embeddings and masks; ``velocity``: v_t at every denoising step),
  ``actions_normalized`` (``predict_action_chunk``) and ``actions`` (after the
  postprocessor), and ``reloaded.actions``: the same batch through the directory loaded back
  with LeRobot's own loaders (``SmolVLAPolicy.from_pretrained(strict=True)``,
  ``make_pre_post_processors(pretrained_path=...)``).
- ``reference.json``: the task strings, the versions, the config, and the checks below.

The tiny VLM directory (``--vlm``; written here with transformers 4.57 when it has no
``config.json``) is what ``vlm_model_name`` points at: LeRobot builds the VLM from its config
and its processor/tokenizer from it. transformers 4.57 cannot read the tokenizer that mmrl's
``save_tiny_vlm`` writes with transformers 5 (``tokenizer_class: TokenizersBackend``), so this
script writes it; transformers 5.24 (mmrl's .venv) reads this one (config, tokenizer, weights).

``--load DIR --inputs REF --out FILE``: the reverse direction. Loads a directory that mmrl
exported with LeRobot's loaders and writes the actions LeRobot computes from it for the
observation and noise of REF/reference.safetensors into FILE.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

LEROBOT_VERSION = "0.4.4"
CAMERAS = {
    # non-square, of different sizes: the top one is shrunk (24x40 -> 19x32, 13 rows of padding
    # on top), the wrist one enlarged (20x12 -> 32x19, 13 columns of padding on the left)
    "observation.images.top": (3, 24, 40),
    "observation.images.wrist": (3, 20, 12),
}
STATE_DIM = 6
ACTION_DIM = 5
# tokenized (with the BOS and the newline LeRobot appends): 16, 11 and 6 tokens; the main case
# truncates the first to tokenizer_max_length = 12 and pads the others to it ("longest")
TASKS = ["pick up the red block", "open the drawer", "push"]
BATCH = len(TASKS)

# The tiny SmolVLM: SigLIP-style vision 32 px / patch 8 (16 patches, 4 tokens after the 2x2
# pixel shuffle), a Llama decoder with grouped-query attention, and values that differ from the
# defaults where LeRobot reads them or deliberately does not (rope_theta: LeRobot's apply_rope
# uses 10 000 whatever the config says; rms_norm_eps 1e-5, not 1e-6).
VLM_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
VLM_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8, layer_norm_eps=1e-6)
SPECIAL = {
    "image_token": "<image>",
    "fake_image_token": "<fake_token_around_image>",
    "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>",
}

# The cases: the main one is SmolVLA-base's structure (expert as deep as the VLM, self-attention
# every 2nd layer, cross-attention between) on a VLM cut to 3 of its 4 layers; the second has an
# expert layer only at every 2nd VLM layer (0 and 2; the others pass the suffix through) and
# self-attention only at layer 0, so layer 2 is a cross-attention layer of the expert. (LeRobot
# cannot run a self-attention layer without an expert layer: torch.cat of an empty list.)
CASES = {
    "": dict(
        num_vlm_layers=3,
        num_expert_layers=-1,
        self_attn_every_n_layers=2,
        expert_width_multiplier=0.75,
        chunk_size=8,
        n_action_steps=8,
        max_state_dim=8,
        max_action_dim=7,
        num_steps=3,
        tokenizer_max_length=12,
    ),
    "sparse_expert": dict(
        num_vlm_layers=4,
        num_expert_layers=2,
        self_attn_every_n_layers=4,
        expert_width_multiplier=0.5,
        chunk_size=4,
        n_action_steps=4,
        max_state_dim=6,
        max_action_dim=8,
        num_steps=4,
        tokenizer_max_length=32,
    ),
}
# every parameter gets N(0, PERTURB^2) added, so zero biases and unit norm weights matter too
PERTURB = 0.05


def versions() -> dict:
    return {name: importlib.metadata.version(name) for name in ("lerobot", "torch", "transformers", "tokenizers", "safetensors")}


def write_tiny_smolvlm(directory: Path, seed: int) -> None:
    """A tiny random SmolVLM (config, weights, tokenizer, image/video processors, processor)
    written with transformers 4.57's own ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import (
        LlamaConfig,
        PreTrainedTokenizerFast,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
        SmolVLMVisionConfig,
    )

    # byte-level BPE: the 256 byte symbols and a few merges (so that BPE merging matters)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("e", "r"), ("i", "n"), ("Ġ", "d"), ("r", "e"), ("o", "p"), ("c", "k"), ("Ġ", "b")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *SPECIAL.values()]
    backend.add_special_tokens(specials)
    bos = "<|im_start|>"
    # a BOS in front of every text: the tokenizer's own post-processor, which LeRobot's call runs
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=dict(SPECIAL),
        model_max_length=2048,
    )
    ids = tokenizer.convert_tokens_to_ids
    text = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=ids(bos), eos_token_id=tokenizer.eos_token_id, **VLM_TEXT)
    config = SmolVLMConfig(
        vision_config=SmolVLMVisionConfig(**VLM_VISION).to_dict(),
        text_config=text.to_dict(),
        image_token_id=ids(SPECIAL["image_token"]),
        scale_factor=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(config).eval()
    size = {"longest_edge": VLM_VISION["image_size"]}
    image_processor = SmolVLMImageProcessor(do_image_splitting=False, size=size, max_image_size=size)
    video_processor = SmolVLMVideoProcessor(size=size, max_image_size=size)
    tokens_per_image = (VLM_VISION["image_size"] // VLM_VISION["patch_size"]) ** 2 // 4
    chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}: "
        "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<image>{% endif %}{% endfor %}"
        "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
    )
    processor = SmolVLMProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor, image_seq_len=tokens_per_image, chat_template=chat_template)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)


def check_tiny_smolvlm(directory: Path) -> dict:
    """What LeRobot needs of the VLM directory: AutoConfig, AutoProcessor (whose tokenizer has
    the fake/global image token ids) and AutoTokenizer."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    config = AutoConfig.from_pretrained(directory)
    processor = AutoProcessor.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert config.model_type == "smolvlm", config.model_type
    return {
        "fake_image_token_id": processor.tokenizer.fake_image_token_id,
        "global_image_token_id": processor.tokenizer.global_image_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "vocab_size": len(tokenizer),
    }


def make_config(vlm_dir: Path, case: dict):
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig

    input_features = {key: PolicyFeature(type=FeatureType.VISUAL, shape=shape) for key, shape in CAMERAS.items()}
    input_features["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))
    return SmolVLAConfig(
        vlm_model_name=str(vlm_dir),
        load_vlm_weights=False,
        resize_imgs_with_padding=(VLM_VISION["image_size"], VLM_VISION["image_size"]),
        input_features=input_features,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))},
        device="cpu",
        push_to_hub=False,
        **case,
    )


def dataset_stats(generator: torch.Generator) -> dict:
    """Non-trivial statistics (mean far from 0, std far from 1) for the state and the action."""
    stats = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        mean = torch.randn(dim, generator=generator)
        std = 0.3 + torch.rand(dim, generator=generator)
        stats[key] = {"mean": mean, "std": std, "min": mean - 2.5 * std, "max": mean + 2.5 * std}
    return stats


def make_observation(generator: torch.Generator, stats: dict) -> dict:
    observation = {key: torch.rand(BATCH, *shape, generator=generator) for key, shape in CAMERAS.items()}
    state = stats["observation.state"]
    observation["observation.state"] = state["mean"] + state["std"] * torch.randn(BATCH, STATE_DIM, generator=generator)
    return observation


class Recorder:
    """Records the policy's intermediates by wrapping methods on the instances (the
    computation is unchanged: the wrappers only keep clones of what passes through)."""

    def __init__(self, policy):
        self.values: dict[str, list[torch.Tensor]] = {}
        model = policy.model
        self._wrap(policy, "prepare_images", lambda out: {"prepared.image": out[0]})
        self._wrap(policy, "prepare_state", lambda out: {"prepared.state": [out]})
        self._wrap(model.vlm_with_expert, "embed_image", lambda out: {"image_embedding": [out]})
        self._wrap(model, "embed_prefix", lambda out: {"prefix.embeddings": [out[0]], "prefix.pad_mask": [out[1]], "prefix.att_mask": [out[2]]})
        self._wrap(model, "denoise_step", lambda out: {"velocity": [out]})

    def _wrap(self, owner, name, pick):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            for key, tensors in pick(out).items():
                self.values.setdefault(key, []).extend(t.detach().clone() for t in tensors)
            return out

        setattr(owner, name, wrapper)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, values in self.values.items():
            if key == "velocity":
                out[key] = torch.stack(values)  # [num_steps, B, chunk, max_action_dim]
            elif key in ("prepared.image", "image_embedding"):
                out.update({f"{key}.{i}": v for i, v in enumerate(values)})
            else:
                (out[key],) = values
        return out


def infer(policy, preprocessor, postprocessor, observation: dict, tasks: list[str], noise: torch.Tensor, record: bool):
    """preprocessor -> predict_action_chunk(noise) -> postprocessor, as lerobot-eval's loop does
    for one chunk. Returns (actions, tensors to save)."""
    batch = {key: value.clone() for key, value in observation.items()}
    batch["task"] = list(tasks)
    policy.reset()
    recorder = Recorder(policy) if record else None
    processed = preprocessor(batch)
    actions_normalized = policy.predict_action_chunk(processed, noise=noise.clone())
    actions = postprocessor(actions_normalized)
    saved = {"actions": actions, "actions_normalized": actions_normalized}
    saved.update({f"pre.{key}": value for key, value in processed.items() if isinstance(value, torch.Tensor)})
    if recorder is not None:
        saved.update(recorder.tensors())
    return actions, saved


def load_with_lerobot(directory: Path, vlm_dir: Path | None):
    """A policy directory through LeRobot's own loaders (strict: every key of the file must
    match the module LeRobot builds from config.json)."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    config = PreTrainedConfig.from_pretrained(directory)
    overrides = {}
    if vlm_dir is not None:
        config.vlm_model_name = str(vlm_dir)
        overrides = {"preprocessor_overrides": {"tokenizer_processor": {"tokenizer_name": str(vlm_dir)}}}
    policy = SmolVLAPolicy.from_pretrained(directory, config=config, strict=True)
    preprocessor, postprocessor = make_pre_post_processors(config, pretrained_path=str(directory), **overrides)
    return policy, preprocessor, postprocessor


def build_case(name: str, case: dict, vlm_dir: Path, out: Path, seed: int) -> dict:
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    out.mkdir(parents=True, exist_ok=True)
    config = make_config(vlm_dir, case)
    torch.manual_seed(seed)
    policy = SmolVLAPolicy(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(PERTURB * torch.randn(parameter.shape, generator=generator))
    stats = dataset_stats(generator)
    preprocessor, postprocessor = make_smolvla_pre_post_processors(config, dataset_stats=stats)
    policy_dir = out / "policy"
    policy.save_pretrained(policy_dir)
    preprocessor.save_pretrained(policy_dir)
    postprocessor.save_pretrained(policy_dir)

    observation = make_observation(generator, stats)
    noise = torch.randn(BATCH, config.chunk_size, config.max_action_dim, generator=generator)
    actions, saved = infer(policy, preprocessor, postprocessor, observation, TASKS, noise, record=True)
    again, _ = infer(policy, preprocessor, postprocessor, observation, TASKS, noise, record=False)
    reloaded_policy, reloaded_pre, reloaded_post = load_with_lerobot(policy_dir, None)
    reloaded, _ = infer(reloaded_policy, reloaded_pre, reloaded_post, observation, TASKS, noise, record=False)
    ours = policy.state_dict()
    theirs = reloaded_policy.state_dict()
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "reloaded weights differ"

    tensors = dict(observation, noise=noise, **saved)
    tensors["reloaded.actions"] = reloaded
    for key, stat in stats.items():
        tensors.update({f"stats.{key}.{s}": v for s, v in stat.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "reference.safetensors"))
    report = {
        "case": name or "main",
        "tasks": TASKS,
        "vlm_dir": str(vlm_dir.resolve()),
        "policy_dir": str(policy_dir.resolve()),
        "seed": seed,
        "versions": versions(),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in case.items()},
        "cameras": {k: list(v) for k, v in CAMERAS.items()},
        "resize_imgs_with_padding": list(config.resize_imgs_with_padding),
        "parameters": sum(p.numel() for p in policy.parameters()),
        "state_dict_keys": len(ours),
        "deterministic": torch.equal(actions, again),
        "repeat_max_abs_diff": (actions - again).abs().max().item(),
        "reloaded_equal": torch.equal(actions, reloaded),
        "reloaded_max_abs_diff": (actions - reloaded).abs().max().item(),
        "actions_abs_max": actions.abs().max().item(),
        "actions_std": actions.std().item(),
    }
    (out / "reference.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def load_mode(args) -> int:
    """The reverse direction: a directory mmrl exported, read by LeRobot's own code."""
    reference = load_file(str(Path(args.inputs) / "reference.safetensors"))
    tasks = json.loads((Path(args.inputs) / "reference.json").read_text())["tasks"]
    policy, preprocessor, postprocessor = load_with_lerobot(Path(args.load), Path(args.vlm) if args.vlm else None)
    observation = {key: reference[key] for key in reference if key.startswith("observation.")}
    actions, saved = infer(policy, preprocessor, postprocessor, observation, tasks, reference["noise"], record=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in saved.items()}, args.out)
    print(json.dumps({"actions": list(actions.shape), "out": args.out, "versions": versions()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vlm", help="tiny SmolVLM directory (written here if it has no config.json)")
    parser.add_argument("--out", required=True, help="output directory (with --load: the .safetensors file to write)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", help="reverse direction: a policy directory mmrl exported, loaded by LeRobot")
    parser.add_argument("--inputs", help="with --load: the reference directory whose observation and noise to use")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    installed = importlib.metadata.version("lerobot")
    if installed != LEROBOT_VERSION:
        print(f"lerobot {installed} is installed; this reference is about {LEROBOT_VERSION}", file=sys.stderr)
        return 2
    if args.load:
        if not args.inputs:
            parser.error("--load needs --inputs")
        return load_mode(args)
    if not args.vlm:
        parser.error("--vlm is required")
    vlm_dir = Path(args.vlm).resolve()
    if not (vlm_dir / "config.json").exists():
        write_tiny_smolvlm(vlm_dir, args.seed)
        print(f"wrote the tiny SmolVLM to {vlm_dir} (transformers {importlib.metadata.version('transformers')})")
    vlm_info = check_tiny_smolvlm(vlm_dir)
    out = Path(args.out).resolve()
    for name, case in CASES.items():
        report = build_case(name, case, vlm_dir, out / name if name else out, args.seed)
        report["vlm"] = vlm_info
        (Path(report["policy_dir"]).parent / "reference.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps({k: report[k] for k in ("case", "parameters", "deterministic", "reloaded_equal", "actions_abs_max", "actions_std")}))
        if not (report["deterministic"] and report["reloaded_equal"]):
            print("the reference is not reproducible (see reference.json)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
