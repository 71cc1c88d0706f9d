// defines: the process-wide logger state and its line writer.
#include "core/log.h"

#include <cstdio>
#include <mutex>

namespace moetrain {

namespace {

LogLevel g_level = LogLevel::Info;
int g_rank = 0;
std::mutex g_mutex;

const char* level_tag(LogLevel level) {
  switch (level) {
    case LogLevel::Debug: return "debug";
    case LogLevel::Info: return "info";
    case LogLevel::Warn: return "warn";
    case LogLevel::Error: return "error";
  }
  return "?";
}

}  // namespace

void setup_logging(LogLevel level, int rank) {
  g_level = level;
  g_rank = rank;
}

bool log_enabled(LogLevel level) { return level >= g_level; }

void log_line(LogLevel level, const std::string& message) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "[moetrain %s r%d] %s\n", level_tag(level), g_rank, message.c_str());
}

}  // namespace moetrain
