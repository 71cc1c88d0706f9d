#!/usr/bin/env bash
# defines: a CPU run of the shared reference-dump script (../shared/golden/make_golden.py, which targets
# CUDA) with another seed, to check the engine on dumps other than the public one without a GPU.
# Usage: GOLDEN_SEED=4321 [GOLDEN_OUT=/tmp/golden_cpu] [PYTHON=python3] scripts/make_golden_cpu.sh [family ...]
# GOLDEN_SHAPE="B T L1,L2,..." sets the dumps' shape as scripts/golden_seeds.sh does (default the public dump's).
# GOLDEN_YARN=1 gives deepseek_v2 a YaRN rope, GOLDEN_GROUP_LIMITED=1 group-limited routing
# (scripts/golden_variant.py says which).
# Needs torch and transformers 5.17 (a virtualenv: python3 -m venv V && V/bin/pip install torch
# 'transformers==5.17.*' safetensors). The dumps land in $GOLDEN_OUT/seed<seed>/<family>/; the shared
# script is not changed: a patched copy goes to a temporary folder. bf16ref.* then comes from CPU
# autocast (bfloat16), the same math as on the GPU up to the kernels' accumulation order. The CPU's random
# stream is not the GPU's: seed 1234 here gives other weights than the public dump.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="${GOLDEN_SCRIPT:-$here/../../shared/golden/make_golden.py}"
[[ -f $src ]] || src="$here/../shared/golden/make_golden.py"
[[ -f $src ]] || { echo "make_golden_cpu: make_golden.py not found (set GOLDEN_SCRIPT)" >&2; exit 1; }
seed="${GOLDEN_SEED:?set GOLDEN_SEED, e.g. GOLDEN_SEED=4321}"
out="${GOLDEN_OUT:-/tmp/golden_cpu}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Each edit must match exactly once, so a changed script fails here instead of running half-patched.
edit() {
  local pattern="$1" replacement="$2"
  local count
  count=$(grep -cF -- "$pattern" "$tmp/make_golden.py" || true)
  [[ $count == 1 ]] || { echo "make_golden_cpu: expected one '$pattern' in $src, found $count" >&2; exit 1; }
  python3 - "$tmp/make_golden.py" "$pattern" "$replacement" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
open(path, "w").write(text.replace(old, new))
PY
}
cp "$src" "$tmp/make_golden.py"
edit 'dev = "cuda"' 'dev = "cpu"'
edit 'torch.autocast("cuda", dtype=torch.bfloat16)' 'torch.autocast(dev, dtype=torch.bfloat16)'
edit 'root = "/tmp/golden"' "root = \"$out\""
edit 'sets = [("public", 1234,' "sets = [(\"seed$seed\", $seed,"
edit 'on CUDA with TF32 off' 'on the CPU (scripts/make_golden_cpu.sh)'
if [[ -n ${GOLDEN_SHAPE:-} ]]; then
  read -r rows tokens lengths <<< "$GOLDEN_SHAPE"
  [[ $rows =~ ^[1-9][0-9]*$ && $tokens =~ ^[1-9][0-9]*$ && $lengths =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
    { echo "make_golden_cpu: GOLDEN_SHAPE expects \"B T L1,L2,...\" (positive integers), found '$GOLDEN_SHAPE'" >&2
      exit 1; }
  edit ", $seed, 2, 48, [13, 7, 28])]" ", $seed, $rows, $tokens, [$lengths])]"
fi
model_variants=()
[[ -n ${GOLDEN_YARN:-} ]] && model_variants+=(--yarn)
[[ -n ${GOLDEN_GROUP_LIMITED:-} ]] && model_variants+=(--group-limited)
python3 "$here/golden_variant.py" "$tmp/make_golden.py" "${model_variants[@]}"
mkdir -p "$out"
cd "$tmp"
RESULTS_DIR="$tmp" "${PYTHON:-python3}" make_golden.py "$@"
echo "make_golden_cpu: dumps in $out/seed$seed/"
