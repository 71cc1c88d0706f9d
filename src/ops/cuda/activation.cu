// defines: the CUDA SwiGLU kernels: silu(g) = g / (1 + exp(-g)), d silu / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))),
// one thread per (row, column) of y, or per 8 consecutive columns where the width allows, each reading its gate and up
// elements. The clamped variant (GPT-OSS):
// g = min(gate, limit), u = clamp(up, -limit, limit), y = (u + 1) * g * sigmoid(g * alpha), the gradient passing the
// clamps strictly inside, min < x < max (torch 2.15's clamp backward: 0 at the limit itself).
#include "ops/cuda/activation.h"

#include <cstdint>
#include <initializer_list>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride beyond this

// The plain SwiGLU walks K consecutive columns per thread: K = 8 (16-byte accesses, one row/column division per 8
// elements) when the width and the addresses allow (spans_of_8), else K = 1. The per-element math is the same.
template <int K, typename T>
__device__ void forward_columns(T* y, const T* gate_up, int64_t rows, int64_t width) {
  const int64_t units = rows * width / K;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; unit < units; unit += stride) {
    const int64_t i = unit * K;
    const int64_t n = i / width;
    const int64_t j = i % width;
    const T* gate = gate_up + n * 2 * width;
    float g[K], u[K];
    load_span<K>(gate + j, g);
    load_span<K>(gate + width + j, u);
#pragma unroll
    for (int e = 0; e < K; ++e) {
      const float silu = g[e] / (1.0f + expf(-g[e]));
      g[e] = silu * u[e];
    }
    store_span<K>(y + i, g);
  }
}

template <typename T>
__global__ void forward_kernel(T* y, const T* gate_up, int64_t rows, int64_t width, bool packed) {
  if (packed) {
    forward_columns<8>(y, gate_up, rows, width);
  } else {
    forward_columns<1>(y, gate_up, rows, width);
  }
}

template <int K, typename T>
__device__ void backward_columns(T* dgate_up, const T* dy, const T* gate_up, int64_t rows, int64_t width) {
  const int64_t units = rows * width / K;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; unit < units; unit += stride) {
    const int64_t i = unit * K;
    const int64_t n = i / width;
    const int64_t j = i % width;
    const T* gate = gate_up + n * 2 * width;
    T* dgate = dgate_up + n * 2 * width;
    float g[K], u[K], d[K], dg[K], du[K];
    load_span<K>(gate + j, g);
    load_span<K>(gate + width + j, u);
    load_span<K>(dy + i, d);
#pragma unroll
    for (int e = 0; e < K; ++e) {
      const float denominator = 1.0f + expf(-g[e]);
      const float sigmoid = 1.0f / denominator;
      const float silu = g[e] / denominator;
      const float dsilu = sigmoid * (1.0f + g[e] * (1.0f - sigmoid));
      dg[e] = d[e] * u[e] * dsilu;
      du[e] = d[e] * silu;
    }
    store_span<K>(dgate + j, dg);
    store_span<K>(dgate + width + j, du);
  }
}

template <typename T>
__global__ void backward_kernel(T* dgate_up, const T* dy, const T* gate_up, int64_t rows, int64_t width, bool packed) {
  if (packed) {
    backward_columns<8>(dgate_up, dy, gate_up, rows, width);
  } else {
    backward_columns<1>(dgate_up, dy, gate_up, rows, width);
  }
}

// min(x, limit) and clamp(x, -limit, limit) as torch writes them (a NaN stays NaN, unlike fminf).
__device__ __forceinline__ float clamp_max(float x, float limit) { return x > limit ? limit : x; }
__device__ __forceinline__ float clamp_both(float x, float limit) {
  return x < -limit ? -limit : (x > limit ? limit : x);
}

template <typename T>
__global__ void clamped_forward_kernel(T* y, const T* gate_up, int64_t rows, int64_t width, float alpha, float limit) {
  const int64_t total = rows * width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t n = i / width;
    const int64_t j = i % width;
    const T* gate = gate_up + n * 2 * width;
    const float g = clamp_max(load_float(gate + j), limit);
    const float u = clamp_both(load_float(gate + width + j), limit);
    const float glu = g * (1.0f / (1.0f + expf(-(g * alpha))));
    store_float(y + i, (u + 1.0f) * glu);
  }
}

