#!/usr/bin/env bash
# defines: the test command of the README and CI: install dependencies, build, run every CPU test
# through CTest; then the same for the CPU-only configuration (no CUDA backend, build-cpu/), which must
# build and pass too. GPU tests (label gpu) skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 600
if [[ ! -f build-cpu/build.ninja ]]; then
  cmake --preset cpu
fi
cmake --build build-cpu -j"$(nproc)"
ctest --test-dir build-cpu --output-on-failure -j"$(nproc)" --timeout 600
