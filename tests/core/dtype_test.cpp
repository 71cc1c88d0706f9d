// Tests for core/dtype: names and sizes, and the scalar conversions between f32 and bf16, f16, fp8
// e4m3fn and e5m2 (exact values, round to nearest with ties to even, NaN, infinities, overflow,
// subnormals, signed zero), with exhaustive decode -> encode round trips of the 8/16-bit formats.
#include "core/dtype.h"

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>

#include <gtest/gtest.h>

namespace moetrain {
namespace {

constexpr DType kAllDTypes[] = {DType::F64,    DType::F32, DType::BF16, DType::F16, DType::F8E4M3,
                                DType::F8E5M2, DType::I64, DType::I32,  DType::I16, DType::I8,
                                DType::U64,    DType::U32, DType::U16,  DType::U8,  DType::Bool};

float from_bits(uint32_t bits) { return std::bit_cast<float>(bits); }
constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- names and sizes ----

TEST(DType, SafetensorsNamesRoundTrip) {
  for (DType dtype : kAllDTypes) {
    DType parsed = DType::U8;
    ASSERT_TRUE(dtype_from_safetensors_name(dtype_safetensors_name(dtype), &parsed)) << dtype_name(dtype);
    EXPECT_EQ(parsed, dtype) << dtype_name(dtype);
  }
  DType untouched = DType::I8;
  EXPECT_FALSE(dtype_from_safetensors_name("F128", &untouched));
  EXPECT_FALSE(dtype_from_safetensors_name("f32", &untouched));  // names are case-sensitive
  EXPECT_EQ(untouched, DType::I8);
}

TEST(DType, SizesAndFormatNames) {
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::Bool), 1u);
  EXPECT_EQ(dtype_safetensors_name(DType::F8E4M3), "F8_E4M3");
  EXPECT_EQ(dtype_safetensors_name(DType::F8E5M2), "F8_E5M2");
  EXPECT_EQ(dtype_safetensors_name(DType::Bool), "BOOL");
  EXPECT_TRUE(dtype_is_floating(DType::BF16));
  EXPECT_FALSE(dtype_is_floating(DType::I32));
}

// ---- bf16 ----

TEST(Bf16, ExactValuesSurvive) {
  for (float v : {0.0f, 1.0f, -2.5f, 0.15625f, 3.140625f, 65280.0f, -0.0f, 0x1p-126f, 0x1p-133f, 0x1.fep127f}) {
    EXPECT_EQ(round_to_bf16(v), v) << v;
  }
  // Every bf16 value decodes to an f32 that encodes back to the same bits.
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float v = bf16_bits_to_f32(uint16_t(bits));
    if (std::isnan(v)) continue;
    ASSERT_EQ(f32_to_bf16_bits(v), bits) << std::hex << "bf16 0x" << bits;
  }
  EXPECT_EQ(bf16_bits_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_bits_to_f32(0xc020), -2.5f);
}

TEST(Bf16, RoundsHalfwayValuesToEven) {
  // 0x3f808000 lies exactly between bf16 0x3f80 (even) and 0x3f81 (odd): down to the even one.
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x3f808000u)), 0x3f80u);
  // 0x3f818000 lies between 0x3f81 (odd) and 0x3f82 (even): up to the even one.
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x3f818000u)), 0x3f82u);
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0xbf818000u)), 0xbf82u);  // same magnitude, negative
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0xbf808000u)), 0xbf80u);
  // Off the halfway point the nearest wins regardless of parity.
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x3f808001u)), 0x3f81u);
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x3f817fffu)), 0x3f81u);
  // A tie whose rounding carries into the exponent: 0x3fff (odd) rounds up to 0x4000 == 2.
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x3fff8000u)), 0x4000u);
  EXPECT_EQ(bf16_bits_to_f32(0x4000), 2.0f);
}

