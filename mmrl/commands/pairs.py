"""``python -m mmrl pairs``: write preference pairs for pairwise reward models, in the
pair-file format of :mod:`mmrl.data.preferences`: verifier-labelled pairs of the demo worlds
(:mod:`mmrl.tasks.shapes.pairs`, :mod:`mmrl.tasks.arithmetic.pairs`), a generator's own
samples labelled by a run config's rewards (:func:`write_policy_pairs`), robot episodes
ranked by success and cost (:func:`write_episode_pairs`), or a merge.

    python -m mmrl pairs shapes --out DIR [--size 32 --num-train 2000 --pairs-per-prompt 1
        --num-held-out 500 --set-size 0 --flip 0.0 --pixel-noise 0 --seed 0]
    python -m mmrl pairs arithmetic --prompts examples/arithmetic --out DIR [--flip 0.0 --seed 0]
    python -m mmrl pairs policy CONFIG [overrides ...] --out DIR [--group-size 16 --rounds 1
        --pairs-per-prompt 8 --flip 0.0 --seed 0 --held-out-seed SEED]
    python -m mmrl pairs episodes EPISODES --out DIR [--cost path_length --margin 0.1
        --held-out-fraction 0.25 --max-pairs-per-instruction N --prefixes 0 --seed 0]
    python -m mmrl pairs merge --out DIR A B ...

**Shapes** (:mod:`mmrl.tasks.shapes.world`). Prompts are the scenes of the compositional split
(held-out pairs use only held-out prompts: unseen colour–shape–count combinations). For each
prompt two candidates are rendered: each is the prompt's scene (with probability 1/2 for the
first, never for the second) or one of :func:`~mmrl.tasks.shapes.world.mistaken_scene`'s mistakes,
with optional Gaussian pixel noise; both are scored by the verifier ``shapes_geneval`` in
partial mode (the fraction of count / colour / position criteria the *image* meets) and the
better-scoring one is chosen; ties are drawn again. With ``--set-size K`` each candidate is a
set of K images for the prompt, each image correct with a probability drawn per set, and the
set with the higher mean verifier score is chosen.

**Arithmetic** (:mod:`mmrl.tasks.arithmetic.world`). For each prompt record the correct worked
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

**Episodes** (:func:`write_episode_pairs`): trajectory preferences as in GRAPE, from saved
robot episodes (``mmrl eval --save-episodes``, ``mmrl collect --keep-failures``). Episodes
are grouped by instruction, and each group's successes and failures are split apart into
train and held-out episodes (``held_out_fraction`` of each, so held-out pairs compare
episodes never trained on). Within a split and an instruction, every success beats every
failure (``metadata.category: success``), and among successes the cheaper one wins when
its cost is lower by more than the relative ``margin``, c_w · (1 + margin) < c_l
(``category: cost``; ``cost: none`` leaves these out). Costs are the env's: ``path_length``,
``steps`` or ``collisions`` on the tabletop.

With ``--prefixes K`` the episodes' prefixes are compared too, as segment preferences in
preference-based RL are: at each of K − 1 lengths n evenly spaced up to the longest episode,
the first n steps of two episodes of one instruction and split form a pair when the last
frame of one shows the task solved and that of the other does not (the env's flag after
action n − 2, ``step_success``; ``category: prefix``). Both items have the same length, so
episode length tells them apart no more than it does for whole episodes of an env that
does not end at success; the pairs multiply what 50 labelled episodes teach about what a
solved state looks like (an episode that ends solved was unsolved at its earlier cuts, so
each one contributes both sides). A prefix item is written ``{"episode": i, "steps": n}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from mmrl.data.preferences import flip_labels, merge_preferences, write_preferences
from mmrl.tasks.arithmetic.pairs import write_arithmetic_pairs
from mmrl.tasks.shapes.pairs import write_shapes_pairs


def write_policy_pairs(
    out: str | Path, config: str | Path, overrides: list[str] = (), *, group_size: int = 16, rounds: int = 1,
    pairs_per_prompt: int = 8, flip: float = 0.0, seed: int = 0, held_out_seed: int | None = None,
) -> dict:
    """Write image pairs sampled from the policy of run config ``config`` (+ dotted
    ``overrides``) and labelled by its rewards (see above); returns ``info``.
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
    from mmrl.core.sampler import sampler_context
    from mmrl.core.weights import build_policy
    from mmrl.rewards.images import rollout_images
    from mmrl.train.run_config import TrainConfig

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
    context = sampler_context(cfg)
    samplers = {split: registry.SAMPLERS.get("prompt")(dataclasses.replace(cfg.sampler, data=dataclasses.replace(data, train=source, eval=None, eval_fraction=0.0)), dataclasses.replace(context, seed=split_seed))
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
    flip_labels(splits["train"], flip, np.random.RandomState(seed + 11))
    extra = {"source": "policy", "config": str(config), "overrides": list(overrides), "group_size": group_size, "rounds": rounds, "pairs_per_prompt": pairs_per_prompt, "flip": flip, "seed": seed, "held_out_seed": held_out_seed}
    return write_preferences(out, "image", splits, images, **extra)


def write_episode_pairs(
    out: str | Path, episodes_dir: str | Path, *, cost: str = "path_length", margin: float = 0.1, held_out_fraction: float = 0.25,
    max_pairs_per_instruction: int | None = None, prefixes: int = 0, seed: int = 0,
) -> dict:
    """Write trajectory pairs of the saved episodes in ``episodes_dir`` (see above); returns
    ``info``. Pairs name episodes by their index; ``info.json`` names the episodes directory
    (relative to ``out``)."""
    import os

    from mmrl.demos import read_demos
    from mmrl.errors import ConfigError

    if not 0 <= held_out_fraction < 1:
        raise ConfigError("--held-out-fraction", held_out_fraction, "expected a fraction in [0, 1)")
    if margin < 0:
        raise ConfigError("--margin", margin, "expected a relative cost margin >= 0")
    if prefixes < 0 or prefixes == 1:
        raise ConfigError("--prefixes", prefixes, "expected 0 (whole episodes only) or K >= 2 cut points per episode length")
    episodes = read_demos(episodes_dir)
    if prefixes and (missing := [i for i, e in enumerate(episodes) if e.step_success is None]):
        raise ConfigError("--prefixes", prefixes, f"prefix pairs need each step's success flag; episode {missing[0]} (and {len(missing) - 1} more) has none: save the episodes with mmrl eval --save-episodes or mmrl collect")
    longest = max(len(e) for e in episodes)
    cuts = sorted({n for j in range(1, prefixes) if (n := int(round(longest * j / prefixes))) >= 2})
    successes = sum(e.success for e in episodes)
    if successes in (0, len(episodes)):
        outcome = "succeeded" if successes else "failed"
        raise ConfigError("episodes", str(episodes_dir), f"all {len(episodes)} episodes {outcome}: success-over-failure pairs need both classes (save a weaker policy's episodes, or mmrl collect --keep-failures --noise 0.6)")
    if cost != "none":
        for i, e in enumerate(episodes):
            if e.success and cost not in e.costs:
                raise ConfigError("--cost", cost, f"episode {i} reports the costs {sorted(e.costs) or 'none'}; choose one of them, or none")
    rng = np.random.RandomState(seed)
    by_instruction: dict[str, list[int]] = {}
    for i, e in enumerate(episodes):
        by_instruction.setdefault(e.instruction, []).append(i)
    splits: dict[str, list[dict]] = {"train": [], "held_out": []}
    held_out_episodes: list[int] = []
    for instruction, members in by_instruction.items():
        split_of: dict[str, list[int]] = {"train": [], "held_out": []}
        for outcome in (True, False):
            group = [i for i in members if episodes[i].success == outcome]
            group = [group[k] for k in rng.permutation(len(group))]
            cut = int(round(held_out_fraction * len(group)))
            split_of["held_out"] += group[:cut]
            split_of["train"] += group[cut:]
        held_out_episodes += split_of["held_out"]
        for split, chosen_from in split_of.items():
            wins = [(w, l, "success") for w in chosen_from if episodes[w].success for l in chosen_from if not episodes[l].success]
            if cost != "none":
                wins += [(w, l, "cost") for w in chosen_from for l in chosen_from
                         if episodes[w].success and episodes[l].success and episodes[w].costs[cost] * (1 + margin) < episodes[l].costs[cost]]
            order = rng.permutation(len(wins))[:max_pairs_per_instruction]
            for k in order:
                w, l, category = wins[k]
                meta = {"category": category, "task": episodes[w].task}
                if cost != "none":
                    meta["costs"] = [episodes[w].costs.get(cost), episodes[l].costs.get(cost)]
                splits[split].append({"prompt": instruction, "chosen": int(w), "rejected": int(l), "metadata": meta})
            cut_wins = []
            for n in cuts:  # equal-length prefixes: the one whose last frame shows the task solved wins
                ends = {i: bool(episodes[i].step_success[n - 2]) for i in chosen_from if len(episodes[i]) >= n}
                cut_wins += [(w, l, n) for w, solved in ends.items() if solved for l, other in ends.items() if not other]
            for k in rng.permutation(len(cut_wins))[:max_pairs_per_instruction]:
                w, l, n = cut_wins[k]
                splits[split].append({"prompt": instruction, "chosen": {"episode": int(w), "steps": n}, "rejected": {"episode": int(l), "steps": n},
                                      "metadata": {"category": "prefix", "task": episodes[w].task, "steps": n}})
    for split, rows in splits.items():
        if not rows and (split == "train" or held_out_fraction > 0):
            raise ConfigError("episodes", str(episodes_dir), f"no {split} pairs: no instruction has both a success and a failure (or two successes apart by the cost margin) among its {split} episodes; save more episodes or lower --held-out-fraction")
    location = os.path.relpath(Path(episodes_dir).resolve(), Path(out).resolve())
    extra = {"source": "episodes", "episodes": location, "cost": cost, "margin": margin, "held_out_fraction": held_out_fraction, "seed": seed,
             "num_episodes": len(episodes), "held_out_episodes": sorted(held_out_episodes), "prefixes": prefixes, "prefix_steps": cuts}
    return write_preferences(out, "trajectory", splits, None, **extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmrl pairs", description="Write verifier-labelled preference pairs for pairwise reward models.")
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
    p.add_argument("--prompts", required=True, help="directory with train.jsonl and held_out.jsonl (python -m mmrl.tasks.arithmetic.world)")
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
    p = sub.add_parser("episodes", help="pairs of saved robot episodes of one instruction: success beats failure, then the lower cost wins (GRAPE)")
    p.add_argument("episodes", help="saved episodes: a LeRobotDataset v3 directory (mmrl eval --save-episodes, mmrl collect --format lerobot) or mmrl-demos")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--cost", default="path_length", help="the cost that ranks successes: path_length, steps, collisions (what the env reports), or none")
    p.add_argument("--margin", type=float, default=0.1, help="relative margin: a success wins on cost only if cost_w * (1 + margin) < cost_l")
    p.add_argument("--held-out-fraction", type=float, default=0.25, help="fraction of each instruction's successes and of its failures kept for held-out pairs")
    p.add_argument("--max-pairs-per-instruction", type=int, default=None, help="cap on pairs drawn per instruction and split, and on prefix pairs (default: all)")
    p.add_argument("--prefixes", type=int, default=0, help="K >= 2: also pair equal-length prefixes cut at K - 1 evenly spaced lengths, the one whose last frame shows the task solved winning (needs each step's success; 0: whole episodes only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split and of the pair order")
    p = sub.add_parser("merge", help="train pairs of several directories, held-out pairs of the first")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("sources", nargs="+", help="preference directories (one kind); the first gives the held-out pairs")
    args = parser.parse_args(argv)
    try:
        if args.source == "merge":
            info = merge_preferences(args.out, args.sources)
        elif args.source == "episodes":
            info = write_episode_pairs(args.out, args.episodes, cost=args.cost, margin=args.margin, held_out_fraction=args.held_out_fraction,
                                       max_pairs_per_instruction=args.max_pairs_per_instruction, prefixes=args.prefixes, seed=args.seed)
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
