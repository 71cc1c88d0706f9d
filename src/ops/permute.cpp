// defines: the public permutation ops: validation of the routing choices, the plan and the tensors, and dispatch
// to the backend: the CPU reference (f32 or f64) or, for CUDA tensors, the CUDA kernels (f32 or bf16). On CUDA the
// values of topk_index and of the plan live on the device, where the host cannot read them: their ranges are the
// caller's contract there (a plan from make_routing_plan always satisfies it), and only shapes, dtypes and devices
// are checked.
#include "ops/permute.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/elementwise.h"
#include "ops/cpu/permute.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#include "ops/row_gather.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/permute.h"
#endif

namespace moetrain::ops {

namespace {

// The float dtypes of the backend: f32 or f64 on the CPU (checked by the reference's dispatch), f32 or bf16 on CUDA.
void check_float_dtype(const Tensor& t, Device device, const char* op, const char* name) {
  if (device.is_cuda()) {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, "{}: expected {} in f32 or bf16 on CUDA but found {}",
             op, name, t.describe());
  }
}

// A token-side tensor (x's gradient, y, dy): on the CPU in the rows' dtype; on CUDA in f32 or bf16 on its own (an f32
// residual stream beside bf16 expert rows under bf16 compute).
void check_token_side(const Tensor& t, const Shape& shape, DType rows_dtype, Device device, const char* op,
                      const char* name) {
  if (device.is_cuda()) {
    check_float_dtype(t, device, op, name);
    check_argument(t, shape, t.dtype(), device, op, name);
    return;
  }
  check_argument(t, shape, rows_dtype, device, op, name);
}

// The routing weights' dtype: f32 on CUDA (the router computes in f32, whatever the activations), the
// activations' on the CPU.
DType weight_dtype(DType activations, Device device) { return device.is_cuda() ? DType::F32 : activations; }

// The plan's tensors have the right shapes, and choice_row / row_choice are inverse permutations of the T*K
// choices (so every permuted row is written exactly once). The values are checked on the CPU only.
void check_plan(const RoutingPlan& plan, Device device, const char* op) {
  MT_CHECK(plan.num_tokens >= 0 && plan.top_k >= 1 && plan.num_experts >= 1,
           "{}: expected a routing plan with T >= 0, K >= 1, E >= 1 but found T = {}, K = {}, E = {}", op,
           plan.num_tokens, plan.top_k, plan.num_experts);
  const int64_t choices = plan.num_tokens * plan.top_k;
  check_argument(plan.expert_offsets, {plan.num_experts + 1}, DType::I32, device, op, "plan.expert_offsets");
  check_argument(plan.row_choice, {choices}, DType::I32, device, op, "plan.row_choice");
  check_argument(plan.choice_row, {choices}, DType::I32, device, op, "plan.choice_row");
  if (device.is_cuda()) return;
  const int32_t* offsets = plan.expert_offsets.data<int32_t>();
  MT_CHECK(offsets[0] == 0 && offsets[plan.num_experts] == choices,
           "{}: plan.expert_offsets must run from 0 to T*K = {} but runs from {} to {}", op, choices, offsets[0],
           offsets[plan.num_experts]);
  const int32_t* row_choice = plan.row_choice.data<int32_t>();
  const int32_t* choice_row = plan.choice_row.data<int32_t>();
  for (int64_t c = 0; c < choices; ++c) {
    const int32_t row = choice_row[c];
    MT_CHECK(row >= 0 && row < choices && row_choice[row] == c,
             "{}: plan.choice_row[{}] = {} is not a row whose plan.row_choice is {} (the plan is not a permutation "
             "of the T*K = {} choices)",
             op, c, row, c, choices);
  }
}

}  // namespace

RoutingPlan make_routing_plan(Stream& stream, const Tensor& topk_index, int64_t num_experts) {
  constexpr const char* op = "make_routing_plan";
  OpScope profile(stream, "permute", op);
  expect_defined(topk_index, "make_routing_plan: topk_index");
  MT_CHECK(topk_index.dim() == 2, "{}: expected topk_index [T, K] but found {}", op, topk_index.describe());
  const Device device = check_tensor_backend(stream, topk_index, op, "topk_index");
  check_argument(topk_index, topk_index.shape(), DType::I32, device, op, "topk_index");
  const int64_t tokens = topk_index.size(0), top_k = topk_index.size(1);
  MT_CHECK(top_k >= 1, "{}: expected topk_index [T, K] with K >= 1 but found {}", op, topk_index.describe());
  MT_CHECK(num_experts >= 1 && num_experts < std::numeric_limits<int32_t>::max(),
           "{}: num_experts must be in [1, 2^31 - 1) but found {}", op, num_experts);
  MT_CHECK(tokens * top_k <= std::numeric_limits<int32_t>::max(),
           "{}: T*K = {} choices do not fit the i32 plan (at most 2^31 - 1)", op, tokens * top_k);
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) return cuda::make_routing_plan(stream, topk_index, num_experts);
#endif
  const int32_t* index = topk_index.data<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t e = index[t * top_k + k];
      MT_CHECK(e >= 0 && e < num_experts, "{}: topk_index[token {}, slot {}] = {} is outside [0, E = {})", op, t, k, e,
               num_experts);
    }
  }
  return cpu::make_routing_plan(topk_index, num_experts);
}

