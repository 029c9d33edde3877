"""mmrl's forward of a LeRobot SmolVLA checkpoint against LeRobot 0.4.4's own code (docs/parity.md,
"LeRobot SmolVLA").

LeRobot pins torch < 2.11 and transformers < 5, so it lives in a venv of its own
(``make lerobot-venv``) and writes its reference into a directory beforehand
(``tests/parity/lerobot_smolvla_reference.py``); ``make parity-lerobot`` does both and runs
this file. Here, in mmrl's .venv, the directory named by ``MMRL_LEROBOT_REFERENCE`` is read:
the tiny random policy LeRobot built and saved (``policy/``), the observation, the noise, and
what LeRobot computed from them. Without it every test is skipped; with
``MMRL_REQUIRE_LEROBOT=1`` a missing reference (or LeRobot venv, for the export test) fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REFERENCE_ENV = "MMRL_LEROBOT_REFERENCE"
REQUIRE_ENV = "MMRL_REQUIRE_LEROBOT"
ROOT = Path(__file__).resolve().parents[2]
REFERENCE_SCRIPT = Path(__file__).with_name("lerobot_smolvla_reference.py")
LEROBOT_VERSION = "0.4.4"
# the main case is the reference directory itself; the others are its subdirectories
CASES = ["main", "sparse_expert"]
# Un-normalized actions [B, chunk, A] of size ~1 (std 1.3, max |a| 4.3) after a 3-4-layer
# VLM prefix and 3-4 Euler steps of the expert, in float32, by two implementations of the same
# eager math (torch 2.10 there, 2.13 here). Measured (docs/parity.md): 0 when both sides run
# the same CPU kernels; 4.8e-7 (1 ulp at 4) with mmrl's side under ATEN_CPU_CAPABILITY=default
# or avx2 and LeRobot's under avx512. The bound is 20x that, far below any semantic difference:
# transformers 5's vision position ids instead of 4.57's move the actions by 0.1.
ACTIONS_ATOL = 1e-5
# the normalized state and the un-normalization are one elementwise op each
ELEMENTWISE_ATOL = 1e-6

pytestmark = pytest.mark.numerics


def _unavailable(problem: str):
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{problem} ({REQUIRE_ENV}=1; `make lerobot-venv parity-lerobot` writes it)", pytrace=False)
    pytest.skip(problem)


def _reference_root() -> Path:
    value = os.environ.get(REFERENCE_ENV)
    if not value:
        _unavailable(f"{REFERENCE_ENV} is not set: it names the directory tests/parity/lerobot_smolvla_reference.py wrote")
    root = Path(value)
    if not (root / "reference.json").is_file():
        _unavailable(f"{REFERENCE_ENV}={value} has no reference.json: run tests/parity/lerobot_smolvla_reference.py --out {value}")
    return root


class Case:
    """One reference directory: LeRobot's policy, the inputs and what LeRobot computed."""

    def __init__(self, directory: Path):
        from safetensors.torch import load_file

        self.dir = directory
        self.meta = json.loads((directory / "reference.json").read_text())
        self.t = load_file(str(directory / "reference.safetensors"))
        self.policy_dir = directory / "policy"
        self.vlm_dir = self.meta["vlm_dir"]
        if self.meta["versions"]["lerobot"] != LEROBOT_VERSION:
            _unavailable(f"{directory} was written by lerobot {self.meta['versions']['lerobot']}; this test is about {LEROBOT_VERSION}")

    def observation(self) -> dict:
        """LeRobot's raw batch: observation.images.<name> [B, 3, H, W] in [0, 1],
        observation.state [B, D], task list[str]."""
        obs = {k: v.clone() for k, v in self.t.items() if k.startswith("observation.")}
        obs["task"] = list(self.meta["tasks"])
        return obs


@pytest.fixture(scope="module", params=CASES)
def case(request) -> Case:
    root = _reference_root()
    directory = root if request.param == "main" else root / request.param
    if not (directory / "reference.json").is_file():
        _unavailable(f"{directory} has no reference.json (an older reference script?)")
    return Case(directory)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_reference_is_reproducible(case):
    """LeRobot's own run: deterministic given the noise, and the same after its own loaders
    read the saved directory back (strict load); else nothing below is meaningful."""
    assert case.meta["deterministic"] and case.meta["repeat_max_abs_diff"] == 0.0
    assert case.meta["reloaded_equal"]
    torch.testing.assert_close(case.t["reloaded.actions"], case.t["actions"], rtol=0, atol=0)


