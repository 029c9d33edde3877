"""The env sampler on a simulator that returns torch tensors (ManiSkill: on its CPU or GPU
backend's device) keeps observations, actions, rewards and flags as tensors on that device,
and collects what the NumPy path collects from the same episodes."""

import numpy as np
import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.weights import build_policy
from mmrl.core.sampler import sampler_context
from mmrl.samplers.env import EnvSampler
from mmrl.train.run_config import TrainConfig


def _convert(x, to):
    if isinstance(x, dict):
        return {k: _convert(v, to) for k, v in x.items()}
    if to == "numpy" and isinstance(x, torch.Tensor):
        return x.cpu().numpy()
    if to == "torch" and isinstance(x, np.ndarray) and x.dtype != object and x.dtype.kind != "U":
        return torch.from_numpy(x.copy())
    return x


class Converted:
    """A vector env whose every batch (observations, rewards, flags, info arrays) comes back as
    NumPy arrays (``to="numpy"``) or torch tensors (``to="torch"``); it hands the inner env
    actions of the inner env's own kind, and records the kind of actions it was given."""

    def __init__(self, env, to: str, inner_takes: str):
        self.env, self.to, self.inner_takes, self.actions = env, to, inner_takes, []

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return _convert(obs, self.to), _convert(info, self.to)

    def step(self, action):
        self.actions.append(type(action))
        action = torch.as_tensor(action) if self.inner_takes == "torch" else np.asarray(action.cpu() if isinstance(action, torch.Tensor) else action)
        return tuple(_convert(x, self.to) for x in self.env.step(action))


def _same_rollouts(a, b):
    for name in ("old_logp", "mask", "step_rewards", "group_id"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    for key in ("success", "return", "length", "truncated"):
        assert torch.equal(a.info[key].cpu(), b.info[key].cpu()), key
    assert set(a.info.get("costs", {})) == set(b.info.get("costs", {}))
    for name, value in a.info.get("costs", {}).items():
        assert value.dtype == b.info["costs"][name].dtype == torch.float64 and torch.equal(value, b.info["costs"][name]), name
    flat = lambda r: [v for v in r.values()] if isinstance(r, dict) else [r]  # noqa: E731
    for x, y in zip(flat(a.replay), flat(b.replay)):
        if isinstance(x, dict):
            for k in x:
                assert torch.equal(x[k].cpu(), y[k].cpu()), k
        else:
            assert torch.equal(x.cpu(), y.cpu())


def _collect_both(cfg, inner_takes: str, kinds=("numpy", "torch"), groups=2):
    """The same groups of step 3, collected from the env as NumPy arrays and as tensors."""
    out = {}
    for kind in kinds:
        sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
        try:
            torch.manual_seed(0)
            policy = build_policy(cfg.policy, sampler.policy_spec())
            sampler.env = Converted(sampler.env, kind, inner_takes)
            out[kind] = (sampler.collect(policy, num_groups=groups, group_size=2, step=3, group_offset=1), sampler.env.actions, sampler.env_steps)
        finally:
            sampler.close()
    return out


@pytest.mark.filterwarnings("ignore:__array_wrap__:DeprecationWarning")
def test_maniskill_tensors_stay_tensors_and_collect_what_the_numpy_path_collects():
    pytest.importorskip("mani_skill", reason="mani_skill is not installed (pip install 'mmrl[maniskill]')")
    cfg = from_dict(TrainConfig, {
        "env": {"type": "maniskill", "id": "PushCube-v1", "num_envs": 4},
        "policy": {"type": "gaussian_mlp", "hidden_sizes": [16]},
        "sampler": {"type": "env", "max_decisions": 6},
        "rewards": [{"type": "return"}],
        "algo": {"group_size": 2, "groups_per_step": 2},
    })
    out = _collect_both(cfg, "numpy")
    (numpy_rollout, numpy_actions, numpy_steps), (torch_rollout, torch_actions, torch_steps) = out["numpy"], out["torch"]
    assert set(numpy_actions) == {np.ndarray} and set(torch_actions) == {torch.Tensor}  # no NumPy round trip on the tensor path
    assert numpy_steps == torch_steps == 6 * 4
    assert torch_rollout.mask.sum() > 0
    _same_rollouts(numpy_rollout, torch_rollout)


def test_the_tabletop_through_tensors_collects_what_it_collects_through_numpy():
    pytest.importorskip("mujoco")
    cfg = from_dict(TrainConfig, {
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "kwargs": {"task": "spatial", "image_size": 32}},
        "policy": {"type": "flow_vla", "action_chunk": 2, "denoising": {"num_inference_steps": 2},
                   "backbone": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 16], "patch_grid": 4}},
        "sampler": {"type": "env", "max_decisions": 4},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 2},
    })
    out = _collect_both(cfg, "numpy")
    (numpy_rollout, numpy_actions, _), (torch_rollout, torch_actions, _) = out["numpy"], out["torch"]
    assert set(numpy_actions) == {np.ndarray} and set(torch_actions) == {torch.Tensor}
    _same_rollouts(numpy_rollout, torch_rollout)
    assert isinstance(torch_rollout.info["success"], torch.Tensor) and torch_rollout.info["costs"]  # the tabletop reports costs


