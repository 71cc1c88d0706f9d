// defines: what the exact lanes' byte gates through `moetrain score` share (tests/cli/score_command_test.cpp on the
// CPU, tests/cli/cuda_exact_test.cpp on one GPU): token rows, score inputs, byte comparisons of log-probs, and the
// score command run on a pp x ep x dp layout of thread ranks. Header-only.
#pragma once

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli/score_command.h"
#include "core/tensor.h"
#include "io/safetensors.h"

namespace moetrain::testing {

constexpr int64_t kScoreVocab = 257;  // examples/tiny_moe/config.json; every golden model's vocabulary is larger

// `n` token ids below kScoreVocab, a fixed function of the position and `salt`.
inline std::vector<int32_t> score_tokens(int64_t n, uint64_t salt) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * i * 13 + i * 5 + salt * 71 + 3) % kScoreVocab);
  return ids;
}

inline Tensor i32_vector(const std::vector<int32_t>& v) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

// A score input of `rows` equal rows of `ids`; documents at `cu` (default: one per row).
inline cli::ScoreInput score_input(const std::vector<int32_t>& ids, int64_t rows, const std::vector<int32_t>& cu = {}) {
  cli::ScoreInput input;
  const int64_t T = static_cast<int64_t>(ids.size()) / rows;
  input.input_ids = Tensor::from_vector(ids, {rows, T});
  std::vector<int32_t> per_row;
  for (int64_t r = 0; r <= rows; ++r) per_row.push_back(static_cast<int32_t>(r * T));
  input.cu_seqlens = i32_vector(cu.empty() ? per_row : cu);
  cli::validate_score_input(input, kScoreVocab, "test input");
  return input;
}

// `count` floats of host tensor `a` from `a_at` against those of `b` from `b_at`, byte for byte.
inline void expect_same_float_bytes(const Tensor& a, int64_t a_at, const Tensor& b, int64_t b_at, int64_t count,
                                    const std::string& what) {
  ASSERT_LE(a_at + count, a.numel()) << what;
  ASSERT_LE(b_at + count, b.numel()) << what;
  EXPECT_EQ(std::memcmp(a.data<float>() + a_at, b.data<float>() + b_at, static_cast<size_t>(count) * sizeof(float)), 0)
      << what;
}

inline std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The score input of the layout gates: 5 rows of 20 tokens, documents packed across them (micro-batches of 2 rows:
// 3 micro-batches, the last of one row, so the data ranks get unequal shares and ep > 1 pads with repeats).
inline std::string write_layout_input(const std::string& dir) {
  const std::string path = dir + "/in.safetensors";
  io::write_safetensors(path, {{"input_ids", Tensor::from_vector(score_tokens(5 * 20, 11), {5, 20})},
                               {"cu_seqlens", i32_vector({0, 7, 20, 33, 40, 46, 60, 80, 91, 100})}});
  return path;
}

struct Layout {
  int pp, ep, dp;
  std::string name() const {
    return "pp " + std::to_string(pp) + " x ep " + std::to_string(ep) + " x dp " + std::to_string(dp) +
           (pp * ep * dp > 1 ? " (" + std::to_string(pp * ep * dp) + " thread ranks)" : " (one process)");
  }
};

// Runs score with the job `dir`/job.toml on `layout` (thread ranks when it has more than one) and returns the output
// file's path.
inline std::string score_on_layout(const std::string& dir, const std::string& input, const Layout& layout,
                                   const std::vector<std::string>& extra) {
  cli::ScoreOptions options;
  options.config_path = dir + "/job.toml";
  options.input = input;
  options.out = dir + "/out_pp" + std::to_string(layout.pp) + "_ep" + std::to_string(layout.ep) + "_dp" +
                std::to_string(layout.dp) + ".safetensors";
  options.overrides = extra;
  options.overrides.push_back("parallel.pp=" + std::to_string(layout.pp));
  options.overrides.push_back("parallel.ep=" + std::to_string(layout.ep));
  const int world = layout.pp * layout.ep * layout.dp;
  if (world > 1) options.overrides.push_back("dist.local_ranks=" + std::to_string(world));
  EXPECT_EQ(cli::run_score(options), 0) << layout.name();
  return options.out;
}

}  // namespace moetrain::testing