template <typename T>
__global__ void clamped_backward_kernel(T* dgate_up, const T* dy, const T* gate_up, int64_t rows, int64_t width,
                                        float alpha, float limit) {
  const int64_t total = rows * width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t n = i / width;
    const int64_t j = i % width;
    const T* gate = gate_up + n * 2 * width;
    T* dgate = dgate_up + n * 2 * width;
    const float gate_in = load_float(gate + j);
    const float up_in = load_float(gate + width + j);
    const float d = load_float(dy + i);
    const float g = clamp_max(gate_in, limit);
    const float u = clamp_both(up_in, limit);
    const float sigmoid = 1.0f / (1.0f + expf(-(g * alpha)));
    const float glu = g * sigmoid;
    const float dglu = sigmoid * (1.0f + alpha * g * (1.0f - sigmoid));
    store_float(dgate + j, gate_in < limit ? d * (u + 1.0f) * dglu : 0.0f);
    store_float(dgate + width + j, (up_in > -limit && up_in < limit) ? d * glu : 0.0f);
  }
}

__device__ __forceinline__ float sigmoid_of(float g) { return 1.0f / (1.0f + expf(-g)); }

// One thread per element; gate_width is width or 1 (a gate per row).
template <typename T>
__global__ void sigmoid_gate_forward_kernel(T* y, const T* x, const T* gate, int64_t rows, int64_t width,
                                            int64_t gate_width) {
  const int64_t total = rows * width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t g = gate_width == 1 ? i / width : i;
    store_float(y + i, load_float(x + i) * sigmoid_of(load_float(gate + g)));
  }
}

// A gate per element: one thread per element.
template <typename T>
__global__ void sigmoid_gate_backward_kernel(T* dx, T* dgate, const T* dy, const T* x, const T* gate, int64_t total) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const float s = sigmoid_of(load_float(gate + i));
    const float d = load_float(dy + i);
    store_float(dgate + i, (d * load_float(x + i)) * (s * (1.0f - s)));
    store_float(dx + i, d * s);
  }
}

// A gate per row: one warp per row (the rows are wide: the model's hidden size), its lanes striding the columns so the
// loads coalesce, the partial sums then combined by a fixed butterfly: deterministic.
constexpr int kRowsPerBlock = kThreads / 32;

template <typename T>
__global__ void sigmoid_row_gate_backward_kernel(T* dx, T* dgate, const T* dy, const T* x, const T* gate, int64_t rows,
                                                 int64_t width) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; n < rows; n += warps) {
    const float s = sigmoid_of(load_float(gate + n));
    float sum = 0.0f;
    for (int64_t j = lane; j < width; j += 32) {
      const int64_t i = n * width + j;
      const float d = load_float(dy + i);
      sum += d * load_float(x + i);
      store_float(dx + i, d * s);
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) store_float(dgate + n, sum * (s * (1.0f - s)));
  }
}

unsigned blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

}  // namespace