TEST(Bf16, KeepsNaNAndInfinities) {
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0x7fa00000u, 0x7f80ffffu}) {
    const uint16_t h = f32_to_bf16_bits(from_bits(bits));
    EXPECT_TRUE(std::isnan(bf16_bits_to_f32(h))) << std::hex << "f32 0x" << bits << " gave 0x" << h;
    EXPECT_FALSE(std::signbit(bf16_bits_to_f32(h))) << std::hex << bits;
  }
  for (uint32_t bits : {0xffc00000u, 0xff800001u}) {
    const uint16_t h = f32_to_bf16_bits(from_bits(bits));
    EXPECT_TRUE(std::isnan(bf16_bits_to_f32(h))) << std::hex << "f32 0x" << bits << " gave 0x" << h;
    EXPECT_TRUE(std::signbit(bf16_bits_to_f32(h))) << std::hex << bits;
  }
  EXPECT_EQ(f32_to_bf16_bits(kInf), 0x7f80u);
  EXPECT_EQ(f32_to_bf16_bits(-kInf), 0xff80u);
  EXPECT_EQ(bf16_bits_to_f32(0x7f80), kInf);
  EXPECT_EQ(bf16_bits_to_f32(0xff80), -kInf);
}

TEST(Bf16, OverflowNearFloatMaxRoundsToInfinity) {
  EXPECT_EQ(f32_to_bf16_bits(FLT_MAX), 0x7f80u);
  EXPECT_EQ(f32_to_bf16_bits(-FLT_MAX), 0xff80u);
  // The halfway point above the largest bf16 (0x7f7f, odd) rounds to even, which is infinity.
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x7f7f8000u)), 0x7f80u);
  // Just below it stays finite at the largest bf16.
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x7f7f7fffu)), 0x7f7fu);
  EXPECT_EQ(bf16_bits_to_f32(0x7f7f), 0x1.fep127f);
}

TEST(Bf16, SubnormalsRoundToNearestEven) {
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x00000001u)), 0x0000u);  // far below half the smallest bf16
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x00008000u)), 0x0000u);  // tie between 0x0000 and 0x0001: even
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x00008001u)), 0x0001u);  // just above the tie
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x00010000u)), 0x0001u);  // exact
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x00018000u)), 0x0002u);  // tie between 0x0001 and 0x0002: even
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x80018000u)), 0x8002u);
  // The largest f32 subnormal rounds up into the smallest normal bf16.
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x007fffffu)), 0x0080u);
  EXPECT_EQ(bf16_bits_to_f32(0x0001), 0x1p-133f);
}

TEST(Bf16, NegativeZeroKeepsItsSign) {
  EXPECT_EQ(f32_to_bf16_bits(-0.0f), 0x8000u);
  EXPECT_EQ(f32_to_bf16_bits(0.0f), 0x0000u);
  EXPECT_TRUE(std::signbit(bf16_bits_to_f32(0x8000)));
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x80000001u)), 0x8000u);  // a tiny negative rounds to -0
}

// ---- f16 ----

TEST(F16, EveryBitPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float v = f16_bits_to_f32(uint16_t(bits));
    const uint16_t back = f32_to_f16_bits(v);
    if (std::isnan(v)) {
      ASSERT_TRUE(std::isnan(f16_bits_to_f32(back))) << std::hex << "f16 0x" << bits << " gave 0x" << back;
    } else {
      ASSERT_EQ(back, bits) << std::hex << "f16 0x" << bits << " decoded to " << v;
    }
  }
}

TEST(F16, KnownValues) {
  EXPECT_EQ(f16_bits_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_bits_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_bits_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_bits_to_f32(0x0400), 0x1p-14f);
  EXPECT_EQ(f16_bits_to_f32(0x0001), 0x1p-24f);
  EXPECT_EQ(f16_bits_to_f32(0x7c00), kInf);
  EXPECT_TRUE(std::isnan(f16_bits_to_f32(0x7e00)));
  EXPECT_EQ(f32_to_f16_bits(1.0f), 0x3c00u);
  EXPECT_EQ(f32_to_f16_bits(-0.0f), 0x8000u);
  EXPECT_TRUE(std::isnan(f16_bits_to_f32(f32_to_f16_bits(kNaN))));
}

