#!/usr/bin/env bash
# defines: the fuzzing runs of the parsers (tests/fuzz/targets.h): builds the libFuzzer binary with clang, ASan and
# UBSan (build-fuzz/, CPU only), then runs each target for SECONDS (default 120) from the committed corpus
# (tests/data/fuzz/<target>/, read only; new inputs go to build-fuzz/corpus/<target>/) and prints its executions and
# coverage. Without TARGET arguments it runs every target of all_targets() (as `moetrain_fuzz_replay --list` prints
# them). A crash leaves its input in build-fuzz/findings/<target>/; fix it, then commit the input into the corpus,
# which the CPU test suite (tests/cli/fuzz_corpus_test.cpp) and CI under ASan + UBSan (scripts/test.sh) replay.
# RUNS=N stops each target after N executions instead (e.g. RUNS=1000000, SECONDS then only a bound).
#   [RUNS=N] bash scripts/fuzz.sh [SECONDS] [TARGET ...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-120}"
shift || true
if [[ ! -f build-fuzz/build.ninja ]]; then
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOETRAIN_CUDA=OFF \
    -DMOETRAIN_SANITIZE=ON -DMOETRAIN_FUZZ=ON
fi
cmake --build build-fuzz -j"$(nproc)" --target moetrain_fuzzer moetrain_fuzz_replay
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || mapfile -t targets < <(build-fuzz/tests/moetrain_fuzz_replay --list)
for target in "${targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$target" "build-fuzz/findings/$target"
  echo "== $target: $seconds s"
  MOETRAIN_FUZZ_TARGET="$target" ASAN_OPTIONS=detect_leaks=1 build-fuzz/tests/moetrain_fuzzer \
    -max_total_time="$seconds" -runs="${RUNS:--1}" -timeout=10 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/findings/$target/" "build-fuzz/corpus/$target" "tests/data/fuzz/$target" 2>&1 |
    grep -E "^stat::(number_of_executed_units|new_units_added|peak_rss_mb)|cov:|ERROR|SUMMARY|Test unit written" |
    tail -n 6
done
