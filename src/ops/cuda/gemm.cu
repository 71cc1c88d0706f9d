// defines: the one kernel of the CUDA gemm that cuBLASLt does not run: out = beta * out for an empty inner
// dimension (K == 0), where cuBLAS is not called at all.
#include "ops/cuda/gemm.h"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kScaleThreads = 256;

template <typename T>
__global__ void scale_kernel(T* out, int64_t n, float beta) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    store_float(out + i, beta * load_float(out + i));
  }
}

}  // namespace

void scale_in_place(const Stream& stream, const Tensor& out, float beta) {
  const int64_t n = out.numel();
  if (n == 0) return;
  auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  if (beta == 0.0f) {  // out is not read (it may hold NaN): plain zeros, as in the CPU reference
    MT_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), cu_stream));
    return;
  }
  const int64_t blocks64 = (n + kScaleThreads - 1) / kScaleThreads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < 65536 ? blocks64 : 65536);
  switch (out.dtype()) {
    case DType::F32:
      scale_kernel<<<blocks, kScaleThreads, 0, cu_stream>>>(static_cast<float*>(out.raw_data()), n, beta);
      break;
    case DType::BF16:
      scale_kernel<<<blocks, kScaleThreads, 0, cu_stream>>>(static_cast<__nv_bfloat16*>(out.raw_data()), n, beta);
      break;
    default: MT_FAIL("gemm (CUDA): out must be f32 or bf16 but found {}", out.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
