// defines: the CUDA optimizer kernels: AdamW with the explicit round-to-nearest intrinsics (__fmul_rn, ...), which
// nvcc never fuses into a multiply-add, so each step rounds exactly as the CPU's -ffp-contract=off code does; sums
// of squares as two fixed trees in f64 (within chunks, then over the chunks).
#include "ops/cuda/optim.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 16;  // grid-stride beyond this
constexpr int kReduceThreads = 256;

// The f32 scalars of ops/cpu/optim.cpp, rounded from the same doubles.
struct AdamWScalars {
  float decay;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float neg_step_size;
  float bias_correction2_sqrt;
  float eps;
  bool apply_decay;
};

__global__ void adamw_kernel(float* p, float* m, float* v, const float* g, int64_t n, AdamWScalars s) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool small_weight = fabsf(s.one_minus_beta1) < 0.5f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float param = p[i];
    float avg = m[i];
    float avg_sq = v[i];
    const float grad = g[i];
    if (s.apply_decay) param = __fmul_rn(param, s.decay);  // param.mul_(1 - lr * wd)
    // exp_avg.lerp_(grad, 1 - b1), at::lerp's two branches.
    const float diff = __fsub_rn(grad, avg);
    avg = small_weight ? __fadd_rn(avg, __fmul_rn(s.one_minus_beta1, diff))
                       : __fsub_rn(grad, __fmul_rn(diff, __fsub_rn(1.0f, s.one_minus_beta1)));
    avg_sq = __fmul_rn(avg_sq, s.beta2);                                              // exp_avg_sq.mul_(b2)
    avg_sq = __fadd_rn(avg_sq, __fmul_rn(s.one_minus_beta2, __fmul_rn(grad, grad)));  // .addcmul_(g, g, 1 - b2)
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(avg_sq), s.bias_correction2_sqrt), s.eps);
    param = __fadd_rn(param, __fmul_rn(s.neg_step_size, __fdiv_rn(avg, denom)));  // param.addcdiv_(m, denom, -ss)
    p[i] = param;
    m[i] = avg;
    v[i] = avg_sq;
  }
}

// Sum over the block (kReduceThreads threads) in a fixed tree; thread 0 gets the result.
__device__ double block_sum(double value) {
  __shared__ double scratch[kReduceThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    total = scratch[0];
    for (int w = 1; w < kReduceThreads / 32; ++w) total += scratch[w];
  }
  return total;
}

// partial[c] = sum of squares of chunk c: thread k takes elements k, k + kReduceThreads, ... of the chunk.
__global__ void chunk_squares_kernel(double* partial, const float* x, int64_t n) {
  const int64_t chunk = blockIdx.x;
  const int64_t begin = chunk * kSumOfSquaresChunk;
  const int64_t end = begin + kSumOfSquaresChunk < n ? begin + kSumOfSquaresChunk : n;
  double sum = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kReduceThreads) {
    const double value = static_cast<double>(x[i]);
    sum += value * value;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) partial[chunk] = sum;
}

// *out = sum of partial[0 .. chunks): thread k takes chunks k, k + kReduceThreads, ..., then the fixed tree.
__global__ void sum_chunks_kernel(double* out, const double* partial, int64_t chunks) {
  double sum = 0.0;
  for (int64_t c = threadIdx.x; c < chunks; c += kReduceThreads) sum += partial[c];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *out = sum;
}

int64_t chunks_of(const Tensor& t) { return (t.numel() + kSumOfSquaresChunk - 1) / kSumOfSquaresChunk; }

}  // namespace

void adamw_step(const Stream& stream, const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& grad, const AdamWParams& params) {
  MT_CHECK(param.dtype() == DType::F32, "adamw_step (CUDA): expected param in f32 but found {}", param.describe());
  // Python-side scalars of torch.optim.adamw in double, then rounded to f32: ops/cpu/optim.cpp's code, line by line.
  const double step = static_cast<double>(params.step);
  const double decay = 1.0 - params.lr * params.weight_decay;
  const double bias_correction1 = 1.0 - std::pow(params.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(params.beta2, step);
  const double step_size = params.lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  AdamWScalars s{};
  s.decay = static_cast<float>(decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - params.beta1);
  s.beta2 = static_cast<float>(params.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - params.beta2);
  s.neg_step_size = static_cast<float>(-step_size);
  s.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  s.eps = static_cast<float>(params.eps);
  s.apply_decay = params.weight_decay != 0.0;

  const int64_t n = param.numel();
  if (n == 0) return;
  const int64_t blocks64 = (n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < kMaxBlocks ? blocks64 : kMaxBlocks);
  adamw_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream_handle(stream))>>>(
      static_cast<float*>(param.raw_data()), static_cast<float*>(exp_avg.raw_data()),
      static_cast<float*>(exp_avg_sq.raw_data()), static_cast<const float*>(grad.raw_data()), n, s);
  MT_CUDA_CHECK(cudaGetLastError());
}

std::vector<double> sums_of_squares(const Stream& stream, const std::vector<Tensor>& tensors) {
  std::vector<double> sums(tensors.size(), 0.0);
  if (tensors.empty()) return sums;
  int64_t total_chunks = 0;
  for (const Tensor& t : tensors) {
    MT_CHECK(t.dtype() == DType::F32, "sum_of_squares (CUDA): expected f32 tensors but found {}", t.describe());
    MT_CHECK(chunks_of(t) < (int64_t(1) << 31), "sum_of_squares (CUDA): {} has too many elements", t.describe());
    total_chunks += chunks_of(t);
  }
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const Device device = stream.device();
  // One buffer: the per-tensor results, then every tensor's chunk sums.
  Tensor buffer = Tensor::empty({static_cast<int64_t>(tensors.size()) + total_chunks}, DType::F64, device);
  double* results = static_cast<double*>(buffer.raw_data());
  double* partial = results + tensors.size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t chunks = chunks_of(tensors[i]);
    if (chunks > 0) {
      chunk_squares_kernel<<<static_cast<unsigned>(chunks), kReduceThreads, 0, cu_stream>>>(
          partial, static_cast<const float*>(tensors[i].raw_data()), tensors[i].numel());
      MT_CUDA_CHECK(cudaGetLastError());
    }
    sum_chunks_kernel<<<1, kReduceThreads, 0, cu_stream>>>(results + i, partial, chunks);
    MT_CUDA_CHECK(cudaGetLastError());
    partial += chunks;
  }
  MT_CUDA_CHECK(cudaMemcpyAsync(sums.data(), results, sums.size() * sizeof(double), cudaMemcpyDeviceToHost, cu_stream));
  MT_CUDA_CHECK(cudaStreamSynchronize(cu_stream));
  return sums;
}

double sum_of_squares(const Stream& stream, const Tensor& x) { return sums_of_squares(stream, {x})[0]; }

}  // namespace moetrain::ops::cuda
