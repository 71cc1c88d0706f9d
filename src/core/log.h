// defines: the logger: one line per message to stderr, with a level and (once the mesh exists)
// the rank. Set once at start-up by setup_logging and read everywhere.
#pragma once

#include <string>

#include <fmt/format.h>

namespace moetrain {

enum class LogLevel { Debug, Info, Warn, Error };

void setup_logging(LogLevel level, int rank = 0);
bool log_enabled(LogLevel level);
void log_line(LogLevel level, const std::string& message);

template <typename... Args>
void log_info(fmt::format_string<Args...> format, Args&&... args) {
  if (log_enabled(LogLevel::Info)) log_line(LogLevel::Info, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> format, Args&&... args) {
  if (log_enabled(LogLevel::Warn)) log_line(LogLevel::Warn, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> format, Args&&... args) {
  if (log_enabled(LogLevel::Debug)) log_line(LogLevel::Debug, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace moetrain
