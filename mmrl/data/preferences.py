"""Preference pairs for pairwise (Bradley–Terry) reward models: their files, and the
verifier-labelled pairs of the shapes world and of the arithmetic prompt sets.

A preference directory holds

    info.json         {"kind": "image" | "image_set" | "text", "train": N, "held_out": M, ...}
    train.jsonl       one pair per line: {"prompt", "chosen", "rejected", "metadata"}
    held_out.jsonl    the same; held-out pairs are never trained on
    images.npz        (images and image sets) ``images``: uint8 [R, H, W, 3], RGB

where ``chosen`` / ``rejected`` are a completion (``text``), a row of ``images``
(``image``), or a list of K rows, the images generated for one prompt (``image_set``, one
K per directory). ``chosen`` is the preferred one. ``metadata.flipped`` marks a train pair
whose label was flipped on purpose (label noise); held-out labels are never flipped, so
held-out accuracy measures agreement with the verifier.

    python -m mmrl.data.preferences shapes --out DIR [--size 32 --num-train 2000 --pairs-per-prompt 1
        --num-held-out 500 --set-size 0 --flip 0.0 --pixel-noise 0 --seed 0]
    python -m mmrl.data.preferences arithmetic --prompts examples/arithmetic --out DIR [--flip 0.0 --seed 0]
    python -m mmrl.data.preferences policy CONFIG [overrides ...] --out DIR [--group-size 16 --rounds 1
        --pairs-per-prompt 8 --flip 0.0 --seed 0 --held-out-seed SEED]
    python -m mmrl.data.preferences merge --out DIR A B ...

**Shapes** (:mod:`mmrl.data.shapes`). Prompts are the scenes of the compositional split
(held-out pairs use only held-out prompts: unseen colour–shape–count combinations). For each
prompt two candidates are rendered: each is the prompt's scene (with probability 1/2 for the
first, never for the second) or one of :func:`~mmrl.data.shapes.mistaken_scene`'s mistakes,
with optional Gaussian pixel noise; both are scored by the verifier ``shapes_geneval`` in
partial mode (the fraction of count / colour / position criteria the *image* meets) and the
better-scoring one is chosen; ties are drawn again. With ``--set-size K`` each candidate is a
set of K images for the prompt, each image correct with a probability drawn per set, and the
set with the higher mean verifier score is chosen.

**Arithmetic** (:mod:`mmrl.data.arithmetic`). For each prompt record the correct worked
completion is paired with an incorrect one: the right steps with a wrong stated answer, one
column's sum off with the answer following from it, or a carry dropped; the completion whose
``<answer>`` equals the record's answer (exact match) is chosen.

**Policy** (:func:`write_policy_pairs`): a generator's own samples, labelled by the rewards of
a run config. The config's policy (with its ``policy.pretrained`` weights) draws
``group_size`` stochastic images per prompt record of ``sampler.data.train`` (train pairs) and
of ``sampler.data.eval`` (held-out pairs), ``rounds`` times each; the config's ``rewards``,
combined as in training, score them, and up to ``pairs_per_prompt`` pairs of one group whose
rewards differ are drawn, the higher-rewarded image chosen. These are the images a reward
model meets when it scores that policy's samples in RL.

**Merge** (:func:`merge_preferences`): one directory whose train pairs are those of all the
given directories (of one kind; ``metadata.source`` names the directory each came from) and
whose held-out pairs are those of the first — e.g. rendered shapes pairs added to a
policy's own pairs, evaluated on the policy's held-out pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.errors import ConfigError

KINDS = ("image", "image_set", "text")
SPLITS = ("train", "held_out")


@dataclass
class PreferencePairs:
    """One split of a preference directory: prompts, chosen and rejected items, metadata."""

    kind: str
    prompts: list[str]
    chosen: Any  # list[str] (text) | uint8 array [N, H, W, 3] | [N, K, H, W, 3]
    rejected: Any
    metadata: list[dict]

    def __len__(self) -> int:
        return len(self.prompts)


def read_info(directory: str | Path, field: str = "data.path") -> dict:
    d = Path(directory)
    if not (d / "info.json").is_file():
        raise ConfigError(field, str(directory), "expected a preference directory with info.json, train.jsonl and held_out.jsonl (python -m mmrl.data.preferences)")
    info = json.loads((d / "info.json").read_text())
    if info.get("kind") not in KINDS:
        raise ConfigError(field, str(directory), f"info.json names kind {info.get('kind')!r}; kinds: {', '.join(KINDS)}")
    return info


def read_pairs(directory: str | Path, split: str, field: str = "data.path") -> PreferencePairs:
    """The pairs of ``split`` (train or held_out), images gathered from ``images.npz``."""
    d = Path(directory)
    kind = read_info(d, field)["kind"]
    path = d / f"{split}.jsonl"
    if not path.is_file():
        raise ConfigError(field, str(directory), f"holds no {split}.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise ConfigError(field, str(path), f"line {i + 1} lacks {', '.join(missing)}")
    prompts = [str(r["prompt"]) for r in rows]
    metadata = [dict(r.get("metadata") or {}) for r in rows]
    if kind == "text":
        return PreferencePairs(kind, prompts, [str(r["chosen"]) for r in rows], [str(r["rejected"]) for r in rows], metadata)
    with np.load(d / "images.npz") as f:
        images = f["images"]
    try:
        chosen = images[np.asarray([r["chosen"] for r in rows], dtype=np.int64)]
        rejected = images[np.asarray([r["rejected"] for r in rows], dtype=np.int64)]
    except (IndexError, ValueError) as e:
        raise ConfigError(field, str(path), f"chosen/rejected must be rows of images.npz ({len(images)} images){' or equally long lists of rows' if kind == 'image_set' else ''}: {e}") from None
    want = 5 if kind == "image_set" else 4
    if chosen.ndim != want:
        raise ConfigError(field, str(path), f"kind {kind} needs {'a list of rows' if kind == 'image_set' else 'one row'} per item, got items of shape {chosen.shape[1:]}")
    return PreferencePairs(kind, prompts, chosen, rejected, metadata)


def write_preferences(out: str | Path, kind: str, splits: dict[str, list[dict]], images: list[np.ndarray] | None = None, **extra) -> dict:
    """Write a preference directory: ``splits`` maps train / held_out to rows {"prompt",
    "chosen", "rejected", "metadata"}; ``images`` are the rows image items index; ``extra``
    goes into info.json. Returns the info."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if images is not None:
        np.savez_compressed(out / "images.npz", images=np.stack(images).astype(np.uint8))
    info = {"kind": kind, **{split: len(rows) for split, rows in splits.items()}, **extra}
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _flip(rows: list[dict], fraction: float, rng: np.random.RandomState) -> None:
    """Swap chosen and rejected of round(fraction · n) pairs drawn from ``rng``."""
    for i in rng.permutation(len(rows))[: round(fraction * len(rows))]:
        row = rows[i]
        row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
        row["metadata"]["flipped"] = True


