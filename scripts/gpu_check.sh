#!/usr/bin/env bash
# defines: the batch of GPU checks run on the GPU machine in one call: the CUDA op parity tests
# (every Cuda* test of every test binary), check-golden on the GPU, and a short GPU training run of
# the tiny example next to the same run on the CPU. Binaries are built on the development machine
# (scripts/build.sh) and carried along; logs go to $RESULTS_DIR (default /tmp/moetrain_gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${RESULTS_DIR:-/tmp/moetrain_gpu}"
mkdir -p "$out"
export MOETRAIN_TEST_DATA="$PWD/tests/data"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

for binary in build/tests/*_tests; do
  [[ -x "$binary" ]] || continue
  name=$(basename "$binary")
  if "$binary" --gtest_filter='Cuda*' --gtest_brief=1 >"$out/$name.log" 2>&1; then
    echo "$name: ok ($(grep -E "^\[  PASSED  \]" "$out/$name.log" | head -1))"
  else
    echo "$name: FAILED"; grep -E "Failure|FAILED|error" "$out/$name.log" | head -40; status=1
  fi
done

for family in qwen3 qwen3_moe; do
  ./build/src/moetrain check-golden --device cuda --model tests/data/golden/$family \
    --reference tests/data/golden/$family/reference.safetensors >"$out/golden_$family.log" 2>&1 || status=1
  tail -n 15 "$out/golden_$family.log"
done

# The tiny example for a few steps on the GPU and on the CPU, from the same seed and data.
steps="${GPU_CHECK_STEPS:-30}"
mkdir -p "$out/data"
mapfile -t texts < <(find /usr/share/common-licenses -type f | sort)
./build/src/moetrain data prepare --text "${texts[@]}" --output "$out/data/licenses" >/dev/null
for device in cuda cpu; do
  ./build/src/moetrain train --config examples/tiny_moe/job.toml --model.device=$device --train.steps=$steps \
    --data.path="$out/data/licenses" --checkpoint.dir= --metrics.jsonl="$out/tiny_$device.jsonl" \
    --metrics.console_every=10 >"$out/tiny_$device.log" 2>&1 || { echo "tiny $device: FAILED"; tail -5 "$out/tiny_$device.log"; status=1; }
  grep -E "step [0-9]+/" "$out/tiny_$device.log" | tail -3
done
exit $status
