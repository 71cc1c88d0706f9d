// defines: the CUDA kernels of the attention sinks (ops/attention.h): an elementwise rescale of attention_forward's
// out and lse, and a deterministic two-pass reduction over tokens for the sink gradient.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// The arguments are validated by ops::attention_sinks_forward / ops::attention_sinks_backward: out / dout
// [T, nh, hdv] in f32 or bf16 (one dtype, computed in f32), lse [T, nh] f32, sinks / dsinks [nh] f32, contiguous, on
// the stream's device.
//
// One warp per (token, head): out *= sigmoid(lse - sink), lse = logaddexp(lse, sink), the formulas of the CPU
// reference (ops/cpu/attention_sinks.cpp).
void attention_sinks_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& sinks);
// dsinks[h] -= sum_t exp(sinks[h] - lse[t, h]) * <dout[t, h, :], out[t, h, :]>. Pass 1: one warp per (chunk of
// kSinkTokensPerChunk tokens, head) sums its chunk's terms in ascending token order (each dot product a lane-strided
// sum and a butterfly across the warp) into an f32 scratch [chunks, nh] from the device pool; pass 2: one block per
// head adds the chunk sums in a fixed tree whose shape depends on the number of chunks alone. No atomics: repeated
// runs give the same bits.
void attention_sinks_backward(const Stream& stream, const Tensor& dsinks, const Tensor& dout, const Tensor& out,
                              const Tensor& lse, const Tensor& sinks);

constexpr int64_t kSinkTokensPerChunk = 64;

}  // namespace moetrain::ops::cuda
