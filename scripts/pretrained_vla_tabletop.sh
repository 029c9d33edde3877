#!/usr/bin/env bash
# demos -> pretraining of mmrl's own tiny VLM -> export -> few-shot SFT -> RL with a value
# baseline, on the tabletop spatial family (docs/vla.md, benchmarks/results/robots_tabletop.md). SEED picks
# the RL seed; the pretraining and SFT stages are shared by the seeds.
set -euo pipefail
cd "$(dirname "$0")/.."
MMRL=${MMRL:-.venv/bin/mmrl}
PY=${PY:-.venv/bin/python}
SEED=${SEED:-0}
[ -d runs/vlm/init_smolvlm64 ] || $PY -m mmrl.policies.vla.tiny_vlm --family smolvlm --out runs/vlm/init_smolvlm64 \
    --image-size 64 --patch-size 8 --vision-hidden-size 32 --hidden-size 64 --num-layers 2 --num-heads 4 --intermediate-size 128
[ -f demos/pretrain_object/index.json ] || $MMRL collect --task tabletop_object_nominal --episodes-per-task 50 --out demos/pretrain_object
[ -f demos/spatial_nominal/index.json ] || $MMRL collect --task tabletop_spatial_nominal --episodes-per-task 5 --out demos/spatial_nominal
[ -d runs/tabletop_vlm_pretrain/checkpoints ] || $MMRL train configs/tabletop_vlm_pretrain.yaml
[ -d runs/vlm/pretrained_smolvlm64 ] || $PY -m mmrl.policies.vla.pretrained export runs/tabletop_vlm_pretrain --out runs/vlm/pretrained_smolvlm64
[ -d runs/tabletop_spatial_vlm_token_vla_sft/checkpoints ] || $MMRL train configs/tabletop_spatial_vlm_token_vla_sft.yaml
$MMRL train configs/tabletop_spatial_vlm_token_vla_gae.yaml seed=$SEED --run-dir runs/tabletop_spatial_vlm_token_vla_gae_s$SEED
$MMRL eval runs/tabletop_spatial_vlm_token_vla_sft --suite tabletop_spatial_nominal --episodes 25
$MMRL eval runs/tabletop_spatial_vlm_token_vla_gae_s$SEED --suite tabletop_spatial_nominal --episodes 25