def test_tokenizer_reads_the_same_ids(case):
    """The VLM directory's tokenizer under mmrl's transformers gives LeRobot's token ids and
    mask for LeRobot's call (task + "\\n", right padding to the longest, truncation at
    tokenizer_max_length, the tokenizer's own special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(case.vlm_dir)
    tasks = [t if t.endswith("\n") else t + "\n" for t in case.meta["tasks"]]
    out = tokenizer(tasks, max_length=case.meta["config"]["tokenizer_max_length"], truncation=True, padding="longest", padding_side="right", return_tensors="pt")
    assert torch.equal(out["input_ids"], case.t["pre.observation.language.tokens"])
    assert torch.equal(out["attention_mask"].bool(), case.t["pre.observation.language.attention_mask"])


def test_statistics_normalize_as_lerobot(case):
    """mmrl's reading of the processors' statistics: the state LeRobot's preprocessor
    normalized, and the actions its postprocessor un-normalized."""
    from mmrl.policies.vla.lerobot_format import read_lerobot_policy

    files = read_lerobot_policy(case.policy_dir)
    pre = files.normalizer("preprocessor", "normalizer_processor")
    post = files.normalizer("postprocessor", "unnormalizer_processor")
    state = pre.normalize("observation.state", case.t["observation.state"])
    assert _max_diff(state, case.t["pre.observation.state"]) <= ELEMENTWISE_ATOL
    actions = post.unnormalize("action", case.t["actions_normalized"])
    assert _max_diff(actions, case.t["actions"]) <= ELEMENTWISE_ATOL


def test_actions_equal_lerobots(case):
    """The whole chain: LeRobot's preprocessor -> predict_action_chunk(noise) ->
    postprocessor against mmrl's lerobot_actions on the same raw observation and noise."""
    from mmrl.policies.smolvla import lerobot_actions

    ours = lerobot_actions(str(case.policy_dir), case.observation(), case.t["noise"].clone(), vlm_dir=case.vlm_dir)
    theirs = case.t["actions"]
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    diff = _max_diff(ours, theirs)
    print(f"{case.meta['case']}: max |mmrl - LeRobot| = {diff:.3g} (actions up to {theirs.abs().max().item():.3g})")
    assert diff <= ACTIONS_ATOL, (
        f"mmrl's actions differ from LeRobot's by {diff:.3g} (> {ACTIONS_ATOL}); "
        f"{case.dir / 'reference.safetensors'} holds LeRobot's intermediates to find the stage: "
        "pre.* (normalized state, token ids, mask), prepared.image.<i> (resized, padded, in [-1, 1]), prepared.state, "
        "image_embedding.<i> (vision + connector), prefix.* (embeddings, pad and attention masks), velocity [step, B, chunk, max_action_dim], actions_normalized"
    )


def _mmrl_policy(case: Case):
    """mmrl's SmolVLAPolicy on the reference's LeRobot directory, as ``lerobot_actions`` builds it."""
    from mmrl.policies.smolvla import SmolVLAConfig, SmolVLAPolicy

    cameras = list(case.meta["cameras"])
    _, h, w = case.meta["cameras"][cameras[0]]
    state_dim = case.t["observation.state"].shape[-1]
    spec = {"action_dim": case.t["actions"].shape[-1], "state_dim": state_dim, "image_shape": [len(cameras), h, w, 3]}
    return SmolVLAPolicy(SmolVLAConfig(checkpoint=str(case.policy_dir), vlm_dir=case.vlm_dir, cameras=cameras), spec).eval()


