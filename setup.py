"""Packaging: every folder with an ``__init__.py`` under mmrl/, envs/, policies/ and rewards/
is a package of the wheel (envs/, policies/ and rewards/ install as mmrl.envs, mmrl.policies
and mmrl.rewards), so a new policy, env, reward or task folder needs no list kept by hand.
Everything else about the project is in pyproject.toml."""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
PACKAGE_DIRS = {"mmrl": "mmrl", "mmrl.envs": "envs", "mmrl.policies": "policies", "mmrl.rewards": "rewards", "mmrl.configs": "configs", "mmrl.assets": "assets"}


def packages() -> list[str]:
    found = ["mmrl.configs", "mmrl.assets"]  # data only
    for package in ("mmrl", "mmrl.envs", "mmrl.policies", "mmrl.rewards"):
        folder = ROOT / PACKAGE_DIRS[package]
        for init in sorted(folder.rglob("__init__.py")):
            parts = init.parent.relative_to(folder).parts
            if "__pycache__" not in parts:
                found.append(".".join((package, *parts)))
    return found


setup(package_dir=PACKAGE_DIRS, packages=packages())
