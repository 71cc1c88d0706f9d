// Replays the committed fuzz corpus (tests/data/fuzz/<target>/: the seeds, and every input a fuzzing run found that
// once crashed or was refused without a message) through the fuzz targets of tests/fuzz/targets.h: each input must be
// accepted or refused with moetrain's Error, never anything else. The seeds themselves are valid files, so each
// target also shows it accepts what it should. Under the sanitize preset this is the replay under ASan + UBSan.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fuzz/targets.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

std::vector<std::filesystem::path> corpus_of(const std::string& target) {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(testing::test_data_path("fuzz/" + target)))
    if (entry.is_regular_file()) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

std::string bytes_of(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(FuzzCorpus, EveryCommittedInputIsAcceptedOrRefusedWithAMessage) {
  for (const auto& [name, target] : fuzz::all_targets()) {
    const std::vector<std::filesystem::path> files = corpus_of(name);
    EXPECT_FALSE(files.empty()) << "no corpus for " << name;
    for (const std::filesystem::path& file : files) {
      SCOPED_TRACE(file.string());
      const std::string bytes = bytes_of(file);
      EXPECT_NO_THROW(target(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
    }
  }
}

}  // namespace
}  // namespace moetrain