TEST(F16, RoundsHalfwayValuesToEven) {
  EXPECT_EQ(f32_to_f16_bits(1.0f + 0x1p-11f), 0x3c00u);             // between 0x3c00 (even) and 0x3c01
  EXPECT_EQ(f32_to_f16_bits(1.0f + 3 * 0x1p-11f), 0x3c02u);         // between 0x3c01 and 0x3c02 (even)
  EXPECT_EQ(f32_to_f16_bits(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01u);  // just above the tie
  EXPECT_EQ(f32_to_f16_bits(-(1.0f + 3 * 0x1p-11f)), 0xbc02u);
  EXPECT_EQ(f32_to_f16_bits(0x1p-25f), 0x0000u);      // subnormal tie between 0 and 0x0001
  EXPECT_EQ(f32_to_f16_bits(3 * 0x1p-25f), 0x0002u);  // subnormal tie between 0x0001 and 0x0002
  EXPECT_EQ(f32_to_f16_bits(2047.5f), 0x6800u);       // tie that carries into the next binade (2048)
}

TEST(F16, OverflowGoesToInfinity) {
  EXPECT_EQ(f32_to_f16_bits(65519.0f), 0x7bffu);  // below the halfway point to 65536
  EXPECT_EQ(f32_to_f16_bits(65520.0f), 0x7c00u);  // the tie rounds to even, which is infinity
  EXPECT_EQ(f32_to_f16_bits(1.0e6f), 0x7c00u);
  EXPECT_EQ(f32_to_f16_bits(-1.0e6f), 0xfc00u);
  EXPECT_EQ(f32_to_f16_bits(FLT_MAX), 0x7c00u);
  EXPECT_EQ(f32_to_f16_bits(kInf), 0x7c00u);
  EXPECT_EQ(f32_to_f16_bits(-kInf), 0xfc00u);
}

// ---- fp8 e4m3fn ----

TEST(E4m3, EveryBitPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xff; ++bits) {
    const float v = e4m3_bits_to_f32(uint8_t(bits));
    const uint8_t back = f32_to_e4m3_bits(v);
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(e4m3_bits_to_f32(back))) << std::hex << "e4m3 0x" << bits << " gave 0x" << int(back);
    } else {
      EXPECT_EQ(back, bits) << std::hex << "e4m3 0x" << bits << " decoded to " << v;
    }
  }
}

