"""How a shapes generator's images fail the verifier: for the held-out prompts of a config
(the train prompts with ``--split train``), the images its evaluation would draw, read by
the verifier's detector with the run's ``shapes_geneval`` settings. Prints the accuracy,
how many images show the wrong number of objects, how many objects have no recognisable
shape (noise blobs, merged objects), and per prompt the accuracy and how many objects its
images show.

    .venv/bin/python benchmarks/shapes_failure_modes.py configs/image_shapes_ddpo.yaml [--per-prompt 8 --seed 1] [key=value ...]
    .venv/bin/python benchmarks/shapes_failure_modes.py configs/image_shapes_ddpo.yaml policy.pretrained=runs/image_shapes_ddpo_s0/checkpoints/latest
"""

from __future__ import annotations

import argparse
import collections

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a shapes image config (its policy.pretrained names the weights)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. policy.pretrained=DIR")
    parser.add_argument("--split", choices=["held_out", "train"], default="held_out")
    parser.add_argument("--per-prompt", type=int, default=8, help="images per prompt")
    parser.add_argument("--seed", type=int, default=1, help="seed of the starting noises")
    args = parser.parse_intermixed_args()

    from mmrl.config import load_config
    from mmrl.core.sampler import build_sampler
    from mmrl.core.weights import build_policy
    from mmrl.tasks.shapes.world import Scene
    from mmrl.tasks.shapes.rewards import ShapesGenevalConfig, check_criteria, detect_shapes
    from mmrl.train.run_config import TrainConfig

    cfg = load_config(TrainConfig, args.config, args.overrides)
    verifier = next((r for r in cfg.rewards if isinstance(r, ShapesGenevalConfig)), ShapesGenevalConfig())
    torch.manual_seed(0)
    sampler = build_sampler(cfg)
    policy = build_policy(cfg.policy, sampler.policy_spec()).eval()
    records = sampler.data.held_out if args.split == "held_out" else sampler.data.train
    generator = torch.Generator().manual_seed(args.seed)
    correct = wrong_count = unrecognised = 0
    per_prompt = {}
    for record in records:
        scene = Scene.from_dict(record.metadata["scene"])
        with torch.no_grad():
            sample = policy.sample([record.prompt] * args.per_prompt, generator, deterministic=sampler.config.eval_deterministic)
        hits, counts = 0, collections.Counter()
        for image in sample.info["images"].numpy():
            found = detect_shapes(image, min_chroma=verifier.min_chroma, min_area=verifier.min_area, min_fill=verifier.min_fill)
            hits += all(check_criteria(scene, found, verifier.position_margin).values())
            wrong_count += len(found) != sum(group.count for group in scene.groups)
            counts[len(found)] += 1
            unrecognised += sum(d.shape == "unrecognised" for d in found)
        correct += hits
        per_prompt[record.prompt] = hits, counts
    n = len(records) * args.per_prompt
    print(f"{args.config} {' '.join(args.overrides)}: {args.split} prompts, {args.per_prompt} images each (noise seed {args.seed})")
    print(f"accuracy {correct / n:.3f} ({correct} of {n}); wrong number of objects in {wrong_count} images; {unrecognised} objects of no recognisable shape")
    for prompt, (hits, counts) in sorted(per_prompt.items()):
        shown = ", ".join(f"{k} objects in {v}" for k, v in sorted(counts.items()))
        print(f"  {prompt}: {hits} of {args.per_prompt} ({shown})")


if __name__ == "__main__":
    main()
