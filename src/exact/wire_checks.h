// defines: the exact-lane checks run on every scheduled forward (docs/design.md section 6): the inter-stage wire tensor
// is bf16 [T, H] and contiguous, and the micro-batch's varlen metadata (cu_seqlens) is present and valid. They read
// only host memory (the host copy of cu_seqlens, tensor metadata), never device memory. Each failure throws
// moetrain::Error "exact: refused: <rule>: <where>: declared <x>, found <y>" naming the micro-batch and the entry.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "model/batch.h"

namespace moetrain::exact {

// The wire tensor (hidden states between stages) of `stage` for `micro_batch`: bf16, 2-D [T, H], contiguous.
void check_wire_tensor(const Tensor& t, int stage, int micro_batch);
// The same, and its shape is exactly [tokens, hidden] (the micro-batch's token count and the model's width).
void check_wire_tensor(const Tensor& t, int stage, int micro_batch, int64_t tokens, int64_t hidden);

// The varlen metadata attention reads for one micro-batch: cu_seqlens_q and cu_seqlens_k host copies (CPU tensors)
// each present, int32, 1-D, contiguous, >= 2 entries, starting at 0, ending at `num_tokens`, strictly increasing;
// q and k spans equal entry by entry; `declared_max_seqlen` (the max length the kernels are told) >= the longest
// span.
void check_varlen_metadata(const Tensor& cu_seqlens_q_host, const Tensor& cu_seqlens_k_host, int64_t num_tokens,
                           int64_t declared_max_seqlen, int micro_batch);

// The same for a micro-batch, whose one cu_seqlens serves q and k: its host copy (cu_seqlens_host) is checked as
// both. The tensor the kernels read (cu_seqlens, possibly on a device) must be present, int32, 1-D and as long as
// the host copy; when it lives on the CPU its entries must equal the host copy's.
void check_varlen_metadata(const model::MicroBatch& batch, int64_t declared_max_seqlen, int micro_batch);

}  // namespace moetrain::exact
