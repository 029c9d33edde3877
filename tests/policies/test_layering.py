"""Families stand on shared ground, not on each other: a family imports shared modules
(``policies/*.py``, the folders in ``SHARED_FOLDERS``) and the families it declares in
``BASE_FAMILIES``, shared ground imports no family, and no ``_private`` name crosses a
folder. Imports inside functions count."""

import ast
from pathlib import Path

from mmrl.policies import BASE_FAMILIES, SHARED_FOLDERS
from tests.conftest import ROOT


def _bases(family: str, declared: dict[str, tuple[str, ...]]) -> set[str]:
    """The families ``family`` builds on: its declared bases and theirs."""
    found, todo = set(), list(declared.get(family, ()))
    while todo:
        base = todo.pop()
        if base not in found:
            found.add(base)
            todo.extend(declared.get(base, ()))
    return found


def _imports(path: Path, package: list[str], folders: set[str]):
    """(line, what is imported: a folder under policies/ or a top-level module, the names taken
    from it, whether this is an attribute read rather than an import) for each use of
    mmrl.policies in the file. A module bound by ``import`` or ``from mmrl.policies.B import
    module`` is followed: each attribute read from it is a name taken from B."""
    tree = ast.parse(path.read_text())
    bound = {}  # local name -> the folder of a policies module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            parts = base.split(".")
            if parts[:2] != ["mmrl", "policies"]:
                continue
            if len(parts) == 2:  # from mmrl.policies import <folder or module>
                for alias in node.names:
                    yield node.lineno, alias.name, [], False
                continue
            if parts[2] in folders:
                bound.update({alias.asname or alias.name: parts[2] for alias in node.names})
            yield node.lineno, parts[2], [alias.name for alias in node.names], False
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["mmrl", "policies"] and len(parts) > 2:
                    if alias.asname:
                        bound[alias.asname] = parts[2]
                    yield node.lineno, parts[2], [], False
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            yield node.lineno, bound[node.value.id], [node.attr], True


def layering_violations(policies: Path, declared: dict[str, tuple[str, ...]], shared_folders: tuple[str, ...]) -> list[str]:
    """Every import under ``policies`` that breaks the layering, as 'file:line: why'."""
    folders = {p.name for p in policies.iterdir() if (p / "__init__.py").exists()}
    found = []
    for path in sorted(policies.rglob("*.py")):
        rel = path.relative_to(policies)
        owner = rel.parts[0] if len(rel.parts) > 1 else None  # None: a shared module at the top
        shared = owner is None or owner in shared_folders
        where = f"{path.relative_to(policies.parent)}:"
        for line, target, names, attribute in _imports(path, ["mmrl", "policies", *rel.parts[:-1]], folders):
            family = target in folders and target not in shared_folders and target != owner
            if family and not attribute:
                if shared:
                    found.append(f"{where}{line}: shared ground imports the family {target}")
                elif target not in _bases(owner, declared):
                    found.append(f"{where}{line}: {owner} imports {target}, which is not a declared base (BASE_FAMILIES)")
            if target != owner:
                found += [f"{where}{line}: {owner or 'shared'} takes the private name {name} from {target}" for name in names if name.startswith("_") and not name.startswith("__")]
    return found


def test_families_import_only_shared_ground_and_their_declared_bases():
    assert layering_violations(ROOT / "policies", BASE_FAMILIES, SHARED_FOLDERS) == []


def test_declared_bases_and_shared_folders_are_folders_here():
    folders = {p.name for p in (ROOT / "policies").iterdir() if (p / "__init__.py").exists()}
    named = set(BASE_FAMILIES) | {b for bases in BASE_FAMILIES.values() for b in bases} | set(SHARED_FOLDERS)
    assert named <= folders, named - folders


def test_the_check_finds_a_private_name_and_an_undeclared_family(tmp_path):
    tmp_path = tmp_path / "p"
    for folder in ("a", "b", "c", "shared"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "helpers.py").write_text("def _inner():\n    from mmrl.policies.a.model import thing\n")
    (tmp_path / "a" / "model.py").write_text("from mmrl.policies.b.model import Public\nfrom mmrl.policies.shared.x import _hidden\n")
    (tmp_path / "c" / "model.py").write_text("def f():\n    from mmrl.policies.b import model\n    return model._helper, model.Public\n")
    (tmp_path / "b" / "model.py").write_text("from mmrl.policies.helpers import helper\nfrom mmrl.policies.shared import x\n")
    found = layering_violations(tmp_path, {"a": ("b",)}, ("shared",))
    assert found == [
        "p/a/model.py:2: a takes the private name _hidden from shared",
        "p/c/model.py:2: c imports b, which is not a declared base (BASE_FAMILIES)",
        "p/c/model.py:3: c takes the private name _helper from b",
        "p/helpers.py:2: shared ground imports the family a",
    ], found
