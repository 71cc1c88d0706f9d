// Tests for ops/embedding: the row gather, the weight gradient (finite differences, repeated ids, ascending
// per-row sums, accumulation into an existing gradient), and id / shape checks.
#include "ops/embedding.h"

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;

using testing::random_tensor;

Tensor ids_tensor(const std::vector<int32_t>& ids) {
  return Tensor::from_vector<int32_t>(ids, {static_cast<int64_t>(ids.size())});
}

TEST(Embedding, ForwardGathersTableRows) {
  Rng rng(41);
  const Tensor table = random_tensor({7, 5}, DType::F32, rng);
  const std::vector<int32_t> ids = {6, 0, 3, 3, 6};
  Tensor y = Tensor::empty({5, 5}, DType::F32);
  ops::embedding_forward(Stream::cpu(), y, ids_tensor(ids), table);
  for (int64_t t = 0; t < 5; ++t) {
    for (int64_t h = 0; h < 5; ++h) EXPECT_EQ(y.data<float>()[t * 5 + h], table.data<float>()[ids[t] * 5 + h]);
  }
}

TEST(Embedding, BackwardMatchesFiniteDifferences) {
  Rng rng(42);
  const Tensor table = random_tensor({6, 4}, DType::F64, rng);
  const Tensor ids = ids_tensor({2, 5, 2, 0, 2, 5, 1});         // 3 and 4 unused, 2 three times
  const Tensor probe = random_tensor({7, 4}, DType::F64, rng);  // loss = sum(y * probe), so dy = probe
  Tensor dtable = Tensor::zeros({6, 4}, DType::F64);
  ops::embedding_backward_weight(Stream::cpu(), dtable, probe, ids);
  const auto loss = [&] {
    Tensor y = Tensor::empty({7, 4}, DType::F64);
    ops::embedding_forward(Stream::cpu(), y, ids, table);
    return testing::dot(y, probe);
  };
  testing::expect_gradients_match(loss, {{"table", table, dtable}});
}

TEST(Embedding, BackwardSumsRepeatedIdsInTokenOrderAndAccumulates) {
  Rng rng(43);
  const std::vector<int32_t> ids = {1, 3, 1, 1, 0, 3};
  const Tensor dy = random_tensor({6, 9}, DType::F32, rng);
  Tensor dtable = random_tensor({4, 9}, DType::F32, rng);
  const std::vector<float> before = dtable.to_vector<float>();
  ops::embedding_backward_weight(Stream::cpu(), dtable, dy, ids_tensor(ids));
  const float* g = dy.data<float>();
  for (int32_t v = 0; v < 4; ++v) {
    for (int64_t h = 0; h < 9; ++h) {
      float sum = 0.0f;  // the row's tokens, ascending, in f32; then added to what was there
      bool any = false;
      for (size_t t = 0; t < ids.size(); ++t) {
        if (ids[t] != v) continue;
        sum += g[t * 9 + h];
        any = true;
      }
      const float expected = any ? before[v * 9 + h] + sum : before[v * 9 + h];
      EXPECT_EQ(dtable.data<float>()[v * 9 + h], expected) << "row " << v << " column " << h;
    }
  }
}

TEST(Embedding, BackwardRowDoesNotDependOnOtherTokens) {
  Rng rng(44);
  const std::vector<int32_t> ids = {4, 2, 4, 7, 2, 4, 0};
  const Tensor dy = random_tensor({7, 16}, DType::F32, rng);
  Tensor full = Tensor::zeros({8, 16}, DType::F32);
  ops::embedding_backward_weight(Stream::cpu(), full, dy, ids_tensor(ids));
  // Only the tokens of row 4, in the same order.
  Tensor dy4 = Tensor::empty({3, 16}, DType::F32);
  for (int64_t k = 0; int64_t t : {0, 2, 5}) {
    std::memcpy(dy4.data<float>() + (k++) * 16, dy.data<float>() + t * 16, 16 * sizeof(float));
  }
  Tensor alone = Tensor::zeros({8, 16}, DType::F32);
  ops::embedding_backward_weight(Stream::cpu(), alone, dy4, ids_tensor({4, 4, 4}));
  EXPECT_EQ(std::memcmp(alone.select(4).raw_data(), full.select(4).raw_data(), 16 * sizeof(float)), 0);
}

TEST(Embedding, RejectsIdOutsideVocabulary) {
  const Tensor table = Tensor::zeros({5, 3}, DType::F32);
  Tensor y = Tensor::zeros({3, 3}, DType::F32);
  expect_error(
      [&] {
        ops::embedding_forward(Stream::cpu(), y, ids_tensor({0, 4, 5}), table);
      },
      {"ids[2] = 5", "[0, V = 5)"});
  expect_error([&] { ops::embedding_forward(Stream::cpu(), y, ids_tensor({-1, 0, 1}), table); }, {"ids[0] = -1"});
  Tensor dtable = Tensor::zeros({5, 3}, DType::F32);
  expect_error(
      [&] {
        ops::embedding_backward_weight(Stream::cpu(), dtable, Tensor::zeros({3, 3}, DType::F32), ids_tensor({1, 9, 0}));
      },
      {"embedding_backward_weight", "ids[1] = 9"});
  for (float v : dtable.to_vector<float>()) EXPECT_EQ(v, 0.0f);  // nothing written
}

TEST(Embedding, RejectsBadShapesAndDtypes) {
  const Tensor table = Tensor::zeros({5, 3}, DType::F32);
  const Tensor ids = ids_tensor({0, 1});
  Tensor y_wide = Tensor::zeros({2, 4}, DType::F32);
  expect_error([&] { ops::embedding_forward(Stream::cpu(), y_wide, ids, table); },
               {"embedding_forward: y", "expected shape [2, 3]", "found [2, 4]"});
  Tensor y64 = Tensor::zeros({2, 3}, DType::F64);
  expect_error([&] { ops::embedding_forward(Stream::cpu(), y64, ids, table); },
               {"y", "expected dtype f32", "found f64"});
  Tensor y = Tensor::zeros({2, 3}, DType::F32);
  expect_error([&] { ops::embedding_forward(Stream::cpu(), y, Tensor::zeros({2}, DType::I64), table); },
               {"ids", "expected dtype i32", "found i64"});
  expect_error([&] { ops::embedding_forward(Stream::cpu(), y, ids, Tensor::zeros({15}, DType::F32)); },
               {"table [V, H]", "f32[15]"});
  Tensor dtable = Tensor::zeros({5, 3}, DType::F32);
  expect_error(
      [&] {
        ops::embedding_backward_weight(Stream::cpu(), dtable, Tensor::zeros({3, 3}, DType::F32), ids);
      },
      {"dy", "expected shape [2, 3]", "found [3, 3]"});
}

}  // namespace
}  // namespace moetrain