def _partition(keys: torch.Tensor) -> list[list[int]]:
    """Which (sample, decision) cells share a key: the grouping GiGPO reads, whatever the key values."""
    flat = keys.flatten().tolist()
    first = {}
    return sorted(sorted(i for i, k in enumerate(flat) if k == key) for key in {k: first.setdefault(k, i) for i, k in enumerate(flat)})


def test_the_tensor_path_keeps_final_observations_and_state_keys_without_a_per_env_loop(monkeypatch):
    """At thousands of worlds the step path must not loop over envs in Python: on a simulator's
    tensors, the final observations (a critic's bootstrap), the observations episodes ended at
    and the state keys are batch operations. The NumPy path's per-env rows are the reference."""
    pytest.importorskip("mujoco")
    import mmrl.samplers.env as env_module

    cfg = from_dict(TrainConfig, {
        "env": {"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 4, "max_episode_steps": 5},
        "policy": {"type": "gaussian_mlp", "hidden_sizes": [16]},
        "sampler": {"type": "env", "max_decisions": 8},
        "rewards": [{"type": "return"}],
        "algo": {"group_size": 2, "groups_per_step": 2},
    })
    out = {}
    for kind in ("numpy", "torch"):
        sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
        try:
            torch.manual_seed(0)
            policy = build_policy(cfg.policy, sampler.policy_spec())
            sampler.env = Converted(sampler.env, kind, "numpy")
            sampler.state_keys = True
            if kind == "torch":
                def no_rows(obs, e):
                    raise AssertionError("a per-env row was taken on the tensor path")

                monkeypatch.setattr(env_module, "observation_row", no_rows)
            _, rollout = sampler._run_wave(policy, [11, 12, 13, 14], torch.Generator().manual_seed(1), deterministic=False, final=True)
            out[kind] = rollout
        finally:
            monkeypatch.undo()
            sampler.close()
    a, b = out["numpy"], out["torch"]
    _same_rollouts(a, b)
    assert a.info["length"].max() == 5  # the time limit ended episodes inside the wave
    for x, y in zip(a.info["final_replay"].values() if isinstance(a.info["final_replay"], dict) else [a.info["final_replay"]],
                    b.info["final_replay"].values() if isinstance(b.info["final_replay"], dict) else [b.info["final_replay"]]):
        assert torch.equal(torch.as_tensor(x).cpu(), torch.as_tensor(y).cpu())
    assert b.info["state_keys"].shape == a.info["state_keys"].shape
    assert _partition(b.info["state_keys"]) == _partition(a.info["state_keys"])


def test_tensor_state_keys_are_equal_for_equal_rows_only():
    from mmrl.samplers.env import tensor_state_keys

    obs = {"state": torch.tensor([[0.5, 1.0], [0.5, 1.0], [0.5, -1.0]]), "image": torch.zeros(3, 2, 2, 3, dtype=torch.uint8)}
    keys = tensor_state_keys(obs)
    assert keys.dtype == torch.int64 and keys.shape == (3,)
    assert keys[0] == keys[1] and keys[0] != keys[2]
    obs["image"][1, 0, 0, 0] = 1  # one byte of one camera differs
    assert tensor_state_keys(obs)[0] != tensor_state_keys(obs)[1]
    assert torch.equal(tensor_state_keys(obs), tensor_state_keys({k: v.clone() for k, v in obs.items()}))  # the same in every call
