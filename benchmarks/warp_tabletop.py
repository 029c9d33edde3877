"""The tabletop suite on MuJoCo Warp against the CPU env: throughput and equivalence.

    python benchmarks/warp_tabletop.py throughput [--device cpu|cuda] [--worlds 1 64 256] [--steps 10]
        [--obs-mode state|rgb] [--cameras top front] [--image-size 64] [--launched]
    python benchmarks/warp_tabletop.py equivalence [--episodes 256] [--families spatial object goal]

``throughput``: env steps/s of ``mmrl/Tabletop-v0`` in a gymnasium SyncVectorEnv of N envs
against one warp batch of N worlds (``tabletop_warp``), both with the same ``--obs-mode``
(``rgb``: every camera of ``--cameras`` rendered at every step, by OpenGL in each CPU env and
by MuJoCo Warp's ray tracer for all worlds in one batch), in the same run, random actions,
finished episodes reset inside both; the ratio is warp / CPU. With ``rgb`` the last column is
the share of a warp step spent rendering (``render_images`` timed alone). ``--launched``
adds warp with each kernel launched from Python instead of the captured graph's replay.
``equivalence``: per family (or ``all``, one batch of every family's tasks), episodes seeded 0..E-1 run by the scripted expert closed loop
on both backends (``--noise``: with Gaussian action noise, equal draws on both); prints both success rates, how often success agrees, and where the states
part: the first control step at which a block or the pusher is more than 1 mm apart, and
whether the pusher had touched a block by then (CPU MuJoCo's contacts). Also the open-loop
gap: the CPU expert's first 20 actions replayed on the warp worlds, the largest state
difference before the pusher's first touch of a block and after it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium  # noqa: E402

import mmrl.envs  # noqa: E402,F401  (registers mmrl/Tabletop-v0)
from mmrl.envs.tabletop.batched import TabletopBatchedEnv, expert_actions  # noqa: E402
from mmrl.envs.tabletop.env import PHYSICS_STEPS, TabletopEnv  # noqa: E402
from mmrl.envs.tabletop.expert import expert_action  # noqa: E402

PART = 1e-3  # metres: states "part" when a block or the pusher is this far apart


def throughput(args) -> None:
    rgb = args.obs_mode == "rgb"
    images = {"cameras": args.cameras, "image_size": args.image_size} if rgb else {}
    what = f"{args.obs_mode}" + (f", {' + '.join(args.cameras)} at {args.image_size} px" if rgb else "")
    unc = " warp, each kernel launched from Python, steps/s | graph / launched |" if args.launched else ""
    print(f"| worlds | CPU env steps/s ({what}) | warp ({args.device}) steps/s | warp / CPU |" + (" warp's time rendering |" if rgb else "") + unc)
    print("|---|---|---|---|" + ("---|" if rgb else "") + ("---|---|" if args.launched else ""))
    args.worlds = sorted(args.worlds)
    if args.cpu_max_worlds is not None and args.worlds[0] > args.cpu_max_worlds:
        raise SystemExit(f"--cpu-max-worlds {args.cpu_max_worlds} leaves no world count to measure the CPU env at: include one at or below it")
    cpu_rate, cpu_note = None, ""
    for n in args.worlds:
        rng = np.random.default_rng(0)
        actions = rng.uniform(-1, 1, size=(args.steps, n, 2)).astype(np.float32)
        if args.cpu_max_worlds is None or n <= args.cpu_max_worlds:
            cpu = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("mmrl/Tabletop-v0", task=args.family, obs_mode=args.obs_mode, **images)] * n)
            cpu.reset(seed=list(range(n)))
            cpu.step(actions[0])
            start = time.perf_counter()
            for a in actions:
                cpu.step(a)
            cpu_rate, cpu_note = n * args.steps / (time.perf_counter() - start), ""
            cpu.close()
        else:  # one process steps its envs one after another: its rate at the largest count measured stands for more
            cpu_note = f" (at {max(w for w in args.worlds if w <= args.cpu_max_worlds)})"
        warp = TabletopBatchedEnv(n, task=args.family, obs_mode=args.obs_mode, device=args.device, **images)
        warp_rate = _warp_rate(warp, actions, args.steps)
        share, launched = "", ""
        if args.launched:
            plain = TabletopBatchedEnv(n, task=args.family, obs_mode=args.obs_mode, device=args.device, capture_graph=False, **images)
            plain_rate = _warp_rate(plain, actions, args.steps)
            plain.close()
            launched = f" {plain_rate:,.0f} | {warp_rate / plain_rate:.2f} |"
        if rgb:
            start = time.perf_counter()
            for _ in range(args.steps):
                warp.render_images()
            _synchronize(warp.device)
            share = f" {(time.perf_counter() - start) * warp_rate / (n * args.steps):.0%} |"
        warp.close()
        print(f"| {n} | {cpu_rate:,.0f}{cpu_note} | {warp_rate:,.0f} | {warp_rate / cpu_rate:.3f} |" + share + launched, flush=True)


def _warp_rate(warp: TabletopBatchedEnv, actions: np.ndarray, steps: int) -> float:
    """Env steps/s of ``warp`` over ``actions`` [steps, N, 2], after two untimed steps."""
    warp.reset(seed=list(range(warp.num_envs)))
    batch = torch.from_numpy(actions).to(warp.device)
    warp.step(batch[0])  # loads the kernels (and the next step captures the graph)
    warp.step(batch[0])
    _synchronize(warp.device)
    start = time.perf_counter()
    for a in batch:
        warp.step(a)
    _synchronize(warp.device)
    return warp.num_envs * steps / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pusher_touched(env: TabletopEnv) -> bool:
    sim = env.unwrapped._sim
    blocks = {int(g) for g in sim.block_geoms}
    return any(sim.pusher_geom in (c.geom1, c.geom2) and {int(c.geom1), int(c.geom2)} & blocks for c in sim.data.contact[: sim.data.ncon])


def _watch_the_pusher(env: TabletopEnv, touched: np.ndarray, i: int) -> None:
    """Make ``env`` (reset) run its MuJoCo steps one by one and set ``touched[i]`` once the
    pusher touches a block at any of them."""
    sim = env.unwrapped._sim

    def step(velocity):
        sim.data.ctrl[:] = velocity
        for _ in range(PHYSICS_STEPS):
            sim.mujoco.mj_step(sim.model, sim.data)
            touched[i] |= _pusher_touched(env)

    sim.step = step


def _positions(state: np.ndarray, blocks: int) -> np.ndarray:
    """Pusher and block centres [.., 1 + blocks, 2] from state vectors."""
    pusher = state[..., None, 0:2]
    centres = state[..., 4 : 4 + 4 * blocks].reshape(*state.shape[:-1], blocks, 4)[..., :2]
    return np.concatenate([pusher, centres], -2)


def equivalence(args) -> None:
    for family in args.families:
        n = args.episodes
        warp = TabletopBatchedEnv(n, task=family, autoreset="disabled", device=args.device)
        blocks = warp.num_blocks
        cpus = [TabletopEnv(task=family, obs_mode="state") for _ in range(n)]
        cpu_obs = np.stack([e.reset(seed=i)[0]["state"] for i, e in enumerate(cpus)])
        warp_obs = warp.reset(seed=list(range(n)))[0]["state"].cpu().numpy()
        cpu_success, warp_success = np.zeros(n, bool), np.zeros(n, bool)
        cpu_alive, warp_alive = np.ones(n, bool), np.ones(n, bool)
        noise_rngs = [[np.random.default_rng(i) for i in range(n)] for _ in range(2)]  # CPU, warp: equal streams
        touched = np.zeros(n, bool)  # the CPU pusher has touched a block so far
        for i, env in enumerate(cpus):
            _watch_the_pusher(env, touched, i)
        parted_at, parted_touched = np.full(n, -1), np.zeros(n, bool)
        for step in range(60):
            gap = np.abs(_positions(cpu_obs, blocks) - _positions(warp_obs, blocks)).max(axis=(-1, -2))
            newly = (parted_at < 0) & (gap > PART) & cpu_alive & warp_alive
            parted_at[newly], parted_touched[newly] = step, touched[newly]
            actions = expert_actions(warp)
            if args.noise:  # what expert_action(env, noise, rng) adds, from the same generators
                noise = torch.from_numpy(np.stack([r.normal(size=2) for r in noise_rngs[1]]) * args.noise)
                actions = (actions + noise.to(actions)).clamp(-1.0, 1.0)
            warp_out = warp.step(actions)
            warp_obs = warp_out[0]["state"].cpu().numpy()
            warp_success |= warp_out[4]["success"].cpu().numpy() & warp_alive
            warp_alive &= ~(warp_out[2] | warp_out[3]).cpu().numpy()
            for i, env in enumerate(cpus):
                if cpu_alive[i]:
                    obs, _, term, trunc, info = env.step(expert_action(env, args.noise, noise_rngs[0][i]))
                    cpu_obs[i] = obs["state"]
                    cpu_success[i] |= info["success"]
                    cpu_alive[i] = not (term or trunc)
        agree = (cpu_success == warp_success).mean()
        parted = parted_at >= 0
        print(
            f"{family}: {n} expert episodes (action noise {args.noise}); success CPU {cpu_success.mean():.3f}, warp {warp_success.mean():.3f}; agree {agree:.3f} "
            f"({(cpu_success & ~warp_success).sum()} only CPU, {(~cpu_success & warp_success).sum()} only warp); "
            f"states part by > {PART * 1000:.0f} mm in {parted.sum()} episodes, at control step {np.median(parted_at[parted]) if parted.any() else float('nan'):.0f} "
            f"(median), {parted_touched[parted].sum()} of them after the pusher had touched a block",
            flush=True,
        )
        if args.open_loop:
            _open_loop(family, min(n, args.open_loop), args.device)
        if args.noise:
            _cpu_against_itself(family, n, args.noise)


def _cpu_against_itself(family: str, n: int, noise: float) -> None:
    """The control: CPU MuJoCo against itself, once from the initial states and once from
    them rounded to float32 (what the warp worlds start from), with the same noisy expert."""
    success = np.zeros((2, n), bool)
    for run in range(2):
        for i in range(n):
            env = TabletopEnv(task=family, obs_mode="state")
            env.reset(seed=i)
            if run:
                sim = env._sim
                sim.data.qpos[:] = sim.data.qpos.astype(np.float32)
                sim.mujoco.mj_forward(sim.model, sim.data)
            rng = np.random.default_rng(i)
            for _ in range(60):  # the time limit (a bare TabletopEnv has no TimeLimit wrapper)
                _, _, term, _, info = env.step(expert_action(env, noise, rng))
                success[run, i] |= info["success"]
                if term:
                    break
            env.close()
    print(f"  control: CPU MuJoCo against itself from float32-rounded initial states: success {success[0].mean():.3f} / {success[1].mean():.3f}, agree {(success[0] == success[1]).mean():.3f}", flush=True)


def _open_loop(family: str, n: int, device: str) -> None:
    """The CPU expert's first 20 actions replayed on warp worlds: the largest state gap
    before and after the pusher first touches a block."""
    cpus = [TabletopEnv(task=family, obs_mode="state", terminate_on_success=False) for _ in range(n)]
    for i, env in enumerate(cpus):
        env.reset(seed=i)
    warp = TabletopBatchedEnv(n, task=family, autoreset="disabled", terminate_on_success=False, device=device)
    warp.reset(seed=list(range(n)))
    touched = np.zeros(n, bool)
    for i, env in enumerate(cpus):
        _watch_the_pusher(env, touched, i)
    blocks = warp.num_blocks
    before, pusher_after, blocks_after = 0.0, 0.0, 0.0
    for _ in range(20):
        actions = np.stack([expert_action(env) for env in cpus])
        cpu_state = np.stack([env.step(action)[0]["state"] for env, action in zip(cpus, actions)])
        warp_state = warp.step(torch.from_numpy(actions))[0]["state"].cpu().numpy()
        gap = np.abs(warp_state - cpu_state).max(-1)
        before = max(before, float(gap[~touched].max(initial=0.0)))
        moved = np.abs(_positions(warp_state, blocks) - _positions(cpu_state, blocks)).max(-1)  # [n, 1 + blocks]
        pusher_after = max(pusher_after, float(moved[touched, 0].max(initial=0.0)))
        blocks_after = max(blocks_after, float(moved[touched, 1:].max(initial=0.0)))
    print(
        f"  open loop, {n} worlds x 20 steps: largest state gap {before:.2e} before the pusher touches a block; "
        f"after, the pusher {pusher_after * 1000:.1f} mm and a block {blocks_after * 1000:.1f} mm apart", flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--worlds", type=int, nargs="+", default=[1, 64, 256])
    t.add_argument("--steps", type=int, default=10, help="timed control steps")
    t.add_argument("--family", default="object")
    t.add_argument("--device", default="cpu", help="warp device: cpu or cuda")
    t.add_argument("--obs-mode", default="state", choices=["state", "rgb"], help="the observations both backends give")
    t.add_argument("--cameras", nargs="+", default=["top"], help="rgb: the cameras rendered (top, front)")
    t.add_argument("--image-size", type=int, default=64, help="rgb: side of the images")
    t.add_argument("--launched", action="store_true", help="also time warp launching each kernel from Python (capture_graph=False), in the same run")
    t.add_argument("--cpu-max-worlds", type=int, default=None, help="build the CPU vector env only up to this many worlds; larger counts compare with its rate there (default: every count)")
    e = sub.add_parser("equivalence")
    e.add_argument("--episodes", type=int, default=256, help="expert episodes per family")
    e.add_argument("--open-loop", type=int, default=64, help="worlds of the open-loop comparison (0: none)")
    e.add_argument("--noise", type=float, default=0.0, help="Gaussian action noise of the expert (its std), the same draws on both backends")
    e.add_argument("--families", nargs="+", default=["spatial", "object", "goal"], help="each its own run; all: one batch of every family's tasks mixed")
    e.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    throughput(args) if args.what == "throughput" else equivalence(args)


if __name__ == "__main__":
    main()
