// defines: the CPU kernels of the chunked linear cross-entropy (ops/linear_cross_entropy.h): the online row
// statistics over one logits chunk, the final lse / losses, and the in-place softmax gradient of one chunk. The
// chunk GEMMs run through ops::gemm; these are the small per-row steps between them.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moetrain::ops::cpu {

// Arguments validated by ops::linear_cross_entropy_*: logits_chunk [T, n] holds vocabulary columns [begin, begin + n);
// row_max / row_sum / target_logit [T] and losses / lse in the chunk's dtype (f32 or f64); targets i32 [T] inside
// [0, vocab) or equal to ignore_index. Each row is reduced in one thread in ascending column order.
//
// first: row_max = chunk max, row_sum = sum exp(l - row_max); else the running pair is merged with the chunk's:
// m' = max(m, m_c), s' = s exp(m - m') + s_c exp(m_c - m'). target_logit takes the target's logit when it is in
// the chunk (and is 0 after the first chunk otherwise).
void linear_cross_entropy_chunk_stats(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                      const Tensor& logits_chunk, const Tensor& targets, int64_t begin, bool first,
                                      int ignore_index);
// lse = m + log(s); losses = lse - target_logit, 0 on ignored rows.
void linear_cross_entropy_finish(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& row_sum,
                                 const Tensor& target_logit, const Tensor& targets, int ignore_index);
// In place: logits_chunk = scale * (exp(l - lse) - onehot(target - begin)), 0 on ignored rows.
void linear_cross_entropy_chunk_gradient(const Tensor& logits_chunk, const Tensor& lse, const Tensor& targets,
                                         int64_t begin, double scale, int ignore_index);

}  // namespace moetrain::ops::cpu
