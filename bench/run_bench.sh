#!/usr/bin/env bash
# defines: the benchmark of record in one run on the GPU machine: moetrain bench on the workload
# of record (bench/workload_of_record.toml), then the PyTorch baseline on the same GPU
# (bench/torch_baseline.py; PREC=bf16, the default: pure bf16, issue 16's yardstick; PREC=amp too when
# BASELINE_PRECS="amp bf16": fp32 masters and moments + bf16 compute, the job's recipe with
# --optim.state_dtype=f32), then the ratios; with ENERGY_FLOOR=1 the step's energy floor (bench/energy_by_kind.py).
# Results (JSON and logs) go to $RESULTS_DIR.
#   RESULTS_DIR=/tmp/bench bash bench/run_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
out="${RESULTS_DIR:-/tmp/moetrain_bench}"
mkdir -p "$out"
export RESULTS_DIR="$out"
binary="${MOETRAIN:-./build/src/moetrain}"

"$binary" bench --config bench/workload_of_record.toml --warmup "${WARMUP:-2}" --steps "${STEPS:-4}" \
  --out "$out/bench_moetrain.json" "$@" 2>&1 | tee "$out/bench_moetrain.log" | grep -E "^bench:|error"

for prec in ${BASELINE_PRECS:-bf16}; do
  PREC=$prec python3 bench/torch_baseline.py >"$out/torch_$prec.log" 2>&1 || { echo "torch $prec: FAILED"; tail -5 "$out/torch_$prec.log"; }
done

python3 bench/summarize_bench.py "$out"

# ENERGY_FLOOR=1: the step's energy floor at this GPU's power limit, and how far this run is above it
# (bench/energy_by_kind.py: ~20 s more on the GPU).
if [[ -n "${ENERGY_FLOOR:-}" ]]; then
  baseline=()
  [[ -f "$out/bench_torch_bf16_acc8.json" ]] && baseline=(--baseline "$out/bench_torch_bf16_acc8.json")
  python3 bench/energy_by_kind.py --job workload_of_record --moetrain "$out/bench_moetrain.json" "${baseline[@]}" \
    2>&1 | tee "$out/energy_floor.log"
fi
