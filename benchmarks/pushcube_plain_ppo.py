"""A plain single-file PPO on ManiSkill3 PushCube-v1 from state, outside mmrl: the yardstick
for mmrl's value-baseline recipe (``configs/maniskill_pushcube_gae.yaml``) at the same data
budget.

    python benchmarks/pushcube_plain_ppo.py --seed 0                      # ManiSkill's ppo settings, 16 envs
    python benchmarks/pushcube_plain_ppo.py --seed 0 --partial-reset 0 --finite-horizon-gae 0 --target-kl 0 --obs-norm 1

Its defaults are the settings of ManiSkill's own PPO baseline (``examples/baselines/ppo`` in
the ManiSkill repository; written from its description, not its code): 3 x 256 tanh actor and
critic, orthogonal init, a state-independent log std from -0.5, Adam 3e-4 (eps 1e-5), gamma 0.8,
lambda 0.9, finite-horizon GAE, 4 epochs of 32 minibatches, advantages normalized per
minibatch, clip 0.2, value coefficient 0.5, gradient norm 0.5, target KL 0.1, no observation
normalization, and partial resets (an episode that succeeds ends and its env resets; every
ended episode is bootstrapped from the critic's value of its final observation). mmrl's
recipe's data budget is kept: 16 envs x 50 steps (800 decisions) per update, 100k env steps,
``pd_ee_delta_pos``, the ``normalized_dense`` reward. Every ``--eval-every`` updates, 100
evaluation episodes with the mean action (fixed seeds, success at any step of 50) print as
``eval_success``; one JSON line per update, ``--out`` writes them all.
"""

from __future__ import annotations

import argparse
import json

import gymnasium as gym
import numpy as np
import torch
from torch import nn

GAMMA, LAM, CLIP = 0.8, 0.9, 0.2


def make_env(ignore_terminations: bool):
    def thunk():
        import mani_skill.envs  # noqa: F401  (registers the tasks)
        from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

        env = gym.make("PushCube-v1", num_envs=1, obs_mode="state", control_mode="pd_ee_delta_pos", reward_mode="normalized_dense", sim_backend="cpu", max_episode_steps=50)
        return CPUGymWrapper(env, ignore_terminations=ignore_terminations)

    return thunk


def mlp(inp: int, out: int, head_gain: float) -> nn.Sequential:
    layers, width = [], inp
    for _ in range(3):
        layers += [nn.Linear(width, 256), nn.Tanh()]
        width = 256
    layers.append(nn.Linear(width, out))
    for i, layer in enumerate(m for m in layers if isinstance(m, nn.Linear)):
        nn.init.orthogonal_(layer.weight, head_gain if i == 3 else np.sqrt(2))
        nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class ObsNorm:
    """Running mean/variance of observations (off unless --obs-norm 1), clipped at 10 stds."""

    def __init__(self, dim: int, on: bool):
        self.on, self.mean, self.var, self.count = on, np.zeros(dim), np.ones(dim), 1e-4

    def update(self, x: np.ndarray) -> None:
        if not self.on:
            return
        m, v, n = x.mean(0), x.var(0), x.shape[0]
        delta, total = m - self.mean, self.count + n
        self.mean = self.mean + delta * n / total
        self.var = (self.var * self.count + v * n + delta**2 * self.count * n / total) / total
        self.count = total

    def __call__(self, x) -> torch.Tensor:
        x = np.asarray(x, dtype=np.float64)
        if self.on:
            x = np.clip((x - self.mean) / np.sqrt(self.var + 1e-8), -10, 10)
        return torch.as_tensor(x, dtype=torch.float32)


