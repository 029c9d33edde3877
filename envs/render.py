"""Offscreen OpenGL backend of MuJoCo rendering, chosen before ``mujoco`` is first imported.

MuJoCo reads ``MUJOCO_GL`` once, when the ``mujoco`` package is imported, and a backend
that fails to create a context cannot be swapped in the same process. So when the variable
is unset, :func:`select_gl_backend` tries each backend of :data:`BACKENDS` in a fresh
Python process (render a 16×16 frame) and sets ``MUJOCO_GL`` (and ``PYOPENGL_PLATFORM``,
which PyOpenGL reads) to the first that works:

- ``egl``: headless EGL (a GPU driver, or Mesa's software rasterizer on a CPU machine);
- ``osmesa``: Mesa's off-screen software renderer.

A ``MUJOCO_GL`` set by the user is always kept. The choice and why it was made are exposed
by :func:`chosen_backend` and reported by ``mmrl doctor``.
"""

from __future__ import annotations

import os
import subprocess
import sys

BACKENDS = ("egl", "osmesa")

_PROBE = """
import mujoco
m = mujoco.MjModel.from_xml_string('<mujoco><worldbody><light pos="0 0 1"/><geom size=".1"/></worldbody></mujoco>')
m.vis.quality.shadowsize = 0
r = mujoco.Renderer(m, 16, 16)
d = mujoco.MjData(m)
mujoco.mj_forward(m, d)
r.update_scene(d)
assert r.render().shape == (16, 16, 3)
r.close()
"""

_chosen: tuple[str | None, str] | None = None


def probe_backend(backend: str, timeout: float = 60.0) -> tuple[bool, str]:
    """Whether MuJoCo renders offscreen with ``MUJOCO_GL=backend`` (tried in a fresh
    process); on failure, the last line of its error."""
    env = {**os.environ, "MUJOCO_GL": backend, "PYOPENGL_PLATFORM": backend}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return proc.returncode == 0, "" if proc.returncode == 0 else (lines[-1] if lines else f"exit code {proc.returncode}")


def select_gl_backend() -> tuple[str | None, str]:
    """Set ``MUJOCO_GL`` if it is unset and ``mujoco`` is not imported yet; return
    ``(backend, how)``: the backend MuJoCo will use (None if none works) and how it was
    chosen. Probes at most once per process."""
    global _chosen
    if _chosen is not None:
        return _chosen
    if os.environ.get("MUJOCO_GL"):
        _chosen = (os.environ["MUJOCO_GL"], "MUJOCO_GL was set")
    elif "mujoco" in sys.modules:
        # Too late to choose: mujoco picked its platform default (GLFW on Linux) at import.
        _chosen = (None, "mujoco was imported before a backend was chosen and MUJOCO_GL is unset")
    else:
        failures = []
        for backend in BACKENDS:
            ok, error = probe_backend(backend)
            if ok:
                os.environ["MUJOCO_GL"] = backend
                os.environ.setdefault("PYOPENGL_PLATFORM", backend)
                _chosen = (backend, f"chosen automatically: the first of {', '.join(BACKENDS)} that renders")
                break
            failures.append(f"{backend}: {error}")
        else:
            _chosen = (None, "no offscreen backend renders (" + "; ".join(failures) + "); install libegl1 or libosmesa6 (Debian)")
    return _chosen


def chosen_backend() -> tuple[str | None, str] | None:
    """``(backend, how)`` once :func:`select_gl_backend` ran in this process, else None."""
    return _chosen
