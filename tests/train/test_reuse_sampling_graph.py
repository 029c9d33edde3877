"""``algo.reuse_sampling_graph``: with one on-policy pass the update backpropagates through the
log-probs that sampling computed (with grad, latents detached between steps) instead of
recomputing them. It must be the update the recompute gives — the same gradient as the
optimizer sees it, the same weights after the step — under idle-sample skipping, filters,
a KL term in the loss, micro-batches on the recompute side and gradient clipping."""

import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.component_config import RewardConfig
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer

pytest.importorskip("diffusers")
pytest.importorskip("cv2")

TRANSITIONS = {
    "ddim": {"transition": "ddim", "eta": 1.0},
    "flow_sde": {"transition": "flow_sde", "noise_level": 0.7},
}


@REWARDS.register("_test_image_mean_of_even_groups", config=RewardConfig)
def _image_mean_of_even_groups(rollout, cfg):
    """The images' mean intensity in even groups, a constant in odd ones (whose advantages
    are then all 0: samples the loss cannot see)."""
    mean = rollout.info["images"].double().mean(dim=(1, 2, 3)) / 255.0
    return torch.where(rollout.group_id % 2 == 0, mean, torch.full_like(mean, 0.5))


def _image(transition: str, **algo) -> TrainConfig:
    return from_dict(TrainConfig, {
        "name": "reuse", "seed": 0, "total_steps": 1,
        "policy": {"type": "image_diffusion", "tiny": {"resolution": 8}, "denoising": {**TRANSITIONS[transition], "num_inference_steps": 4}},
        "sampler": {"type": "prompt", "data": {"num_prompts": 3}, "batch_groups": 2},
        "rewards": [{"type": "_test_image_mean_of_even_groups"}],
        "algo": {"group_size": 3, "groups_per_step": 4, **algo},
        # a clip norm below the gradient's: clipping scales both updates
        "optim": {"lr": 1e-3, "max_grad_norm": 1e-3},
        "eval": {"every": 0, "at_end": False}, "log": {"progress": False, "tensorboard": False},
    })


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _one_step(cfg: TrainConfig, run_dir):
    """The gradient the optimizer steps on, the weights after the step, the metrics, and how
    often the policy recomputed log-probs."""
    trainer = Trainer(cfg, run_dir)
    recomputed = []
    log_prob = trainer.policy.log_prob
    trainer.policy.log_prob = lambda *a, **kw: recomputed.append(1) or log_prob(*a, **kw)
    grads = []
    step = trainer.learner.optimizer.step
    trainer.learner.optimizer.step = lambda *a, **kw: grads.append({n: p.grad.clone() for n, p in trainer.learner.model.named_parameters() if p.grad is not None}) or step(*a, **kw)
    metrics = trainer.rl_step(0)
    weights = {n: p.detach().clone() for n, p in trainer.learner.model.named_parameters()}
    return trainer, grads, weights, metrics, len(recomputed)


