"""The core stands alone: envs, policies, samplers and rewards build on mmrl.core, and
nothing in mmrl.core pulls in the training package."""

import re
import subprocess
import sys

from tests.conftest import ROOT

_TRAIN_IMPORT = re.compile(r"^\s*(from mmrl\.train|import mmrl\.train)", re.M)


def test_core_components_and_algorithms_import_without_the_training_package():
    code = (
        "import sys, mmrl.core, mmrl.core.reward, mmrl.core.config, mmrl.core.weights, mmrl.core.statistics, mmrl.algo;"
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