# ---------------------------------------------------------------- shapes


def write_shapes_pairs(
    out: str | Path, *, size: int = 32, num_train: int = 2000, num_held_out: int = 500, set_size: int = 0,
    flip: float = 0.0, pixel_noise: float = 0.0, seed: int = 0, held_out_fraction: float = 0.2, pairs_per_prompt: int = 1,
    held_out_prompts: str = "held_out", render_seed: int | None = None,
) -> dict:
    """Write shapes preference pairs (see the module docstring); returns ``info``.
    ``held_out_prompts: train`` draws the held-out pairs from the *train* prompts instead
    (new images of seen prompts: in-distribution accuracy); ``render_seed`` (default
    seed + 7) seeds the renders and candidates apart from the split."""
    from mmrl.data.shapes import MISTAKES, balanced, mistaken_scene, render_scene, split_scenes
    from mmrl.rewards.shapes import check_criteria, detect_shapes

    if set_size == 1 or set_size < 0:
        raise ValueError(f"set size must be 0 (single images) or at least 2, not {set_size}")
    if not 0 <= flip < 0.5:
        raise ValueError(f"flip must lie in [0, 0.5), not {flip}")
    if held_out_prompts not in ("held_out", "train"):
        raise ValueError(f"held-out prompts come from the held_out or the train split, not {held_out_prompts!r}")
    train_scenes, held_scenes = split_scenes(held_out_fraction, seed)
    if held_out_prompts == "train":
        held_scenes = train_scenes
    rng = np.random.RandomState(seed + 7 if render_seed is None else render_seed)
    images: list[np.ndarray] = []

    def render(scene, correct: bool) -> tuple[int, float]:
        """Row of a new image of ``scene`` (or of a mistake of it) and its verifier score."""
        while True:
            target = scene
            if not correct:
                options = [m for m in (mistaken_scene(scene, mistake, int(rng.randint(1 << 30))) for mistake in MISTAKES) if m is not None and m.groups]
                target = options[rng.randint(len(options))]
            try:
                image = render_scene(target, size, int(rng.randint(1 << 30)))
            except ValueError:  # a mistake with four objects may not fit a small image
                continue
            if pixel_noise > 0:
                image = np.clip(image + rng.normal(0.0, pixel_noise, image.shape), 0, 255).astype(np.uint8)
            met = check_criteria(scene, detect_shapes(image, min_chroma=60, min_area=0.01, min_fill=0.8)).values()
            images.append(image)
            return len(images) - 1, sum(met) / len(met)

    def candidate(scene, first: bool):
        if set_size == 0:
            return render(scene, correct=first and rng.rand() < 0.5)
        p_correct = rng.rand()
        members = [render(scene, correct=rng.rand() < p_correct) for _ in range(set_size)]
        return [row for row, _ in members], float(np.mean([score for _, score in members]))

    def pairs(scenes, n, per_prompt) -> list[dict]:
        rows = []
        for scene in [s for s in balanced(scenes, n) for _ in range(per_prompt)]:
            while True:
                (a, score_a), (b, score_b) = candidate(scene, True), candidate(scene, False)
                if abs(score_a - score_b) > 1e-9:
                    break
            chosen, rejected = (a, b) if score_a > score_b else (b, a)
            rows.append({"prompt": scene.text(), "chosen": chosen, "rejected": rejected,
                         "metadata": {"category": scene.category, "scores": [max(score_a, score_b), min(score_a, score_b)]}})
        return rows

    splits = {"train": pairs(train_scenes, num_train, pairs_per_prompt), "held_out": pairs(held_scenes, num_held_out, 1)}
    _flip(splits["train"], flip, np.random.RandomState(seed + 11))
    kind = "image_set" if set_size else "image"
    extra = {"source": "shapes", "size": size, "pairs_per_prompt": pairs_per_prompt, "held_out_prompts": held_out_prompts, "render_seed": render_seed, "set_size": set_size, "flip": flip, "pixel_noise": pixel_noise, "seed": seed}
    return write_preferences(out, kind, splits, images, **extra)