void swiglu_forward(const Stream& stream, const Tensor& y, const Tensor& gate_up) {
  const int64_t rows = gate_up.size(0);
  const int64_t width = gate_up.size(1) / 2;
  if (rows * width == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const bool packed = spans_of_8(width, {y.raw_data(), gate_up.raw_data()});
  switch (gate_up.dtype()) {
    case DType::F32:
      forward_kernel<<<blocks_for(rows * width / (packed ? 8 : 1)), kThreads, 0, cu_stream>>>(
          static_cast<float*>(y.raw_data()), static_cast<const float*>(gate_up.raw_data()), rows, width, packed);
      break;
    case DType::BF16:
      forward_kernel<<<blocks_for(rows * width / (packed ? 8 : 1)), kThreads, 0, cu_stream>>>(
          static_cast<__nv_bfloat16*>(y.raw_data()), static_cast<const __nv_bfloat16*>(gate_up.raw_data()), rows, width,
          packed);
      break;
    default: MT_FAIL("swiglu_forward (CUDA): expected gate_up in f32 or bf16 but found {}", gate_up.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

void swiglu_backward(const Stream& stream, const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up) {
  const int64_t rows = gate_up.size(0);
  const int64_t width = gate_up.size(1) / 2;
  if (rows * width == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const bool packed = spans_of_8(width, {dgate_up.raw_data(), dy.raw_data(), gate_up.raw_data()});
  switch (gate_up.dtype()) {
    case DType::F32:
      backward_kernel<<<blocks_for(rows * width / (packed ? 8 : 1)), kThreads, 0, cu_stream>>>(
          static_cast<float*>(dgate_up.raw_data()), static_cast<const float*>(dy.raw_data()),
          static_cast<const float*>(gate_up.raw_data()), rows, width, packed);
      break;
    case DType::BF16:
      backward_kernel<<<blocks_for(rows * width / (packed ? 8 : 1)), kThreads, 0, cu_stream>>>(
          static_cast<__nv_bfloat16*>(dgate_up.raw_data()), static_cast<const __nv_bfloat16*>(dy.raw_data()),
          static_cast<const __nv_bfloat16*>(gate_up.raw_data()), rows, width, packed);
      break;
    default: MT_FAIL("swiglu_backward (CUDA): expected gate_up in f32 or bf16 but found {}", gate_up.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

void clamped_swiglu_forward(const Stream& stream, const Tensor& y, const Tensor& gate_up,
                            const ClampedSwigluParams& params) {
  const int64_t rows = gate_up.size(0);
  const int64_t width = gate_up.size(1) / 2;
  if (rows * width == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  switch (gate_up.dtype()) {
    case DType::F32:
      clamped_forward_kernel<<<blocks_for(rows * width), kThreads, 0, cu_stream>>>(
          static_cast<float*>(y.raw_data()), static_cast<const float*>(gate_up.raw_data()), rows, width, params.alpha,
          params.limit);
      break;
    case DType::BF16:
      clamped_forward_kernel<<<blocks_for(rows * width), kThreads, 0, cu_stream>>>(
          static_cast<__nv_bfloat16*>(y.raw_data()), static_cast<const __nv_bfloat16*>(gate_up.raw_data()), rows, width,
          params.alpha, params.limit);
      break;
    default: MT_FAIL("clamped_swiglu_forward (CUDA): expected gate_up in f32 or bf16 but found {}", gate_up.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

void clamped_swiglu_backward(const Stream& stream, const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up,
                             const ClampedSwigluParams& params) {
  const int64_t rows = gate_up.size(0);
  const int64_t width = gate_up.size(1) / 2;
  if (rows * width == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  switch (gate_up.dtype()) {
    case DType::F32:
      clamped_backward_kernel<<<blocks_for(rows * width), kThreads, 0, cu_stream>>>(
          static_cast<float*>(dgate_up.raw_data()), static_cast<const float*>(dy.raw_data()),
          static_cast<const float*>(gate_up.raw_data()), rows, width, params.alpha, params.limit);
      break;
    case DType::BF16:
      clamped_backward_kernel<<<blocks_for(rows * width), kThreads, 0, cu_stream>>>(
          static_cast<__nv_bfloat16*>(dgate_up.raw_data()), static_cast<const __nv_bfloat16*>(dy.raw_data()),
          static_cast<const __nv_bfloat16*>(gate_up.raw_data()), rows, width, params.alpha, params.limit);
      break;
    default:
      MT_FAIL("clamped_swiglu_backward (CUDA): expected gate_up in f32 or bf16 but found {}", gate_up.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_sigmoid_gate_forward(cudaStream_t stream, const Tensor& y, const Tensor& x, const Tensor& gate) {
  const int64_t rows = x.size(0), width = x.size(1);
  sigmoid_gate_forward_kernel<<<blocks_for(rows * width), kThreads, 0, stream>>>(
      static_cast<T*>(y.raw_data()), static_cast<const T*>(x.raw_data()), static_cast<const T*>(gate.raw_data()), rows,
      width, gate.size(1));
}

template <typename T>
void launch_sigmoid_gate_backward(cudaStream_t stream, const Tensor& dx, const Tensor& dgate, const Tensor& dy,
                                  const Tensor& x, const Tensor& gate) {
  const int64_t rows = x.size(0), width = x.size(1);
  if (gate.size(1) == 1) {
    sigmoid_row_gate_backward_kernel<<<blocks_for(rows * 32), kThreads, 0, stream>>>(
        static_cast<T*>(dx.raw_data()), static_cast<T*>(dgate.raw_data()), static_cast<const T*>(dy.raw_data()),
        static_cast<const T*>(x.raw_data()), static_cast<const T*>(gate.raw_data()), rows, width);
  } else {
    sigmoid_gate_backward_kernel<<<blocks_for(rows * width), kThreads, 0, stream>>>(
        static_cast<T*>(dx.raw_data()), static_cast<T*>(dgate.raw_data()), static_cast<const T*>(dy.raw_data()),
        static_cast<const T*>(x.raw_data()), static_cast<const T*>(gate.raw_data()), rows * width);
  }
}

void sigmoid_gate_forward(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& gate) {
  if (x.numel() == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  switch (x.dtype()) {
    case DType::F32: launch_sigmoid_gate_forward<float>(cu_stream, y, x, gate); break;
    case DType::BF16: launch_sigmoid_gate_forward<__nv_bfloat16>(cu_stream, y, x, gate); break;
    default: MT_FAIL("sigmoid_gate_forward (CUDA): expected x in f32 or bf16 but found {}", x.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

void sigmoid_gate_backward(const Stream& stream, const Tensor& dx, const Tensor& dgate, const Tensor& dy,
                           const Tensor& x, const Tensor& gate) {
  if (x.numel() == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  switch (x.dtype()) {
    case DType::F32: launch_sigmoid_gate_backward<float>(cu_stream, dx, dgate, dy, x, gate); break;
    case DType::BF16: launch_sigmoid_gate_backward<__nv_bfloat16>(cu_stream, dx, dgate, dy, x, gate); break;
    default: MT_FAIL("sigmoid_gate_backward (CUDA): expected x in f32 or bf16 but found {}", x.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
