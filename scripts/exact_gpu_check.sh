#!/usr/bin/env bash
# defines: the exact lanes' checks on the GPU machine in one call (docs/exact_lanes.md): the exact-mode GPU tests
# (batch invariance of each certified kernel, the decoding attention's bytes, thread ranks sharing the GPU, and the
# byte gates of every family: packing, padding, training, generate, pp x ep layouts), then whether the CPU's exact
# bytes equal the GPU's for the same job and input, then exact mode's tokens/s on the workload of record beside the
# fast path's, in one run. Logs go to $RESULTS_DIR (default /tmp/moetrain_exact).
#   RESULTS_DIR=/tmp/exact MOETRAIN=build/src/moetrain TEST_BINARIES=build/tests bash scripts/exact_gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
out="${RESULTS_DIR:-/tmp/moetrain_exact}"
mkdir -p "$out"
export MOETRAIN_TEST_DATA="$PWD/tests/data"
moetrain="${MOETRAIN:-./build/src/moetrain}"
tests="${TEST_BINARIES:-build/tests}"
status=0

filters=(ops_tests:'CudaBatchInvariance*:CudaAttentionDecode*' dist_tests:'CudaHostStaged*' cli_tests:'CudaExact*')
for entry in "${filters[@]}"; do
  binary="$tests/${entry%%:*}"
  [[ -x "$binary" ]] || { echo "${entry%%:*}: not built"; status=1; continue; }
  log="$out/exact_$(basename "$binary").log"
  if "$binary" --gtest_filter="${entry#*:}" >"$log" 2>&1; then
    echo "$(basename "$binary") ${entry#*:}: ok ($(grep -E "^\[  PASSED  \]" "$log" | head -1))"
  else
    echo "$(basename "$binary") ${entry#*:}: FAILED"; grep -E "Failure|FAILED|error|Which is|differs" "$log" | head -40
    status=1
  fi
done

# The CPU's exact program against the GPU's on one job and input: the tiny example, bf16 compute.
job="$out/job.toml"
cat >"$job" <<EOF
[model]
config = "$PWD/examples/tiny_moe/config.json"
init = "random"
[data]
mode = "synthetic"
[train]
steps = 1
seq_len = 32
micro_batch = 2
seed = 1234
[exact]
enabled = true
EOF
python3 - "$out/in.safetensors" <<'PY'
import struct, sys, json
rows, width = 4, 32
ids = [(i * i * 13 + i * 5 + 3) % 257 for i in range(rows * width)]
header = json.dumps({"input_ids": {"dtype": "I32", "shape": [rows, width], "data_offsets": [0, 4 * len(ids)]}}).encode()
header += b" " * (-len(header) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + struct.pack(f"<{len(ids)}i", *ids))
PY
# The CPU's exact program computes in f32 within a layer (docs/exact_lanes.md); the GPU's in bf16.
for device in cpu cuda; do
  dtype=bf16
  [[ $device == cpu ]] && dtype=f32
  "$moetrain" score --config "$job" --input "$out/in.safetensors" --out "$out/score_$device.safetensors" \
    --model.device=$device --model.compute_dtype=$dtype >"$out/score_$device.log" 2>&1 ||
    { echo "score on $device: FAILED"; tail -3 "$out/score_$device.log"; status=1; }
done
python3 - "$out/score_cpu.safetensors" "$out/score_cuda.safetensors" <<'PY'
import json, struct, sys
def logprobs(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8:8 + n])["logprobs"]
    begin, end = meta["data_offsets"]
    raw = data[8 + n + begin:8 + n + end]
    return raw, struct.unpack(f"<{len(raw) // 4}f", raw)
cpu_raw, cpu = logprobs(sys.argv[1])
gpu_raw, gpu = logprobs(sys.argv[2])
diff = max(abs(a - b) for a, b in zip(cpu, gpu))
print(f"exact bytes, CPU against GPU: {'equal' if cpu_raw == gpu_raw else 'differ'} "
      f"({len(cpu)} log-probs, max |cpu - gpu| = {diff:.3e})")
PY

# Exact mode's speed beside the fast path's on the workload of record, in one run. Both take the per-micro-batch
# expert weight gradients: the job's once-a-step form sums in another order than the byte gates pin, and exact mode
# refuses it.
for mode in fast exact; do
  flags=(--model.expert_weight_gradient=micro_batch)
  [[ $mode == exact ]] && flags+=(--exact.enabled=true)
  "$moetrain" bench --config bench/workload_of_record.toml --warmup 2 --steps 4 --out "$out/bench_$mode.json" \
    "${flags[@]}" >"$out/bench_$mode.log" 2>&1 || { echo "bench $mode: FAILED"; tail -5 "$out/bench_$mode.log"; status=1; }
  grep -E "^bench: [0-9]+ tokens/step" "$out/bench_$mode.log" | sed "s/^/$mode: /"
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = {m: json.load(open(os.path.join(out, f"bench_{m}.json"))) for m in ("fast", "exact")
        if os.path.exists(os.path.join(out, f"bench_{m}.json"))}
if len(runs) == 2:
    print(f"exact / fast = {runs['exact']['tokens_per_s'] / runs['fast']['tokens_per_s']:.3f} "
          f"({runs['exact']['tokens_per_s']:.0f} against {runs['fast']['tokens_per_s']:.0f} tokens/s; peaks "
          f"{runs['exact']['memory']['peak_GiB']:.1f} and {runs['fast']['memory']['peak_GiB']:.1f} GiB)")
PY
exit $status
