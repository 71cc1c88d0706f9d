// Tests for io/mxfp4: the decoder against transformers 5.17's own (convert_moe_packed_tensors, through the fixture
// scripts/make_mxfp4_fixture.py wrote), bit for bit in f32 and in bf16, transposed as GPT-OSS gets it and plain; the
// nibble order, signs and extreme scales by hand; the packed shapes; and one test per refusal.
#include "io/mxfp4.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "io/safetensors.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::io {
namespace {

using moetrain::testing::error_message;

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

uint32_t bits(float value) {
  uint32_t b;
  std::memcpy(&b, &value, sizeof b);
  return b;
}

Tensor bytes(const std::vector<uint8_t>& values, const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::U8);
  MT_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "test: {} bytes for shape {}", values.size(),
           shape_str(shape));
  std::memcpy(t.raw_data(), values.data(), values.size());
  return t;
}

Tensor filled(const Shape& shape, uint8_t value) {
  Tensor t = Tensor::empty(shape, DType::U8);
  std::memset(t.raw_data(), value, t.nbytes());
  return t;
}

struct Fixture {
  Tensor blocks, scales, bf16, f32;  // bf16 / f32: transformers' decoding, [E, G * 32, R]
};

Fixture load_fixture() {
  const auto file = SafetensorsFile::open(testing::test_data_path("mxfp4/experts.safetensors"));
  return {file.tensor("blocks").clone(), file.tensor("scales").clone(), file.tensor("dequantized_bf16").clone(),
          file.tensor("dequantized_f32").clone()};
}

// Every value of transformers' decoding (f32 and its default bf16), bit for bit: the decoded values are exact in both
// formats (at most 2 significant bits, the same exponent range), so no tolerance applies.
TEST(Mxfp4, TransposedMatchesTransformersBitForBit) {
  const Fixture fx = load_fixture();
  ASSERT_EQ(fx.blocks.shape(), (Shape{3, 6, 4, 16}));
  const Tensor ours = dequantize_mxfp4_transposed(fx.blocks, fx.scales);
  ASSERT_EQ(ours.dtype(), DType::F32);
  ASSERT_EQ(ours.shape(), fx.f32.shape());
  ASSERT_EQ(ours.shape(), (Shape{3, 128, 6}));
  const float* o = ours.data<float>();
  const float* ref = fx.f32.data<float>();
  const auto* ref16 = static_cast<const uint16_t*>(fx.bf16.raw_data());
  int64_t infinite = 0, subnormal = 0;
  for (int64_t i = 0; i < ours.numel(); ++i) {
    ASSERT_EQ(bits(o[i]), bits(ref[i])) << "element " << i << ": " << o[i] << " vs " << ref[i];
    ASSERT_EQ(f32_to_bf16_bits(o[i]), ref16[i]) << "element " << i << " in bf16";
    infinite += std::isinf(o[i]);
    subnormal += std::fpclassify(o[i]) == FP_SUBNORMAL;
  }
  EXPECT_GT(infinite, 0) << "the fixture should reach the overflow of large scales";
  EXPECT_GT(subnormal, 0) << "the fixture should reach the subnormals of small scales";
}

// The plain decoding is the same values before transformers' transpose(1, 2): [E, R, C][e, r, c] = fixture[e, c, r].
TEST(Mxfp4, PlainIsTransformersDecodingBeforeItsTranspose) {
  const Fixture fx = load_fixture();
  const Tensor ours = dequantize_mxfp4(fx.blocks, fx.scales);
  ASSERT_EQ(ours.shape(), (Shape{3, 6, 128}));
  const float* o = ours.data<float>();
  const float* ref = fx.f32.data<float>();
  for (int64_t e = 0; e < 3; ++e)
    for (int64_t r = 0; r < 6; ++r)
      for (int64_t c = 0; c < 128; ++c)
        ASSERT_EQ(bits(o[(e * 6 + r) * 128 + c]), bits(ref[(e * 128 + c) * 6 + r])) << e << ", " << r << ", " << c;
}

