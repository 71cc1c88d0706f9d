// defines: the CUDA kernels of the RMSNorm ops (ops/norm.h), plain and zero-centred: one warp per row for the
// forward and the input gradient, a fixed two-stage column reduction for the weight gradient.
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/norm.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::rmsnorm_*: contiguous, on the stream's device, x viewed as [N, D]; x, y, dy, dx in
// one dtype, f32 or bf16 (computed in f32); w, dw and rstd (N values) f32. A row's sums run in an order fixed by D
// alone (lane-strided partial sums, then a butterfly across the warp), so a row's results do not depend on N or on
// the other rows.
void rmsnorm_forward(const Stream& stream, const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                     const RmsNormParams& params);
// sum = a + b rounded to the activation dtype (ops::cuda::add_forward's element code), then rmsnorm_forward's row code
// on that rounded sum, one warp per row in one pass: the bits of add_forward then rmsnorm_forward on CUDA. a, b, sum,
// y in one dtype (f32 or bf16); sum may alias a or b; y may alias a or b but not sum.
void add_rmsnorm_forward(const Stream& stream, const Tensor& sum, const Tensor& y, const Tensor& rstd, const Tensor& a,
                         const Tensor& b, const Tensor& w, const RmsNormParams& params);
// dx may alias dy. A defined addend (shaped as x, in x's dtype) is added to each element after it is rounded to dx's
// dtype: the bits of this op followed by accumulate(dx, addend).
void rmsnorm_backward_input(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd, const RmsNormParams& params, const Tensor& addend = Tensor());
// dw += sum over rows of dy * xhat, summed by blocks of rows (eight strided ascending sums a block, added in order),
// then the blocks' sums by blocks again: each column's order of additions follows from the row count alone.
void rmsnorm_backward_weight(const Stream& stream, const Tensor& dw, const Tensor& dy, const Tensor& x,
                             const Tensor& rstd);

// rmsnorm_backward_input (with its addend) and rmsnorm_backward_weight in one pass over the rows where they allow it
// (rows of rmsnorm_backward_in_one_pass's width, every tensor 16-byte aligned): dx has the bits of
// rmsnorm_backward_input; dw the same terms summed per column over each warp's rows, a block's warps and then the
// blocks (add_column_sums), an order fixed by the row count. Otherwise the two kernels, the weight gradient first (dx
// may alias dy).
void rmsnorm_backward_input_weight(const Stream& stream, const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                   const Tensor& x, const Tensor& w, const Tensor& rstd, const RmsNormParams& params,
                                   const Tensor& addend = Tensor());
// Whether rmsnorm_backward_input_weight takes rows of `dim` elements in its one pass (given 16-byte aligned tensors):
// whole spans of 8 elements, 129 to 2048 elements a row.
bool rmsnorm_backward_in_one_pass(int64_t dim);

// dw [D] += the column sums of partial [R, D] f32 (R > 0: terms already formed, e.g. one row of sums per block of a
// kernel that made them), by the weight gradient's levels of row blocks: each column's order follows from R alone.
void add_column_sums(const Stream& stream, const Tensor& dw, const Tensor& partial);

}  // namespace moetrain::ops::cuda
