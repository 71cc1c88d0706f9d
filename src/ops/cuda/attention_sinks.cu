// defines: the CUDA attention-sink kernels (ops/cuda/attention_sinks.h): the elementwise forward rescale and the
// two-pass sink gradient. Both compute in f32 with the CPU reference's formulas (ops/cpu/attention_sinks.cpp); the
// products and sums are written with the round-to-nearest intrinsics, which nvcc never fuses into multiply-adds.
#include "ops/cuda/attention_sinks.h"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride beyond this
constexpr unsigned kFullMask = 0xffffffffu;

// Butterfly sum over the warp: every lane ends with the same bits, in an order fixed by the lane layout.
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// One warp per (token, head) pair. Lane 0 reads lse and broadcasts it, and writes the new lse after the rescale, so
// no lane reads the pair's lse after it changed.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(T* out, float* lse, const float* sinks, int64_t pairs, int nh, int hdv) {
  const int lane = threadIdx.x % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t pair = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; pair < pairs; pair += stride) {
    float a = lane == 0 ? lse[pair] : 0.0f;
    a = __shfl_sync(kFullMask, a, 0);
    const float s = sinks[pair % nh];
    const float d = __fsub_rn(a, s);  // +inf for a sink of -inf: the scale is 1 and lse is unchanged
    const float e = expf(-fabsf(d));
    const float denominator = __fadd_rn(1.0f, e);
    const float scale = d >= 0.0f ? __fdiv_rn(1.0f, denominator) : __fdiv_rn(e, denominator);
    T* row = out + pair * hdv;
    for (int c = lane; c < hdv; c += 32) store_float(row + c, __fmul_rn(load_float(row + c), scale));
    if (lane == 0) lse[pair] = __fadd_rn(fmaxf(a, s), log1pf(e));
  }
}

// partial[chunk, h] = sum over the tokens of the chunk, ascending, of exp(sinks[h] - lse[t, h]) * <dout, out>[t, h].
// Grid (chunks, ceil(nh / kWarps)); warp w of block (c, y) owns head y * kWarps + w.
template <typename T>
__global__ void __launch_bounds__(kThreads) chunk_kernel(float* partial, const T* dout, const T* out, const float* lse,
                                                         const float* sinks, int64_t tokens, int nh, int hdv) {
  const int lane = threadIdx.x % 32;
  const int h = static_cast<int>(blockIdx.y) * kWarps + static_cast<int>(threadIdx.x) / 32;
  if (h >= nh) return;  // the whole warp leaves together
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kSinkTokensPerChunk;
  const int64_t end = begin + kSinkTokensPerChunk < tokens ? begin + kSinkTokensPerChunk : tokens;
  const float s = sinks[h];
  float acc = 0.0f;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t pair = t * nh + h;
    const T* dout_row = dout + pair * hdv;
    const T* out_row = out + pair * hdv;
    float dot = 0.0f;
    for (int c = lane; c < hdv; c += 32)
      dot = __fadd_rn(dot, __fmul_rn(load_float(dout_row + c), load_float(out_row + c)));
    dot = warp_sum(dot);
    acc = __fadd_rn(acc, __fmul_rn(expf(__fsub_rn(s, lse[pair])), dot));
  }
  if (lane == 0) partial[blockIdx.x * static_cast<int64_t>(nh) + h] = acc;
}

// dsinks[h] -= the chunk sums of head h: thread i adds chunks i, i + kThreads, ... in ascending order, then a tree in
// shared memory halves the kThreads partial sums (a shape fixed by kThreads), one block per head.
__global__ void __launch_bounds__(kThreads) total_kernel(float* dsinks, const float* partial, int64_t chunks, int nh) {
  __shared__ float sums[kThreads];
  const int h = static_cast<int>(blockIdx.x);
  float acc = 0.0f;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) acc = __fadd_rn(acc, partial[c * nh + h]);
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half)
      sums[threadIdx.x] = __fadd_rn(sums[threadIdx.x], sums[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x == 0) dsinks[h] = __fsub_rn(dsinks[h], sums[0]);
}

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }

// Calls f(T*) with out's element type, f32 or bf16.
template <typename F>
void dispatch_activation(const Tensor& out, const char* op, F&& f) {
  switch (out.dtype()) {
    case DType::F32: f(static_cast<float*>(nullptr)); return;
    case DType::BF16: f(static_cast<__nv_bfloat16*>(nullptr)); return;
    default: MT_FAIL("{} (CUDA): expected out in f32 or bf16 but found {}", op, out.describe());
  }
}

}  // namespace

void attention_sinks_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& sinks) {
  const int64_t pairs = out.size(0) * out.size(1);
  if (pairs == 0) return;
  const int64_t blocks = (pairs + kWarps - 1) / kWarps;
  dispatch_activation(out, "attention_sinks_forward", [&]<typename T>(T*) {
    forward_kernel<<<static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads, 0, native(stream)>>>(
        static_cast<T*>(out.raw_data()), static_cast<float*>(lse.raw_data()),
        static_cast<const float*>(sinks.raw_data()), pairs, static_cast<int>(out.size(1)),
        static_cast<int>(out.size(2)));
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void attention_sinks_backward(const Stream& stream, const Tensor& dsinks, const Tensor& dout, const Tensor& out,
                              const Tensor& lse, const Tensor& sinks) {
  const int64_t tokens = out.size(0), nh = out.size(1);
  if (tokens == 0 || nh == 0) return;  // dsinks -= an empty sum
  MT_CHECK(nh <= int64_t{65535} * kWarps, "attention_sinks_backward (CUDA): at most {} heads but found {}",
           int64_t{65535} * kWarps, nh);
  const int64_t chunks = (tokens + kSinkTokensPerChunk - 1) / kSinkTokensPerChunk;
  const cudaStream_t cu_stream = native(stream);
  // The scratch comes from the device's stream-ordered pool; its release is ordered after these kernels.
  const Tensor partial = Tensor::empty({chunks, nh}, DType::F32, dsinks.device());
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>((nh + kWarps - 1) / kWarps));
  dispatch_activation(out, "attention_sinks_backward", [&]<typename T>(T*) {
    chunk_kernel<<<grid, kThreads, 0, cu_stream>>>(
        static_cast<float*>(partial.raw_data()), static_cast<const T*>(dout.raw_data()),
        static_cast<const T*>(out.raw_data()), static_cast<const float*>(lse.raw_data()),
        static_cast<const float*>(sinks.raw_data()), tokens, static_cast<int>(nh), static_cast<int>(out.size(2)));
  });
  MT_CUDA_CHECK(cudaGetLastError());
  total_kernel<<<static_cast<unsigned>(nh), kThreads, 0, cu_stream>>>(static_cast<float*>(dsinks.raw_data()),
                                                                      static_cast<const float*>(partial.raw_data()),
                                                                      chunks, static_cast<int>(nh));
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