// Byte j holds value 2j in its low nibble, 2j + 1 in its high one; nibble 8 is -0; the block is scaled by
// 2^(scale - 127).
TEST(Mxfp4, DecodesLowNibbleFirstWithSignsAndTheBlockScale) {
  std::vector<uint8_t> block{0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE, 0x0F, 0xF0, 0, 0, 0, 0, 0, 0};
  std::vector<uint8_t> two = block;
  two.insert(two.end(), block.begin(), block.end());
  const Tensor out = dequantize_mxfp4(bytes(two, {2, 16}), bytes({127, 129}, {2}));
  ASSERT_EQ(out.shape(), (Shape{64}));
  const std::vector<float> fp4{0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
  const float* o = out.data<float>();
  for (int n = 0; n < 16; ++n) {
    EXPECT_EQ(bits(o[n]), bits(fp4[size_t(n)])) << "nibble " << n;
    EXPECT_EQ(bits(o[32 + n]), bits(4 * fp4[size_t(n)])) << "nibble " << n << " at scale 2^2";
  }
  EXPECT_EQ(o[16], -6.0f);  // 0x0F: low nibble 15, high 0
  EXPECT_EQ(o[17], 0.0f);
  EXPECT_EQ(o[18], 0.0f);  // 0xF0
  EXPECT_EQ(o[19], -6.0f);
  EXPECT_TRUE(std::signbit(o[8]) && o[8] == 0.0f) << "nibble 8 is -0";
}

// Scale byte 0 is 2^-127 (a subnormal factor; 0.5 * 2^-127 = 2^-128 exact); 254 is 2^127, where 1.5 stays finite and
// 2 overflows to inf, as transformers' ldexp gives it.
TEST(Mxfp4, ExtremeScalesAreExactOrOverflowToInfinity) {
  std::vector<uint8_t> two(32, 0);
  two[0] = 0x21;   // 0.5, 1
  two[1] = 0x43;   // 1.5, 2
  two[16] = 0x43;  // 1.5, 2
  two[17] = 0xFF;  // -6, -6
  const Tensor out = dequantize_mxfp4(bytes(two, {2, 16}), bytes({0, 254}, {2}));
  const float* o = out.data<float>();
  EXPECT_EQ(o[0], std::ldexp(1.0f, -128));
  EXPECT_EQ(o[1], std::ldexp(1.0f, -127));
  EXPECT_EQ(o[2], std::ldexp(1.5f, -127));
  EXPECT_EQ(o[3], std::ldexp(1.0f, -126));
  EXPECT_EQ(o[32], std::ldexp(1.5f, 127));
  EXPECT_EQ(o[33], std::numeric_limits<float>::infinity());
  EXPECT_EQ(o[34], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(o[35], -std::numeric_limits<float>::infinity());
}

TEST(Mxfp4, EmptyTensorsDecodeToEmptyResults) {
  EXPECT_EQ(dequantize_mxfp4(filled({0, 4, 16}, 0), filled({0, 4}, 127)).shape(), (Shape{0, 128}));
  EXPECT_EQ(dequantize_mxfp4_transposed(filled({2, 0, 4, 16}, 0), filled({2, 0, 4}, 127)).shape(), (Shape{2, 128, 0}));
}

TEST(Mxfp4, BlocksShapeFollowsTheDecodedShape) {
  EXPECT_EQ(mxfp4_blocks_shape({3, 8, 64}, false, "w"), (Shape{3, 8, 2, 16}));
  EXPECT_EQ(mxfp4_blocks_shape({64}, false, "w"), (Shape{2, 16}));
  // GPT-OSS: gate_up_proj [E, H, 2I] comes as [E, 2I, H / 32, 16]; down_proj [E, I, H] as [E, H, I / 32, 16].
  EXPECT_EQ(mxfp4_blocks_shape({4, 2880, 5760}, true, "gate_up_proj"), (Shape{4, 5760, 90, 16}));
  EXPECT_EQ(mxfp4_blocks_shape({4, 2880, 2880}, true, "down_proj"), (Shape{4, 2880, 90, 16}));
  EXPECT_EQ(mxfp4_blocks_name("model.layers.0.mlp.experts.down_proj"), "model.layers.0.mlp.experts.down_proj_blocks");
  EXPECT_EQ(mxfp4_scales_name("model.layers.0.mlp.experts.down_proj"), "model.layers.0.mlp.experts.down_proj_scales");
}

TEST(Mxfp4, BlocksShapeRefusesWhatCannotBePacked) {
  EXPECT_TRUE(contains(error_message([] {
                         mxfp4_blocks_shape({3, 48}, false, "w");
                       }),
                       "'w' of shape [3, 48] cannot be MXFP4-packed: its packed dim (48) is not a multiple of 32"));
  EXPECT_TRUE(contains(error_message([] {
                         mxfp4_blocks_shape({3, 48, 64}, true, "w");
                       }),
                       "its packed dim (48) is not a multiple of 32"));
  EXPECT_TRUE(contains(error_message([] { mxfp4_blocks_shape({64}, true, "w"); }),
                       "'w' of shape [64] cannot be MXFP4-packed: at least 2 dim(s) expected"));
  EXPECT_TRUE(contains(error_message([] { mxfp4_blocks_shape({}, false, "w"); }), "at least 1 dim(s) expected"));
}

TEST(Mxfp4, FindsTheFirstNanScale) {
  EXPECT_EQ(mxfp4_first_nan_scale(bytes({1, 2, 254, 0}, {2, 2})), -1);
  EXPECT_EQ(mxfp4_first_nan_scale(bytes({1, 2, 255, 255}, {2, 2})), 2);
  EXPECT_TRUE(contains(error_message([] { mxfp4_first_nan_scale(Tensor::zeros({2}, DType::F32)); }),
                       "scales are f32[2] on cpu but contiguous u8 on the CPU was expected"));
}

// ---- Refusals ----

TEST(Mxfp4, RefusesBlocksOrScalesOfAnotherDtype) {
  const std::string b = error_message([] { dequantize_mxfp4(Tensor::zeros({2, 16}, DType::F32), filled({2}, 127)); });
  EXPECT_TRUE(contains(b, "dequantize_mxfp4: blocks are f32[2, 16] on cpu but u8")) << b;
  const std::string s = error_message([] { dequantize_mxfp4(filled({2, 16}, 0), Tensor::zeros({2}, DType::I8)); });
  EXPECT_TRUE(contains(s, "dequantize_mxfp4: scales are i8[2] on cpu but u8 (e8m0 exponents)")) << s;
}

TEST(Mxfp4, RefusesBlocksWhoseLastDimIsNot16) {
  const std::string m = error_message([] { dequantize_mxfp4(filled({2, 32}, 0), filled({2}, 127)); });
  EXPECT_TRUE(contains(m, "dequantize_mxfp4: blocks are u8[2, 32] on cpu but [..., G, 16] was expected")) << m;
}

TEST(Mxfp4, RefusesBlocksWithTooFewDims) {
  const std::string plain = error_message([] { dequantize_mxfp4(filled({16}, 0), filled({1}, 127)); });
  EXPECT_TRUE(contains(plain, "blocks are u8[16] on cpu but [..., G, 16] was expected")) << plain;
  // Transposing needs a row dim: [..., R, G, 16].
  const std::string t = error_message([] { dequantize_mxfp4_transposed(filled({4, 16}, 0), filled({4}, 127)); });
  EXPECT_TRUE(contains(t, "dequantize_mxfp4_transposed: blocks are u8[4, 16] on cpu but [..., R, G, 16]")) << t;
}

TEST(Mxfp4, RefusesScalesWhoseDimsAreNotTheBlocksLeadingDims) {
  for (const Shape& scales : {Shape{3, 6, 5}, Shape{3, 5, 4}, Shape{2, 6, 4}, Shape{3, 6}, Shape{3, 6, 4, 1}}) {
    const std::string m = error_message([&] {
      dequantize_mxfp4_transposed(filled({3, 6, 4, 16}, 0), filled(scales, 127));
    });
    EXPECT_TRUE(contains(m, "dequantize_mxfp4_transposed: scales are u8" + shape_str(scales) +
                                " on cpu but blocks u8[3, 6, 4, 16] on cpu need scales of shape [3, 6, 4]"))
        << m;
  }
}

TEST(Mxfp4, RefusesTheE8m0NanScaleNamingItsPosition) {
  Tensor scales = filled({3, 6, 4}, 127);
  scales.data<uint8_t>()[(1 * 6 + 2) * 4 + 3] = 255;
  for (bool transposed : {false, true}) {
    const std::string m = error_message([&] {
      if (transposed) {
        dequantize_mxfp4_transposed(filled({3, 6, 4, 16}, 0x11), scales);
      } else {
        dequantize_mxfp4(filled({3, 6, 4, 16}, 0x11), scales);
      }
    });
    EXPECT_TRUE(contains(m, "scale [1, 2, 3] is 255, e8m0's NaN: refused")) << m;
  }
}

}  // namespace
}  // namespace moetrain::io
