"""How many operators does one VLA decision dispatch? Counts the aten operators that
``policy.sample`` dispatches for a batch of B observations (each one a launch on a GPU), per
call and per decision, and the decisions per second on this CPU, for the token VLA (mmrl's
miniature, and on a tiny SmolVLM) and the flow VLA at B = 1, 32 and 256.

    python benchmarks/launches.py [--old <commit>] [--batches 1 32 256] [--rounds 3] [--device cuda]
    python benchmarks/launches.py --compile --cases flow_vla --batches 32 256 --rounds 3

The count is that of a ``TorchDispatchMode`` around one ``sample`` call: every operator the
dispatcher runs, views included, the same on any machine for the same code and inputs. With
``--old`` the same measurements run on that commit too (from a git worktree in a temporary
directory, this interpreter, that worktree first on the import path), case by case beside the
checkout's own code, and the table gives the ratios old / new of one run. Timings are medians
over repeated calls on one thread (``torch.set_num_threads(1)``); with ``--rounds R`` each case
is measured R times, old and new taking turns, and the median of the R is shown (on a machine
that others load, one round's timings scatter by ±20%).

``--compile`` times, in the same run, the cases that can compile their denoising step
(``compile_denoiser``: the flow VLA) both eager and compiled (``torch.compile``, CUDA graphs on
CUDA; each batch size compiles once, in the warm-up call, outside the timings), eager and
compiled taking turns, and prints decisions/s of both and their ratio. Their operator counts
are not compared: a compiled step runs fused kernels that no dispatch mode sees one by one.

The policies are random, built in-process at the sizes of the tabletop configs
(``configs/tabletop_{token,flow}_vla_sft.yaml``: 64 px camera, hidden 64, 2 layers, chunk 4)
and, for the SmolVLM case, of ``scripts/pretrained_vla_tabletop.sh``'s VLM (64 px images,
patch 8, hidden 64, 2 layers, 48 instruction tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTIONS = ["push the red block into the left zone", "push the blue block to the right", "move the green block up", "push the yellow block into the far zone"]
SPEC = {"action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0], "state_dim": 4, "image_shape": [64, 64, 3], "instructions": INSTRUCTIONS}
MINIATURE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "vision_channels": [16, 32], "patch_grid": 8}
VLM_SIZE = {"image_size": 64, "patch_size": 8, "vision_hidden_size": 32, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}
CASES = {
    "token_vla": {"type": "token_vla", "action_bins": 32, "action_chunk": 4, "backbone": MINIATURE},
    "token_vla_smolvlm": {"type": "token_vla", "action_bins": 32, "action_chunk": 4, "backbone": {"max_instruction_tokens": 48}},
    "flow_vla": {"type": "flow_vla", "action_chunk": 4, "denoising": {"num_inference_steps": 5}, "backbone": {**MINIATURE, "coord_channels": True}},
}


# ------------------------------------------------------------------ one tree's measurements (a subprocess)


COMPILABLE = ("flow_vla",)


def _policy(case: str, vlm_dir: str | None, compiled: bool = False):
    import torch

    from mmrl.config import from_dict
    from mmrl.core.weights import build_policy
    from mmrl.registry import POLICIES

    data = json.loads(json.dumps(CASES[case]))
    if case.endswith("smolvlm"):
        data["backbone"]["vlm_path"] = vlm_dir
    if compiled:
        data["compile_denoiser"] = True
    config = from_dict(POLICIES.entry(data["type"]).config, data, "policy")
    torch.manual_seed(0)
    return build_policy(config, SPEC).eval()


def _inputs(batch: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    return {
        "image": torch.randint(0, 256, (batch, 64, 64, 3), generator=g, dtype=torch.uint8),
        "state": torch.randn(batch, 4, generator=g),
        "instruction": [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(batch)],
    }


def count_operators(policy, inputs) -> int:
    """The aten operators one ``policy.sample(inputs)`` dispatches."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    counter = Count()
    with counter:
        policy.sample(inputs, torch.Generator().manual_seed(0))
    return counter.calls


def measure(case: str, batches: list[int], seconds: float, vlm_dir: str | None, device: str = "cpu", compiled: bool = False) -> list[dict]:
    """Per batch size: operators per ``sample`` call (None when ``compiled``) and the median
    decisions per second."""
    import torch

    torch.set_num_threads(1)
    policy = _policy(case, vlm_dir, compiled).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)  # a call's time includes its kernels
    rows = []
    for batch in batches:
        inputs = _inputs(batch)
        policy.sample(inputs, torch.Generator().manual_seed(0))  # warm-up (allocations, lazy inits, the compile)
        if compiled:
            policy.sample(inputs, torch.Generator().manual_seed(0))  # CUDA graphs record on the second call
        ops = None if compiled else count_operators(policy, inputs)
        times, start = [], time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 50):
            sync()
            t0 = time.perf_counter()
            policy.sample(inputs, torch.Generator().manual_seed(len(times)))
            sync()
            times.append(time.perf_counter() - t0)
        rows.append({"batch": batch, "ops": ops, "decisions_per_s": batch / statistics.median(times)})
    return rows


