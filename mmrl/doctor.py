"""``mmrl doctor``: what this machine can run — torch devices, MuJoCo offscreen rendering
backends, ManiSkill's Vulkan device, and which optional extras are installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

_MUJOCO_RENDER = """
import mujoco
m = mujoco.MjModel.from_xml_string('<mujoco><worldbody><light pos="0 0 1"/><geom size=".1"/></worldbody></mujoco>')
m.vis.quality.shadowsize = 0
r = mujoco.Renderer(m, 16, 16)
d = mujoco.MjData(m)
r.update_scene(d)
assert r.render().shape == (16, 16, 3)
"""

_MANISKILL_MAKE = """
import gymnasium as gym, mani_skill.envs
env = gym.make("PushCube-v1", obs_mode="state", sim_backend="physx_cpu", num_envs=1)
env.reset(seed=0)
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
    return {gl: _run(_MUJOCO_RENDER, {"MUJOCO_GL": gl, "PYOPENGL_PLATFORM": gl}) for gl in ("egl", "osmesa")}


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
        backends = mujoco_backends()
        good = [gl for gl, (ok, _) in backends.items() if ok]
        detail = f"{v}; offscreen rendering: {', '.join(good) if good else 'none'}"
        if good:
            detail += f" (mmrl uses MUJOCO_GL={good[0]} unless MUJOCO_GL is set)"
        else:
            detail += "; install libegl1 or libosmesa6 (Debian) for rendering"
        rows.append(("mujoco", "ok" if good else "no-render", detail))
    v = _version("mani_skill") or _version("mani-skill")
    if v is None:
        rows.append(("mani_skill", "missing", "pip install 'mmrl[maniskill]'"))
    else:
        ok, err = _run(_MANISKILL_MAKE)
        hint = "" if ok else f"; cannot create an env: {err[:120]} — on CPU install lavapipe from Debian bookworm-backports Mesa 25 (scripts/setup.sh does)"
        rows.append(("mani_skill", "ok" if ok else "NO-VULKAN", f"{v}{hint}"))
    width = max(len(r[0]) for r in rows)
    for name, status, detail in rows:
        print(f"{name:{width}s}  {status:9s}  {detail}")
    return 0 if all(status in ("ok", "missing") for _, status, _ in rows) else 1
