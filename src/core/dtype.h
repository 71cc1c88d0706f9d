// defines: DType, every element type the engine stores (those of the safetensors format), its size
// and names, and the scalar conversions for the reduced-precision formats (bf16 with
// round-to-nearest-even, f16, fp8 e4m3fn / e5m2 storage).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace moetrain {

enum class DType : uint8_t {
  F64,
  F32,
  BF16,
  F16,
  F8E4M3,  // OCP e4m3fn: no infinities, 0x7f/0xff are NaN, max 448
  F8E5M2,
  I64,
  I32,
  I16,
  I8,
  U64,
  U32,
  U16,
  U8,
  Bool,
};

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);                             // "f32", "bf16", ...
std::string_view dtype_safetensors_name(DType dtype);                 // "F32", "BF16", "F8_E4M3", ...
bool dtype_from_safetensors_name(std::string_view name, DType* out);  // false when unknown
bool dtype_is_floating(DType dtype);

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<double>() {
  return DType::F64;
}
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::I64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::I32;
}
template <>
constexpr DType dtype_of<int16_t>() {
  return DType::I16;
}
template <>
constexpr DType dtype_of<int8_t>() {
  return DType::I8;
}
template <>
constexpr DType dtype_of<uint64_t>() {
  return DType::U64;
}
template <>
constexpr DType dtype_of<uint32_t>() {
  return DType::U32;
}
template <>
constexpr DType dtype_of<uint16_t>() {
  return DType::U16;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::U8;
}

// bf16 is the upper half of an f32; the conversion rounds to nearest, ties to even, keeps NaN a
// (quiet) NaN and infinities infinite. Subnormals round like any other value.
uint16_t f32_to_bf16_bits(float value);
float bf16_bits_to_f32(uint16_t bits);
// Rounds an f32 to the nearest bf16 and returns it as an f32 (the value the wire would carry).
inline float round_to_bf16(float value) { return bf16_bits_to_f32(f32_to_bf16_bits(value)); }

uint16_t f32_to_f16_bits(float value);  // round to nearest even; overflow -> inf
float f16_bits_to_f32(uint16_t bits);

uint8_t f32_to_e4m3_bits(float value);  // saturates to +-448; NaN -> 0x7f
float e4m3_bits_to_f32(uint8_t bits);
uint8_t f32_to_e5m2_bits(float value);  // round to nearest even; overflow -> inf
float e5m2_bits_to_f32(uint8_t bits);

}  // namespace moetrain
