#!/usr/bin/env bash
# defines: the main command of the README: install dependencies, build, prepare the demo data
# (the license texts of /usr/share/common-licenses, byte-level tokens) and train the tiny
# Qwen3-MoE of examples/tiny_moe on the CPU. It resumes from runs/tiny_moe/checkpoints when run
# again; extra arguments are passed to `moetrain train` as overrides (e.g. --train.steps=300).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
if [[ ! -f runs/data/licenses.idx ]]; then
  mkdir -p runs/data
  mapfile -t texts < <(find /usr/share/common-licenses -type f | sort)
  ./build/src/moetrain data prepare --text "${texts[@]}" --output runs/data/licenses
fi
./build/src/moetrain train --config examples/tiny_moe/job.toml "$@"