# ---------------------------------------------------------------- a policy's samples


def write_policy_pairs(
    out: str | Path, config: str | Path, overrides: list[str] = (), *, group_size: int = 16, rounds: int = 1,
    pairs_per_prompt: int = 8, flip: float = 0.0, seed: int = 0, held_out_seed: int | None = None,
) -> dict:
    """Write image pairs sampled from the policy of run config ``config`` (+ dotted
    ``overrides``) and labelled by its rewards (see the module docstring); returns ``info``.
    Round k of a split samples every record once with the sampler's stream at step k (noise
    seeded by ``seed``, the held-out split's by ``held_out_seed``, default ``seed``: set it
    apart when the held-out prompts are the train prompts, else both splits draw the same
    images); a pair is two images of one group with different combined rewards,
    drawn without replacement, the higher one chosen. ``metadata`` holds the record's
    ``category`` (if any), the two ``scores`` and the round."""
    import dataclasses

    import torch

    from mmrl import registry
    from mmrl.config import load_config
    from mmrl.core.reward import RewardContext, RewardSet
    from mmrl.core.weights import build_policy
    from mmrl.rewards.images import rollout_images
    from mmrl.train.config import TrainConfig

    if group_size < 2 or rounds < 1 or pairs_per_prompt < 1:
        raise ValueError(f"group size must be at least 2 and rounds and pairs per prompt at least 1, not {group_size}, {rounds}, {pairs_per_prompt}")
    if not 0 <= flip < 0.5:
        raise ValueError(f"flip must lie in [0, 0.5), not {flip}")
    cfg = load_config(TrainConfig, config, list(overrides))
    if cfg.sampler.type != "prompt" or not cfg.sampler.data.eval:
        raise ValueError(f"{config}: sampling pairs needs sampler.type prompt with held-out prompts in sampler.data.eval (got sampler.type {cfg.sampler.type!r}, data.eval {cfg.sampler.data.eval!r})")
    if not cfg.rewards:
        raise ValueError(f"{config}: no rewards to label the samples with")
    cfg = dataclasses.replace(cfg, seed=seed)
    torch.manual_seed(seed)
    data = cfg.sampler.data
    held_out_seed = seed if held_out_seed is None else held_out_seed
    samplers = {split: registry.SAMPLERS.get("prompt")(dataclasses.replace(cfg.sampler, data=dataclasses.replace(data, train=source, eval=None, eval_fraction=0.0)), dataclasses.replace(cfg, seed=split_seed))
                for split, source, split_seed in (("train", data.train, seed), ("held_out", data.eval, held_out_seed))}
    policy = build_policy(cfg.policy, samplers["train"].policy_spec()).eval()
    rewards = RewardSet(cfg.rewards, cfg.algo.reward_aggregation, RewardContext(device=torch.device("cpu"), run_dir=Path(out), seed=seed), cfg.algo.log_tamed_threshold)
    rng = np.random.RandomState(seed + 7)
    images: list[np.ndarray] = []
    splits: dict[str, list[dict]] = {}
    for split, sampler in samplers.items():
        rows = []
        num_records = len(sampler.data.train)
        for step in range(rounds):
            with torch.no_grad():
                rollout = sampler.collect(policy, num_records, group_size, step)
                scores = rewards.combine(rewards.score(rollout, policy=policy), rollout.group_id.cpu()).numpy()
            batch = rollout_images(rollout, "policy pairs")
            group_id = rollout.group_id.cpu().numpy()
            for g in np.unique(group_id):
                members = np.flatnonzero(group_id == g)
                candidates = [(i, j) for a, i in enumerate(members) for j in members[a + 1 :] if abs(scores[i] - scores[j]) > 1e-9]
                for k in rng.permutation(len(candidates))[:pairs_per_prompt]:
                    i, j = candidates[k]
                    win, lose = (i, j) if scores[i] > scores[j] else (j, i)
                    images.extend([batch[win], batch[lose]])
                    metadata = rollout.info["metadata"][win]
                    meta = {"scores": [float(scores[win]), float(scores[lose])], "round": step}
                    if "category" in metadata:
                        meta["category"] = metadata["category"]
                    rows.append({"prompt": str(rollout.info["prompt"][win]), "chosen": len(images) - 2, "rejected": len(images) - 1, "metadata": meta})
        splits[split] = rows
    if not images:
        raise ValueError("every group's samples scored alike: no pairs (more samples per group, or a finer reward such as shapes_geneval mode partial)")
    _flip(splits["train"], flip, np.random.RandomState(seed + 11))
    extra = {"source": "policy", "config": str(config), "overrides": list(overrides), "group_size": group_size, "rounds": rounds, "pairs_per_prompt": pairs_per_prompt, "flip": flip, "seed": seed, "held_out_seed": held_out_seed}
    return write_preferences(out, "image", splits, images, **extra)


