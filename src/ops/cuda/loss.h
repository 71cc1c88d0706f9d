// defines: the CUDA kernels of the cross-entropy ops (ops/loss.h): one block per row for the log-sum-exp and the
// gradient, one block for the totals, which come back to the host in one copy.
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/loss.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::cross_entropy_*: contiguous, on the stream's device; logits [T, V] f32 or bf16
// (computed in f32), dlogits in the logits' dtype, losses / lse [T] f32, targets i32 [T]. Targets are NOT checked
// against [0, V) on the device (that needs the values on the host; the trainer validates batches there): a target
// outside [0, V) that is not the ignore index gives a NaN loss and a NaN gradient row instead of a read outside the
// row. Each row's reductions run in an order fixed by V (block of kCrossEntropyThreads threads, strided partials of
// 16-byte packs when V is a multiple of a pack and the logits start on a 16-byte boundary, as every allocation does,
// else of single elements; then a fixed tree), so a row's results do not depend on T or on the other rows.
void cross_entropy_forward(const Stream& stream, const Tensor& losses, const Tensor& lse, const Tensor& logits,
                           const Tensor& targets, int ignore_index);
void cross_entropy_backward(const Stream& stream, const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, double scale, int ignore_index);
// The two above in one kernel: each row's log-sum-exp, loss and gradient by one block, the gradient pass right after
// the row's reduction and in reverse order (the row's most recently read end is the likeliest still in L2), with
// `row_blocks_per_sm` blocks per SM (the benchmark tries 1, 2 and 4). The same bits as the two kernels: the same
// per-row code, and the gradient reads the log-sum-exp as the forward writes it. dlogits may be logits.
// Measured on an H200 at the workload of record's shape (8192 x 151936 bf16): 1 block per SM 3.27 ms (one block per
// SM cannot draw the full bandwidth; a variant with 8 loads of 16 bytes in flight per thread instead of 4 took
// 3.29 ms and was not kept), 2 blocks 2.41 ms, 4 blocks 2.41 ms, the two kernels 2.41 ms. At 2 blocks the rows in
// flight (80 MB) no longer fit in the 50 MB L2, so what the one kernel saves is a launch and the memory of a separate
// gradient, not a read. A form that stages each row in the shared memory of a cluster of 2, 4 or 8 blocks (one HBM
// read, the same bits) took 2.30-2.43 ms: at most 0.75 rows per SM fit, too few threads for the two exp passes
// (docs/gpu_notes.md, fourteenth session); not kept.
inline constexpr int kFusedCrossEntropyBlocksPerSm = 2;
void cross_entropy_forward_backward(const Stream& stream, const Tensor& losses, const Tensor& lse,
                                    const Tensor& dlogits, const Tensor& logits, const Tensor& targets, double scale,
                                    int ignore_index, int row_blocks_per_sm = kFusedCrossEntropyBlocksPerSm);
// Sum (f64) and count of the counted tokens' losses (f32 [T]), reduced on the device in an order fixed by T alone,
// then copied to the host: this call synchronises the stream.
LossTotals cross_entropy_totals(const Stream& stream, const Tensor& losses, const Tensor& targets, int ignore_index);

constexpr int kCrossEntropyThreads = 512;

}  // namespace moetrain::ops::cuda
