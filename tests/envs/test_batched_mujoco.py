"""The batched-MJCF base (envs/batched_mujoco.py) through its second user,
examples/batched_reacher.py: a whole task in a few dozen lines, seeded worlds, same-step
resets, and the device and model arguments."""

import importlib.util

import mujoco
import numpy as np
import pytest
import torch

from mmrl.errors import ConfigError

from ..conftest import ROOT
from .test_warp_tabletop import require_warp


@pytest.fixture(scope="module")
def reacher():
    require_warp()
    spec = importlib.util.spec_from_file_location("batched_reacher", ROOT / "examples" / "batched_reacher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reacher_example_brings_most_arms_to_their_targets(reacher):
    assert reacher.main(worlds=16, device="cpu", steps=50) >= 0.75


def test_worlds_seeded_alike_start_alike_and_finished_worlds_reset_in_the_same_step(reacher):
    env = reacher.BatchedReacher(4, device="cpu")
    obs, _ = env.reset(seed=[3, 3, 4, 4])
    assert torch.equal(obs[0], obs[1]) and torch.equal(obs[2], obs[3]) and not torch.equal(obs[0], obs[2])
    assert isinstance(obs, torch.Tensor) and obs.device == env.device
    env.max_episode_steps = 2
    env.step(torch.zeros(4, 2))
    after, reward, terminated, truncated, info = env.step(torch.ones(4, 2))
    assert truncated.all() and info["_final"].all()
    assert (info["final_obs"][:, 3] != 0).all() and (after[:, :4] == 0).all()  # moving at the end; at rest after the reset
    assert not torch.equal(after[:, 4:], obs[:, 4:])  # new targets from each world's generator
    assert reward.shape == (4,) and reward.dtype == torch.float32


def test_the_model_comes_from_an_mjcf_string_a_file_or_an_mjmodel(reacher, tmp_path):
    from mmrl.envs.batched_mujoco import load_model

    path = tmp_path / "reacher.xml"
    path.write_text(reacher.REACHER)
    models = [load_model(reacher.REACHER), load_model(path), load_model(str(path)), load_model(mujoco.MjModel.from_xml_string(reacher.REACHER))]
    assert {m.nq for m in models} == {2} and {m.nmocap for m in models} == {1}


def test_the_device_defaults_to_cuda_where_warp_finds_one_and_an_unknown_one_names_the_field():
    require_warp()
    import warp

    from mmrl.envs.batched_mujoco import warp_device

    assert warp_device(None) == ("cuda:0" if warp.get_cuda_device_count() else "cpu")
    assert warp_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match=r"^env\.device: got 'cuda:7'"):
        warp_device("cuda:7", "env.device")
    with pytest.raises(ConfigError, match="autoreset"):
        from mmrl.envs.batched_mujoco import BatchedMujocoEnv
        from gymnasium import spaces

        box = spaces.Box(-1, 1, (1,), np.float32)
        BatchedMujocoEnv("<mujoco/>", 1, box, box, autoreset="next_step", device="cpu")