void permute_forward(Stream& stream, Tensor permuted, const Tensor& x, const RoutingPlan& plan) {
  constexpr const char* op = "permute_forward";
  OpScope profile(stream, "permute", op);
  const Device device = check_tensor_backend(stream, x, op, "x");
  check_plan(plan, device, op);
  MT_CHECK(x.dim() == 2, "{}: expected x [T, H] but found {}", op, x.describe());
  check_float_dtype(x, device, op, "x");
  const int64_t hidden = x.size(1);
  check_argument(x, {plan.num_tokens, hidden}, x.dtype(), device, op, "x");
  check_argument(permuted, {plan.num_tokens * plan.top_k, hidden}, x.dtype(), device, op, "permuted");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::permute_forward(stream, permuted, x, plan);
    return;
  }
#endif
  cpu::permute_forward(permuted, x, plan);
}

namespace {

// The arguments of permute_backward (and of permute_backward_add, under its name); the device they are on.
Device check_permute_backward(const Stream& stream, const Tensor& dx, const Tensor& dpermuted, const RoutingPlan& plan,
                              const char* op) {
  const Device device = check_tensor_backend(stream, dpermuted, op, "dpermuted");
  check_plan(plan, device, op);
  MT_CHECK(dpermuted.dim() == 2, "{}: expected dpermuted [T*K, H] but found {}", op, dpermuted.describe());
  check_float_dtype(dpermuted, device, op, "dpermuted");
  const int64_t hidden = dpermuted.size(1);
  check_argument(dpermuted, {plan.num_tokens * plan.top_k, hidden}, dpermuted.dtype(), device, op, "dpermuted");
  check_token_side(dx, {plan.num_tokens, hidden}, dpermuted.dtype(), device, op, "dx");
  return device;
}

// The arguments of unpermute_forward (and of unpermute_forward_add, under its name); the device they are on.
Device check_unpermute_forward(const Stream& stream, const Tensor& y, const Tensor& expert_out,
                               const Tensor& topk_weight, const RoutingPlan& plan, const char* op) {
  const Device device = check_tensor_backend(stream, expert_out, op, "expert_out");
  check_plan(plan, device, op);
  MT_CHECK(expert_out.dim() == 2, "{}: expected expert_out [T*K, H] but found {}", op, expert_out.describe());
  check_float_dtype(expert_out, device, op, "expert_out");
  const int64_t hidden = expert_out.size(1);
  const DType dtype = expert_out.dtype();
  check_argument(expert_out, {plan.num_tokens * plan.top_k, hidden}, dtype, device, op, "expert_out");
  check_argument(topk_weight, {plan.num_tokens, plan.top_k}, weight_dtype(dtype, device), device, op, "topk_weight");
  check_token_side(y, {plan.num_tokens, hidden}, dtype, device, op, "y");
  return device;
}

// The addend of the _add forms: shaped as the token side `sum` (dx, y), apart from it.
void check_token_addend(const Tensor& addend, const Tensor& sum, Device device, const char* op, const char* sum_name) {
  check_token_side(addend, sum.shape(), sum.dtype(), device, op, "addend");
  MT_CHECK(!share_memory(addend, sum), "{}: expected the addend {} apart from {} {} ({} is written before it is added)",
           op, addend.describe(), sum_name, sum.describe(), sum_name);
}

}  // namespace

void permute_backward(Stream& stream, Tensor dx, const Tensor& dpermuted, const RoutingPlan& plan) {
  constexpr const char* op = "permute_backward";
  OpScope profile(stream, "permute", op);
  [[maybe_unused]] const Device device = check_permute_backward(stream, dx, dpermuted, plan, op);
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::permute_backward(stream, dx, dpermuted, plan);
    return;
  }
#endif
  cpu::permute_backward(dx, dpermuted, plan);
}

void permute_backward_add(Stream& stream, Tensor dx, const Tensor& dpermuted, const RoutingPlan& plan,
                          const Tensor& addend) {
  constexpr const char* op = "permute_backward_add";
  OpScope profile(stream, "permute", op);
  const Device device = check_permute_backward(stream, dx, dpermuted, plan, op);
  check_token_addend(addend, dx, device, op, "dx");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::permute_backward(stream, dx, dpermuted, plan, addend);
    return;
  }
#endif
  cpu::permute_backward(dx, dpermuted, plan);
  cpu::accumulate(dx, addend);
}

void unpermute_forward(Stream& stream, Tensor y, const Tensor& expert_out, const Tensor& topk_weight,
                       const RoutingPlan& plan) {
  constexpr const char* op = "unpermute_forward";
  OpScope profile(stream, "permute", op);
  [[maybe_unused]] const Device device = check_unpermute_forward(stream, y, expert_out, topk_weight, plan, op);
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::unpermute_forward(stream, y, expert_out, topk_weight, plan);
    return;
  }
