// defines: the replay of the committed fuzz corpus without libFuzzer: every file of <corpus>/<target>/ through its
// fuzz target (fuzz/targets.h). Built with clang, ASan and UBSan it is CI's sanitizer pass over the corpus
// (scripts/test.sh): a sanitizer report stops the process (halt_on_error, -fno-sanitize-recover), and an exception
// other than moetrain's Error, a target without inputs or an unknown target fails it. `--list` prints the targets'
// names, one a line (scripts/fuzz.sh runs them all).
//   moetrain_fuzz_replay --list
//   moetrain_fuzz_replay CORPUS_FOLDER [TARGET ...]
#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/targets.h"

namespace {

namespace fs = std::filesystem;

std::string bytes_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs every input of folder through target; returns the number of failures (each printed).
int replay(const std::string& name, moetrain::fuzz::Target target, const fs::path& folder) {
  std::error_code error;
  std::vector<fs::path> files;
  for (fs::directory_iterator it(folder, error), end; !error && it != end; it.increment(error))
    if (it->is_regular_file()) files.push_back(it->path());
  if (error || files.empty()) {
    std::fprintf(stderr, "FAIL %s: no inputs in %s%s\n", name.c_str(), folder.c_str(),
                 error ? (": " + error.message()).c_str() : "");
    return 1;
  }
  std::sort(files.begin(), files.end());
  int failures = 0;
  for (const fs::path& file : files) {
    const std::string bytes = bytes_of(file);
    try {
      target(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "FAIL %s: %s threw an exception other than moetrain::Error: %s\n", name.c_str(),
                   file.c_str(), e.what());
      ++failures;
    } catch (...) {
      std::fprintf(stderr, "FAIL %s: %s threw a non-standard exception\n", name.c_str(), file.c_str());
      ++failures;
    }
  }
  std::printf("%-20s %zu inputs, %d failures\n", name.c_str(), files.size(), failures);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  const auto targets = moetrain::fuzz::all_targets();
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 1 && args[0] == "--list") {
    for (const auto& [name, target] : targets) std::printf("%s\n", name.c_str());
    return 0;
  }
  if (args.empty() || args[0].rfind("-", 0) == 0) {
    std::fprintf(stderr, "usage: %s --list | CORPUS_FOLDER [TARGET ...]\n", argv[0]);
    return 2;
  }
  const std::vector<std::string> wanted(args.begin() + 1, args.end());
  int failures = 0;
  for (const std::string& name : wanted) {
    if (std::none_of(targets.begin(), targets.end(), [&](const auto& t) { return t.first == name; })) {
      std::fprintf(stderr, "FAIL: no fuzz target '%s' (--list names them)\n", name.c_str());
      ++failures;
    }
  }
  for (const auto& [name, target] : targets) {
    if (wanted.empty() || std::find(wanted.begin(), wanted.end(), name) != wanted.end())
      failures += replay(name, target, fs::path(args[0]) / name);
  }
  if (failures > 0) std::fprintf(stderr, "fuzz corpus replay: %d failures\n", failures);
  return failures > 0 ? 1 : 0;
}
