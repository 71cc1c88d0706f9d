#!/usr/bin/env bash
# defines: the batch of GPU checks run on the GPU machine in one call: the CUDA op parity tests
# (every Cuda* test of every test binary), check-golden on the GPU, and a short GPU training run of
# the tiny example (bf16 compute) whose loss curve docs/training.md compares with the CPU's. Binaries are built on the development machine
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
  for dtype in f32 bf16; do
    ./build/src/moetrain check-golden --device cuda --dtype $dtype --model tests/data/golden/$family \
      --reference tests/data/golden/$family/reference.safetensors >"$out/golden_${family}_$dtype.log" 2>&1 || status=1
    tail -n 24 "$out/golden_${family}_$dtype.log"  # bf16 on qwen3_moe: ~20 lines
  done
done

# The tiny example on the GPU in bf16 compute, from the seed and the data of the CPU run it is compared
# with: the data comes along in runs/data (the GPU machine's license texts differ from Debian's).
steps="${GPU_CHECK_STEPS:-300}"
data=runs/data/licenses
if [[ ! -f $data.idx ]]; then
  data="$out/data/licenses"; mkdir -p "$out/data"
  mapfile -t texts < <(find /usr/share/common-licenses -type f | sort)
  ./build/src/moetrain data prepare --text "${texts[@]}" --output "$data" >/dev/null
fi
./build/src/moetrain train --config examples/tiny_moe/job.toml --model.device=cuda --model.compute_dtype=bf16 \
  --train.steps=$steps --data.path="$data" --checkpoint.dir= --metrics.jsonl="$out/tiny_cuda_bf16.jsonl" \
  --metrics.console_every=25 >"$out/tiny_cuda_bf16.log" 2>&1 || { echo "tiny cuda: FAILED"; tail -5 "$out/tiny_cuda_bf16.log"; status=1; }
grep -E "step [0-9]+/" "$out/tiny_cuda_bf16.log" | tail -3
exit $status
