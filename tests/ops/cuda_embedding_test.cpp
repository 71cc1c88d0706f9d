// Tests for the CUDA embedding kernels (ops/cuda/embedding.*) through the public ops: the gather and the weight
// gradient against the CPU reference bit for bit (the gradient sums each id's tokens in the CPU's ascending order),
// bf16 tables / outputs / gradients, repeated and hot ids, determinism, the out-of-range guard and argument checks.
// Run on a GPU; skipped elsewhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/embedding.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;
using testing::gpu;
using testing::on_cpu;
using testing::on_gpu;
using testing::random_tensor;

// Fails with the first differing element when two host tensors of one dtype differ in any byte.
void expect_same_bytes(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const size_t size = dtype_size(got.dtype());
  const auto* pa = static_cast<const unsigned char*>(got.raw_data());
  const auto* pb = static_cast<const unsigned char*>(want.raw_data());
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (std::memcmp(pa + i * size, pb + i * size, size) != 0) {
      ADD_FAILURE() << what << ": first difference at element " << i << ": got "
                    << got.to(DType::F64).to_vector<double>()[i] << ", want "
                    << want.to(DType::F64).to_vector<double>()[i];
      return;
    }
  }
}

// T ids in [0, V): a share `hot` of them is id `hot_id` (a padding or very common token), the rest uniform.
Tensor make_ids(int64_t tokens, int64_t vocab, double hot, int32_t hot_id, Rng& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (auto& id : ids) {
    id = rng.uniform() < hot ? hot_id : static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  }
  return Tensor::from_vector(ids, {tokens});
}

struct Case {
  int64_t tokens;
  int64_t vocab;
  int64_t hidden;
  double hot;
};

// Small and large vocabularies, H below, at and above one block of columns (256 single columns, or 256 spans of 8
// where H is a multiple of 8), a hot id, no tokens at all.
const std::vector<Case> kCases = {{1, 1, 1, 0.0},          {17, 5, 3, 0.0},         {300, 50, 96, 0.5},
                                  {2000, 50000, 300, 0.3}, {4096, 151936, 64, 0.0}, {0, 10, 8, 0.0},
                                  {500, 1000, 4104, 0.2}};

TEST(CudaEmbedding, ForwardMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " V " << c.vocab << " H " << c.hidden);
    Rng rng(21);
    const Tensor table = random_tensor({c.vocab, c.hidden}, DType::F32, rng);
    const Tensor ids = make_ids(c.tokens, c.vocab, c.hot, 0, rng);
    Tensor want = Tensor::empty({c.tokens, c.hidden}, DType::F32);
    ops::embedding_forward(Stream::cpu(), want, ids, table);
    Tensor got = Tensor::empty({c.tokens, c.hidden}, DType::F32, Device::cuda(0));
    ops::embedding_forward(gpu(), got, on_gpu(ids), on_gpu(table));
    expect_same_bytes(on_cpu(got), want, "f32 table -> f32 y");

    // A bf16 y holds the table rows rounded to nearest even; a bf16 table gathers exactly into f32.
    Tensor got16 = Tensor::empty({c.tokens, c.hidden}, DType::BF16, Device::cuda(0));
    ops::embedding_forward(gpu(), got16, on_gpu(ids), on_gpu(table));
    expect_same_bytes(on_cpu(got16), want.to(DType::BF16), "f32 table -> bf16 y");
    const Tensor table16 = table.to(DType::BF16);
    Tensor want_from16 = Tensor::empty({c.tokens, c.hidden}, DType::F32);
    ops::embedding_forward(Stream::cpu(), want_from16, ids, table16.to(DType::F32));
    Tensor got_from16 = Tensor::empty({c.tokens, c.hidden}, DType::F32, Device::cuda(0));
    ops::embedding_forward(gpu(), got_from16, on_gpu(ids), on_gpu(table16));
    expect_same_bytes(on_cpu(got_from16), want_from16, "bf16 table -> f32 y");
  }
}

TEST(CudaEmbedding, BackwardWeightMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  // Each dtable element is, on both sides, the f32 sum of the id's dy rows in ascending token order added to the old
  // value: the same operations in the same order, so the same bits.
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " V " << c.vocab << " H " << c.hidden);
    Rng rng(22);
    const Tensor ids = make_ids(c.tokens, c.vocab, c.hot, static_cast<int32_t>(c.vocab / 2), rng);
    const Tensor dy = random_tensor({c.tokens, c.hidden}, DType::F32, rng);
    const Tensor dtable0 = random_tensor({c.vocab, c.hidden}, DType::F32, rng);  // accumulated into
    Tensor want = dtable0.clone();
    ops::embedding_backward_weight(Stream::cpu(), want, dy, ids);
    Tensor got = on_gpu(dtable0);
    ops::embedding_backward_weight(gpu(), got, on_gpu(dy), on_gpu(ids));
    expect_same_bytes(on_cpu(got), want, "f32 dy");

    // bf16 dy: its values are exact in f32, so the CPU on the widened values gives the same bits.
    const Tensor dy16 = dy.to(DType::BF16);
    Tensor want16 = dtable0.clone();
    ops::embedding_backward_weight(Stream::cpu(), want16, dy16.to(DType::F32), ids);
    Tensor got16 = on_gpu(dtable0);
    ops::embedding_backward_weight(gpu(), got16, on_gpu(dy16), on_gpu(ids));
    expect_same_bytes(on_cpu(got16), want16, "bf16 dy");
  }
}

