#!/usr/bin/env bash
# defines: a CPU run of the shared reference-dump script (../shared/golden/make_golden.py, which targets
# CUDA) with another seed, to check the engine on dumps other than the public one without a GPU.
# Usage: GOLDEN_SEED=4321 [GOLDEN_OUT=/tmp/golden_cpu] [PYTHON=python3] scripts/make_golden_cpu.sh [family ...]
# GOLDEN_YARN=1 gives deepseek_v2 a YaRN rope (factor 40 over an original context of 32 tokens, so the ramp falls
# inside the rotary dims at the dump's lengths; mscale 1 and mscale_all_dim 0.8, so both the cos/sin attention factor
# and the softmax-scale temperature differ from 1).
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
if [[ -n ${GOLDEN_YARN:-} ]]; then
  edit 'scoring_func="softmax", max_position_embeddings=4096' \
    'scoring_func="softmax", max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}'
fi
mkdir -p "$out"
cd "$tmp"
RESULTS_DIR="$tmp" "${PYTHON:-python3}" make_golden.py "$@"
echo "make_golden_cpu: dumps in $out/seed$seed/"
