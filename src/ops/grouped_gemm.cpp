// defines: the public grouped GEMM ops: validation of the group offsets, shapes, dtypes and devices, and dispatch
// to the backend: the CPU reference (f32 or f64) or, for CUDA tensors, the Hopper tensor-core kernels of
// ops/cuda/grouped_gemm_cutlass (bf16 with N and K multiples of 8 and 16-byte aligned data) and the generic kernels
// of ops/cuda/grouped_gemm for everything else (f32, other shapes); weight gradients in f32.
#include "ops/grouped_gemm.h"

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/grouped_gemm.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/grouped_gemm.h"
#include "ops/cuda/grouped_gemm_cutlass.h"
#include "ops/cuda/runtime.h"
#endif

namespace moetrain::ops {

namespace {

#if MOETRAIN_HAS_CUDA
// Whether the CUTLASS kernels run the call: by the shapes and the data's alignment. Under the exact lanes' policy by
// the shapes alone: a row's bytes then never depend on where the batch's tensors happen to start or on how many rows
// there are, and tensors CUTLASS cannot take are refused rather than sent to the generic kernels, whose bytes differ.
bool use_cutlass(const Stream& stream, DType dtype, int64_t rows, int64_t n_out, int64_t n_in,
                 std::initializer_list<const Tensor*> tensors, const char* op) {
  if (!batch_invariant(stream)) return cuda::cutlass_grouped_gemm_supported(dtype, rows, n_out, n_in, tensors);
  if (!cuda::cutlass_grouped_gemm_supported(dtype, 0, n_out, n_in, {})) return false;
  if (cuda::cutlass_grouped_gemm_supported(dtype, rows, n_out, n_in, tensors)) return true;
  std::vector<const void*> starts;
  for (const Tensor* t : tensors) starts.push_back(t->raw_data());
  MT_FAIL(
      "{} (batch-invariant): N = {}, K = {} run on CUTLASS, which needs 16-byte aligned tensors and at most 2^31 - 1 "
      "rows, but found {} rows and data at {}; the exact lanes do not send them to another kernel, whose bytes "
      "differ",
      op, n_out, n_in, rows, fmt::join(starts, ", "));
}
#endif

void check_argument(const Stream& stream, const Tensor& t, const Shape& shape, DType dtype, const char* op,
                    const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
  check_tensor_backend(stream, t, op, name);
}

// The dtypes a backend computes activations and weights in: f32 or f64 on the CPU, f32 or bf16 on CUDA.
void check_float_dtype(const Tensor& t, const char* op, const char* name) {
  if (on_cuda(t)) {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, "{}: expected {} in f32 or bf16 on CUDA but found {}",
             op, name, t.describe());
  } else {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
             t.describe());
  }
}

// w must be [G, N, K] in a float dtype of its backend; the caller then reads G, N and K from it.
void check_weight_rank(const Tensor& w, const char* op, const char* name) {
  expect_defined(w, fmt::format("{}: {}", op, name));
  MT_CHECK(w.dim() == 3, "{}: expected {} [G, N, K] but found {}", op, name, w.describe());
  check_float_dtype(w, op, name);
}

void check_matrix_rank(const Tensor& t, const char* op, const char* name, const char* dims) {
  expect_defined(t, fmt::format("{}: {}", op, name));
  MT_CHECK(t.dim() == 2, "{}: expected {} {} but found {}", op, name, dims, t.describe());
}

// offsets: i32 [G + 1], 0 at the start, non-decreasing, R at the end. The values can only be checked for CPU
// offsets: reading device memory here would need a copy and a synchronisation, so for CUDA offsets only shape, dtype
// and device are checked (the kernels clamp the values into [0, R], so bad ones give wrong results, never
// out-of-bounds accesses).
void check_offsets(const Stream& stream, const Tensor& offsets, int64_t groups, int64_t rows, const char* op) {
  check_argument(stream, offsets, {groups + 1}, DType::I32, op, "offsets");
  if (on_cuda(offsets)) return;
  const int32_t* off = offsets.data<int32_t>();
  MT_CHECK(off[0] == 0, "{}: offsets[0] must be 0 but found {}", op, off[0]);
  for (int64_t g = 1; g <= groups; ++g) {
    MT_CHECK(off[g] >= off[g - 1], "{}: offsets must not decrease but offsets[{}] = {} follows offsets[{}] = {}", op, g,
             off[g], g - 1, off[g - 1]);
  }
  MT_CHECK(off[groups] == rows, "{}: the last offset offsets[{}] must equal the row count R = {} but found {}", op,
           groups, rows, off[groups]);
}

}  // namespace

void grouped_linear_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& w, const Tensor& offsets) {
  constexpr const char* op = "grouped_linear_forward";
  OpScope profile(stream, "grouped_gemm", op);
  check_weight_rank(w, op, "w");
  check_matrix_rank(x, op, "x", "[R, K]");
  const int64_t groups = w.size(0), n_out = w.size(1), n_in = w.size(2), rows = x.size(0);
  const DType dtype = w.dtype();
  check_argument(stream, w, {groups, n_out, n_in}, dtype, op, "w");
  check_argument(stream, x, {rows, n_in}, dtype, op, "x");
  check_argument(stream, y, {rows, n_out}, dtype, op, "y");
  check_offsets(stream, offsets, groups, rows, op);
#if MOETRAIN_HAS_CUDA
  if (on_cuda(y)) {
    if (use_cutlass(stream, dtype, rows, n_out, n_in, {&y, &x, &w}, op)) {
      cuda::grouped_linear_forward_cutlass(stream, y, x, w, offsets);
      return;
    }
    cuda::grouped_linear_forward(stream, y, x, w, offsets);
    return;
  }
#endif
  cpu::grouped_linear_forward(y, x, w, offsets);
}

