// defines: DType names and sizes, and the scalar conversions between f32 and the reduced formats.
#include "core/dtype.h"

#include <bit>
#include <cmath>

#include "core/error.h"

namespace moetrain {

namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view name;
  std::string_view safetensors;
  bool floating;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::F64, 8, "f64", "F64", true},           {DType::F32, 4, "f32", "F32", true},
    {DType::BF16, 2, "bf16", "BF16", true},        {DType::F16, 2, "f16", "F16", true},
    {DType::F8E4M3, 1, "f8e4m3", "F8_E4M3", true}, {DType::F8E5M2, 1, "f8e5m2", "F8_E5M2", true},
    {DType::I64, 8, "i64", "I64", false},          {DType::I32, 4, "i32", "I32", false},
    {DType::I16, 2, "i16", "I16", false},          {DType::I8, 1, "i8", "I8", false},
    {DType::U64, 8, "u64", "U64", false},          {DType::U32, 4, "u32", "U32", false},
    {DType::U16, 2, "u16", "U16", false},          {DType::U8, 1, "u8", "U8", false},
    {DType::Bool, 1, "bool", "BOOL", false},
};

const DTypeInfo& info(DType dtype) {
  for (const auto& entry : kDTypes) {
    if (entry.dtype == dtype) return entry;
  }
  MT_FAIL("dtype: unknown enumerator {}", static_cast<int>(dtype));
}

// A small binary float format: 1 sign bit, `exp_bits` exponent bits, `man_bits` mantissa bits.
// `has_inf` is the IEEE layout (all-ones exponent = inf/NaN); otherwise it is the "fn" layout of
// e4m3fn, where only the all-ones pattern is NaN and there are no infinities.
struct MiniFloat {
  int exp_bits;
  int man_bits;
  bool has_inf;

  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  int max_exponent() const { return has_inf ? (1 << exp_bits) - 2 - bias() : (1 << exp_bits) - 1 - bias(); }
  double max_finite() const {
    const int top_mantissa = has_inf ? (1 << man_bits) - 1 : (1 << man_bits) - 2;
    return std::ldexp(1.0 + top_mantissa / double(1 << man_bits), max_exponent());
  }
  uint32_t nan_bits() const {
    return has_inf ? (((1u << exp_bits) - 1) << man_bits) | (1u << (man_bits - 1)) : (1u << (exp_bits + man_bits)) - 1;
  }
  uint32_t inf_bits() const { return ((1u << exp_bits) - 1) << man_bits; }

  // Round to nearest, ties to even. Overflow gives inf (IEEE layout) or saturates (fn layout).
  uint32_t encode(float value) const {
    const uint32_t sign = std::signbit(value) ? 1u << (exp_bits + man_bits) : 0u;
    if (std::isnan(value)) return sign | nan_bits();
    const double magnitude = std::fabs(double(value));
    if (std::isinf(value)) return sign | (has_inf ? inf_bits() : encode_finite(max_finite()));
    if (magnitude == 0.0) return sign;
    const int min_normal_exp = 1 - bias();
    int exponent = std::ilogb(magnitude);
    if (exponent < min_normal_exp) exponent = min_normal_exp;
    const double quantum = std::ldexp(1.0, exponent - man_bits);
    const double rounded = std::nearbyint(magnitude / quantum) * quantum;  // FE_TONEAREST: ties to even
    if (rounded > max_finite()) return sign | (has_inf ? inf_bits() : encode_finite(max_finite()));
    return sign | encode_finite(rounded);
  }

  // `magnitude` is exactly representable.
  uint32_t encode_finite(double magnitude) const {
    const int min_normal_exp = 1 - bias();
    if (magnitude < std::ldexp(1.0, min_normal_exp)) {
      return uint32_t(magnitude / std::ldexp(1.0, min_normal_exp - man_bits));
    }
    const int exponent = std::ilogb(magnitude);
    const double fraction = magnitude / std::ldexp(1.0, exponent) - 1.0;
    const uint32_t mantissa = uint32_t(fraction * (1 << man_bits));
    return (uint32_t(exponent + bias()) << man_bits) | mantissa;
  }

  float decode(uint32_t bits) const {
    const bool negative = (bits >> (exp_bits + man_bits)) & 1u;
    const uint32_t exponent_field = (bits >> man_bits) & ((1u << exp_bits) - 1);
    const uint32_t mantissa = bits & ((1u << man_bits) - 1);
    double magnitude;
    const uint32_t all_ones = (1u << exp_bits) - 1;
    if (has_inf && exponent_field == all_ones) {
      magnitude = mantissa ? NAN : INFINITY;
    } else if (!has_inf && exponent_field == all_ones && mantissa == (1u << man_bits) - 1) {
      magnitude = NAN;
    } else if (exponent_field == 0) {
      magnitude = std::ldexp(double(mantissa), 1 - bias() - man_bits);
    } else {
      magnitude = std::ldexp(1.0 + mantissa / double(1 << man_bits), int(exponent_field) - bias());
    }
    return float(negative ? -magnitude : magnitude);
  }
};

constexpr MiniFloat kF16{5, 10, true};
constexpr MiniFloat kE4M3{4, 3, false};
constexpr MiniFloat kE5M2{5, 2, true};

}  // namespace

size_t dtype_size(DType dtype) { return info(dtype).size; }
std::string_view dtype_name(DType dtype) { return info(dtype).name; }
std::string_view dtype_safetensors_name(DType dtype) { return info(dtype).safetensors; }
bool dtype_is_floating(DType dtype) { return info(dtype).floating; }

bool dtype_from_safetensors_name(std::string_view name, DType* out) {
  for (const auto& entry : kDTypes) {
    if (entry.safetensors == name) {
      *out = entry.dtype;
      return true;
    }
  }
  return false;
}

uint16_t f32_to_bf16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return uint16_t((bits >> 16) | 0x0040u);  // keep sign, force quiet NaN
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t((bits + rounding_bias) >> 16);
}

float bf16_bits_to_f32(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

uint16_t f32_to_f16_bits(float value) { return uint16_t(kF16.encode(value)); }
float f16_bits_to_f32(uint16_t bits) { return kF16.decode(bits); }
uint8_t f32_to_e4m3_bits(float value) { return uint8_t(kE4M3.encode(value)); }
float e4m3_bits_to_f32(uint8_t bits) { return kE4M3.decode(bits); }
uint8_t f32_to_e5m2_bits(float value) { return uint8_t(kE5M2.encode(value)); }
float e5m2_bits_to_f32(uint8_t bits) { return kE5M2.decode(bits); }

}  // namespace moetrain
