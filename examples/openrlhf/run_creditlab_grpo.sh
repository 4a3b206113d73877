#!/usr/bin/env bash
# creditlab on OpenRLHF 0.11.2: GRPO-style training (group_norm) with InterQ-RL through OpenRLHF's
# PolicyLoss (CORRECTION=tis: token TIS), the FORK reward as its reward_func, the live checks in its
# metrics and a rollout dump written by its experience maker; then creditlab diagnose on the dump.
# Needs GPUs, vLLM, DeepSpeed, a running Ray cluster (ray start --head) and a judge endpoint
# (examples/README.md). Per-turn credit: none (OpenRLHF's advantage estimators have no hook).
#
#   DATA=~/data/rubrics/train.jsonl JUDGE_URL=http://judge:8000/v1 bash examples/openrlhf/run_creditlab_grpo.sh
#
# Each dataset line: "prompt" (chat messages) and "rubrics" (a list of {"criterion", "points"}).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DATA=${DATA:-$HOME/data/rubrics/train.jsonl}
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
JUDGE_URL=${JUDGE_URL:-http://localhost:8000/v1}
JUDGE_MODEL=${JUDGE_MODEL:-Qwen/Qwen2.5-72B-Instruct}
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_GPUS=${NUM_GPUS:-4}
CORRECTION=${CORRECTION:-interq}
OUT=${OUT:-$PWD/runs/openrlhf-creditlab-$CORRECTION}
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # the trainer actor writes the dump: an absolute path

case "$CORRECTION" in
    interq) SPEC="interq:alpha_g=0.5" ;;  # InterQ-RL
    tis) SPEC="tis:cap=2.0" ;;            # token TIS, the alternative
    *) echo "CORRECTION must be interq or tis, got '$CORRECTION'" >&2; exit 2 ;;
esac

# Ray runs creditlab.integrations.openrlhf.install in every OpenRLHF process (trainer, actors, vLLM engines):
# it patches PolicyLoss.forward (the correction) and the experience maker (dump, live checks). Ray merges
# these env_vars with the ones OpenRLHF's driver passes to ray.init (TOKENIZERS_PARALLELISM, NCCL_DEBUG,
# RAY_ENABLE_ZERO_COPY_TORCH_TENSORS: do not set those here).
RUNTIME_ENV=$(cat <<JSON
{"worker_process_setup_hook": "creditlab.integrations.openrlhf.install",
 "env_vars": {"CREDITLAB_OPENRLHF_CORRECTION": "$SPEC",
              "CREDITLAB_OPENRLHF_DUMP_DIR": "$OUT/dump",
              "JUDGE_URL": "$JUDGE_URL",
              "JUDGE_MODEL": "$JUDGE_MODEL"}}
JSON
)

# --algo.advantage.is_correction_level token: OpenRLHF collects vLLM's log-probs only with its own
# correction on; creditlab's replaces it in the loss.
ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
    -- python3 -m openrlhf.cli.train_ppo_ray \
    --actor.model_name_or_path "$MODEL" \
    --actor.num_nodes 1 \
    --actor.num_gpus_per_node "$NUM_GPUS" \
    --vllm.num_engines "$NUM_GPUS" \
    --vllm.tensor_parallel_size 1 \
    --vllm.gpu_memory_utilization 0.6 \
    --vllm.enable_sleep \
    --train.colocate_all \
    --data.prompt_dataset "$DATA" \
    --data.input_key prompt \
    --data.label_key rubrics \
    --data.apply_chat_template \
    --data.max_len 3072 \
    --rollout.max_new_tokens 2048 \
    --reward.remote_url "$HERE/fork_reward_func.py" \
    --algo.advantage.estimator group_norm \
    --algo.advantage.is_correction_level token \
    --algo.kl.init_coef 0 \
    --rollout.n_samples_per_prompt 8 \
    --rollout.batch_size 16 \
    --rollout.micro_batch_size 8 \
    --train.batch_size 128 \
    --train.micro_batch_size 4 \
    --train.max_epochs 1 \
    --actor.adam.lr 1e-6 \
    --ds.zero_stage 2 \
    --ckpt.output_dir "$OUT/checkpoints" \
    "$@"

# exit code 0: no check failed; 1: one did (report.md says which, with its fix)
creditlab diagnose "$OUT/dump" --out "$OUT/diagnose"
