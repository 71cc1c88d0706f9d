// defines: a libFuzzer entry point for one fuzz target of fuzz/targets.h, chosen at compile time by
// MOETRAIN_FUZZ_TARGET (tests/CMakeLists.txt builds one binary per target with -DMOETRAIN_FUZZ=ON; scripts/fuzz.sh runs
// them).
#include <cstddef>
#include <cstdint>

#include "fuzz/targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moetrain::fuzz::MOETRAIN_FUZZ_TARGET(data, size);
  return 0;
}
