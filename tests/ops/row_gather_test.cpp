// Tests for ops/row_gather (the CPU reference): gather_rows against a hand loop (f32, f64, bf16, i32; repeated and
// skipped rows; no rows), sum_rows against a hand loop in the same ascending order (bitwise in f32 and f64, bf16
// summed in f32 and rounded once, empty segments writing 0, one-row segments copying bit for bit), gather and
// sum_rows being each other's transposes, batch invariance, and the refused arguments; concat_group_rows and
// concat_group_offsets (several expert-ordered row sets as one) against a hand loop, and their refusals.
#include "ops/row_gather.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "testing/cuda_compare.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::expect_error;
using testing::random_tensor;
using testing::same_bytes;

std::vector<int32_t> random_index(int64_t n, int64_t bound, Rng& rng) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& i : v) i = static_cast<int32_t>(rng.below(static_cast<uint64_t>(bound)));
  return v;
}

Tensor vec(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}); }

// Random segments over `rows` input rows: some empty, some of one row, rows repeating across segments.
struct Segments {
  std::vector<int32_t> offsets{0}, rows;
};
Segments random_segments(int64_t segments, int64_t rows, Rng& rng) {
  Segments s;
  for (int64_t u = 0; u < segments; ++u) {
    const int64_t len = static_cast<int64_t>(rng.below(5));  // 0 .. 4 rows
    for (int64_t j = 0; j < len; ++j) s.rows.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(rows))));
    s.offsets.push_back(static_cast<int32_t>(s.rows.size()));
  }
  return s;
}

// The hand loop: out[u] = in[rows[b]] + in[rows[b + 1]] + ... in ascending order, from the first row, in T.
template <typename T>
std::vector<T> hand_sum(const std::vector<T>& in, int64_t hidden, const Segments& s) {
  const int64_t segments = static_cast<int64_t>(s.offsets.size()) - 1;
  std::vector<T> out(static_cast<size_t>(segments * hidden), T(0));
  for (int64_t u = 0; u < segments; ++u) {
    for (int64_t h = 0; h < hidden; ++h) {
      T acc = T(0);
      for (int32_t j = s.offsets[static_cast<size_t>(u)]; j < s.offsets[static_cast<size_t>(u) + 1]; ++j) {
        const T v = in[static_cast<size_t>(s.rows[static_cast<size_t>(j)] * hidden + h)];
        acc = j == s.offsets[static_cast<size_t>(u)] ? v : acc + v;
      }
      out[static_cast<size_t>(u * hidden + h)] = acc;
    }
  }
  return out;
}

TEST(RowGather, GatherCopiesIndexedRows) {
  Rng rng(1);
  const int64_t M = 9, N = 14, H = 5;
  const std::vector<int32_t> index = random_index(N, M, rng);  // repeats and skips rows
  for (DType dtype : {DType::F32, DType::F64, DType::BF16, DType::I32}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Tensor in = random_tensor({M, H}, DType::F64, rng, 100.0).to(dtype);
    Tensor out = Tensor::empty({N, H}, dtype);
    gather_rows(Stream::cpu(), out, in, vec(index));
    const size_t row_bytes = static_cast<size_t>(H) * dtype_size(dtype);
    for (int64_t i = 0; i < N; ++i) {
      EXPECT_EQ(
          std::memcmp(static_cast<const char*>(out.raw_data()) + i * row_bytes,
                      static_cast<const char*>(in.raw_data()) + index[static_cast<size_t>(i)] * row_bytes, row_bytes),
          0)
          << "row " << i << " is not row " << index[static_cast<size_t>(i)] << " of the input";
    }
  }
}

TEST(RowGather, GatherAndSumOfNoRows) {
  Tensor out = Tensor::empty({0, 4}, DType::F32);
  gather_rows(Stream::cpu(), out, Tensor::empty({0, 4}, DType::F32), vec({}));
  EXPECT_EQ(out.shape(), (Shape{0, 4}));
  // Segments over an empty input: all empty, all 0.
  Tensor sums = Tensor::from_vector<float>(std::vector<float>(8, 7.0f), {2, 4});
  sum_rows(Stream::cpu(), sums, Tensor::empty({0, 4}, DType::F32), vec({0, 0, 0}), vec({}));
  EXPECT_EQ(sums.to_vector<float>(), std::vector<float>(8, 0.0f));
}

