#!/usr/bin/env bash
# The checks that only a CUDA GPU can make, as one script of a few minutes (CI never runs it).
#
#   bash benchmarks/gpu_check.sh [checks...]      # default: tests bench train
#
# - tests: (TESTS="files..." to choose others, TESTS_WORKERS processes, 12 by default) the test files whose trainers, samplers and policies take `device: auto`, which is
#   CUDA on such a machine: pretrained-VLM VLAs (each family, LoRA, bf16), the critic and the
#   value head, the env sampler's device handling, the trainer. A failure here is a place where
#   mmrl's code assumes the CPU.
# - bench: benchmarks/vla_rollout_cost.py on the CPU and the GPU in one run at the tabletop
#   size, then the pretrained families at `--vlm-size base` on the GPU in float32 and bfloat16
#   (throughput and the PPO ratio's error on recompute); the flow VLA's chain eager against
#   compiled (policy.compile_denoiser: CUDA graphs on CUDA), decisions/s at B = 32 and 256.
# - train: a few updates of the object-family dense-reward GAE recipe with `device=cuda` and
#   `device=cpu`, seconds per update of each.
# - rl: the pretrained-backbone token VLA's GAE recipe on the spatial family
#   (configs/tabletop_spatial_vlm_token_vla_gae.yaml, from the SFT run that
#   scripts/pretrained_vla_tabletop.sh makes; carry runs/vlm/pretrained_smolvlm64 and
#   runs/tabletop_spatial_vlm_token_vla_sft) on CUDA, one run per seed in RL_SEEDS side by side,
#   each stopped by SIGTERM after RL_SECONDS (its checkpoint stays whole); their metrics go to $OUT.
# - warp: tabletop_warp on CUDA (MuJoCo Warp): env steps/s at 256 / 1,024 / 4,096 worlds (state)
#   and 256 / 1,024 (rgb), each against the CPU vector env's rate at 256; the env sampler against
#   stepping 4,096 worlds by hand (benchmarks/rollout_overhead.py); then one flow VLA
#   GRPO update (random weights) at 1,024 worlds with rgb frames on CUDA, and the same update at
#   64 CPU-env worlds on the CPU, seconds of sampling and of the update of each.
# - warp_gae: the state GAE recipe on tabletop_warp on CUDA (configs/tabletop_object_state_gae_warp.yaml)
#   from an SFT start made here (20 expert episodes per task, ~30 s), one run per seed in
#   RL_SEEDS side by side, each stopped by SIGTERM after WARP_SECONDS; seconds per update and the
#   evaluations go to $OUT (the CPU's curves of both backends: benchmarks/results/robots_tabletop.md).
# - warp_grpo: the same for the flow VLA's GRPO recipe from images
#   (configs/tabletop_spatial_flow_vla_grpo_warp.yaml, 16 groups per update as its CPU study)
#   from an SFT start made here (5 expert episodes per task, 1,500 steps).
# - versions: only the package versions (every call prints them first).
#
# Results go to $OUT (default /tmp/mmrl_gpu_check): log files and the benchmark tables.
#
# A machine that lacks packages mmrl needs gets them from two optional folders of the
# checkout, filled where an index is reachable (Python 3.12 wheels for x86-64):
#   .gpu/whl/  pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/whl \
#                gymnasium farama-notifications mujoco glfw pyopengl websockets transformers peft \
#                mujoco-warp==3.17.0 warp-lang==1.19.0
#   .gpu/gl/   Debian packages of the GL and Vulkan loaders (libegl1 libglvnd0 libopengl0
#              libgl1 libglx0 libgles2 libvulkan1), unpacked into / for MuJoCo's EGL renderer.
set -u
OUT=${OUT:-/tmp/mmrl_gpu_check}
mkdir -p "$OUT"
CHECKS=${*:-tests bench train}
stamp() { echo "== $* ($(date +%T))"; }

