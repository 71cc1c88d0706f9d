// Tests that the CUDA decoding attention (ops::attention_decode_forward, ops/cuda/attention_decode.cu) gives, byte for
// byte, the out and lse rows of our own CUDA training forward (ops::attention_forward with max_seqlen = 0) for the
// same query: documents of 1 to 200 tokens packed into one run, each decoded at its last token and at prefixes, with
// and without a sliding window, GQA and MHA, f32 and bf16, head dims 16 to 256 (the exact mode's promise: the
// sampler's log-probs are training's).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/attention.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::gpu;
using testing::on_cpu;
using testing::on_gpu;
using testing::random_tensor;

struct Shape4 {
  int64_t nh, nkv, hd, hdv;
};

// Documents across the 64-key tiles (1, short, one short of a tile, a tile, one past, two tiles and more).
const std::vector<int32_t> kDocLengths = {1, 5, 63, 64, 65, 130, 200};

// A tensor of `shape` whose every element is NaN: cache rows past a sequence's length, which decoding must not read.
Tensor nan_filled(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::fill_n(t.data<float>(), t.numel(), std::numeric_limits<float>::quiet_NaN());
  return t.to(dtype);
}

// Whether row `a_row` of a (dim 0) and row `b_row` of b hold the same bytes (host tensors of one dtype).
bool same_row_bytes(const Tensor& a, int64_t a_row, const Tensor& b, int64_t b_row) {
  const Tensor ra = a.select(a_row), rb = b.select(b_row);
  return ra.dtype() == rb.dtype() && ra.nbytes() == rb.nbytes() &&
         std::memcmp(ra.raw_data(), rb.raw_data(), ra.nbytes()) == 0;
}

// For every document of kDocLengths packed into one run: the forward over the run, then one decoding call whose
// sequences are the documents' last tokens and prefixes (the token at `pos`, its cache the document's rows 0 .. pos),
// each compared with the forward's row of that token.
void expect_decode_matches_forward(const Shape4& s, DType dtype, const AttentionParams& params, uint64_t seed) {
  std::vector<int32_t> cu = {0};
  for (int32_t len : kDocLengths) cu.push_back(cu.back() + len);
  const int64_t tokens = cu.back();
  Rng rng(seed);
  const Tensor q = random_tensor({tokens, s.nh, s.hd}, DType::F32, rng).to(dtype);
  const Tensor k = random_tensor({tokens, s.nkv, s.hd}, DType::F32, rng).to(dtype);
  const Tensor v = random_tensor({tokens, s.nkv, s.hdv}, DType::F32, rng).to(dtype);

  Tensor out_d = Tensor::empty({tokens, s.nh, s.hdv}, dtype, Device::cuda(0));
  Tensor lse_d = Tensor::empty({tokens, s.nh}, DType::F32, Device::cuda(0));
  ASSERT_EQ(params.max_seqlen, 0) << "the training forward compared against is our own kernel, not cuDNN's";
  attention_forward(gpu(), out_d, lse_d, on_gpu(q), on_gpu(k), on_gpu(v),
                    on_gpu(Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())})), params);
  const Tensor out = on_cpu(out_d), lse = on_cpu(lse_d);

  // The decoded tokens: (document, position), the last token of each document and prefixes that end around the tile
  // and window edges.
  struct Token {
    int64_t doc, pos;
  };
  std::vector<Token> decoded;
  for (int64_t d = 0; d < static_cast<int64_t>(kDocLengths.size()); ++d) {
    for (int64_t pos : {0, 4, 31, 47, 48, 62, 63, 64, 100, 128, 129, 150}) {
      if (pos < kDocLengths[d] - 1) decoded.push_back({d, pos});
    }
    decoded.push_back({d, kDocLengths[d] - 1});
  }
  const int64_t rows = static_cast<int64_t>(decoded.size());
  const int64_t capacity = *std::max_element(kDocLengths.begin(), kDocLengths.end());
  Tensor q_new = Tensor::empty({rows, s.nh, s.hd}, dtype);
  Tensor k_cache = nan_filled({rows, capacity, s.nkv, s.hd}, dtype);
  Tensor v_cache = nan_filled({rows, capacity, s.nkv, s.hdv}, dtype);
  std::vector<int32_t> lengths;
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t first = cu[decoded[b].doc], token = first + decoded[b].pos;
    q_new.select(b).copy_from(q.select(token));
    k_cache.select(b).slice(0, decoded[b].pos + 1).copy_from(k.slice(first, token + 1));
    v_cache.select(b).slice(0, decoded[b].pos + 1).copy_from(v.slice(first, token + 1));
    lengths.push_back(static_cast<int32_t>(decoded[b].pos + 1));
  }

  Tensor dec_out_d = Tensor::empty({rows, s.nh, s.hdv}, dtype, Device::cuda(0));
  Tensor dec_lse_d = Tensor::empty({rows, s.nh}, DType::F32, Device::cuda(0));
  attention_decode_forward(gpu(), dec_out_d, dec_lse_d, on_gpu(q_new), on_gpu(k_cache), on_gpu(v_cache),
                           Tensor::from_vector(lengths, {rows}), params);
  const Tensor dec_out = on_cpu(dec_out_d), dec_lse = on_cpu(dec_lse_d);

  int failures = 0;
  for (int64_t b = 0; b < rows && failures < 5; ++b) {
    const int64_t token = cu[decoded[b].doc] + decoded[b].pos;
    const bool out_same = same_row_bytes(dec_out, b, out, token), lse_same = same_row_bytes(dec_lse, b, lse, token);
    if (!out_same || !lse_same) ++failures;
    EXPECT_TRUE(out_same) << "out of document " << decoded[b].doc << " (length " << kDocLengths[decoded[b].doc]
                          << ") at position " << decoded[b].pos;
    EXPECT_TRUE(lse_same) << "lse of document " << decoded[b].doc << " (length " << kDocLengths[decoded[b].doc]
                          << ") at position " << decoded[b].pos;
  }
}

