// defines: the CUDA elementwise kernels: grid-stride loops over the elements, one output per element. The bf16
// conversion of cast and round_to_bf16_inplace is the bit-level rule of core/dtype.cpp (NaN too), so those ops
// give the CPU's bytes; the arithmetic ones round bf16 results with __float2bfloat16_rn (nearest even).
#include "ops/cuda/elementwise.h"

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // the grid-stride loop covers the rest

// core/dtype.cpp's f32_to_bf16_bits: nearest even; NaN keeps its sign and upper payload and is forced quiet.
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float value) {
  const uint32_t bits = __float_as_uint(value);
  if (value != value) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t bits) { return __uint_as_float(uint32_t(bits) << 16); }

// f32 <-> f64 as the CPU (x86 cvtss2sd / cvtsd2ss) converts: a NaN keeps its sign and the top of its payload and
// is made quiet; everything else converts with IEEE rounding to nearest (subnormals included: no flush to zero).
__device__ __forceinline__ double f32_to_f64(float value) {
  if (value != value) {
    const uint32_t bits = __float_as_uint(value);
    const uint64_t sign = static_cast<uint64_t>(bits >> 31) << 63;
    const uint64_t payload = static_cast<uint64_t>((bits & 0x7fffffu) | 0x400000u) << 29;
    return __longlong_as_double(static_cast<long long>(sign | 0x7ff0000000000000ull | payload));
  }
  return static_cast<double>(value);
}

__device__ __forceinline__ float f64_to_f32(double value) {
  if (value != value) {
    const auto bits = static_cast<uint64_t>(__double_as_longlong(value));
    const uint32_t sign = static_cast<uint32_t>(bits >> 63) << 31;
    const uint32_t payload = static_cast<uint32_t>((bits >> 29) & 0x7fffffu) | 0x400000u;
    return __uint_as_float(sign | 0x7f800000u | payload);
  }
  return __double2float_rn(value);
}

// The cast's element conversion, as ops/cpu/elementwise.cpp's: f32 <-> bf16 directly; every other pair through
// double, which holds f32 and bf16 exactly; to f32 rounds to nearest, to bf16 through f32.
__device__ __forceinline__ double load_double(double v) { return v; }
__device__ __forceinline__ double load_double(float v) { return f32_to_f64(v); }
__device__ __forceinline__ double load_double(uint16_t v) { return f32_to_f64(bf16_bits_to_f32(v)); }

template <typename Out>
__device__ __forceinline__ Out store_double(double v);
template <>
__device__ __forceinline__ double store_double<double>(double v) {
  return v;
}
template <>
__device__ __forceinline__ float store_double<float>(double v) {
  return f64_to_f32(v);
}
template <>
__device__ __forceinline__ uint16_t store_double<uint16_t>(double v) {
  return f32_to_bf16_bits(f64_to_f32(v));
}

template <typename In, typename Out>
__device__ __forceinline__ Out convert(In v) {
  if constexpr (std::is_same_v<In, float> && std::is_same_v<Out, uint16_t>) {
    return f32_to_bf16_bits(v);
  } else if constexpr (std::is_same_v<In, uint16_t> && std::is_same_v<Out, float>) {
    return bf16_bits_to_f32(v);
  } else {
    return store_double<Out>(load_double(v));
  }
}

__device__ __forceinline__ int64_t first_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// out = a + b, 8 consecutive elements a thread (16-byte accesses) when `packed`, else one; each sum rounded once.
template <typename T, typename TB>
__global__ void add_kernel(T* out, const T* a, const TB* b, int64_t n, bool packed) {
  if (packed) {
    for (int64_t i = first_index() * 8; i < n; i += grid_stride() * 8) {
      float va[8], vb[8];
      load8(a + i, va);
      load8(b + i, vb);
#pragma unroll
      for (int e = 0; e < 8; ++e) va[e] = va[e] + vb[e];
      store8(out + i, va);
    }
    return;
  }
  for (int64_t i = first_index(); i < n; i += grid_stride())
    store_float(out + i, load_float(a + i) + load_float(b + i));
}

template <typename T>
__global__ void scale_kernel(T* x, float factor, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) store_float(x + i, load_float(x + i) * factor);
}

template <typename In, typename Out>
__global__ void cast_kernel(Out* out, const In* in, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = convert<In, Out>(in[i]);
}

__global__ void round_to_bf16_kernel(float* x, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) x[i] = bf16_bits_to_f32(f32_to_bf16_bits(x[i]));
}

