#!/usr/bin/env bash
# defines: the main command of the README: install dependencies, build, and run the main job on
# the CPU (a GPU is used when present and the CUDA backend supports the job).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
for family in qwen3 qwen3_moe; do
  ./build/src/moetrain check-golden --model tests/data/golden/$family \
    --reference tests/data/golden/$family/reference.safetensors --case all
done