TEST(RowGather, SumRowsMatchesHandLoopBitwise) {
  Rng rng(2);
  for (int64_t H : {1, 7, 64}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    const int64_t N = 23, U = 17;
    const Segments s = random_segments(U, N, rng);
    const Tensor in32 = random_tensor({N, H}, DType::F32, rng);
    Tensor out32 = Tensor::empty({U, H}, DType::F32);
    sum_rows(Stream::cpu(), out32, in32, vec(s.offsets), vec(s.rows));
    EXPECT_EQ(out32.to_vector<float>(), hand_sum(in32.to_vector<float>(), H, s));

    const Tensor in64 = random_tensor({N, H}, DType::F64, rng);
    Tensor out64 = Tensor::empty({U, H}, DType::F64);
    sum_rows(Stream::cpu(), out64, in64, vec(s.offsets), vec(s.rows));
    EXPECT_EQ(out64.to_vector<double>(), hand_sum(in64.to_vector<double>(), H, s));
  }
}

// bf16 in and out: the sum runs in f32 over the bf16 values and rounds once to the nearest bf16.
TEST(RowGather, SumRowsBf16AccumulatesInF32) {
  Rng rng(3);
  const int64_t N = 19, U = 11, H = 9;
  const Segments s = random_segments(U, N, rng);
  const Tensor in = random_tensor({N, H}, DType::F32, rng).to(DType::BF16);
  Tensor out = Tensor::empty({U, H}, DType::BF16);
  sum_rows(Stream::cpu(), out, in, vec(s.offsets), vec(s.rows));
  std::vector<float> want = hand_sum(in.to(DType::F32).to_vector<float>(), H, s);
  for (float& v : want) v = round_to_bf16(v);
  EXPECT_EQ(out.to(DType::F32).to_vector<float>(), want);
}

// A one-row segment is a copy (signed zeros, NaN payloads and all); an empty one writes +0.
TEST(RowGather, SumRowsOneRowSegmentCopiesBitwiseAndEmptyWritesZero) {
  const Tensor in = Tensor::from_vector<float>({-0.0f, 1.5f, std::nanf(""), -3.25f}, {2, 2});
  Tensor out = Tensor::from_vector<float>({9.0f, 9.0f, 9.0f, 9.0f, 9.0f, 9.0f}, {3, 2});
  sum_rows(Stream::cpu(), out, in, vec({0, 1, 1, 2}), vec({0, 1}));
  EXPECT_TRUE(same_bytes(out.slice(0, 1), in.slice(0, 1)));
  EXPECT_TRUE(same_bytes(out.slice(2, 3), in.slice(1, 2)));
  const std::vector<float> empty = out.slice(1, 2).to_vector<float>();
  EXPECT_EQ(empty, (std::vector<float>{0.0f, 0.0f}));
  EXPECT_FALSE(std::signbit(empty[0]));
}

// <gather(x), y> = <x, sum_rows(y grouped by index)> in f64: sum_rows over the index's inverse is gather's
// transpose (the pair the de-duplicated dispatch and its backward are made of).
TEST(RowGather, SumRowsOverTheInverseIndexIsTheTransposeOfGather) {
  Rng rng(4);
  const int64_t M = 12, N = 30, H = 6;
  const std::vector<int32_t> index = random_index(N, M, rng);
  Segments inverse;  // segment m: the i with index[i] == m, ascending
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < N; ++i)
      if (index[static_cast<size_t>(i)] == m) inverse.rows.push_back(static_cast<int32_t>(i));
    inverse.offsets.push_back(static_cast<int32_t>(inverse.rows.size()));
  }
  const Tensor x = random_tensor({M, H}, DType::F64, rng);
  const Tensor y = random_tensor({N, H}, DType::F64, rng);
  Tensor gx = Tensor::empty({N, H}, DType::F64);
  gather_rows(Stream::cpu(), gx, x, vec(index));
  Tensor sy = Tensor::empty({M, H}, DType::F64);
  sum_rows(Stream::cpu(), sy, y, vec(inverse.offsets), vec(inverse.rows));
  const double a = testing::dot(gx, y), b = testing::dot(x, sy);
  EXPECT_NEAR(a, b, 1e-12 * std::abs(a));
}

// A segment's sum does not change when other segments (and input rows) are added around it.
TEST(RowGather, SumRowsIsBatchInvariant) {
  Rng rng(5);
  const int64_t N = 40, H = 33;
  const Tensor in = random_tensor({N, H}, DType::F32, rng);
  const Segments big = random_segments(25, N, rng);
  Tensor all = Tensor::empty({25, H}, DType::F32);
  sum_rows(Stream::cpu(), all, in, vec(big.offsets), vec(big.rows));
  for (int64_t u : {0, 12, 24}) {
    const int32_t b = big.offsets[static_cast<size_t>(u)], e = big.offsets[static_cast<size_t>(u) + 1];
    const std::vector<int32_t> rows(big.rows.begin() + b, big.rows.begin() + e);
    Tensor one = Tensor::empty({1, H}, DType::F32);
    sum_rows(Stream::cpu(), one, in, vec({0, e - b}), vec(rows));
    EXPECT_TRUE(same_bytes(one, all.slice(u, u + 1))) << "segment " << u;
  }
}

