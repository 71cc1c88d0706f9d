#!/usr/bin/env bash
# defines: the test command of the README and CI: install dependencies, build, run every CPU test
# through CTest; then the same for the CPU-only configuration (no CUDA backend, build-cpu/), which must
# build and pass too. GPU tests (label gpu) skip themselves when no GPU is present. Last, the committed
# fuzz corpus (tests/data/fuzz/) replayed under ASan + UBSan: clang builds the replay alone (the fuzz targets
# and the libraries they link, build-fuzz-replay/), and any sanitizer report or failing input fails the run.
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
if ! command -v clang++ >/dev/null; then
  echo "test: clang++ is missing, and the fuzz corpus replay under ASan + UBSan needs it (scripts/setup.sh installs" \
    "the Debian package clang)" >&2
  exit 1
fi
if [[ ! -f build-fuzz-replay/build.ninja ]]; then
  cmake --preset fuzz-replay
fi
cmake --build build-fuzz-replay -j"$(nproc)" --target moetrain_fuzz_replay
ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  build-fuzz-replay/tests/moetrain_fuzz_replay tests/data/fuzz
