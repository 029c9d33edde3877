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


# A flat red tile on two slide joints over a grey floor, seen straight down by "down" (image up
# = +y) and at an angle from the front by "side".
TILE = """
<mujoco>
  <visual><headlight ambient="0.4 0.4 0.4" diffuse="0.6 0.6 0.6" specular="0 0 0"/></visual>
  <worldbody>
    <camera name="side" pos="0 -0.8 0.7" xyaxes="1 0 0 0 0.6 0.8" fovy="60"/>
    <camera name="down" pos="0 0 1" xyaxes="1 0 0 0 1 0" fovy="60"/>
    <geom type="box" size="1 1 0.01" pos="0 0 -0.01" rgba="0.4 0.4 0.4 1"/>
    <body name="tile" pos="0 0 0.1">
      <joint name="x" type="slide" axis="1 0 0"/>
      <joint name="y" type="slide" axis="0 1 0"/>
      <geom name="tile" type="box" size="0.05 0.05 0.001" rgba="0.9 0.1 0.1 1" contype="0" conaffinity="0"/>
    </body>
  </worldbody>
</mujoco>
"""


def _red(images: torch.Tensor) -> torch.Tensor:
    rgb = images.int()
    return (rgb[..., 0] > 150) & (rgb[..., 1] < 80) & (rgb[..., 2] < 80)


def test_render_images_ray_traces_every_named_camera_of_every_world_where_qpos_puts_the_bodies():
    """The tile's centroid in "down" is its centre's pinhole projection: focal length
    32 / tan(30 deg) = 55.4 px at 64 px, 0.9 m from the camera to the tile; an outline pixel
    more or less on one side moves a ~36-pixel mask's centroid by at most half a pixel."""
    require_warp()
    from gymnasium import spaces

    from mmrl.envs.batched_mujoco import BatchedMujocoEnv

    places = [(0.0, 0.0), (0.2, 0.0), (0.0, -0.15)]

    class Tiles(BatchedMujocoEnv):
        def reset_worlds(self, worlds):
            self.qpos[worlds] = torch.tensor(places, dtype=self.qpos.dtype)[worlds]

        def observe(self):
            return self.render_images()

    box = spaces.Box(-1, 1, (2,), np.float32)
    env = Tiles(TILE, 3, box, box, device="cpu", cameras=["down", "side"], image_width=64, image_height=48)
    images, _ = env.reset(seed=0)  # no step: the images show the state the reset wrote
    assert images.shape == (3, 2, 48, 64, 3) and images.dtype == torch.uint8 and images.device == env.device
    focal = 24 / np.tan(np.radians(30))  # the vertical field of view spans the image's height
    for w, (x, y) in enumerate(places):
        rows, cols = _red(images[w, 0]).nonzero(as_tuple=True)
        assert abs(cols.float().mean().item() + 0.5 - (32 + focal * x / 0.9)) <= 0.5
        assert abs(rows.float().mean().item() + 0.5 - (24 - focal * y / 0.9)) <= 0.5
    assert _red(images[:, 1]).sum((1, 2)).min() > 0  # the side camera, second as named, sees it too
    env.qpos[0, 0] = 0.2  # a state written between steps is drawn too
    assert torch.equal(env.render_images()[0], images[1])
    tile = env.mj_model.geom("tile").id
    env.per_world("geom_rgba")[2, tile] = torch.tensor([0.1, 0.1, 0.9, 1.0])  # world 2's tile alone turns blue
    recoloured = env.render_images()
    assert not _red(recoloured[2]).any() and torch.equal(recoloured[:2], env.render_images()[:2]) and _red(recoloured[1]).any()
    with pytest.raises(ConfigError, match=r"^cameras: got \['down', 'top'\]"):
        Tiles(TILE, 1, box, box, device="cpu", cameras=["down", "top"])
    with pytest.raises(RuntimeError, match="cameras"):
        Tiles(TILE, 1, box, box, device="cpu").render_images()
