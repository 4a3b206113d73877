#!/usr/bin/env bash
# creditlab on verl 0.9.1: GRPO on rubric-graded prompts with InterQ-RL (CORRECTION=tis: token TIS), PRM
# credit, the FORK reward, the live checks in verl's metrics and a rollout dump written every step; then
# creditlab diagnose on the dump. Needs GPUs, vLLM and a judge endpoint (README.md).
#
#   DATA_DIR=~/data/rubrics MODEL=Qwen/Qwen2.5-1.5B-Instruct JUDGE_URL=http://judge:8000/v1 \
#       bash examples/verl/run_creditlab_grpo.sh [more Hydra overrides]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DATA_DIR=${DATA_DIR:-$HOME/data/rubrics}
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
JUDGE_URL=${JUDGE_URL:-http://localhost:8000/v1}
JUDGE_MODEL=${JUDGE_MODEL:-Qwen/Qwen2.5-72B-Instruct}
NGPUS=${NGPUS:-8}
CORRECTION=${CORRECTION:-interq}
OUT=${OUT:-runs/verl-creditlab-$CORRECTION}

case "$CORRECTION" in
    interq) ROLLOUT_IS="creditlab_interq:alpha_g=0.5" ;;  # InterQ-RL
    tis) ROLLOUT_IS="creditlab_tis:cap=2.0" ;;             # token TIS, the alternative
    *) echo "CORRECTION must be interq or tis, got '$CORRECTION'" >&2; exit 2 ;;
esac

# loads creditlab in every verl process (driver and workers): estimators, loss, correction, dump, live checks
export VERL_USE_EXTERNAL_MODULES=creditlab.integrations.verl

python3 -m verl.trainer.main_ppo \
    --config-path="$HERE/config" --config-name=creditlab_grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=128 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    "algorithm.rollout_correction.rollout_is='$ROLLOUT_IS'" \
    algorithm.creditlab.dump_dir="$OUT/dump" \
    reward.custom_reward_function.reward_kwargs.base_url="$JUDGE_URL" \
    reward.custom_reward_function.reward_kwargs.model="$JUDGE_MODEL" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.nnodes=1 \
    trainer.total_epochs=1 \
    trainer.logger='["console"]' \
    trainer.project_name=creditlab \
    trainer.experiment_name="verl-grpo-$CORRECTION" \
    trainer.default_local_dir="$OUT/checkpoints" \
    "$@"

# exit code 0: no check failed; 1: one did (report.md says which, with its fix)
creditlab diagnose "$OUT/dump" --out "$OUT/diagnose"
