"""The yardstick PPO of benchmarks/pushcube_plain_ppo.py: its advantages, against hand computations."""

import runpy
from pathlib import Path

import torch

SCRIPT = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "pushcube_plain_ppo.py"))
advantages, GAMMA, LAM = SCRIPT["advantages"], SCRIPT["GAMMA"], SCRIPT["LAM"]


def _two_steps():
    r = torch.tensor([[0.3], [0.7]])
    v = torch.tensor([[0.5], [0.2]])
    zeros = torch.zeros(2, 1)
    return r, v, zeros, torch.zeros(1), torch.tensor([0.9])


def test_plain_gae_is_the_usual_recursion():
    r, v, zeros, next_done, next_v = _two_steps()
    adv = advantages(r, v, zeros, zeros, next_done, next_v, finite_horizon=False)
    a1 = 0.7 + GAMMA * 0.9 - 0.2
    a0 = 0.3 + GAMMA * 0.2 - 0.5 + GAMMA * LAM * a1
    torch.testing.assert_close(adv[:, 0], torch.tensor([a0, a1]))


def test_finite_horizon_gae_weighs_the_n_step_returns_by_normalized_powers_of_lambda():
    r, v, zeros, next_done, next_v = _two_steps()
    adv = advantages(r, v, zeros, zeros, next_done, next_v, finite_horizon=True)
    one_step, two_step = 0.3 + GAMMA * 0.2, 0.3 + GAMMA * 0.7 + GAMMA**2 * 0.9
    a0 = (one_step + LAM * two_step) / (1 + LAM) - 0.5
    torch.testing.assert_close(adv[:, 0], torch.tensor([a0, 0.7 + GAMMA * 0.9 - 0.2]))


def test_an_ended_episode_is_bootstrapped_from_its_final_value_and_cut_from_the_next():
    r, v, _, _, next_v = _two_steps()
    dones = torch.tensor([[0.0], [1.0]])  # the env reset before step 1: step 0 ended an episode
    final = torch.tensor([[0.4], [0.0]])  # the critic's value of that episode's final observation
    for finite in (False, True):
        adv = advantages(r, v, dones, final, torch.zeros(1), next_v, finite_horizon=finite)
        torch.testing.assert_close(adv[0, 0], torch.tensor(0.3 + GAMMA * 0.4 - 0.5))
