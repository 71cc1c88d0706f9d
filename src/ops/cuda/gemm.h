// defines: the CUDA dense matrix multiply behind ops::gemm: cuBLASLt with an explicit f32 compute type (no TF32,
// no fast accumulation), one cached descriptor set and algorithm per problem key, and the scaling kernel that
// handles an empty inner dimension without cuBLAS.
#pragma once

#include <memory>
#include <string>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/gemm.h"

namespace moetrain::ops::cuda {

// out [M, N] = alpha * op(a) * op(b) + beta * out, row-major, validated by ops::gemm. Supported dtypes:
// a, b, out all f32; or a, b bf16 with out bf16 or f32 (f32 accumulation and scaling in every case). out is not
// read when beta == 0. The algorithm cuBLASLt's heuristic picks is cached per (M, N, K, transposes, dtypes,
// beta != 0, pointer alignments), so one problem always runs one algorithm: results are deterministic.
void gemm(const Stream& stream, const Tensor& out, const Tensor& a, Transpose transpose_a, const Tensor& b,
          Transpose transpose_b, double alpha, double beta);

// For the kernel benchmark (tests/ops/cuda_gemm_bench_test.cpp): the first `limit` algorithms cuBLASLt's heuristic
// offers for one problem, best first (index 0 is the one gemm runs), each described by its configuration and run by
// index on the operands given here. The operands are held until destruction.
class GemmAlternatives {
 public:
  GemmAlternatives(const Tensor& out, const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
                   double beta, int limit);
  ~GemmAlternatives();
  GemmAlternatives(const GemmAlternatives&) = delete;
  GemmAlternatives& operator=(const GemmAlternatives&) = delete;

  int count() const;
  std::string describe(int index) const;
  // out = alpha op(a) op(b) + beta out with algorithm `index`; beta must be zero exactly when it was at construction.
  void run(const Stream& stream, int index, double alpha, double beta) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// out = beta * out over the contiguous f32 or bf16 tensor out (the K == 0 case); beta == 0 writes zeros
// without reading out. Kernel in gemm.cu.
void scale_in_place(const Stream& stream, const Tensor& out, float beta);

}  // namespace moetrain::ops::cuda