def advantages(rewards, values, dones, final_values, next_done, next_value, finite_horizon: bool):
    """GAE over [T, E] tensors. ``dones[t]``: the episode was reset before step t;
    ``final_values[t]``: the critic's value of the final observation of an episode that ended
    at step t (0 elsewhere). Finite-horizon GAE weighs the n-step returns an episode has by
    lambda^n normalized to sum 1, instead of giving the longest one the rest of the weight."""
    steps = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    coef = rew_sum = val_sum = torch.zeros_like(rewards[0])
    for t in reversed(range(steps)):
        not_done = 1.0 - (next_done if t == steps - 1 else dones[t + 1])
        nxt = next_value if t == steps - 1 else values[t + 1]
        next_v = not_done * nxt + final_values[t]
        if finite_horizon:
            coef, rew_sum, val_sum = coef * not_done, rew_sum * not_done, val_sum * not_done
            coef = 1.0 + LAM * coef
            rew_sum = LAM * GAMMA * rew_sum + coef * rewards[t]
            val_sum = LAM * GAMMA * val_sum + GAMMA * next_v
            adv[t] = (rew_sum + val_sum) / coef - values[t]
        else:
            last = rewards[t] + GAMMA * next_v - values[t] + GAMMA * LAM * not_done * last
            adv[t] = last
    return adv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=50, help="env steps per env per update")
    ap.add_argument("--total", type=int, default=100_000, help="env steps of training")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--minibatches", type=int, default=32)
    ap.add_argument("--partial-reset", type=int, default=1, help="1: success ends a training episode (ManiSkill's); 0: every episode runs 50 steps (mmrl's ignore_terminations)")
    ap.add_argument("--finite-horizon-gae", type=int, default=1)
    ap.add_argument("--target-kl", type=float, default=0.1, help="0: no early stop")
    ap.add_argument("--obs-norm", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    torch.set_num_threads(1)

    same_step = gym.vector.AutoresetMode.SAME_STEP
    envs = gym.vector.SyncVectorEnv([make_env(not args.partial_reset) for _ in range(args.envs)], autoreset_mode=same_step)
    eval_envs = gym.vector.SyncVectorEnv([make_env(True) for _ in range(10)], autoreset_mode=same_step)
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    critic, actor = mlp(obs_dim, 1, 1.0), mlp(obs_dim, act_dim, 0.01 * np.sqrt(2))
    log_std = nn.Parameter(torch.full((1, act_dim), -0.5))
    params = [*critic.parameters(), *actor.parameters(), log_std]
    opt = torch.optim.Adam(params, lr=3e-4, eps=1e-5)
    low, high = torch.as_tensor(envs.single_action_space.low), torch.as_tensor(envs.single_action_space.high)
    norm = ObsNorm(obs_dim, bool(args.obs_norm))

    def evaluate() -> float:
        success = []
        for wave in range(10):  # 100 episodes, the same seeds at every evaluation
            obs, _ = eval_envs.reset(seed=[10_000_000 + 10 * wave + i for i in range(10)])
            once = np.zeros(10, dtype=bool)
            for _ in range(50):
                with torch.no_grad():
                    action = actor(norm(obs)).clamp(low, high)
                obs, _, _, _, info = eval_envs.step(action.numpy())
                once |= np.asarray(info["success"], dtype=bool)
            success += once.tolist()
        return float(np.mean(success))

    T, E = args.steps, args.envs
    obs, _ = envs.reset(seed=[args.seed * 1000 + i for i in range(E)])
    next_done = torch.zeros(E)
    env_steps, log = 0, []
    for update in range(1, args.total // (T * E) + 1):
        b_obs, b_act = torch.zeros(T, E, obs_dim), torch.zeros(T, E, act_dim)
        b_logp, rewards, dones, values, final_values = (torch.zeros(T, E) for _ in range(5))
        ended = []
        for t in range(T):
            norm.update(np.asarray(obs))
            x = norm(obs)
            b_obs[t], dones[t] = x, next_done
            with torch.no_grad():
                mean = actor(x)
                dist = torch.distributions.Normal(mean, log_std.exp().expand_as(mean))
                action = dist.sample()
                b_logp[t], values[t] = dist.log_prob(action).sum(1), critic(x).flatten()
            b_act[t] = action
            obs, reward, terminated, truncated, info = envs.step(action.clamp(low, high).numpy())
            env_steps += E
            rewards[t] = torch.as_tensor(reward, dtype=torch.float32)
            done = np.logical_or(terminated, truncated)
            next_done = torch.as_tensor(done, dtype=torch.float32)
            for i in np.nonzero(done)[0]:  # every ended episode is bootstrapped (ManiSkill's choice)
                ended.append(bool(info["final_info"]["success"][i]))
                with torch.no_grad():
                    final_values[t, i] = critic(norm(info["final_obs"][i][None])).flatten()[0]
        with torch.no_grad():
            adv = advantages(rewards, values, dones, final_values, next_done, critic(norm(obs)).flatten(), bool(args.finite_horizon_gae))
            returns = adv + values
        flat = lambda v: v.reshape(T * E, *v.shape[2:])  # noqa: E731
        f_obs, f_act, f_logp, f_adv, f_ret = map(flat, (b_obs, b_act, b_logp, adv, returns))
        size = T * E // args.minibatches
        kls, stopped = [], False
        for _ in range(args.epochs):
            order = rng.permutation(T * E)
            for start in range(0, T * E, size):
                idx = torch.as_tensor(order[start : start + size])
                mean = actor(f_obs[idx])
                logp = torch.distributions.Normal(mean, log_std.exp().expand_as(mean)).log_prob(f_act[idx]).sum(1)
                log_ratio = logp - f_logp[idx]
                ratio = log_ratio.exp()
                with torch.no_grad():
                    kl = ((ratio - 1) - log_ratio).mean().item()
                if args.target_kl > 0 and kl > args.target_kl:
                    stopped = True
                    break
                kls.append(kl)
                a = f_adv[idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                policy_loss = torch.max(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP)).mean()
                value_loss = 0.5 * ((critic(f_obs[idx]).flatten() - f_ret[idx]) ** 2).mean()
                opt.zero_grad()
                (policy_loss + 0.5 * value_loss).backward()
                nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
            if stopped:
                break
        row = {"update": update, "env_steps": env_steps, "train_success": float(np.mean(ended)) if ended else None, "episodes": len(ended), "approx_kl": float(np.mean(kls)) if kls else 0.0, "log_std": log_std.mean().item()}
        if update % args.eval_every == 0 or update == args.total // (T * E):
            row["eval_success"] = evaluate()
        log.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
