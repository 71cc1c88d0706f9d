// defines: the out-of-line thrower behind MT_CHECK, so the macro stays small at every call site.
#include "core/error.h"

#include <cstring>

namespace moetrain {

void throw_error(const char* file, int line, const std::string& message) {
  const char* base = std::strrchr(file, '/');
  throw Error(fmt::format("{} [{}:{}]", message, base ? base + 1 : file, line));
}

}  // namespace moetrain