def test_stages_equal_lerobots(case):
    """Each stage of mmrl's forward fed LeRobot's own input of that stage, so that a mismatch
    of the actions points at one: vision tower + connector, prefix embeddings, the VLM and
    expert velocity at every denoising step. (Tied to the module layout of
    mmrl.policies.smolvla.model; skipped if that moved.)"""
    t = case.t
    policy = _mmrl_policy(case)
    try:
        vlm = policy.model.vlm_with_expert
        n_images = len([k for k in t if k.startswith("prepared.image.")])
        diffs = {}
        with torch.no_grad():
            for i in range(n_images):
                diffs[f"image_embedding.{i}"] = _max_diff(vlm.embed_image(t[f"prepared.image.{i}"]), t[f"image_embedding.{i}"])
            masks = [torch.ones(t["prepared.state"].shape[0], dtype=torch.bool)] * n_images
            embeds, pad, blocks = policy.model.embed_prefix(
                [t[f"prepared.image.{i}"] for i in range(n_images)], masks, t["pre.observation.language.tokens"], t["pre.observation.language.attention_mask"], t["prepared.state"], policy.special_ids
            )
            diffs["prefix.embeddings"] = _max_diff(embeds, t["prefix.embeddings"])
            assert torch.equal(pad, t["prefix.pad_mask"]) and torch.equal(blocks, t["prefix.att_mask"])
            memory = vlm.expert_memory(vlm.prefix(t["prefix.embeddings"], t["prefix.pad_mask"], t["prefix.att_mask"]))
            steps = t["velocity"].shape[0]
            x, dt = t["noise"].clone(), -1.0 / steps
            for k in range(steps):
                v = policy.model.velocity(x, torch.tensor(1.0 + k * dt, dtype=torch.float32).expand(x.shape[0]), memory, t["prefix.pad_mask"])
                diffs[f"velocity[{k}]"] = _max_diff(v, t["velocity"][k])
                x = x + dt * v
    except AttributeError as e:
        pytest.skip(f"mmrl.policies.smolvla.model's layout changed ({e}); the stage-by-stage check needs updating")
    bad = {k: f"{v:.3g}" for k, v in diffs.items() if v > ACTIONS_ATOL}
    assert not bad, f"stages that differ from LeRobot's (max |diff|): {bad}"


def test_state_dict_keys_are_the_files(case):
    """Every tensor of model.safetensors is loaded by mmrl (as stored), and mmrl holds no
    other: its LeRobot-named state dict is the file's."""
    from safetensors.torch import load_file

    stored = load_file(str(case.policy_dir / "model.safetensors"))
    loaded = _mmrl_policy(case).lerobot_state_dict()
    assert set(loaded) == set(stored), {"only in mmrl": sorted(set(loaded) - set(stored)), "only in the file": sorted(set(stored) - set(loaded))}
    changed = [k for k in stored if not torch.equal(loaded[k], stored[k])]
    assert not changed, changed


def _lerobot_python() -> Path:
    python = Path(os.environ.get("MMRL_LEROBOT_PYTHON", ROOT / ".venv-lerobot" / "bin" / "python"))
    if not python.exists():
        _unavailable(f"no LeRobot venv at {python} (make lerobot-venv; or set MMRL_LEROBOT_PYTHON)")
    return python


def test_mmrl_export_is_read_by_lerobot(case, tmp_path):
    """The reverse direction: mmrl's policy with every weight moved (as fine-tuning would),
    written by ``save_lerobot_policy`` and loaded by LeRobot's own loaders
    (``SmolVLAPolicy.from_pretrained(strict=True)``, ``make_pre_post_processors``), gives
    the actions mmrl computes with those weights."""
    from safetensors.torch import load_file

    from mmrl.policies.smolvla import lerobot_actions, save_lerobot_policy

    python = _lerobot_python()
    policy = _mmrl_policy(case)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=g))
    exported = save_lerobot_policy(policy, tmp_path / "exported")
    out = tmp_path / "lerobot_actions.safetensors"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    run = subprocess.run(
        [str(python), str(REFERENCE_SCRIPT), "--load", str(exported), "--inputs", str(case.dir), "--vlm", case.vlm_dir, "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert run.returncode == 0, f"LeRobot could not load mmrl's export:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    theirs = load_file(str(out))["actions"]
    assert _max_diff(theirs, case.t["actions"]) > 1e-3, "LeRobot's actions did not change: were the moved weights written?"
    in_memory = policy.lerobot_chunk(case.observation(), case.t["noise"].clone())
    reread = lerobot_actions(str(exported), case.observation(), case.t["noise"].clone(), vlm_dir=case.vlm_dir)
    assert _max_diff(reread, in_memory) == 0.0, "mmrl reads back other weights than it wrote"
    assert _max_diff(in_memory, theirs) <= ACTIONS_ATOL


def test_missing_reference_skips_unless_required(monkeypatch):
    monkeypatch.delenv(REFERENCE_ENV, raising=False)
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=REFERENCE_ENV):
        _reference_root()
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=REQUIRE_ENV):
        _reference_root()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