# ------------------------------------------------------------------ the comparison


def run_tree(tree: Path, case: str, batches: list[int], seconds: float, vlm_dir: str | None, device: str, compiled: bool = False) -> list[dict]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", case, "--batches", *map(str, batches), "--seconds", str(seconds), "--device", device]
    if compiled:
        command.append("--compiled")
    if vlm_dir:
        command += ["--vlm-dir", vlm_dir]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{case} at {tree}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="a commit to compare against (its code, measured in the same run)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256], help="observations per sample call")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--seconds", type=float, default=3.0, help="timed calls per batch size, at least 3 and for about this long")
    parser.add_argument("--rounds", type=int, default=1, help="measurements per case and commit, old and new taking turns; the table gives the median decisions/s")
    parser.add_argument("--device", default="cpu", help="where the policies run (cuda: the timings wait for the kernels); the counts do not depend on the machine, and on a GPU add the copies of the inputs to it")
    parser.add_argument("--compile", action="store_true", help="time the flow VLA's compiled denoising step (compile_denoiser) against its eager one in the same run")
    parser.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--vlm-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.batches, args.seconds, args.vlm_dir, args.device, args.compiled)))
        return 0

    import platform

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vlm_dir = None
        if any(case.endswith("smolvlm") for case in args.cases):
            vlm_dir = str(tmp / "smolvlm64")
            size = [f"--{k.replace('_', '-')}={v}" for k, v in VLM_SIZE.items()]
            subprocess.run([sys.executable, "-m", "mmrl.policies.vla.tiny_vlm", "--family", "smolvlm", "--out", vlm_dir, *size], cwd=ROOT, check=True, capture_output=True)
        trees = {"new": ROOT}
        if args.old:
            trees["old"] = tmp / "old"
            subprocess.run(["git", "worktree", "add", "--detach", str(trees["old"]), args.old], cwd=ROOT, check=True, capture_output=True)
        try:
            cpu = platform.processor() or platform.machine()
            try:
                cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
            except (OSError, StopIteration):
                pass
            where = f"{cpu}, 1 thread" if args.device == "cpu" else f"{args.device} ({torch.cuda.get_device_name(args.device) if torch.cuda.is_available() else 'unavailable'}), {cpu}"
            print(f"torch {torch.__version__}, {where}; aten operators per sample call of B observations, per decision (/ B), decisions/s")
            if args.old:
                print(f"old = {args.old}, new = this checkout")
                print("| policy | B | ops / call old | new | old / new | ops / decision new | decisions/s old | new | new / old |")
                print("|---|---|---|---|---|---|---|---|---|")
            else:
                print("| policy | B | ops / call | ops / decision | decisions/s |")
                print("|---|---|---|---|---|")
            for case in args.cases:
                rounds = [{label: run_tree(tree, case, args.batches, args.seconds, vlm_dir, args.device) for label, tree in trees.items()} for _ in range(args.rounds)]
                results = {
                    label: [{**row, "decisions_per_s": statistics.median(r[label][i]["decisions_per_s"] for r in rounds)} for i, row in enumerate(rounds[0][label])]
                    for label in trees
                }
                for i, new in enumerate(results["new"]):
                    b = new["batch"]
                    if args.old:
                        old = results["old"][i]
                        print(
                            f"| {case} | {b} | {old['ops']} | {new['ops']} | {old['ops'] / new['ops']:.2f} | {new['ops'] / b:.2f} "
                            f"| {old['decisions_per_s']:.0f} | {new['decisions_per_s']:.0f} | {new['decisions_per_s'] / old['decisions_per_s']:.2f} |"
                        )
                    else:
                        print(f"| {case} | {b} | {new['ops']} | {new['ops'] / b:.2f} | {new['decisions_per_s']:.0f} |")
            compilable = [case for case in args.cases if case in COMPILABLE]
            if args.compile and compilable:
                print("\ncompile_denoiser: eager against compiled denoising steps of this checkout, decisions/s")
                print("| policy | B | eager | compiled | compiled / eager |")
                print("|---|---|---|---|---|")
                for case in compilable:
                    rounds = [{compiled: run_tree(ROOT, case, args.batches, args.seconds, vlm_dir, args.device, compiled) for compiled in (False, True)} for _ in range(args.rounds)]
                    for i, b in enumerate(args.batches):
                        eager, compiled = (statistics.median(r[flag][i]["decisions_per_s"] for r in rounds) for flag in (False, True))
                        print(f"| {case} | {b} | {eager:.0f} | {compiled:.0f} | {compiled / eager:.2f} |")
        finally:
            if args.old:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees["old"])], cwd=ROOT, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