def merge_preferences(out: str | Path, sources: list[str | Path]) -> dict:
    """Write to ``out`` the train pairs of every directory of ``sources`` and the held-out
    pairs of the first (see the module docstring); returns ``info``."""
    if not sources:
        raise ValueError("nothing to merge: name at least one preference directory")
    kinds = {read_info(d, "sources")["kind"] for d in sources}
    if len(kinds) > 1:
        raise ValueError(f"cannot merge pairs of different kinds: {sorted(kinds)}")
    kind = kinds.pop()
    splits: dict[str, list[dict]] = {"train": [], "held_out": []}
    images: list[np.ndarray] = []
    for k, d in enumerate(sources):
        d = Path(d)
        shift = len(images)
        if kind != "text":
            with np.load(d / "images.npz") as f:
                images.extend(f["images"])
        move = (lambda item: item) if kind == "text" else (lambda item: [i + shift for i in item] if isinstance(item, list) else item + shift)
        for split in SPLITS if k == 0 else ("train",):
            for line in (d / f"{split}.jsonl").read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    splits[split].append({**row, "chosen": move(row["chosen"]), "rejected": move(row["rejected"]), "metadata": {**(row.get("metadata") or {}), "source": str(d)}})
    return write_preferences(out, kind, splits, images if kind != "text" else None, source="merge", sources=[str(d) for d in sources])


