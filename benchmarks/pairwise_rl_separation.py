"""Does a learned reward still rank a policy's samples as the verifier does?

For each weights directory (an asset, a run directory) given, builds the policy of
configs/image_shapes_flow_grpo_pairwise.yaml with those weights, samples 16 stochastic images
per train and per held-out prompt (stream step 100, away from training's), scores them by
the config's two rewards (the pairwise model, the verifier) and prints the verifier
accuracy, the mean learned score, the mean score of verifier-correct and -wrong images and
the AUC (the probability that a correct image outscores a wrong one).

    .venv/bin/python benchmarks/pairwise_rl_separation.py assets/shapes_flow_sft runs/image_shapes_flow_grpo_pairwise
"""
import dataclasses, sys, torch, numpy as np
from mmrl import registry
from mmrl.config import load_config
from mmrl.core.reward import RewardContext, RewardSet
from mmrl.core.weights import build_policy
from mmrl.train.config import TrainConfig
from pathlib import Path
for weights in sys.argv[1:]:
    cfg = load_config(TrainConfig, 'configs/image_shapes_flow_grpo_pairwise.yaml', [f'policy.pretrained={weights}'])
    res = {}
    for split, src in (('train', cfg.sampler.data.train), ('held_out', cfg.sampler.data.eval)):
        s = registry.SAMPLERS.get('prompt')(dataclasses.replace(cfg.sampler, data=dataclasses.replace(cfg.sampler.data, train=src, eval=None)), cfg)
        torch.manual_seed(0)
        pol = build_policy(cfg.policy, s.policy_spec()).eval()
        rs = RewardSet(cfg.rewards, 'weighted_sum', RewardContext(device=torch.device('cpu'), run_dir=Path('.'), seed=0))
        with torch.no_grad():
            ro = s.collect(pol, len(s.data.train), 16, 100)
            sc = rs.score(ro).numpy()
        pw, ver = sc[:, 0], sc[:, 1]
        ok, bad = pw[ver == 1], pw[ver == 0]
        auc = float((ok[:, None] > bad[None, :]).mean()) if len(ok) and len(bad) else float('nan')
        print(weights, split, f"n={len(pw)} verifier={ver.mean():.3f} score={pw.mean():.3f} (sd {pw.std():.2f}) score|correct={ok.mean():.3f} score|wrong={bad.mean():.3f} AUC={auc:.3f}")