TEST(RowGather, RejectsBadArguments) {
  const Tensor in = Tensor::zeros({4, 3}, DType::F32);
  Stream& s = Stream::cpu();
  expect_error(
      [&] {
        gather_rows(s, Tensor::empty({2, 3}, DType::F32), in, vec({0, 4}));
      },
      "gather_rows: index[1] = 4 is outside [0, rows of in = 4)");
  expect_error(
      [&] {
        gather_rows(s, Tensor::empty({2, 3}, DType::F32), in, vec({-1, 0}));
      },
      "gather_rows: index[0] = -1 is outside");
  expect_error(
      [&] {
        gather_rows(s, Tensor::empty({2, 3}, DType::F32), in, Tensor::zeros({2}, DType::I64));
      },
      "gather_rows: index");
  expect_error([&] { gather_rows(s, Tensor::empty({3, 3}, DType::F32), in, vec({0, 1})); }, "gather_rows: out");
  expect_error([&] { gather_rows(s, Tensor::empty({2, 3}, DType::F64), in, vec({0, 1})); }, "gather_rows: out");
  expect_error(
      [&] {
        gather_rows(s, Tensor::empty({2, 12}, DType::F32), Tensor::zeros({12}, DType::F32), vec({0}));
      },
      "gather_rows: expected in as a matrix [rows, H] but found f32[12] on cpu");

  Tensor out = Tensor::empty({2, 3}, DType::F32);
  expect_error([&] { sum_rows(s, out, in, vec({1, 1, 2}), vec({0, 1})); }, "sum_rows: segment_offsets[0] must be 0");
  expect_error(
      [&] {
        sum_rows(s, out, in, vec({0, 2, 1}), vec({0}));
      },
      "sum_rows: segment_offsets must not decrease; found segment_offsets[1] = 2 > segment_offsets[2] = 1");
  expect_error(
      [&] {
        sum_rows(s, out, in, vec({0, 1, 1}), vec({0, 1}));
      },
      "sum_rows: segment_offsets must end at the length of segment_rows (2); found segment_offsets[2] = 1");
  expect_error(
      [&] {
        sum_rows(s, out, in, vec({0, 1, 2}), vec({0, 5}));
      },
      "sum_rows: segment_rows[1] = 5 is outside [0, rows of in = 4)");
  expect_error([&] { sum_rows(s, out, in, vec({0, 1}), vec({0})); }, "sum_rows: out");
  expect_error([&] { sum_rows(s, out, in, vec({}), vec({})); }, "at least one entry");
  expect_error(
      [&] {
        sum_rows(s, Tensor::empty({1, 3}, DType::I32), Tensor::zeros({4, 3}, DType::I32), vec({0, 1}), vec({0}));
      },
      "sum_rows: expected in in f32, f64 or bf16 but found i32[4, 3] on cpu");
  expect_error([&] { sum_rows(s, Tensor::empty({1, 3}, DType::F64), in, vec({0, 1}), vec({0})); }, "sum_rows: out");
}

// Tokens 0..3 choosing 2 of 6 experts on 3 ranks (2 experts each): by hand.
TEST(CountTokensPerRank, CountsEachTokenOncePerRankItReaches) {
  const Tensor topk = Tensor::from_vector<int32_t>({0, 1, /**/ 1, 4, /**/ 5, 2, /**/ 3, 2}, {4, 2});
  Tensor counts = Tensor::empty({3}, DType::I32);
  count_tokens_per_rank(Stream::cpu(), counts, topk, 2);
  // rank 0 (experts 0, 1): tokens 0, 1; rank 1 (2, 3): tokens 2, 3 (token 3 twice, counted once); rank 2: 1, 2.
  EXPECT_EQ(counts.to_vector<int32_t>(), (std::vector<int32_t>{2, 2, 2}));
  Tensor none = Tensor::empty({3}, DType::I32);
  count_tokens_per_rank(Stream::cpu(), none, Tensor::empty({0, 2}, DType::I32), 2);
  EXPECT_EQ(none.to_vector<int32_t>(), (std::vector<int32_t>{0, 0, 0}));
  EXPECT_THROW(count_tokens_per_rank(Stream::cpu(), counts, Tensor::from_vector<int32_t>({0, 6}, {1, 2}), 2), Error);
  EXPECT_THROW(count_tokens_per_rank(Stream::cpu(), counts, topk.view({-1}), 2), Error);
  EXPECT_THROW(count_tokens_per_rank(Stream::cpu(), Tensor::empty({3}, DType::I64), topk, 2), Error);
}