# ---------------------------------------------------------------- arithmetic


def wrong_completion(a: int, b: int, rng: np.random.RandomState) -> tuple[str, str]:
    """An incorrect worked completion of ``a + b`` and its mistake: the right steps and a
    wrong stated answer (``wrong answer``), one column's sum off by 1–3 with the answer
    following from the wrong steps (``wrong step``), or, when a column carries, the carry
    dropped (``dropped carry``)."""
    from mmrl.data.arithmetic import steps

    right = steps(a, b)
    kinds = ["wrong answer", "wrong step"] + (["dropped carry"] if any("+1=" in s for s in right) else [])
    kind = kinds[rng.randint(len(kinds))]
    if kind == "wrong answer":
        answer = a + b + int(rng.choice([-1, 1])) * int(rng.randint(1, 11))
        return f"<think>{' '.join(right)}</think><answer>{max(answer, 0) if answer != a + b else a + b + 1}</answer>", kind
    da, db = str(a)[::-1], str(b)[::-1]
    broken = int(rng.randint(len(right))) if kind == "wrong step" else None
    out, digits, carry = [], [], 0
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        c = 0 if kind == "dropped carry" else carry
        s = x + y + c
        if i == broken:
            s = max(0, s + int(rng.choice([-1, 1])) * int(rng.randint(1, 4)))
        out.append(f"{x}+{y}+{c}={s}" if c else f"{x}+{y}={s}")
        digits.append(str(s % 10))
        carry = s // 10
    answer = int(f"{carry}{''.join(reversed(digits))}")
    if answer == a + b:  # the error cancelled out: state a wrong answer instead
        answer += 1
    return f"<think>{' '.join(out)}</think><answer>{answer}</answer>", kind


