#!/usr/bin/env bash
# defines: a family's benchmark beside transformers 5.17 in one run on the GPU machine: moetrain bench on
# bench/<family>/job.toml, then bench/hf_families.py for the same model (its first 4 layers, bf16, 4 micro-batches of
# 4096 tokens), then the ratio. Results (JSON and logs) go to $RESULTS_DIR.
#   RESULTS_DIR=/tmp/bench bash bench/run_family_bench.sh deepseek_v2_lite
# STEPS (moetrain, default 4) and HF_STEPS (transformers, default 3) set the timed steps: a steady energy figure needs
# windows of two seconds or more (docs/training.md).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
family="${1:?usage: run_family_bench.sh <family folder under bench/, e.g. deepseek_v2_lite, gpt_oss_20b>}"
out="${RESULTS_DIR:-/tmp/moetrain_bench}"
mkdir -p "$out"
binary="${MOETRAIN:-./build/src/moetrain}"
"$binary" bench --config "bench/$family/job.toml" --warmup "${WARMUP:-2}" --steps "${STEPS:-4}" \
  --out "$out/bench_$family.json" 2>&1 | tee "$out/bench_$family.log" | grep -E "^bench:|error"
RESULTS_DIR="$out" FAMILIES="${family}_4l" python3 bench/hf_families.py >"$out/hf_$family.log" 2>&1 ||
  { echo "transformers: FAILED"; tail -5 "$out/hf_$family.log"; }
python3 - "$out" "$family" <<'PY'
import json, os, sys
out, family = sys.argv[1], sys.argv[2]
ours = json.load(open(os.path.join(out, f"bench_{family}.json")))
def energy(joules, watts):
    return f", {joules:.0f} J/step at {watts:.0f} W" if joules else ""
e = ours.get("energy", {})
print(f"moetrain {family}: {ours['tokens_per_s']:.0f} tokens/s, {100 * ours['mfu_vs_989']:.1f}% MFU, "
      f"peak {ours['memory']['peak_GiB']:.1f} GiB{energy(e.get('joules_per_step'), e.get('mean_power_W'))}")
path = os.path.join(out, "hf_families.json")
hf = json.load(open(path)).get(f"{family}_4l") if os.path.exists(path) else None
if hf:
    print(f"transformers {family}: {hf['tok_s']:.0f} tokens/s ({hf['attn']} attention), peak {hf['peak_GiB']:.1f} GiB"
          f"{energy(hf.get('joules_per_step'), hf.get('mean_power_W'))} "
          f"-> moetrain / transformers = {ours['tokens_per_s'] / hf['tok_s']:.2f}x")
    if hf.get("kernels"):
        print(f"transformers {family} kernels: {hf['kernels']}")
PY
