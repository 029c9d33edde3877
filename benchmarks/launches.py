"""How many operators does one VLA decision dispatch? Counts the aten operators that
``policy.sample`` dispatches for a batch of B observations (each one a launch on a GPU), per
call and per decision, and the decisions per second on this CPU, for the token VLA (mmrl's
miniature, and on a tiny SmolVLM) and the flow VLA at B = 1, 32 and 256.

    python benchmarks/launches.py [--old <commit>] [--batches 1 32 256] [--rounds 3] [--device cuda]
    python benchmarks/launches.py --compile --batches 32 256 --rounds 3

The count is that of a ``TorchDispatchMode`` around one ``sample`` call: every operator the
dispatcher runs, views included, the same on any machine for the same code and inputs. With
``--old`` the same measurements run on that commit too (from a git worktree in a temporary
directory, this interpreter, that worktree first on the import path), case by case beside the
checkout's own code, and the table gives the ratios old / new of one run. Timings are medians
over repeated calls on one thread (``torch.set_num_threads(1)``); with ``--rounds R`` each case
is measured R times, old and new taking turns, and the median of the R is shown (on a machine
that others load, one round's timings scatter by ±20%).

``--compile`` measures, in the same run, each case eager and with its sampling compiled
(``torch.compile``, CUDA graphs on CUDA; the flow VLA's ``compile_denoiser`` and
``compile_prefix``, the token VLA's ``compile_decoder``; each batch size compiles once, in the
warm-up call, outside the timings), eager and compiled taking turns, and prints decisions/s of
both and, on the CPU, what a compiled call launches: the aten operators it dispatches (the eager
code around the compiled graphs, and the extern kernels the graphs call: matrix products,
attention), counted by the same dispatch mode declared an infrastructure mode (under a user
mode ``torch.compile`` runs the Python eagerly instead), and the fused C++ kernels inductor
generated, each run recording a profiler event of its name
(``torch._inductor.config.cpp.enable_kernel_profile``). Kernels launched = the two together.
The fused kernels are inductor's for the CPU; on CUDA its Triton kernels fuse otherwise, and
CUDA graphs replay a graph's kernels in one launch: neither is counted here.

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


COMPILABLE = {"flow_vla": ("compile_denoiser", "compile_prefix"), "token_vla": ("compile_decoder",), "token_vla_smolvlm": ("compile_decoder",)}


def _policy(case: str, vlm_dir: str | None, compiled: bool = False):
    import torch

    from mmrl.config import from_dict
    from mmrl.core.weights import build_policy
    from mmrl.registry import POLICIES

    data = json.loads(json.dumps(CASES[case]))
    if case.endswith("smolvlm"):
        data["backbone"]["vlm_path"] = vlm_dir
    if compiled:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True  # a profiler event per fused kernel run (count_compiled_launches)
        data.update(dict.fromkeys(COMPILABLE[case], True))
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


def _counter(infra: bool = False):
    """A ``TorchDispatchMode`` counting the operators dispatched under it. ``infra``: declared an
    infrastructure mode, which ``torch.compile`` lets its compiled code run under (under a user
    mode it runs the original Python eagerly instead)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        @classmethod
        def is_infra_mode(cls):
            return infra

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    return Count()


def count_operators(policy, inputs) -> int:
    """The aten operators one ``policy.sample(inputs)`` dispatches."""
    import torch

    counter = _counter()
    with counter:
        policy.sample(inputs, torch.Generator().manual_seed(0))
    return counter.calls


def count_compiled_launches(policy, inputs) -> tuple[int, int]:
    """(aten operators dispatched, inductor kernels run) by one ``policy.sample(inputs)`` of a
    policy whose step was compiled on the CPU with ``torch._inductor.config.cpp.enable_kernel_profile``
    set (:func:`_policy` sets it): the aten operators are those of the eager code around the
    compiled graphs and those the graphs call as extern kernels (matrix products, attention);
    each of inductor's fused C++ kernels then records a profiler event of its own name
    (``graph_<i>_cpp_fused_…``), and those are counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    counter = _counter(infra=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof, counter:
        policy.sample(inputs, torch.Generator().manual_seed(0))
    return counter.calls, sum(1 for event in prof.events() if "cpp_fused" in event.name)


def measure(case: str, batches: list[int], seconds: float, vlm_dir: str | None, device: str = "cpu", compiled: bool = False) -> list[dict]:
    """Per batch size: operators per ``sample`` call (with ``compiled`` on the CPU, the aten
    operators and the fused kernels of :func:`count_compiled_launches`) and the median decisions
    per second."""
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
        fused = None
        if not compiled:
            ops = count_operators(policy, inputs)
        elif device == "cpu":
            ops, fused = count_compiled_launches(policy, inputs)
        else:
            ops = None
        times, start = [], time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 50):
            sync()
            t0 = time.perf_counter()
            policy.sample(inputs, torch.Generator().manual_seed(len(times)))
            sync()
            times.append(time.perf_counter() - t0)
        rows.append({"batch": batch, "ops": ops, "fused": fused, "decisions_per_s": batch / statistics.median(times)})
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
    parser.add_argument("--compile", action="store_true", help="measure each case's compiled sampling (compile_denoiser and compile_prefix, compile_decoder) against its eager one in the same run: launches (on the CPU) and decisions/s")
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
            before = {}  # (case, B): the old commit's operators per call
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
                        before[case, b] = old["ops"]
                        print(
                            f"| {case} | {b} | {old['ops']} | {new['ops']} | {old['ops'] / new['ops']:.2f} | {new['ops'] / b:.2f} "
                            f"| {old['decisions_per_s']:.0f} | {new['decisions_per_s']:.0f} | {new['decisions_per_s'] / old['decisions_per_s']:.2f} |"
                        )
                    else:
                        print(f"| {case} | {b} | {new['ops']} | {new['ops'] / b:.2f} | {new['decisions_per_s']:.0f} |")
            compilable = [case for case in args.cases if case in COMPILABLE]
            if args.compile and compilable:
                print("\ncompiled sampling (flow_vla: compile_denoiser + compile_prefix; token_vla: compile_decoder) against eager, this checkout: per sample call, ops eager, "
                      "and compiled: aten ops dispatched, inductor's fused kernels, kernels launched = the two; decisions/s")
                old_column = ("| old ops / launched ", "|---") if args.old else ("", "")
                print(f"| policy | B | ops eager | aten ops compiled | fused kernels | kernels launched | launched / eager ops {old_column[0]}| decisions/s eager | compiled | compiled / eager |")
                print(f"|---|---|---|---|---|---|---{old_column[1]}|---|---|---|")
                for case in compilable:
                    rounds = [{compiled: run_tree(ROOT, case, args.batches, args.seconds, vlm_dir, args.device, compiled) for compiled in (False, True)} for _ in range(args.rounds)]
                    for i, b in enumerate(args.batches):
                        eager, compiled = (statistics.median(r[flag][i]["decisions_per_s"] for r in rounds) for flag in (False, True))
                        ops, row = rounds[0][False][i]["ops"], rounds[0][True][i]
                        if row["fused"] is None:
                            counts = f"| {ops} | - | - | - | - " + ("| - " if args.old else "")
                        else:
                            launched = row["ops"] + row["fused"]
                            counts = f"| {ops} | {row['ops']} | {row['fused']} | {launched} | {launched / ops:.2f} "
                            counts += f"| {before[case, b] / launched:.2f} " if args.old else ""
                        print(f"| {case} | {b} {counts}| {eager:.0f} | {compiled:.0f} | {compiled / eager:.2f} |")
        finally:
            if args.old:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees["old"])], cwd=ROOT, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
