#!/usr/bin/env bash
# defines: the batch of GPU checks run on the GPU machine in one call: the CUDA op parity tests
# (every Cuda* test of every test binary), check-golden on the GPU for every family's dump in tests/data/golden, in f32
# and bf16 (an f32 residual stream, and for information a bf16 one), and a short GPU training run of
# the tiny example (bf16 compute) whose loss curve docs/training.md compares with the CPU's. Binaries are built on the development machine
# (scripts/build.sh) and carried along; logs go to $RESULTS_DIR (default /tmp/moetrain_gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
out="${RESULTS_DIR:-/tmp/moetrain_gpu}"
mkdir -p "$out"
export MOETRAIN_TEST_DATA="$PWD/tests/data"
status=0
moetrain="${MOETRAIN:-./build/src/moetrain}"  # MOETRAIN, TEST_BINARIES: binaries carried elsewhere
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

for binary in "${TEST_BINARIES:-build/tests}"/*_tests; do
  [[ -x "$binary" ]] || continue
  name=$(basename "$binary")
  if "$binary" --gtest_filter='Cuda*' --gtest_brief=1 >"$out/$name.log" 2>&1; then
    echo "$name: ok ($(grep -E "^\[  PASSED  \]" "$out/$name.log" | head -1))"
  else
    # The failed tests' names first: the ops tests' informational "relative error" lines would crowd them out.
    echo "$name: FAILED"; grep -E "^\[  FAILED  \]" "$out/$name.log" | sort -u | head -40
    grep -E "Failure|[Ee]rror:" "$out/$name.log" | head -20; status=1
  fi
done

for dir in tests/data/golden/*/; do
  family=$(basename "$dir")
  for dtype in f32 bf16; do
    if "$moetrain" check-golden --device cuda --dtype $dtype --model "$dir" --reference "$dir/reference.safetensors" \
      >"$out/golden_${family}_$dtype.log" 2>&1; then
      echo "check-golden $family cuda $dtype: ok"
    else
      echo "check-golden $family cuda $dtype: FAILED"; grep -E "FAIL|error" "$out/golden_${family}_$dtype.log" | head -20
      status=1
    fi
  done
  # bf16 above keeps the residual stream in f32, as the reference's autocast does; the engine's default recipe
  # (model.residual_dtype = compute: a bf16 stream) is reported beside it, for information.
  "$moetrain" check-golden --device cuda --dtype bf16 --residual compute --model "$dir" \
    --reference "$dir/reference.safetensors" >"$out/golden_${family}_bf16_stream.log" 2>&1
  echo "check-golden $family cuda bf16 with a bf16 stream (information): $(tail -1 "$out/golden_${family}_bf16_stream.log")"
done

# The tiny example on the GPU in bf16 compute, from the seed and the data of the CPU run it is compared
# with: the data comes along in runs/data (the GPU machine's license texts differ from Debian's).
steps="${GPU_CHECK_STEPS:-300}"
data=runs/data/licenses
if [[ ! -f $data.idx ]]; then
  data="$out/data/licenses"; mkdir -p "$out/data"
  mapfile -t texts < <(find /usr/share/common-licenses -type f | sort)
  "$moetrain" data prepare --text "${texts[@]}" --output "$data" >/dev/null
fi
"$moetrain" train --config examples/tiny_moe/job.toml --model.device=cuda --model.compute_dtype=bf16 \
  --train.steps=$steps --data.path="$data" --checkpoint.dir= --metrics.jsonl="$out/tiny_cuda_bf16.jsonl" \
  --eval.every=0 --metrics.tensorboard= \
  --metrics.console_every=25 >"$out/tiny_cuda_bf16.log" 2>&1 || { echo "tiny cuda: FAILED"; tail -5 "$out/tiny_cuda_bf16.log"; status=1; }
grep -E "step [0-9]+/" "$out/tiny_cuda_bf16.log" | tail -3
exit $status