# rl_on_warp NAME "COLLECT ARGS" SFT_CONFIG RL_CONFIG [OVERRIDES...]: an SFT start on CUDA from
# expert demos, then one RL run per seed in RL_SEEDS side by side on tabletop_warp on CUDA, each
# stopped by SIGTERM after WARP_SECONDS; seconds per update and the evaluations go to $OUT.
rl_on_warp() {
    local name=$1 collect=$2 sft=$3 rl=$4 dir=/tmp/mmrl_$1
    shift 4
    stamp "$name: the SFT start on CUDA"
    python3 -m mmrl collect $collect --out $dir/demos 2>&1 | tail -1
    python3 -m mmrl train $sft --run-dir $dir/sft data.path=$dir/demos log.progress=false device=cuda 2>&1 | tail -1
    for seed in ${RL_SEEDS:-1 2 3}; do
        stamp "$name: $rl on tabletop_warp, CUDA, seed $seed, ${WARP_SECONDS:-240} s"
        timeout -s TERM ${WARP_SECONDS:-240} python3 -m mmrl train $rl --run-dir $dir/s$seed \
            seed=$seed device=cuda env.device=cuda policy.pretrained=$dir/sft log.progress=false "$@" > "$OUT/${name}_s$seed.log" 2>&1 &
    done
    wait
    for seed in ${RL_SEEDS:-1 2 3}; do
        cp $dir/s$seed/metrics.jsonl "$OUT/${name}_s$seed.metrics.jsonl"
        python3 -c "from mmrl.train.metrics import read_metrics; rows = read_metrics('$dir/s$seed'); print('seed $seed', [(r['step'], round(r['time/sample_s'], 2), round(r['time/step_s'], 2)) for r in rows if 'time/step_s' in r][-3:], [(r['step'], round(r['eval/success_rate'], 3)) for r in rows if 'eval/success_rate' in r])" 2>&1 | tee -a "$OUT/$name.txt"
    done
}

