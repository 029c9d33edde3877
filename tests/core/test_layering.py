"""The core stands alone: envs, policies, samplers and rewards build on mmrl.core, and
nothing in mmrl.core pulls in the training package."""

import re
from pathlib import Path
import subprocess
import sys

from tests.conftest import ROOT

_TRAIN_IMPORT = re.compile(r"^\s*(from mmrl\.train|import mmrl\.train)", re.M)


def test_core_components_and_algorithms_import_without_the_training_package():
    code = (
        "import sys, mmrl.core, mmrl.core.reward, mmrl.core.component_config, mmrl.core.weights, mmrl.core.statistics, mmrl.algo;"
        "import mmrl.envs, mmrl.policies, mmrl.rewards, mmrl.samplers;"
        "bad = sorted(m for m in sys.modules if m.startswith('mmrl.train'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_core_env_policy_sampler_or_reward_module_imports_the_training_package():
    folders = [ROOT / "mmrl" / "core", ROOT / "mmrl" / "samplers", ROOT / "envs", ROOT / "policies", ROOT / "rewards"]
    offenders = [str(p.relative_to(ROOT)) for folder in folders for p in folder.rglob("*.py") if _TRAIN_IMPORT.search(p.read_text())]
    assert not offenders


# ------------------------------------------------------------------ the import graph, function-level imports included

_PACKAGES = {"mmrl": ROOT / "mmrl", "mmrl.envs": ROOT / "envs", "mmrl.policies": ROOT / "policies", "mmrl.rewards": ROOT / "rewards"}


def _modules() -> dict[str, Path]:
    """Every mmrl module (dotted name -> file), as installed: envs/, policies/, rewards/ are
    mmrl.envs, mmrl.policies, mmrl.rewards."""
    found = {}
    for package, folder in _PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _import_graph() -> dict[str, set[str]]:
    """module -> the mmrl modules it imports anywhere in its file (top level or inside a function)."""
    import ast

    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names if a.name.startswith("mmrl")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{base}" if base else parent
                if base.startswith("mmrl"):  # `from pkg import module` imports the module
                    targets |= {owner(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else owner(base) for a in node.names}
        graph[name] = targets - {None, name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_closed_inside_a_function():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_mmrl_modules():
    graph = _import_graph()
    assert "mmrl.train.trainer" in graph and "mmrl.data.sources" in graph["mmrl.train.run_config"]  # the parse sees imports
    assert _cycles(graph) == []


def test_core_algo_and_train_import_no_demo_world_and_no_plugin():
    """mmrl/core, mmrl/algo and mmrl/train import no demo world (mmrl.tasks) and no plugin
    package (mmrl.envs, mmrl.policies, mmrl.rewards), not even inside a function."""
    forbidden = ("mmrl.tasks", "mmrl.envs", "mmrl.policies", "mmrl.rewards")
    offenders = {
        name: sorted(t for t in targets if t.startswith(forbidden))
        for name, targets in _import_graph().items()
        if name.startswith(("mmrl.core", "mmrl.algo", "mmrl.train")) and any(t.startswith(forbidden) for t in targets)
    }
    assert offenders == {}


def test_no_role_imports_the_loop_and_the_rollout_workers_import_nothing_of_training():
    graph = _import_graph()
    assert "mmrl.train.trainer" not in graph["mmrl.train.learner"]
    rollout = {name: targets for name, targets in graph.items() if name.startswith("mmrl.rollout")}
    assert rollout and not any(t.startswith("mmrl.train") for targets in rollout.values() for t in targets)


def test_the_core_imports_nothing_that_builds_on_it_not_even_inside_a_function():
    """mmrl/core stands above algo, data, samplers, rollout and train: it imports none of them."""
    above = ("mmrl.algo", "mmrl.data", "mmrl.samplers", "mmrl.rollout", "mmrl.train")
    offenders = {
        name: sorted(t for t in targets if t.startswith(above))
        for name, targets in _import_graph().items()
        if name.startswith("mmrl.core") and any(t.startswith(above) for t in targets)
    }
    assert offenders == {}
