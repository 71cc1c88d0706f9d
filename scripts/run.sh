#!/usr/bin/env bash
# defines: the main command of the README: install dependencies, build, prepare the demo data
# (the license texts of /usr/share/common-licenses, byte-level tokens) and train the tiny
# Qwen3-MoE of examples/tiny_moe on the CPU, with a held-out loss on the copyright files of
# /usr/share/doc. It resumes from runs/tiny_moe/checkpoints when run again; extra arguments are
# passed to `moetrain train` as overrides (e.g. --train.steps=300).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
if [[ ! -f runs/data/licenses.idx ]]; then
  mkdir -p runs/data
  mapfile -t texts < <(find /usr/share/common-licenses -type f | sort)
  ./build/src/moetrain data prepare --text "${texts[@]}" --output runs/data/licenses
fi
# The held-out set of the job's [eval]: the copyright files of /usr/share/doc (text like the licenses, none of them
# in the training data); without any, the job runs with no evaluation.
if [[ ! -f runs/data/licenses_heldout.idx ]]; then
  mkdir -p runs/data
  mapfile -t heldout < <(find /usr/share/doc -mindepth 2 -maxdepth 2 -name copyright -type f 2>/dev/null | sort | head -n 16)
  if (( ${#heldout[@]} > 0 )); then
    ./build/src/moetrain data prepare --text "${heldout[@]}" --output runs/data/licenses_heldout
  fi
fi
eval_args=()
[[ -f runs/data/licenses_heldout.idx ]] || eval_args=(--eval.every=0)
./build/src/moetrain train --config examples/tiny_moe/job.toml "${eval_args[@]}" "$@"