TEST(E4m3, KnownValues) {
  EXPECT_EQ(e4m3_bits_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_bits_to_f32(0xfe), -448.0f);
  EXPECT_EQ(e4m3_bits_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_bits_to_f32(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(e4m3_bits_to_f32(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(e4m3_bits_to_f32(0x78), 256.0f);   // all-ones exponent is still a number in the fn layout
  EXPECT_TRUE(std::isnan(e4m3_bits_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_bits_to_f32(0xff)));
  EXPECT_TRUE(std::signbit(e4m3_bits_to_f32(0x80)));
  EXPECT_EQ(f32_to_e4m3_bits(-0.0f), 0x80u);
  EXPECT_EQ(f32_to_e4m3_bits(kNaN), 0x7fu);
  EXPECT_TRUE(std::isnan(e4m3_bits_to_f32(f32_to_e4m3_bits(-kNaN))));
}

TEST(E4m3, SaturatesTo448) {
  EXPECT_EQ(f32_to_e4m3_bits(448.0f), 0x7eu);
  EXPECT_EQ(f32_to_e4m3_bits(449.0f), 0x7eu);
  EXPECT_EQ(f32_to_e4m3_bits(464.0f), 0x7eu);
  EXPECT_EQ(f32_to_e4m3_bits(480.0f), 0x7eu);  // would be 0x7f, which is NaN in the fn layout
  EXPECT_EQ(f32_to_e4m3_bits(1.0e9f), 0x7eu);
  EXPECT_EQ(f32_to_e4m3_bits(kInf), 0x7eu);
  EXPECT_EQ(f32_to_e4m3_bits(-1000.0f), 0xfeu);
  EXPECT_EQ(f32_to_e4m3_bits(-kInf), 0xfeu);
}

TEST(E4m3, RoundsHalfwayValuesToEven) {
  EXPECT_EQ(f32_to_e4m3_bits(1.0625f), 0x38u);  // between 1 (0x38, even) and 1.125 (0x39)
  EXPECT_EQ(f32_to_e4m3_bits(1.1875f), 0x3au);  // between 1.125 (0x39) and 1.25 (0x3a, even)
  EXPECT_EQ(f32_to_e4m3_bits(-1.1875f), 0xbau);
  EXPECT_EQ(f32_to_e4m3_bits(1.07f), 0x39u);     // above the tie
  EXPECT_EQ(f32_to_e4m3_bits(0x1p-10f), 0x00u);  // subnormal tie between 0 and 0x01
  EXPECT_EQ(f32_to_e4m3_bits(3 * 0x1p-10f), 0x02u);
}

// ---- fp8 e5m2 ----

TEST(E5m2, EveryBitPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xff; ++bits) {
    const float v = e5m2_bits_to_f32(uint8_t(bits));
    const uint8_t back = f32_to_e5m2_bits(v);
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(e5m2_bits_to_f32(back))) << std::hex << "e5m2 0x" << bits << " gave 0x" << int(back);
    } else {
      EXPECT_EQ(back, bits) << std::hex << "e5m2 0x" << bits << " decoded to " << v;
    }
  }
}

TEST(E5m2, KnownValues) {
  EXPECT_EQ(e5m2_bits_to_f32(0x7b), 57344.0f);
  EXPECT_EQ(e5m2_bits_to_f32(0x3c), 1.0f);
  EXPECT_EQ(e5m2_bits_to_f32(0x04), 0x1p-14f);  // smallest normal
  EXPECT_EQ(e5m2_bits_to_f32(0x01), 0x1p-16f);  // smallest subnormal
  EXPECT_EQ(e5m2_bits_to_f32(0x7c), kInf);
  EXPECT_EQ(e5m2_bits_to_f32(0xfc), -kInf);
  EXPECT_TRUE(std::isnan(e5m2_bits_to_f32(0x7e)));
  EXPECT_EQ(f32_to_e5m2_bits(-0.0f), 0x80u);
  EXPECT_TRUE(std::isnan(e5m2_bits_to_f32(f32_to_e5m2_bits(kNaN))));
}

TEST(E5m2, OverflowGoesToInfinity) {
  EXPECT_EQ(f32_to_e5m2_bits(57344.0f), 0x7bu);
  EXPECT_EQ(f32_to_e5m2_bits(61439.0f), 0x7bu);  // below the halfway point to 65536
  EXPECT_EQ(f32_to_e5m2_bits(61440.0f), 0x7cu);  // the tie rounds to even, which is infinity
  EXPECT_EQ(f32_to_e5m2_bits(1.0e6f), 0x7cu);
  EXPECT_EQ(f32_to_e5m2_bits(-1.0e6f), 0xfcu);
  EXPECT_EQ(f32_to_e5m2_bits(kInf), 0x7cu);
}

TEST(E5m2, RoundsHalfwayValuesToEven) {
  EXPECT_EQ(f32_to_e5m2_bits(1.125f), 0x3cu);  // between 1 (0x3c, even) and 1.25 (0x3d)
  EXPECT_EQ(f32_to_e5m2_bits(1.375f), 0x3eu);  // between 1.25 (0x3d) and 1.5 (0x3e, even)
  EXPECT_EQ(f32_to_e5m2_bits(-1.375f), 0xbeu);
  EXPECT_EQ(f32_to_e5m2_bits(0x1p-17f), 0x00u);      // subnormal tie between 0 and 0x01
  EXPECT_EQ(f32_to_e5m2_bits(3 * 0x1p-17f), 0x02u);  // subnormal tie between 0x01 and 0x02
}

}  // namespace
}  // namespace moetrain