void run_shapes(const std::vector<Shape4>& shapes, uint64_t seed) {
  for (const Shape4& s : shapes) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      for (int window : {0, 48}) {
        // The usual 1 / sqrt(hd), and a sharp softmax (scores of tens: rescalings by exp of large differences,
        // probabilities that underflow).
        for (float scale : {static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.hd))), 2.0f}) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " nh " + std::to_string(s.nh) + " nkv " +
                       std::to_string(s.nkv) + " hd " + std::to_string(s.hd) + " hdv " + std::to_string(s.hdv) +
                       " window " + std::to_string(window) + " scale " + std::to_string(scale));
          AttentionParams params;
          params.softmax_scale = scale;
          params.sliding_window = window;
          expect_decode_matches_forward(s, dtype, params, seed++);
        }
      }
    }
  }
}

TEST(CudaAttentionDecodeBytes, SmallHeadDimsMatchTheTrainingForward) {
  MT_REQUIRE_GPU();
  // 16 and 32 (16-byte loads of the keys), 20 / 36 (element loads, a lane column past hdv).
  run_shapes({{4, 2, 16, 16}, {4, 4, 32, 32}, {2, 1, 20, 36}}, 1000);
}

TEST(CudaAttentionDecodeBytes, NarrowHeadDimsMatchTheTrainingForward) {
  MT_REQUIRE_GPU();
  run_shapes({{4, 4, 64, 64}, {4, 2, 128, 128}}, 2000);
}

TEST(CudaAttentionDecodeBytes, WideHeadDimsMatchTheTrainingForward) {
  MT_REQUIRE_GPU();
  // Past 128 the forward takes its wide tiles (4 rows per warp, 8 columns per lane): latent attention's 192 / 128 and
  // 256.
  run_shapes({{4, 2, 192, 128}, {4, 4, 256, 256}, {4, 2, 256, 256}}, 3000);
}

}  // namespace
}  // namespace moetrain::ops
