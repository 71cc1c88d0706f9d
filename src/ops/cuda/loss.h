// defines: the CUDA kernels of the cross-entropy ops (ops/loss.h): a row held in registers by a cluster of blocks, or
// one block per row, for the log-sum-exp and the gradient; one block for the totals, which come back to the host in
// one copy.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/loss.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::cross_entropy_*: contiguous, on the stream's device; logits [T, V] f32 or bf16
// (computed in f32), dlogits in the logits' dtype, losses / lse [T] f32, targets i32 [T]. Targets are NOT checked
// against [0, V) on the device (that needs the values on the host; the trainer validates batches there): a target
// outside [0, V) that is not the ignore index gives a NaN loss and a NaN gradient row instead of a read outside the
// row. Each row's reductions run in an order fixed by V and the dtype, so a row's results do not depend on T or on the
// other rows:
// - a row of 16-byte packs (V a multiple of a pack and the logits starting on a 16-byte boundary, as every allocation
//   does) of at most 8 x 512 x 10 packs (327,680 bf16 logits) is held in registers by a cluster of 1, 2, 4 or 8 blocks:
//   one HBM read for its maximum, its sum of exponentials and (forward_backward) its gradient;
// - any other row takes one block of kCrossEntropyThreads threads, strided partials of packs or of single elements.
// How a row of `vocab` logits in packs of `pack` elements (8 bf16 or 4 f32; `packed` false when the row is not in
// packs) is held: by a cluster of `ranks` blocks of `threads` threads, each thread up to 10 packs; ranks 0 when the
// one-block kernels take it. A function of these arguments alone, which is what makes a row's bits independent of T.
struct HeldRowShape {
  int ranks = 0;
  int threads = 0;
};
HeldRowShape held_row_shape(bool packed, int64_t vocab, int pack);
void cross_entropy_forward(const Stream& stream, const Tensor& losses, const Tensor& lse, const Tensor& logits,
                           const Tensor& targets, int ignore_index);
void cross_entropy_backward(const Stream& stream, const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, double scale, int ignore_index);
// The two above in one kernel, with the same bits (the same reductions, and the gradient is one function of the
// logit and the lse as the forward writes it). dlogits may be logits. Rows held in registers move one read and one
// write of the logits; the one-block form reads each row for its log-sum-exp and at once again (in reverse, the most
// recently read end the likeliest still in L2) for its gradient, with 2 blocks per SM.
// Measured on an H200 at the workload of record's shape (8192 x 151936 bf16), the one-block form: 1 block per SM 3.27
// ms, 2 blocks 2.41 ms, 4 blocks 2.41 ms, the two kernels 2.41 ms (at 2 blocks the rows in flight, 80 MB, no longer fit
// in the 50 MB L2). A form that staged each row in the shared memory of a cluster (fourteenth session) took 2.30-2.43
// ms: at most 0.75 rows per SM fit there, too few threads for the two exp passes. Registers hold more: the held form
// takes 1.57 ms there, 3.18 TB/s over its one read and one write (docs/gpu_notes.md, twenty-first session).
void cross_entropy_forward_backward(const Stream& stream, const Tensor& losses, const Tensor& lse,
                                    const Tensor& dlogits, const Tensor& logits, const Tensor& targets, double scale,
                                    int ignore_index);
// Sum (f64) and count of the counted tokens' losses (f32 [T]), reduced on the device in an order fixed by T alone,
// into totals f64 [2] = {sum, count} on the same device; nothing waits.
void cross_entropy_totals(const Stream& stream, const Tensor& totals, const Tensor& losses, const Tensor& targets,
                          int ignore_index);

constexpr int kCrossEntropyThreads = 512;

}  // namespace moetrain::ops::cuda
