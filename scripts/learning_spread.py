"""Measure the margin of every learning test (pytest marker ``learning``) over seeds and CPU kernels.

Runs ``python -m pytest -q -m "learning and not slow"`` once per (seed, capability): the training
seed comes from ``MMRL_LEARNING_SEED``, the float kernels from ``ATEN_CPU_CAPABILITY``, and each
test's ``learned(...)`` checks append their measured values to one JSONL log. A failing run does
not stop the others (each run's pytest report is kept beside the log). Then it prints, per test and check: the threshold, its direction, the min,
mean and max of the value over all runs, the worst margin and how many runs missed the threshold.

    python scripts/learning_spread.py --seeds 5 --capabilities default,avx2,avx512
    python scripts/learning_spread.py --seeds 3 -- tests/policies/test_reward_model.py
    python scripts/learning_spread.py --from-log /tmp/learning.jsonl

Arguments after ``--`` (or any unknown ones) go to pytest as they are (a file, ``-k ...``).
Capabilities this CPU lacks are skipped: torch falls back to a lower one without an error, so
each is checked with ``torch.backends.cpu.get_cpu_capability()`` under its own setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def actual_capability(name: str) -> str:
    """The kernel set torch uses under ``ATEN_CPU_CAPABILITY=name`` (it falls back silently)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "ATEN_CPU_CAPABILITY": name})
    return out.stdout.strip().lower()


def run_all(seeds: list[int], capabilities: list[str], log: Path, pytest_args: list[str]) -> None:
    usable = []
    for cap in capabilities:
        got = actual_capability(cap)
        if got == cap.lower():
            usable.append(cap)
        else:
            print(f"skipping {cap}: this CPU runs {got or 'nothing'} under ATEN_CPU_CAPABILITY={cap}", flush=True)
    for seed in seeds:
        for cap in usable:
            env = {**os.environ, "MMRL_LEARNING_SEED": str(seed), "ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": "1", "MMRL_LEARNING_LOG": str(log)}
            cmd = [sys.executable, "-m", "pytest", "-q", "-m", "learning and not slow", "-p", "no:randomly", "-p", "no:cacheprovider", *pytest_args]
            start = time.monotonic()
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            log.with_name(f"{log.stem}.seed{seed}.{cap}.txt").write_text(proc.stdout + proc.stderr)  # pytest's report, beside the log
            summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-300:]
            print(f"seed {seed} {cap:>7}: exit {proc.returncode} in {time.monotonic() - start:.0f} s: {summary}", flush=True)
            if proc.returncode not in (0, 1):  # 1: some test failed (recorded in the log); others: no tests ran or an error
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", flush=True)


def table(log: Path) -> str:
    """Per test (its node id on a line), one row per named check over all logged runs."""
    groups: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for line in log.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            groups[record["test"]][record["name"]].append(record)
    header = ("  check", "threshold", "dir", "min", "mean", "max", "worst margin", "failed")
    blocks = []
    for test, checks in sorted(groups.items()):
        rows = []
        for name, records in checks.items():
            values = [r["value"] for r in records]
            margins = [(r["value"] - r["threshold"]) if r["higher"] else (r["threshold"] - r["value"]) for r in records]
            thresholds = sorted({r["threshold"] for r in records})
            threshold = f"{thresholds[0]:.4g}" if len(thresholds) == 1 else f"{thresholds[0]:.4g}..{thresholds[-1]:.4g}"
            rows.append((f"  {name or 'value'}", threshold, ">=" if records[0]["higher"] else "<=", f"{min(values):.4g}", f"{sum(values) / len(values):.4g}",
                         f"{max(values):.4g}", f"{min(margins):.4g}", f"{sum(m < 0 for m in margins)}/{len(records)}"))
        blocks.append((test, rows))
    every = [header] + [row for _, rows in blocks for row in rows]
    widths = [max(len(row[i]) for row in every) for i in range(len(header))]

    def fmt(row) -> str:
        return "  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))

    lines = [fmt(header)]
    for test, rows in blocks:
        lines.append(test)
        lines += [fmt(row) for row in rows]
    runs = sorted({(r["seed"], r["capability"]) for checks in groups.values() for records in checks.values() for r in records})
    seeds, caps = sorted({s for s, _ in runs}), sorted({c.lower() for _, c in runs})
    lines.append(f"\n{len(runs)} runs (seed x capability): seeds {seeds} x {caps}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default 5)")
    parser.add_argument("--first-seed", type=int, default=0, help="start the seeds here (default 0)")
    parser.add_argument("--capabilities", default="default,avx2,avx512", help="comma-separated ATEN_CPU_CAPABILITY values (default default,avx2,avx512)")
    parser.add_argument("--log", type=Path, help="the JSONL log to append to (default: a new file in the temp directory)")
    parser.add_argument("--from-log", type=Path, help="only print the table of this existing log")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    if args.from_log:
        print(table(args.from_log))
        return 0
    log = args.log or Path(tempfile.mkstemp(prefix="learning_spread_", suffix=".jsonl")[1])
    print(f"log: {log}", flush=True)
    start = time.monotonic()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    run_all(seeds, [c.strip() for c in args.capabilities.split(",") if c.strip()], log, pytest_args)
    print(f"all runs: {time.monotonic() - start:.0f} s\n", flush=True)
    if log.stat().st_size:
        print(table(log))
    else:
        print("nothing was logged: no learning test ran (or MMRL_LEARNING_LOG is not read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
