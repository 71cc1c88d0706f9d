#!/usr/bin/env bash
# defines: check-golden in bf16 on fresh reference dumps, made on the GPU machine by the shared make_golden.py with
# other seeds, every tensor listed (--every-tensor), then a summary of our errors against transformers' own
# (scripts/golden_seeds_summary.py). It measures how the per-tensor bf16 rule behaves on dumps nobody tuned on, and
# with GOLDEN_VARIANTS=1 it runs transformers' own bf16 with more precise placements of its roundings on the same
# dumps (scripts/bf16_variants.py), the yardstick of what an equally good implementation gets.
# Usage (GPU machine; the binaries built here and carried, make_golden.py copied from ../shared/golden):
#   GOLDEN_SCRIPT=.gpu/make_golden.py GOLDEN_SEEDS="$(seq 11 30)" RESULTS_DIR=$OUT/seeds \
#     bash scripts/golden_seeds.sh qwen3_5 qwen3_5_moe
# GOLDEN_F32=1 checks every case of each dump in f32 as well; GOLDEN_BF16_TRAJECTORY=1 the trajectory case in bf16.
# GOLDEN_SHAPE="B T L1,L2,..." sets the dumps' shape: B rows of T tokens in the batch case, one packed row of documents
# of lengths L1, L2, ... (default "2 48 13,7,28", the public dump's).
# GOLDEN_KEEP_FAILED=1 copies each dump that fails a check into $RESULTS_DIR/failed/seed<S>/<family>, to replay it.
# GOLDEN_YARN=1 and GOLDEN_GROUP_LIMITED=1 give deepseek_v2 a YaRN rope and group-limited routing
# (scripts/golden_variant.py says which).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
src="${GOLDEN_SCRIPT:?set GOLDEN_SCRIPT to a copy of ../shared/golden/make_golden.py}"
seeds="${GOLDEN_SEEDS:-$(seq 11 30)}"
out="${RESULTS_DIR:-/tmp/moetrain_golden_seeds}"
moetrain="${MOETRAIN:-./build/src/moetrain}"
families=("$@")
[[ ${#families[@]} -gt 0 ]] || families=(qwen3_5 qwen3_5_moe)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out/check" "$out/variants"
export MOETRAIN_TEST_DATA="$PWD/tests/data"

# The shared script, unchanged but for its list of sets and where it writes: one set per seed.
seed_list=$(echo $seeds | tr ' ' ',')
read -r rows tokens lengths <<< "${GOLDEN_SHAPE:-2 48 13,7,28}"
[[ $rows =~ ^[1-9][0-9]*$ && $tokens =~ ^[1-9][0-9]*$ && $lengths =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
  { echo "golden_seeds: GOLDEN_SHAPE expects \"B T L1,L2,...\" (positive integers) but found '${GOLDEN_SHAPE:-}'" >&2; exit 1; }
# Each edit must match exactly once, so a changed script fails here instead of writing its dumps elsewhere.
for pattern in '^sets = ' 'root = "/tmp/golden"'; do
  count=$(grep -c -- "$pattern" "$src")
  [[ $count == 1 ]] || { echo "golden_seeds: expected one '$pattern' in $src, found $count" >&2; exit 1; }
done
sed "s|^sets = .*|sets = [(f\"seed{s}\", s, $rows, $tokens, [$lengths]) for s in [$seed_list]]|; s|root = \"/tmp/golden\"|root = \"$work/golden\"|" \
  "$src" > "$work/make_golden.py"
model_variants=()
[[ ${GOLDEN_YARN:-0} == 1 ]] && model_variants+=(--yarn)
[[ ${GOLDEN_GROUP_LIMITED:-0} == 1 ]] && model_variants+=(--group-limited)
python3 scripts/golden_variant.py "$work/make_golden.py" "${model_variants[@]}" || exit 1
(cd "$work" && RESULTS_DIR="$work" python3 make_golden.py "${families[@]}") > "$out/make_golden.log" 2>&1 ||
  { echo "golden_seeds: make_golden.py failed, see $out/make_golden.log" >&2; exit 1; }

check() {
  local dir=$1 case=$2 tag=$3
  "$moetrain" check-golden --device cuda --dtype bf16 --every-tensor --case "$case" --model "$dir" \
    --reference "$dir/reference.safetensors" > "$out/check/${tag}_$case.log" 2>&1
  echo "$tag $case: $(tail -1 "$out/check/${tag}_$case.log")"
}
export -f check
export out moetrain
for s in $seeds; do
  for f in "${families[@]}"; do
    dir="$work/golden/seed$s/$f"
    [[ -f $dir/reference.safetensors ]] || { echo "golden_seeds: no dump in $dir" >&2; exit 1; }
  done
done
for s in $seeds; do for f in "${families[@]}"; do for c in batch packed; do
  echo "$work/golden/seed$s/$f $c seed${s}_$f"
done; done; done | xargs -P 8 -n 3 bash -c 'check "$0" "$1" "$2"' | sort > "$out/check_summary.txt"
if [[ ${GOLDEN_VARIANTS:-0} == 1 ]]; then
  for s in $seeds; do for f in "${families[@]}"; do echo "$work/golden/seed$s/$f seed${s}_$f"; done; done |
    xargs -P 8 -n 2 bash -c 'DEV=cuda python3 scripts/bf16_variants.py "$0" "$out/variants/$1.json" > "$out/variants/$1.log" 2>&1'
fi
python3 scripts/golden_seeds_summary.py "$out" | tee "$out/summary.txt"
# GOLDEN_F32=1: every case in f32 on the GPU too (the trajectory included), a line per dump in check_f32_summary.txt.
if [[ ${GOLDEN_F32:-0} == 1 ]]; then
  mkdir -p "$out/check_f32"
  check_f32() {
    local dir=$1 tag=$2
    "$moetrain" check-golden --device cuda --dtype f32 --model "$dir" --reference "$dir/reference.safetensors" \
      > "$out/check_f32/$tag.log" 2>&1
    echo "$tag f32: $(tail -1 "$out/check_f32/$tag.log")"
  }
  export -f check_f32
  for s in $seeds; do for f in "${families[@]}"; do echo "$work/golden/seed$s/$f seed${s}_$f"; done; done |
    xargs -P 8 -n 2 bash -c 'check_f32 "$0" "$1"' | sort > "$out/check_f32_summary.txt"
  echo "f32, every case: $(grep -c ' 0 failed' "$out/check_f32_summary.txt") of $(wc -l < "$out/check_f32_summary.txt") dumps pass" |
    tee -a "$out/summary.txt"
fi
# GOLDEN_BF16_TRAJECTORY=1: the trajectory case in bf16 on the GPU, a line per dump in check_trajectory_summary.txt.
if [[ ${GOLDEN_BF16_TRAJECTORY:-0} == 1 ]]; then
  mkdir -p "$out/check_trajectory"
  for s in $seeds; do for f in "${families[@]}"; do echo "$work/golden/seed$s/$f trajectory seed${s}_$f"; done; done |
    xargs -P 8 -n 3 bash -c 'check "$0" "$1" "$2"' | sort > "$out/check_trajectory_summary.txt"
  mv "$out"/check/*_trajectory.log "$out/check_trajectory/" 2>/dev/null
  echo "bf16 trajectory: $(grep -c ' 0 failed' "$out/check_trajectory_summary.txt") of $(wc -l < "$out/check_trajectory_summary.txt") dumps pass" |
    tee -a "$out/summary.txt"
fi
if [[ ${GOLDEN_KEEP_FAILED:-0} == 1 ]]; then
  cat "$out"/check_summary.txt "$out"/check_f32_summary.txt "$out"/check_trajectory_summary.txt 2>/dev/null |
    grep -v ' 0 failed' | grep -oE '^seed[0-9]+_[a-z0-9_]+' | sort -u | while read -r tag; do
      seed=${tag%%_*} family=${tag#*_}
      mkdir -p "$out/failed/$seed" && cp -r "$work/golden/$seed/$family" "$out/failed/$seed/"
    done || true  # nothing failed: grep finds no line
fi
