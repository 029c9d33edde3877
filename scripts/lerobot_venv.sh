#!/usr/bin/env bash
# A virtual environment of its own for LeRobot, the reference of tests/parity/test_lerobot_smolvla.py
# (make lerobot-venv; make parity-lerobot runs the comparison). LeRobot 0.4.4 pins torch < 2.11
# and transformers < 5, mmrl's .venv has torch 2.13 and transformers 5.x, so the two cannot share
# one environment. PyPI's torch of the 2.10 line is the CUDA build: the venv is ~8 GB. Nothing in
# it needs a GPU: the reference runs on the CPU.
#
# Idempotent: a stamp file ($VENV/.installed, holding the spec) marks a finished install; delete
# it (or the venv) to reinstall. Needs only PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LEROBOT_VENV:-.venv-lerobot}
# smolvla extra: transformers>=4.57.1,<5, num2words (the SmolVLM processor imports it),
# accelerate, safetensors.
LEROBOT_SPEC=${LEROBOT_SPEC:-lerobot[smolvla]==0.4.4}
STAMP="$VENV/.installed"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$LEROBOT_SPEC" ] && [ -x "$VENV/bin/python" ]; then
    echo "lerobot-venv: $VENV already has $LEROBOT_SPEC (delete $STAMP to reinstall)"
    touch "$STAMP"  # newer than this script: make's rule is satisfied
    exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    echo "lerobot-venv: creating $VENV with $(python3 --version) (LeRobot 0.4.4 needs Python >= 3.10)"
    python3 -m venv "$VENV"
fi
echo "lerobot-venv: installing $LEROBOT_SPEC into $VENV (several minutes, ~8 GB)"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$LEROBOT_SPEC"
echo "$LEROBOT_SPEC" >"$STAMP"
echo "lerobot-venv: done in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1): $("$VENV/bin/python" -c '
import importlib.metadata as m
print(", ".join(f"{d} {m.version(d)}" for d in ("lerobot", "torch", "transformers", "num2words")))')"