void grouped_linear_forward_gathered(Stream& stream, Tensor y, const Tensor& x, const RoutingPlan& plan,
                                     const Tensor& w) {
  constexpr const char* op = "grouped_linear_forward_gathered";
  check_weight_rank(w, op, "w");
  check_matrix_rank(x, op, "x", "[T, K]");
  const int64_t groups = w.size(0), n_out = w.size(1), n_in = w.size(2), rows = plan.num_tokens * plan.top_k;
  MT_CHECK(groups == plan.num_experts && x.size(0) == plan.num_tokens,
           "{}: expected w's {} groups and x's {} tokens to match the plan's {} experts and {} tokens", op, groups,
           x.size(0), plan.num_experts, plan.num_tokens);
  const DType dtype = w.dtype();
  check_argument(stream, x, {plan.num_tokens, n_in}, dtype, op, "x");
  check_argument(stream, y, {rows, n_out}, dtype, op, "y");
  check_argument(stream, plan.row_choice, {rows}, DType::I32, op, "plan.row_choice");
  check_offsets(stream, plan.expert_offsets, groups, rows, op);
#if MOETRAIN_HAS_CUDA
  if (on_cuda(y) && !batch_invariant(stream) && cuda::cutlass_gathered_rows_fit(x.numel()) &&
      cuda::cutlass_grouped_gemm_supported(dtype, rows, n_out, n_in, {&y, &x, &w})) {
    OpScope profile(stream, "grouped_gemm", op);
    cuda::grouped_linear_forward_gathered_cutlass(stream, y, x, plan.row_choice, plan.top_k, w, plan.expert_offsets);
    return;
  }
#endif
  Tensor permuted = Tensor::empty({rows, n_in}, dtype, x.device());
  permute_forward(stream, permuted, x, plan);
  grouped_linear_forward(stream, y, permuted, w, plan.expert_offsets);
}

void grouped_linear_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& w,
                                   const Tensor& offsets) {
  constexpr const char* op = "grouped_linear_backward_input";
  OpScope profile(stream, "grouped_gemm", op);
  check_weight_rank(w, op, "w");
  check_matrix_rank(dy, op, "dy", "[R, N]");
  const int64_t groups = w.size(0), n_out = w.size(1), n_in = w.size(2), rows = dy.size(0);
  const DType dtype = w.dtype();
  check_argument(stream, w, {groups, n_out, n_in}, dtype, op, "w");
  check_argument(stream, dy, {rows, n_out}, dtype, op, "dy");
  check_argument(stream, dx, {rows, n_in}, dtype, op, "dx");
  check_offsets(stream, offsets, groups, rows, op);
#if MOETRAIN_HAS_CUDA
  if (on_cuda(dx)) {
    if (use_cutlass(stream, dtype, rows, n_out, n_in, {&dx, &dy, &w}, op)) {
      cuda::grouped_linear_backward_input_cutlass(stream, dx, dy, w, offsets);
      return;
    }
    cuda::grouped_linear_backward_input(stream, dx, dy, w, offsets);
    return;
  }
#endif
  cpu::grouped_linear_backward_input(dx, dy, w, offsets);
}

void grouped_linear_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                    GradientWrite write) {
  constexpr const char* op = "grouped_linear_backward_weight";
  OpScope profile(stream, "grouped_gemm", op);
  check_weight_rank(dw, op, "dw");
  check_matrix_rank(x, op, "x", "[R, K]");
  const int64_t groups = dw.size(0), n_out = dw.size(1), n_in = dw.size(2), rows = x.size(0);
  // The CPU computes in one dtype; on CUDA dy and x share an activation dtype (f32 or bf16) and the weight gradient
  // is f32.
  const DType dtype = on_cuda(dw) ? x.dtype() : dw.dtype();
  if (on_cuda(dw)) check_float_dtype(x, op, "x");
  check_argument(stream, dw, {groups, n_out, n_in}, on_cuda(dw) ? DType::F32 : dtype, op, "dw");
  check_argument(stream, dy, {rows, n_out}, dtype, op, "dy");
  check_argument(stream, x, {rows, n_in}, dtype, op, "x");
  check_offsets(stream, offsets, groups, rows, op);
#if MOETRAIN_HAS_CUDA
  if (on_cuda(dw)) {
    if (use_cutlass(stream, dtype, rows, n_out, n_in, {&dw, &dy, &x}, op)) {
      cuda::grouped_linear_backward_weight_cutlass(stream, dw, dy, x, offsets,
                                                   /*accumulate=*/write == GradientWrite::Accumulate);
      return;
    }
    if (write == GradientWrite::Overwrite) zero_on_stream(stream, dw);
    cuda::grouped_linear_backward_weight(stream, dw, dy, x, offsets);
    return;
  }
#endif
  // The reference and the generic kernels accumulate: overwriting is adding onto zeros, the same bytes (a sum that
  // starts from +0 is never -0).
  if (write == GradientWrite::Overwrite) dw.zero_();
  cpu::grouped_linear_backward_weight(dw, dy, x, offsets);
}

}  // namespace moetrain::ops
