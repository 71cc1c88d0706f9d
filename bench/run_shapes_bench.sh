#!/usr/bin/env bash
# defines: the workload of record's recipe on two other Qwen3-MoE shapes (issue "One H200 at 1.5x": the gain must hold
# without shape-specific tuning), each beside the PyTorch baseline on the same shape in the same run:
#   qwen3_moe_e64        64 experts top-6 of width 1408, 16 query heads (hidden 2048)
#   qwen3_moe_e32_h2560  32 experts top-4 of width 2048, hidden 2560, 20 query heads
# 4 layers, 8 micro-batches of 2 x 4096 tokens, bf16 compute with fp32 masters and bf16 AdamW moments, the expert
# weight gradients once a step (bench/workload_of_record.toml).
# Results (JSON and logs) go to $RESULTS_DIR/<shape>.
#   RESULTS_DIR=/tmp/shapes BASELINE_PRECS="amp bf16" bash bench/run_shapes_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
root="${RESULTS_DIR:-/tmp/moetrain_shapes}"
binary="${MOETRAIN:-./build/src/moetrain}"
declare -A torch_shape=(
  [qwen3_moe_e64]='{"E": 64, "topk": 6, "I": 1408, "nh": 16}'
  [qwen3_moe_e32_h2560]='{"E": 32, "topk": 4, "I": 2048, "nh": 20, "Hd": 2560}'
)
for shape in qwen3_moe_e64 qwen3_moe_e32_h2560; do
  out="$root/$shape"
  mkdir -p "$out"
  "$binary" bench --config bench/workload_of_record.toml --model.config="$PWD/bench/$shape/config.json" \
    --warmup "${WARMUP:-2}" --steps "${STEPS:-4}" --out "$out/bench_moetrain.json" >"$out/bench_moetrain.log" 2>&1 ||
    { echo "$shape moetrain: FAILED"; tail -5 "$out/bench_moetrain.log"; continue; }
  for prec in ${BASELINE_PRECS:-amp bf16}; do
    CFG="${torch_shape[$shape]}" PREC=$prec RESULTS_DIR="$out" python3 bench/torch_baseline.py >"$out/torch_$prec.log" 2>&1 ||
      { echo "$shape torch $prec: FAILED"; tail -3 "$out/torch_$prec.log"; }
  done
  python3 bench/summarize_bench.py "$out" "$shape"
done
