// defines: the CUDA per-row steps of the chunked linear cross-entropy (ops/linear_cross_entropy.h), the formulas of
// ops/cpu/linear_cross_entropy.cpp in f32: online row statistics over one logits chunk, the final lse / losses, and
// the in-place softmax gradient of one chunk. The chunk GEMMs run through ops::gemm (cuBLASLt).
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::linear_cross_entropy_*: contiguous, on the stream's device; logits_chunk [T, n] f32 or
// bf16 (computed in f32) holds vocabulary columns [begin, begin + n); row_max / row_sum / target_logit / losses /
// lse [T] f32; targets i32 [T]. Targets are NOT checked against [0, vocab) on the device: a target outside it that
// is not the ignore index leaves target_logit NaN (set by the first chunk), so its loss is NaN, and its gradient row
// is NaN, as in ops/cuda/loss.h. One block per row; each row's reduction order depends on n alone.
void linear_cross_entropy_chunk_stats(const Stream& stream, const Tensor& row_max, const Tensor& row_sum,
                                      const Tensor& target_logit, const Tensor& logits_chunk, const Tensor& targets,
                                      int64_t begin, bool first, int ignore_index);
void linear_cross_entropy_finish(const Stream& stream, const Tensor& losses, const Tensor& lse, const Tensor& row_max,
                                 const Tensor& row_sum, const Tensor& target_logit, const Tensor& targets,
                                 int ignore_index);
void linear_cross_entropy_chunk_gradient(const Stream& stream, const Tensor& logits_chunk, const Tensor& lse,
                                         const Tensor& targets, int64_t begin, int64_t vocab, double scale,
                                         int ignore_index);

}  // namespace moetrain::ops::cuda