def write_arithmetic_pairs(out: str | Path, prompts: str | Path, *, flip: float = 0.0, seed: int = 0) -> dict:
    """Write arithmetic preference pairs from the prompt sets in ``prompts`` (train.jsonl,
    held_out.jsonl of ``python -m mmrl.data.arithmetic``); returns ``info``."""
    from mmrl.data.arithmetic import completion, stated_answer

    if not 0 <= flip < 0.5:
        raise ValueError(f"flip must lie in [0, 0.5), not {flip}")
    rng = np.random.RandomState(seed)
    splits = {}
    for split in SPLITS:
        path = Path(prompts) / f"{split}.jsonl"
        if not path.is_file():
            raise ValueError(f"{path} does not exist (python -m mmrl.data.arithmetic --out {prompts})")
        rows = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            a, b, answer = int(record["a"]), int(record["b"]), str(record["answer"])
            (second, mistake), first = wrong_completion(a, b, rng), completion(a, b)
            correct = [str(stated_answer(t)) == answer for t in (first, second)]
            if correct[0] == correct[1]:
                continue  # exact match cannot tell them apart
            chosen, rejected = (first, second) if correct[0] else (second, first)
            rows.append({"prompt": record["prompt"], "chosen": chosen, "rejected": rejected, "metadata": {"category": record.get("category"), "question_id": record.get("question_id"), "mistake": mistake}})
        splits[split] = rows
    _flip(splits["train"], flip, np.random.RandomState(seed + 11))
    return write_preferences(out, "text", splits, source="arithmetic", prompts=str(prompts), flip=flip, seed=seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.data.preferences", description="Write verifier-labelled preference pairs for pairwise reward models.")
    sub = parser.add_subparsers(dest="source", required=True)
    p = sub.add_parser("shapes", help="pairs of shapes images (or image sets) for one prompt, the better by the shapes verifier chosen")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", type=int, default=32, help="image side in pixels")
    p.add_argument("--num-train", type=int, default=2000, help="train prompts (balanced over categories; the split has 2,913)")
    p.add_argument("--pairs-per-prompt", type=int, default=1, help="train pairs drawn per train prompt")
    p.add_argument("--num-held-out", type=int, default=500, help="held-out pairs (one per held-out prompt; the split has 1,731)")
    p.add_argument("--set-size", type=int, default=0, help="0: single images; K >= 2: sets of K images per prompt")
    p.add_argument("--pixel-noise", type=float, default=0.0, help="std of Gaussian noise added to every image (grey levels)")
    p.add_argument("--flip", type=float, default=0.0, help="fraction of train labels flipped (label noise; held-out labels stay clean)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the renders and the flips")
    p.add_argument("--held-out-prompts", choices=("held_out", "train"), default="held_out", help="draw the held-out pairs from the held-out prompts (compositional) or from the train prompts (new images of seen prompts)")
    p.add_argument("--render-seed", type=int, default=None, help="seed of the renders and candidates (default: seed + 7)")
    p = sub.add_parser("arithmetic", help="a correct and an incorrect worked completion of each arithmetic prompt")
    p.add_argument("--prompts", required=True, help="directory with train.jsonl and held_out.jsonl (python -m mmrl.data.arithmetic)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--flip", type=float, default=0.0, help="fraction of train labels flipped (label noise; held-out labels stay clean)")
    p.add_argument("--seed", type=int, default=0, help="seed of the incorrect completions and the flips")
    p = sub.add_parser("policy", help="pairs of a generator's own samples for one prompt, the better by the config's rewards chosen")
    p.add_argument("config", help="run config (YAML) whose policy samples and whose rewards label; its sampler.data.train / .eval give the train / held-out prompts")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the config, e.g. policy.pretrained=RUN or rewards.0.mode=partial")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--group-size", type=int, default=16, help="images sampled per prompt per round")
    p.add_argument("--rounds", type=int, default=1, help="times every prompt is sampled")
    p.add_argument("--pairs-per-prompt", type=int, default=8, help="pairs drawn per group (of those whose rewards differ)")
    p.add_argument("--flip", type=float, default=0.0, help="fraction of train labels flipped (label noise; held-out labels stay clean)")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples, the pairs and the flips")
    p.add_argument("--held-out-seed", type=int, default=None, help="seed of the held-out samples (default: --seed; set it apart when sampler.data.eval is the train prompts, else both splits draw the same images)")
    p = sub.add_parser("merge", help="train pairs of several directories, held-out pairs of the first")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("sources", nargs="+", help="preference directories (one kind); the first gives the held-out pairs")
    args = parser.parse_args(argv)
    try:
        if args.source == "merge":
            info = merge_preferences(args.out, args.sources)
        elif args.source == "policy":
            info = write_policy_pairs(args.out, args.config, args.overrides, group_size=args.group_size, rounds=args.rounds, pairs_per_prompt=args.pairs_per_prompt, flip=args.flip, seed=args.seed, held_out_seed=args.held_out_seed)
        elif args.source == "shapes":
            info = write_shapes_pairs(args.out, size=args.size, num_train=args.num_train, num_held_out=args.num_held_out, set_size=args.set_size, pairs_per_prompt=args.pairs_per_prompt, held_out_prompts=args.held_out_prompts, render_seed=args.render_seed,
                                      flip=args.flip, pixel_noise=args.pixel_noise, seed=args.seed)
        else:
            info = write_arithmetic_pairs(args.out, args.prompts, flip=args.flip, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {info['train']} train and {info['held_out']} held-out {info['kind']} pairs to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
