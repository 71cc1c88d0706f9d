#!/usr/bin/env bash
# defines: the test command of the README and CI: install dependencies, build, run every CPU test
# through CTest. GPU tests (label gpu) skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 600