#endif
  cpu::unpermute_forward(y, expert_out, topk_weight, plan);
}

void unpermute_forward_add(Stream& stream, Tensor y, const Tensor& expert_out, const Tensor& topk_weight,
                           const RoutingPlan& plan, const Tensor& addend) {
  constexpr const char* op = "unpermute_forward_add";
  OpScope profile(stream, "permute", op);
  const Device device = check_unpermute_forward(stream, y, expert_out, topk_weight, plan, op);
  check_token_addend(addend, y, device, op, "y");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::unpermute_forward(stream, y, expert_out, topk_weight, plan, addend);
    return;
  }
#endif
  cpu::unpermute_forward(y, expert_out, topk_weight, plan);
  cpu::accumulate(y, addend);
}

void unpermute_backward(Stream& stream, Tensor dexpert_out, Tensor dtopk_weight, const Tensor& dy,
                        const Tensor& expert_out, const Tensor& topk_weight, const RoutingPlan& plan) {
  constexpr const char* op = "unpermute_backward";
  OpScope profile(stream, "permute", op);
  const Device device = check_tensor_backend(stream, dy, op, "dy");
  check_plan(plan, device, op);
  MT_CHECK(dy.dim() == 2, "{}: expected dy [T, H] but found {}", op, dy.describe());
  MT_CHECK(expert_out.dim() == 2, "{}: expected expert_out [T*K, H] but found {}", op, expert_out.describe());
  check_float_dtype(expert_out, device, op, "expert_out");
  const int64_t hidden = dy.size(1);
  const DType dtype = expert_out.dtype();
  check_token_side(dy, {plan.num_tokens, hidden}, dtype, device, op, "dy");
  check_argument(expert_out, {plan.num_tokens * plan.top_k, hidden}, dtype, device, op, "expert_out");
  check_argument(topk_weight, {plan.num_tokens, plan.top_k}, weight_dtype(dtype, device), device, op, "topk_weight");
  check_argument(dexpert_out, {plan.num_tokens * plan.top_k, hidden}, dtype, device, op, "dexpert_out");
  check_argument(dtopk_weight, {plan.num_tokens, plan.top_k}, weight_dtype(dtype, device), device, op, "dtopk_weight");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::unpermute_backward(stream, dexpert_out, dtopk_weight, dy, expert_out, topk_weight, plan);
    return;
  }
#endif
  cpu::unpermute_backward(dexpert_out, dtopk_weight, dy, expert_out, topk_weight, plan);
}

void concat_permuted_rows(Stream& stream, Tensor out, const std::vector<PermutedRows>& sources) {
  constexpr const char* op = "concat_permuted_rows";
  OpScope profile(stream, "permute", op);
  const Device device = check_tensor_backend(stream, out, op, "out");
  MT_CHECK(out.dim() == 2, "{}: expected out [rows, H] but found {}", op, out.describe());
  check_float_dtype(out, device, op, "out");
  const int64_t count = static_cast<int64_t>(sources.size());
  MT_CHECK(count >= 1 && count <= kMaxGroupParts, "{}: expected 1 to {} sources but found {}", op, kMaxGroupParts,
           count);
  const int64_t hidden = out.size(1);
  const bool weighted = sources[0].weight.defined();
  const int64_t experts = sources[0].plan.num_experts;
  int64_t rows = 0;
  for (size_t p = 0; p < sources.size(); ++p) {
    const PermutedRows& source = sources[p];
    const std::string where = fmt::format("{} (sources[{}])", op, p);
    check_plan(source.plan, device, where.c_str());
    MT_CHECK(source.plan.num_experts == experts,
             "{}: every source's plan groups its rows by the same experts; sources[0] has E = {} but sources[{}] has "
             "E = {}",
             op, experts, p, source.plan.num_experts);
    MT_CHECK(source.weight.defined() == weighted,
             "{}: the sources are all weighted or none; sources[0] is {} but sources[{}] is {}", op,
             weighted ? "weighted" : "not", p, source.weight.defined() ? "weighted" : "not");
    const Shape tokens{source.plan.num_tokens, hidden};
    if (weighted) {
      check_token_side(source.tokens, tokens, out.dtype(), device, where.c_str(), "tokens");
      check_argument(source.weight, {source.plan.num_tokens, source.plan.top_k}, weight_dtype(out.dtype(), device),
                     device, where.c_str(), "weight");
    } else {
      check_argument(source.tokens, tokens, out.dtype(), device, where.c_str(), "tokens");
    }
    rows += source.plan.num_tokens * source.plan.top_k;
  }
  // The concatenation's group offsets are i32, as every plan's are: its rows must be counted by one too.
  MT_CHECK(rows <= std::numeric_limits<int32_t>::max(),
           "{}: the sources hold {} rows together, more than i32 group offsets count ({}); concatenate fewer", op, rows,
           std::numeric_limits<int32_t>::max());
  check_argument(out, {rows, hidden}, out.dtype(), device, op, "out");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::concat_permuted_rows(stream, out, sources);
    return;
  }
#endif
  cpu::concat_permuted_rows(out, sources);
}

}  // namespace moetrain::ops