# A second call on the same machine (two checks side by side) finds the packages in place.
if [ -d .gpu/gl ] && [ ! -f /tmp/mmrl_gl.done ]; then
    for f in .gpu/gl/*.deb; do dpkg -x "$f" /; done
    ldconfig && touch /tmp/mmrl_gl.done
fi
if [ -d .gpu/whl ]; then
    if [ ! -f /tmp/mmrl_site/.done ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mmrl_site .gpu/whl/*.whl || exit 1
        touch /tmp/mmrl_site/.done
    fi
    export PYTHONPATH=/tmp/mmrl_site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MUJOCO_GL=egl PYOPENGL_PLATFORM=egl
[ -f /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json ] && export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json

stamp "versions"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import torch, transformers, gymnasium, mujoco
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
print("transformers", transformers.__version__, "gymnasium", gymnasium.__version__, "mujoco", mujoco.__version__)
EOF

for check in $CHECKS; do
    case $check in
    tests)
        stamp "tests on CUDA"
        timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider -p no:randomly -n ${TESTS_WORKERS:-12} --timeout 150 --continue-on-collection-errors --tb=line -m "${MARKS:-not slow}" \
            ${TESTS:-tests/policies/test_vla_pretrained.py tests/train/test_critic.py tests/samplers/test_env_device.py \
            tests/train/test_trainer.py tests/train/test_self_imitation.py} > "$OUT/tests.txt" 2>&1
        grep -E "^/|^E |Error|passed|failed" "$OUT/tests.txt" | sort | uniq -c | sort -rn | head -40
        ;;
    bench)
        stamp "vla_rollout_cost, tabletop size, CPU and GPU"
        timeout 90 python3 benchmarks/vla_rollout_cost.py --devices cpu cuda --vlm-families smolvlm qwen2_vl --rounds 2 --env-steps 100 2>&1 | tee "$OUT/bench_tiny.txt"
        stamp "vla_rollout_cost, base size, GPU float32 and bfloat16"
        timeout 100 python3 benchmarks/vla_rollout_cost.py --devices cuda --vlm-families smolvlm qwen2_vl --vlm-size base \
            --vlm-dtypes float32 bfloat16 --no-miniatures --batch-sizes 64 8 --rounds 2 --env-steps 50 2>&1 | tee "$OUT/bench_base.txt"
        stamp "the flow VLA's denoising chain, eager against compiled (CUDA graphs), B = 32 and 256"
        timeout 150 python3 benchmarks/launches.py --compile --cases flow_vla --batches 32 256 --rounds 3 --device cuda 2>&1 | tee "$OUT/bench_compile.txt"
        ;;
    train)
        for device in ${TRAIN_DEVICES:-cuda cpu}; do
            stamp "2 updates of the object dense GAE recipe, device=$device"
            timeout 60 python3 -m mmrl train configs/tabletop_object_flow_vla_gae_dense.yaml --run-dir /tmp/mmrl_train_$device \
                device=$device policy.pretrained=null total_steps=2 algo.groups_per_step=8 eval.every=0 eval.at_start=false eval.at_end=false \
                env.vectorization=async env.num_envs=16 2>&1 | tail -3
            python3 -c "from mmrl.train.metrics import read_metrics; print('$device', [(r['step'], round(r['time/sample_s'], 1), round(r['time/update_s'], 1)) for r in read_metrics('/tmp/mmrl_train_$device') if 'time/step_s' in r])" 2>&1 | tee -a "$OUT/train.txt"
        done
        ;;
    rl)
        for seed in ${RL_SEEDS:-1}; do
            stamp "pretrained-backbone token VLA, GAE, spatial family, seed $seed, ${RL_SECONDS:-300} s"
            OMP_NUM_THREADS=${RL_THREADS:-2} timeout -s TERM ${RL_SECONDS:-300} python3 -m mmrl train configs/tabletop_spatial_vlm_token_vla_gae.yaml \
                seed=$seed device=cuda --run-dir /tmp/mmrl_rl_s$seed eval.at_start=false log.progress=false \
                env.vectorization=async env.num_envs=${RL_ENVS:-16} > "$OUT/rl_s$seed.log" 2>&1 &
        done
        wait
        for seed in ${RL_SEEDS:-1}; do
            cp /tmp/mmrl_rl_s$seed/metrics.jsonl "$OUT/rl_s$seed.metrics.jsonl"
            python3 -c "from mmrl.train.metrics import read_metrics; rows = read_metrics('/tmp/mmrl_rl_s$seed'); print('seed $seed', [(r['step'], round(r['success_rate'], 3), round(r['time/step_s'], 1)) for r in rows if 'time/step_s' in r][-5:], [(r['step'], r[k]) for r in rows for k in r if k.startswith('eval/') and 'success' in k])" 2>&1 | tee -a "$OUT/rl.txt"
        done
        ;;
    warp)
        stamp "tabletop_warp throughput on CUDA, state"
        timeout 150 python3 benchmarks/warp_tabletop.py throughput --device cuda --worlds 256 1024 4096 --cpu-max-worlds 256 --steps 20 2>&1 | tee "$OUT/warp_state.txt"
        stamp "tabletop_warp throughput on CUDA, rgb"
        timeout 150 python3 benchmarks/warp_tabletop.py throughput --device cuda --obs-mode rgb --worlds 256 1024 --cpu-max-worlds 256 --steps 10 2>&1 | tee "$OUT/warp_rgb.txt"
        stamp "the env sampler against stepping 4,096 warp worlds by hand, CUDA"
        timeout 150 python3 benchmarks/rollout_overhead.py --env tabletop_warp:spatial --num-envs 4096 --sim-backend cuda --device cuda --rounds 3 2>&1 | tail -2 | tee "$OUT/warp_overhead.txt"
        for where in cuda cpu; do
            if [ $where = cuda ]; then worlds=1024; env="{type: tabletop_warp, num_envs: 1024, task: spatial, obs_mode: rgb, cameras: top, image_size: 64, layout: nominal, layout_noise: 0.03, device: cuda}"
            else worlds=64; env="{type: gym, id: mmrl/Tabletop-v0, num_envs: 64, vectorization: async, kwargs: {task: spatial, image_size: 64, cameras: top, layout: nominal, layout_noise: 0.03}}"; fi
            stamp "one flow VLA GRPO update, $worlds worlds, device=$where"
            timeout 150 python3 -m mmrl train configs/tabletop_spatial_flow_vla_grpo.yaml device=$where policy.pretrained=null "env=$env" \
                algo.groups_per_step=$((worlds / 8)) algo.group_size=8 total_steps=2 eval.every=0 eval.at_start=false eval.at_end=false log.progress=false \
                --run-dir /tmp/mmrl_warp_vla_$where 2>&1 | tail -2
            python3 -c "from mmrl.train.metrics import read_metrics; print('$where $worlds worlds', [(r['step'], r['env_steps'], round(r['time/sample_s'], 1), round(r['time/update_s'], 1)) for r in read_metrics('/tmp/mmrl_warp_vla_$where') if 'time/step_s' in r])" 2>&1 | tee -a "$OUT/warp_vla.txt"
        done
        ;;
    warp_gae)
        rl_on_warp warp_gae "--task tabletop_object_nominal --episodes-per-task 20 --obs-mode state" \
            configs/tabletop_object_state_sft.yaml configs/tabletop_object_state_gae_warp.yaml
        ;;
    warp_grpo)
        rl_on_warp warp_grpo "--task tabletop_spatial_nominal --episodes-per-task 5" \
            configs/tabletop_spatial_flow_vla_sft.yaml configs/tabletop_spatial_flow_vla_grpo_warp.yaml \
            algo.groups_per_step=16 eval.every=10 eval.episodes=64
        ;;
    versions) ;;
    esac
done
stamp "done"
