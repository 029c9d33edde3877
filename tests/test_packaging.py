"""The wheel carries mmrl.envs / mmrl.policies / mmrl.rewards / presets and imports the same
from the repository root and from elsewhere."""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

from tests.conftest import ROOT

_CHECK = (
    "import json, mmrl, mmrl.envs, mmrl.policies, mmrl.rewards, mmrl.algo;"
    "from mmrl.config import list_presets;"
    "assert 'grpo' in list_presets(), list_presets();"
    "print(mmrl.__file__);"
    "print(json.dumps(__import__('tests_registered').registered()))"
)

# what every registry holds, and the file each component comes from
_REGISTERED = """
import sys
from mmrl import registry

def registered():
    kinds = {name: value for name, value in vars(registry).items() if isinstance(value, registry.Registry)}
    return {kind: {e.name: sys.modules[e.obj.__module__].__file__ for e in reg.entries()} for kind, reg in sorted(kinds.items())}
"""


def _source_packages() -> set[str]:
    names = set()
    for top, dotted in (("mmrl", "mmrl"), ("envs", "mmrl.envs"), ("policies", "mmrl.policies"), ("rewards", "mmrl.rewards")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            names.add(".".join((dotted, *rel)))
    return names


def _registered(py, cwd, env, helper_dir) -> tuple[str, dict]:
    import json

    proc = subprocess.run([py, "-c", _CHECK], cwd=cwd, capture_output=True, text=True, env={**env, "PYTHONPATH": str(helper_dir)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    location, components = proc.stdout.strip().splitlines()[-2:]
    return location, json.loads(components)


def test_built_wheel_imports_in_a_fresh_venv(tmp_path):
    """Packaging finds every package folder by itself: the wheel holds every package of the
    source tree, and every registered component (policies, envs, rewards, samplers, data
    sources, the algorithm's axes) imports from the wheel, none from the source tree."""
    src = tmp_path / "src"  # a clean copy: no stale build/ directory leaks into the wheel
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "runs", "*.egg-info", "__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, src], check=True, capture_output=True, timeout=600)
    (wheel,) = dist.glob("mmrl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {os.path.dirname(n).replace("/", ".") for n in zf.namelist() if n.endswith("/__init__.py")}
        assert "mmrl/configs/presets/grpo.yaml" in zf.namelist()
    assert _source_packages() <= in_wheel, sorted(_source_packages() - in_wheel)
    assert not any(n.split(".")[0] in ("envs", "policies", "rewards") for n in in_wheel)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    # dependencies come from this interpreter's site-packages (a path entry: its .pth files,
    # including the editable install's finder, are not run)
    (open(os.path.join(site, "deps.pth"), "w")).write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    helper_dir = tmp_path / "helper"
    helper_dir.mkdir()
    (helper_dir / "tests_registered.py").write_text(_REGISTERED)
    location, from_wheel = _registered(py, tmp_path, env, helper_dir)
    assert location.startswith(site)
    _, from_source = _registered(sys.executable, tmp_path, env, helper_dir)
    assert {k: sorted(v) for k, v in from_wheel.items()} == {k: sorted(v) for k, v in from_source.items()}  # nothing left out
    assert sum(len(v) for v in from_wheel.values()) > 50 and "tasks" in from_wheel["REWARDS"]["shapes_geneval"]
    files = [f for components in from_wheel.values() for f in components.values()]
    assert all(f.startswith(site) for f in files), [f for f in files if not f.startswith(site)][:5]
    _registered(py, ROOT, env, helper_dir)  # at the repository root (the source tree first on sys.path) too
    cli = subprocess.run([py, "-m", "mmrl", "list", "presets"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert cli.returncode == 0 and "dapo" in cli.stdout, cli.stderr[-2000:]


def test_editable_install_imports_from_elsewhere(tmp_path):
    (tmp_path / "tests_registered.py").write_text(_REGISTERED)
    location, components = _registered(sys.executable, tmp_path, dict(os.environ), tmp_path)
    assert location.startswith(str(ROOT)) and "gaussian_mlp" in components["POLICIES"]


def test_missing_extra_names_the_extra(monkeypatch):
    import builtins

    import pytest

    from mmrl.errors import MissingExtraError

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("mani_skill"):
            raise ImportError("No module named 'mani_skill'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    from mmrl.config import from_dict
    from mmrl.train.run_config import TrainConfig

    with pytest.raises(MissingExtraError, match=r"mmrl\[maniskill\]"):
        from_dict(TrainConfig, {"env": {"type": "maniskill", "id": "PushCube-v1"}, "policy": {"type": "gaussian_mlp"}, "sampler": {"type": "env"}, "rewards": [{"type": "success"}]})