TEST(CudaEmbedding, BackwardWeightIsDeterministic) {
  MT_REQUIRE_GPU();
  Rng rng(23);
  const int64_t tokens = 20000, vocab = 3000, hidden = 384;
  const Tensor ids = on_gpu(make_ids(tokens, vocab, 0.4, 7, rng));
  const Tensor dy = on_gpu(random_tensor({tokens, hidden}, DType::F32, rng));
  Tensor first = Tensor::zeros({vocab, hidden}, DType::F32, Device::cuda(0));
  Tensor second = Tensor::zeros({vocab, hidden}, DType::F32, Device::cuda(0));
  ops::embedding_backward_weight(gpu(), first, dy, ids);
  ops::embedding_backward_weight(gpu(), second, dy, ids);
  expect_same_bytes(on_cpu(second), on_cpu(first), "second run");
}

TEST(CudaEmbedding, OutOfRangeIdsPoisonTheForwardRowAndAreSkippedByTheBackward) {
  MT_REQUIRE_GPU();
  // The device cannot report a bad id (the trainer validates batches on the host); it must not read or write outside
  // the table: a NaN row in y, no contribution to dtable. Single columns (H 3) and spans of 8 (H 16).
  const int64_t vocab = 4;
  const Tensor ids = Tensor::from_vector(std::vector<int32_t>{1, 4, -3, 2}, {4});
  for (const int64_t hidden : {int64_t{3}, int64_t{16}}) {
    SCOPED_TRACE(::testing::Message() << "H " << hidden);
    const Tensor ones = Tensor::from_vector(std::vector<float>(4 * hidden, 1.0f), {4, hidden});
    Tensor y = Tensor::zeros({4, hidden}, DType::F32, Device::cuda(0));
    ops::embedding_forward(gpu(), y, on_gpu(ids), on_gpu(ones));  // the table: vocab (4) rows of ones
    const std::vector<float> rows = on_cpu(y).to_vector<float>();
    for (int64_t t = 0; t < 4; ++t) {
      for (int64_t h = 0; h < hidden; ++h) {
        const float v = rows[t * hidden + h];
        if (t == 1 || t == 2) {
          EXPECT_TRUE(std::isnan(v)) << "token " << t << " column " << h << " = " << v;
        } else {
          EXPECT_EQ(v, 1.0f) << "token " << t << " column " << h;
        }
      }
    }
    Tensor dtable = Tensor::zeros({vocab, hidden}, DType::F32, Device::cuda(0));
    ops::embedding_backward_weight(gpu(), dtable, on_gpu(ones), on_gpu(ids));  // dy: 4 tokens' rows of ones
    std::vector<float> want(vocab * hidden, 0.0f);
    for (const int64_t id : {1, 2}) std::fill_n(want.begin() + id * hidden, hidden, 1.0f);
    EXPECT_EQ(on_cpu(dtable).to_vector<float>(), want);
  }
}

TEST(CudaEmbedding, RejectsDtypesWithoutACudaKernelAndMixedDevices) {
  MT_REQUIRE_GPU();
  const Tensor ids = on_gpu(Tensor::from_vector(std::vector<int32_t>{0, 1}, {2}));
  const Tensor table = Tensor::zeros({5, 3}, DType::F32, Device::cuda(0));
  Tensor y64 = Tensor::zeros({2, 3}, DType::F64, Device::cuda(0));
  expect_error([&] { ops::embedding_forward(gpu(), y64, ids, table); },
               {"embedding_forward", "y", "f32 or bf16", "f64"});
  Tensor dtable16 = Tensor::zeros({5, 3}, DType::BF16, Device::cuda(0));
  expect_error(
      [&] {
        ops::embedding_backward_weight(gpu(), dtable16, Tensor::zeros({2, 3}, DType::F32, Device::cuda(0)), ids);
      },
      {"dtable", "expected dtype f32", "bf16"});
  Tensor y = Tensor::zeros({2, 3}, DType::F32, Device::cuda(0));
  const Tensor host_ids = Tensor::from_vector(std::vector<int32_t>{0, 1}, {2});
  expect_error([&] { ops::embedding_forward(gpu(), y, host_ids, table); },
               {"embedding_forward", "ids", "stream's device cuda:0", "on cpu"});
}

}  // namespace
}  // namespace moetrain
