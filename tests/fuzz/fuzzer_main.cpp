// defines: the libFuzzer entry point over the fuzz targets of fuzz/targets.h (tests/CMakeLists.txt builds it with
// -DMOETRAIN_FUZZ=ON; scripts/fuzz.sh runs it): the environment variable MOETRAIN_FUZZ_TARGET names the target, one
// of all_targets(); an unknown or missing name stops the run before any input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz/targets.h"

namespace {
moetrain::fuzz::Target g_target = nullptr;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* wanted = std::getenv("MOETRAIN_FUZZ_TARGET");
  std::string names;
  for (const auto& [name, target] : moetrain::fuzz::all_targets()) {
    if (wanted != nullptr && name == wanted) g_target = target;
    names += " " + name;
  }
  if (g_target == nullptr) {
    std::fprintf(stderr, "MOETRAIN_FUZZ_TARGET is '%s', expected one of:%s\n", wanted == nullptr ? "" : wanted,
                 names.c_str());
    std::exit(2);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  g_target(data, size);
  return 0;
}
