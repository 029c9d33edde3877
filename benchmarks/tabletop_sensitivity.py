"""How fragile are a tabletop family's pushes? Open-loop replays of perturbed expert actions.

For each task of a family, the scripted expert solves ``--episodes`` initial states; each
solution's actions are then replayed open-loop from the same state (plus ``--extra`` steps
repeating the last action), after a perturbation: binning to ``--bins`` bin centres (what a
token VLA can emit) or Gaussian noise of each ``--noise`` std (in action units, 1 = 0.4 m/s).
Success of the replays says how much precision a policy needs: a family whose replays
survive small perturbations leaves room for an imitation policy's small errors, one whose
replays fail needs closed-loop correction from the images (benchmarks/results/robots_tabletop.md).
With ``--policy RUN`` a trained policy is also rolled out, deterministically, from the same
initial states (those of ``mmrl collect --seed 0``: its own training states when it was
trained on the first ``--episodes`` demonstrations per task).

    .venv/bin/python benchmarks/tabletop_sensitivity.py --family object --layout nominal
    .venv/bin/python benchmarks/tabletop_sensitivity.py --family object --episodes 5 --policy runs/tabletop_flow_vla_sft
"""

from __future__ import annotations

import argparse

import gymnasium
import numpy as np
import torch

import mmrl.envs  # noqa: F401  (registers mmrl/Tabletop-v0)
from mmrl.commands.collect import run_expert_episode
from mmrl.envs.tabletop.expert import expert_action
from mmrl.envs.tabletop.tasks import family_tasks
from mmrl.policies.token_vla.model import action_bins, bin_centers


def expert_solutions(env, tasks: list[str], episodes: int) -> list[tuple[str, int, np.ndarray]]:
    solved = (run_expert_episode(env, expert_action, task, seed) for task in tasks for seed in range(episodes))
    return [(ep.task, ep.seed, ep.action) for ep in solved if ep.success]


def replay_success(env, solutions, perturb, extra: int) -> float:
    successes = 0
    for task, seed, actions in solutions:
        env.reset(seed=seed, options={"task": task})
        for action in list(actions) + [actions[-1]] * extra:
            _, _, terminated, truncated, _ = env.step(perturb(action))
            if terminated or truncated:
                break
        successes += bool(terminated)
    return successes / max(len(solutions), 1)


def policy_success(env, policy, solutions) -> float:
    """Closed-loop success of ``policy`` (deterministic actions, whole chunks) from the
    initial states of ``solutions``: those of ``mmrl collect --seed 0``, i.e. the states a
    policy trained on these demonstrations has seen."""
    successes = 0
    for task, seed, _ in solutions:
        obs, _ = env.reset(seed=seed, options={"task": task})
        terminated = truncated = False
        while not (terminated or truncated):
            inputs = {"image": torch.from_numpy(obs["image"][None].copy()), "state": torch.from_numpy(obs["state"][None]), "instruction": [obs["instruction"]]}
            with torch.no_grad():
                chunk = policy.sample(inputs, deterministic=True).output[0].numpy()
            for action in chunk:
                obs, _, terminated, truncated, _ = env.step(action)
                if terminated or truncated:
                    break
        successes += bool(terminated)
    return successes / max(len(solutions), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="object", choices=("spatial", "object", "goal"))
    parser.add_argument("--layout", default="nominal", choices=("nominal", "random"))
    parser.add_argument("--episodes", type=int, default=20, help="initial states per task")
    parser.add_argument("--bins", type=int, default=32)
    parser.add_argument("--noise", type=float, nargs="*", default=[0.05, 0.15])
    parser.add_argument("--extra", type=int, default=10, help="steps of the last action after the solution's end")
    parser.add_argument("--policy", help="also roll out this policy (a run directory or saved weights, 64x64 top camera) from the same initial states")
    args = parser.parse_args()

    image_size = 64 if args.policy else 16
    env = gymnasium.make("mmrl/Tabletop-v0", task=args.family, image_size=image_size, cameras="top", layout=args.layout)
    solutions = expert_solutions(env, family_tasks(args.family), args.episodes)
    total = len(family_tasks(args.family)) * args.episodes
    lengths = [len(a) for _, _, a in solutions]
    print(f"{args.family} ({args.layout}): expert solved {len(solutions)}/{total}, mean length {np.mean(lengths):.1f} steps")
    rng = np.random.default_rng(0)
    centers = bin_centers(args.bins)  # the tabletop's actions are already in [-1, 1]
    perturbations = {f"{args.bins} bins": lambda a: centers[action_bins(torch.from_numpy(a), args.bins)].numpy()}
    for std in args.noise:
        perturbations[f"noise {std}"] = lambda a, std=std: np.clip(a + rng.normal(0.0, std, a.shape), -1.0, 1.0).astype(np.float32)
    for name, perturb in perturbations.items():
        print(f"  open-loop replay, {name:12s} success {replay_success(env, solutions, perturb, args.extra):.3f}")
    if args.policy:
        from mmrl.core.weights import load_pretrained

        policy = load_pretrained(args.policy).eval()
        print(f"  policy {args.policy}, closed loop from the same states: success {policy_success(env, policy, solutions):.3f}")
    env.close()


if __name__ == "__main__":
    main()
