"""``algo.loss: sac`` in two learner processes (DDP, gloo) against one: the same buffer, the
same batches, and the weights, critics, targets and temperature of one process's updates.

Run as a script, this file is the command line with float64 as the default dtype and the
gaussian_mlp policy's observations cast to it on entry (the policy computes in float32
otherwise): the policy, the critics, log α and the noise are float64."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import ROOT
from tests.train.test_sac import sac_config


def _float64_cli() -> int:
    torch.set_default_dtype(torch.float64)
    from mmrl.cli import main
    from mmrl.policies.gaussian_mlp.model import GaussianMLPPolicy

    normalize = GaussianMLPPolicy._normalize
    GaussianMLPPolicy._normalize = lambda self, obs: normalize(self, obs.to(torch.float64))
    return main()


def _final(run: Path, step: int) -> tuple[dict, dict]:
    at = run / "checkpoints" / f"step_{step:08d}"
    return load_file(str(at / "model.safetensors")), torch.load(at / "state.pt", weights_only=True)


PUSHER = {"intervener": {"type": "tests.train.test_interventions:FirstRowPusher", "kwargs": {"push": 0.5}}}


@pytest.mark.numerics
@pytest.mark.parametrize("sampler", [{}, PUSHER], ids=["plain", "intervened"])
def test_two_learner_processes_take_the_updates_of_one(tmp_path, sampler):
    """PointReach, 3 steps of 8 episodes, 100 transitions before the first update and then 0.1
    update a transition (about 13 updates at step 1, 16 at each of steps 2 and 3): after the
    first step with updates and at the end, two processes hold one process's policy, critics,
    targets, log α and buffer; plain, the two processes' run stops after step 2 and resumes from
    its checkpoint (written by process 0, read by both) for step 3. Intervened: an intervener takes over each wave's first env (one
    group in each process), so the demonstrations' buffer fills from both processes and half
    of every batch comes from it.

    Each process takes the mean over its half of a batch and the two are averaged, where one
    process takes the mean over the whole: the sums differ in rounding, ~1e-16 relative in
    float64. Adam's first steps are about lr·g/(|g| + eps) per entry, which turns a rounding
    difference δ of an entry g near 0 into up to lr·δ/eps = 1e-3 · 1e-17 / 1e-8 = 1e-12 of
    weight; over the 45 updates and the critics' feedback into their own targets we allow
    1e-10, where a real mismatch (another batch, another noise, a share's gradient left out of
    the average) moves a weight by ~lr = 1e-3. Measured: at most 1e-15 (ATEN_CPU_CAPABILITY
    default and avx2)."""
    # waves of 4 envs: each process's 4 groups are one of one process's two waves (the same episodes)
    data = sac_config(total_steps=3, loss={"learning_starts": 100, "utd": 0.1}, env={"num_envs": 4}, sampler=sampler, checkpoint={"every": 1, "keep": 3}, log={"progress": False, "tensorboard": False})
    path = tmp_path / "sac.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = str(Path(__file__).resolve())
    one = subprocess.run([sys.executable, script, "train", str(path), "--run-dir", str(tmp_path / "one")], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29539", script, "train"]
    runs = [[str(path), "--run-dir", str(tmp_path / "two")]]
    if not sampler:  # stop after step 2, resume for step 3
        runs = [runs[0] + ["total_steps=2"], [str(tmp_path / "two"), "total_steps=3", "--resume"]]
    for args in runs:
        two = subprocess.run(launch + args, capture_output=True, text=True, env=env, timeout=300)
        assert two.returncode == 0, two.stderr[-3000:]
    gap = 0.0  # the largest difference of a weight, critic, target, log α or transition
    for step in (1, 2, 3):
        (wa, sa), (wb, sb) = _final(tmp_path / "one", step), _final(tmp_path / "two", step)
        assert sa["loss"]["updates"] == sb["loss"]["updates"]
        if step == 1:
            assert 0 < sa["loss"]["updates"] < 20  # the first step with updates
            # sampled with the initial weights: the same transitions, bit for bit
            assert all(torch.equal(sa["replay_buffer"]["storage"][k], sb["replay_buffer"]["storage"][k]) for k in sa["replay_buffer"]["storage"])
        assert wa["net.0.weight"].dtype == torch.float64 and sa["loss"]["log_alpha"].dtype == torch.float64
        ba, bb = sa["replay_buffer"], sb["replay_buffer"]
        assert ba["size"] == bb["size"] > 0 and torch.equal(ba["generator"], bb["generator"]) and sa["loss"]["generator"].equal(sb["loss"]["generator"])
        pairs = [(wa[k], wb[k]) for k in wa] + [(sa["loss"]["log_alpha"], sb["loss"]["log_alpha"])]
        pairs += [(sa["loss"][part][k], sb["loss"][part][k]) for part in ("critics", "targets") for k in sa["loss"][part]]
        pairs += [(ba["storage"][k], bb["storage"][k]) for k in ba["storage"]]  # later steps sample with weights that differ in rounding
        if sampler:
            da, db = sa["demo_buffer"], sb["demo_buffer"]
            assert da["size"] == db["size"] > 0 and torch.equal(da["generator"], db["generator"]) and sa["loss"]["updates"] > 0
            pairs += [(da["storage"][k], db["storage"][k]) for k in da["storage"]]
        for a, b in pairs:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
            gap = max(gap, float((a.double() - b.double()).abs().max()) if a.numel() else 0.0)
    print(f"largest difference, two processes vs one: {gap:.1e}")
    assert not torch.equal(_final(tmp_path / "one", 1)[0]["net.0.weight"], wa["net.0.weight"])  # the weights did move


if __name__ == "__main__":
    sys.exit(_float64_cli())