@pytest.mark.numerics
@pytest.mark.parametrize(
    "algo",
    [
        {},  # odd groups have advantage 0: the recompute leaves them out of its pass
        # the zero-variance filter drops the odd groups; a sampled KL in the loss; the recompute in pieces
        {"filters": [{"type": "zero_variance"}], "kl": {"type": "k3", "coef": 0.1}, "micro_batch_mb": 0.004},
    ],
    ids=["idle_samples", "filter_kl_pieces"],
)
@pytest.mark.parametrize("transition", sorted(TRANSITIONS))
def test_the_reused_sampling_graph_gives_the_recomputed_update(tmp_path, float64, transition, algo):
    results = {}
    for reuse in (True, False):
        trainer, grads, weights, metrics, recomputed = _one_step(_image(transition, reuse_sampling_graph=reuse, **algo), tmp_path / str(reuse))
        assert trainer.learner.reuse_graph is reuse
        results[reuse] = grads, weights, metrics, recomputed
    (g_reuse, w_reuse, m_reuse, n_reuse), (g_recompute, w_recompute, m_recompute, n_recompute) = results[True], results[False]
    assert n_reuse == 0 and n_recompute >= 1  # the hook ran no log_prob at all
    assert len(g_reuse) == len(g_recompute) == 1 and g_reuse[0].keys() == g_recompute[0].keys()
    scale = max(float(g.abs().max()) for g in g_recompute[0].values())
    assert scale > 1e-6
    for name, g in g_recompute[0].items():
        torch.testing.assert_close(g_reuse[0][name], g, rtol=0, atol=1e-10 * scale, msg=name)
    initial = Trainer(_image(transition, **algo), tmp_path / "initial").learner.model.state_dict()
    assert any(not torch.equal(w_recompute[name], initial[name]) for name in w_recompute)  # the step moved the weights
    for name, w in w_recompute.items():
        torch.testing.assert_close(w_reuse[name], w, rtol=1e-9, atol=1e-12, msg=name)
    assert m_reuse["grad_norm"] > 1e-3  # clipping engaged
    for key in ("loss/policy", "grad_norm", "objective/clipped"):
        assert m_reuse[key] == pytest.approx(m_recompute[key], rel=1e-8, abs=1e-12), key
    if "kl" in algo:
        assert m_reuse["kl/ref"] == pytest.approx(m_recompute["kl/ref"], rel=1e-8, abs=1e-12)
        assert m_reuse["filter/kept_fraction"] == 0.5


def test_auto_engages_for_one_pass_and_not_for_two_epochs(tmp_path):
    assert not Trainer(_image("ddim"), tmp_path / "default").learner.reuse_graph  # opt-in: it holds the whole sampling graph
    assert Trainer(_image("ddim", reuse_sampling_graph="auto"), tmp_path / "one").learner.reuse_graph
    trainer, grads, _, metrics, recomputed = _one_step(_image("ddim", ppo_epochs=2, reuse_sampling_graph="auto"), tmp_path / "two")
    assert not trainer.learner.reuse_graph and recomputed >= 2 and len(grads) == 2 and metrics["approx_kl"] > 0
    assert not Trainer(_image("ddim", num_minibatches=2, reuse_sampling_graph="auto"), tmp_path / "mb").learner.reuse_graph
    assert not Trainer(_image("ddim", micro_batches=2, reuse_sampling_graph="auto"), tmp_path / "pieces").learner.reuse_graph
    assert not Trainer(_image("ddim", kl={"type": "exact", "coef": 0.1}, reuse_sampling_graph="auto"), tmp_path / "exact").learner.reuse_graph  # its forward runs anyway
    assert not Trainer(_image("ddim", reuse_sampling_graph=False), tmp_path / "off").learner.reuse_graph


@pytest.mark.parametrize(
    ("algo", "message"),
    [
        ({"ppo_epochs": 2}, r"algo\.reuse_sampling_graph: got True; needs one on-policy pass \(ppo_epochs 1 and num_minibatches 1, got 2 and 1\)"),
        ({"num_minibatches": 2}, r"algo\.reuse_sampling_graph: got True; needs one on-policy pass \(ppo_epochs 1 and num_minibatches 1, got 1 and 2\)"),
        ({"micro_batches": 2}, r"algo\.reuse_sampling_graph: got True; .*micro_batches must be null or 1 \(got 2\)"),
    ],
)
def test_reusing_the_graph_where_it_cannot_be_exact_is_a_config_error(algo, message):
    with pytest.raises(ConfigError, match=message):
        _image("ddim", reuse_sampling_graph=True, **algo)


def test_reusing_the_graph_of_a_policy_that_cannot_keep_it_is_a_config_error(tmp_path):
    cfg = from_dict(TrainConfig, {
        "name": "tokens", "sampler": {"type": "prompt"}, "policy": {"type": "categorical_sequence"},
        "rewards": [{"type": "token_fraction", "token": 3}], "algo": {"reuse_sampling_graph": True},
        "log": {"progress": False, "tensorboard": False},
    })
    with pytest.raises(ConfigError, match=r"algo\.reuse_sampling_graph: got True; policy 'categorical_sequence' with sampler 'prompt' cannot keep the sampling graph"):
        Trainer(cfg, tmp_path / "run")
