// defines: moetrain::Error, the one error type, and the MT_CHECK macros that raise it with file,
// line and a message naming what was expected and what was found. Errors fail closed: callers
// validate first and act after, so an Error never leaves partial state behind.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace moetrain {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& message);

}  // namespace moetrain

// MT_CHECK(cond, "fmt {}", args...): throws moetrain::Error with the formatted message when cond is false.
#define MT_CHECK(cond, ...)                                                    \
  do {                                                                         \
    if (!(cond)) [[unlikely]] {                                                \
      ::moetrain::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
    }                                                                          \
  } while (0)

// MT_FAIL("fmt {}", args...): unconditional error.
#define MT_FAIL(...) ::moetrain::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))
