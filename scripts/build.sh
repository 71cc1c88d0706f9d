#!/usr/bin/env bash
# defines: configure and build moetrain into build/ (Release, Ninja). CUDA code is compiled when
# nvcc is present. Extra arguments go to CMake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -f build/build.ninja ]]; then
  cmake --preset release "$@"
fi
cmake --build build -j"$(nproc)"
