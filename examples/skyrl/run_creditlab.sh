#!/usr/bin/env bash
# creditlab on SkyRL (0.3.0 / 0.4.0, Python >= 3.12): GRPO with InterQ-RL as the policy loss
# (CORRECTION=tis: token TIS), PRM credit on the turns, the FORK reward as the skyrl-gym environment
# creditlab_fork, a rollout dump every step; then creditlab diagnose on the dump. Needs GPUs, vLLM and a
# judge endpoint (examples/README.md).
#
#   DATA_DIR=~/data/rubrics-skyrl bash examples/skyrl/run_creditlab.sh [more overrides]
#
# Each dataset row: "prompt" (chat messages), "env_class": "creditlab_fork", and "reward_spec" with
# "ground_truth" (the rubrics) and "judge" ({"judge": "openai", "base_url": ..., "model": ...}).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DATA_DIR=${DATA_DIR:-$HOME/data/rubrics-skyrl}
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
NUM_GPUS=${NUM_GPUS:-4}
LOGGER=${LOGGER:-console}
CORRECTION=${CORRECTION:-interq}
OUT=${OUT:-runs/skyrl-creditlab-$CORRECTION}

case "$CORRECTION" in
    # InterQ-RL weights times creditlab's clipped surrogate, computed per micro-batch in SkyRL's loss
    interq) CORRECTION_ARGS=(trainer.algorithm.policy_loss_type=creditlab_interq
                             trainer.algorithm.creditlab.correction_params.alpha_g=0.5) ;;
    # token TIS, the alternative (equal to SkyRL's regular loss with tis_ratio_type=token, same cap)
    tis) CORRECTION_ARGS=(trainer.algorithm.policy_loss_type=creditlab_tis
                          trainer.algorithm.creditlab.correction_params.cap=2.0) ;;
    *) echo "CORRECTION must be interq or tis, got '$CORRECTION'" >&2; exit 2 ;;
esac

python3 "$HERE/main_creditlab.py" \
    data.train_data="['$DATA_DIR/train.parquet']" \
    data.val_data="['$DATA_DIR/validation.parquet']" \
    "${CORRECTION_ARGS[@]}" \
    trainer.algorithm.advantage_estimator=creditlab_prm \
    trainer.algorithm.creditlab.prm_lambda=0.5 \
    trainer.algorithm.creditlab.prm_schedule=decay \
    trainer.algorithm.creditlab.prm_start=20 \
    trainer.algorithm.creditlab.prm_end=30 \
    trainer.algorithm.creditlab.dump_dir="$OUT/dump" \
    trainer.algorithm.use_kl_loss=false \
    environment.env_class=creditlab_fork \
    generator.sampling_params.logprobs=1 \
    generator.n_samples_per_prompt=8 \
    trainer.policy.model.path="$MODEL" \
    trainer.placement.colocate_all=true \
    trainer.strategy=fsdp \
    trainer.placement.policy_num_gpus_per_node="$NUM_GPUS" \
    trainer.placement.ref_num_gpus_per_node="$NUM_GPUS" \
    generator.inference_engine.num_engines="$NUM_GPUS" \
    generator.inference_engine.tensor_parallel_size=1 \
    generator.inference_engine.backend=vllm \
    generator.inference_engine.gpu_memory_utilization=0.6 \
    trainer.epochs=1 \
    trainer.train_batch_size=128 \
    trainer.policy_mini_batch_size=32 \
    trainer.micro_forward_batch_size_per_gpu=8 \
    trainer.micro_train_batch_size_per_gpu=8 \
    trainer.max_prompt_length=1024 \
    generator.sampling_params.max_generate_length=2048 \
    trainer.policy.optimizer_config.lr=1.0e-6 \
    trainer.logger="$LOGGER" \
    trainer.project_name=creditlab \
    trainer.run_name="skyrl-grpo-$CORRECTION" \
    trainer.ckpt_path="$OUT/checkpoints" \
    "$@"

# exit code 0: no check failed; 1: one did (report.md says which, with its fix)
creditlab diagnose "$OUT/dump" --out "$OUT/diagnose"
