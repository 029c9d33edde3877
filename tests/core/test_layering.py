"""The core stands alone: envs, policies, samplers and rewards build on mmrl.core, and
nothing in mmrl.core pulls in the training package."""

import subprocess
import sys

from tests.conftest import ROOT


def test_core_and_components_import_without_the_training_package():
    code = (
        "import sys, mmrl.core, mmrl.core.reward, mmrl.core.config, mmrl.core.weights, mmrl.algo;"
        "bad = sorted(m for m in sys.modules if m.startswith('mmrl.train'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_core_module_names_the_training_package():
    import re

    imports = re.compile(r"^\s*(from mmrl\.train|import mmrl\.train)", re.M)
    offenders = [p.name for p in (ROOT / "mmrl" / "core").glob("*.py") if imports.search(p.read_text())]
    assert not offenders