TEST(ConcatGroupRows, PlacesEachPartsGroupAfterTheEarlierPartsRowsOfIt) {
  Rng rng(7);
  const int64_t groups = 5, hidden = 3;
  const std::vector<int64_t> rows = {9, 0, 4, 12};  // an empty part too
  std::vector<Tensor> parts, offsets;
  std::vector<std::vector<int32_t>> host_offsets;
  for (const int64_t r : rows) {
    host_offsets.push_back(testing::random_group_offsets(groups, r, rng));
    offsets.push_back(vec(host_offsets.back()));
    parts.push_back(random_tensor({r, hidden}, DType::F32, rng));
  }
  // The hand loop: group by group, part by part, the part's rows of the group in order.
  std::vector<float> want;
  std::vector<int32_t> want_offsets{0};
  for (int64_t g = 0; g < groups; ++g) {
    for (size_t p = 0; p < parts.size(); ++p) {
      const std::vector<float> v = parts[p].to_vector<float>();
      for (int32_t r = host_offsets[p][static_cast<size_t>(g)]; r < host_offsets[p][static_cast<size_t>(g) + 1]; ++r) {
        for (int64_t h = 0; h < hidden; ++h) want.push_back(v[static_cast<size_t>(r * hidden + h)]);
      }
    }
    want_offsets.push_back(static_cast<int32_t>(want.size() / hidden));
  }
  Tensor out = Tensor::empty({25, hidden}, DType::F32);
  Tensor out_offsets = Tensor::empty({groups + 1}, DType::I32);
  concat_group_rows(Stream::cpu(), out, parts, offsets);
  concat_group_offsets(Stream::cpu(), out_offsets, offsets);
  EXPECT_EQ(out.to_vector<float>(), want);
  EXPECT_EQ(out_offsets.to_vector<int32_t>(), want_offsets);
  // One part is a copy of it.
  Tensor one = Tensor::empty({9, hidden}, DType::F32);
  concat_group_rows(Stream::cpu(), one, {parts[0]}, {offsets[0]});
  EXPECT_TRUE(same_bytes(one, parts[0]));
}

TEST(ConcatGroupRows, RefusesBadArguments) {
  Stream& s = Stream::cpu();
  const Tensor a = Tensor::zeros({3, 2}, DType::F32), b = Tensor::zeros({2, 2}, DType::F32);
  Tensor out = Tensor::empty({5, 2}, DType::F32);
  expect_error([&] { concat_group_rows(s, out, {a, b}, {vec({0, 3})}); }, "one offsets vector per part");
  expect_error(
      [&] {
        concat_group_rows(s, out, {a, b}, {vec({0, 3}), vec({0, 1, 2})});
      },
      "every part has the same groups");
  expect_error(
      [&] {
        concat_group_rows(s, out, {a, b}, {vec({0, 2}), vec({0, 2})});
      },
      "concat_group_rows: offsets[0] must end at part 0's row count (3); found 2");
  expect_error([&] { concat_group_rows(s, out, {a, b}, {vec({0, 3}), vec({1, 2})}); }, "offsets[1][0] must be 0");
  expect_error(
      [&] {
        concat_group_rows(s, out, {a, b}, {vec({0, 2, 1, 3}), vec({0, 1, 1, 2})});
      },
      "offsets[0] must not decrease");
  expect_error(
      [&] {
        concat_group_rows(s, out, {a, Tensor::zeros({2, 3}, DType::F32)}, {vec({0, 3}), vec({0, 2})});
      },
      "every part is [rows, 2] f32");
  expect_error(
      [&] {
        concat_group_rows(s, Tensor::empty({4, 2}, DType::F32), {a, b}, {vec({0, 3}), vec({0, 2})});
      },
      "concat_group_rows: out");
  expect_error(
      [&] {
        concat_group_offsets(s, Tensor::empty({3}, DType::I32), {vec({0, 3}), vec({0, 2})});
      },
      "concat_group_offsets: out_offsets");
  expect_error([&] { concat_group_offsets(s, Tensor::empty({2}, DType::I32), {}); }, "expected 1 to 64 parts");
  // 2^31 rows together (of zero width: no bytes) do not fit the i32 group offsets.
  const Tensor half = Tensor::zeros({int64_t{1} << 30, 0}, DType::F32);
  expect_error(
      [&] {
        concat_group_rows(s, Tensor::empty({int64_t{1} << 31, 0}, DType::F32), {half, half},
                          {vec({0, 1 << 30}), vec({0, 1 << 30})});
      },
      "concat_group_rows: the parts hold 2147483648 rows together, more than i32 group offsets count");
  const std::vector<Tensor> many(65, vec({0, 0}));
  expect_error([&] { concat_group_offsets(s, Tensor::empty({2}, DType::I32), many); }, "expected 1 to 64 parts");
}

}  // namespace
}  // namespace moetrain::ops