unsigned blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }

// out = a + b with out and a of one float type and b of its own; accumulate is the case out == a.
void launch_add(const Stream& stream, const Tensor& out, const Tensor& a, const Tensor& b, const char* op) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const bool packed = n % 8 == 0 && reinterpret_cast<uintptr_t>(out.raw_data()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(a.raw_data()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(b.raw_data()) % 16 == 0;
  const unsigned blocks = blocks_for(packed ? n / 8 : n);
  const auto launch = [&]<typename T>(T*) {
    switch (b.dtype()) {
      case DType::F32:
        add_kernel<<<blocks, kThreads, 0, native(stream)>>>(static_cast<T*>(out.raw_data()),
                                                            static_cast<const T*>(a.raw_data()),
                                                            static_cast<const float*>(b.raw_data()), n, packed);
        break;
      case DType::BF16:
        add_kernel<<<blocks, kThreads, 0, native(stream)>>>(static_cast<T*>(out.raw_data()),
                                                            static_cast<const T*>(a.raw_data()),
                                                            static_cast<const __nv_bfloat16*>(b.raw_data()), n, packed);
        break;
      default: MT_FAIL("{} (CUDA): expected the addend in f32 or bf16 but found {}", op, b.describe());
    }
  };
  switch (out.dtype()) {
    case DType::F32: launch(static_cast<float*>(nullptr)); break;
    case DType::BF16: launch(static_cast<__nv_bfloat16*>(nullptr)); break;
    default: MT_FAIL("{} (CUDA): expected f32 or bf16 tensors but found {}", op, out.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

template <typename In>
void launch_cast_from(const Stream& stream, const Tensor& out, const In* in, int64_t n) {
  const unsigned blocks = blocks_for(n);
  switch (out.dtype()) {
    case DType::F64:
      cast_kernel<<<blocks, kThreads, 0, native(stream)>>>(static_cast<double*>(out.raw_data()), in, n);
      break;
    case DType::F32:
      cast_kernel<<<blocks, kThreads, 0, native(stream)>>>(static_cast<float*>(out.raw_data()), in, n);
      break;
    case DType::BF16:
      cast_kernel<<<blocks, kThreads, 0, native(stream)>>>(static_cast<uint16_t*>(out.raw_data()), in, n);
      break;
    default: MT_FAIL("cast (CUDA): expected out in f64, f32 or bf16 but found {}", out.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void add_forward(const Stream& stream, const Tensor& out, const Tensor& a, const Tensor& b) {
  launch_add(stream, out, a, b, "add_forward");
}

void accumulate(const Stream& stream, const Tensor& acc, const Tensor& x) {
  launch_add(stream, acc, acc, x, "accumulate");
}

void scale_inplace(const Stream& stream, const Tensor& x, double factor) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const float f = static_cast<float>(factor);
  switch (x.dtype()) {
    case DType::F32:
      scale_kernel<<<blocks_for(n), kThreads, 0, native(stream)>>>(static_cast<float*>(x.raw_data()), f, n);
      break;
    case DType::BF16:
      scale_kernel<<<blocks_for(n), kThreads, 0, native(stream)>>>(static_cast<__nv_bfloat16*>(x.raw_data()), f, n);
      break;
    default: MT_FAIL("scale_inplace (CUDA): expected x in f32 or bf16 but found {}", x.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

void cast(const Stream& stream, const Tensor& out, const Tensor& in) {
  const int64_t n = in.numel();
  if (n == 0) return;
  switch (in.dtype()) {
    case DType::F64: launch_cast_from(stream, out, static_cast<const double*>(in.raw_data()), n); return;
    case DType::F32: launch_cast_from(stream, out, static_cast<const float*>(in.raw_data()), n); return;
    case DType::BF16: launch_cast_from(stream, out, static_cast<const uint16_t*>(in.raw_data()), n); return;
    default: MT_FAIL("cast (CUDA): expected in in f64, f32 or bf16 but found {}", in.describe());
  }
}

void round_to_bf16_inplace(const Stream& stream, const Tensor& x) {
  const int64_t n = x.numel();
  if (n == 0) return;
  MT_CHECK(x.dtype() == DType::F32, "round_to_bf16_inplace (CUDA): expected x in f32 but found {}", x.describe());
  round_to_bf16_kernel<<<blocks_for(n), kThreads, 0, native(stream)>>>(static_cast<float*>(x.raw_data()), n);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
