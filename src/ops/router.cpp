// defines: the public router ops: argument validation (shapes, dtypes, devices, top_k, groups, scaling factor, the
// top-k-before-softmax combinations, index ranges) and dispatch to the backend: the CPU reference (f32 or f64) or, for
// CUDA tensors, the CUDA kernels (f32).
#include "ops/router.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/router.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/router.h"
#endif

namespace moetrain::ops {

namespace {

// Checks the [T, E] tensor that fixes the shapes and returns {T, E}.
std::pair<int64_t, int64_t> check_router_shape(const Tensor& t, const RouterParams& params, const char* op,
                                               const char* name) {
  expect_defined(t, fmt::format("{}: {}", op, name));
  MT_CHECK(t.dim() == 2, "{}: expected {} [T, E] but found {}", op, name, t.describe());
  if (t.device().is_cuda()) {
    MT_CHECK(t.dtype() == DType::F32, "{}: expected {} in f32 on CUDA (the router computes in f32) but found {}", op,
             name, t.describe());
  } else {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
             t.describe());
  }
  const int64_t experts = t.size(1);
  check_router_params(params, experts, op);
  if (t.dtype() == DType::F32) {  // the f32 kernels multiply by the factor rounded to f32
    const float factor = static_cast<float>(params.scaling_factor);
    MT_CHECK(std::isfinite(factor) && factor > 0.0f, "{}: scaling_factor ({}) is not a finite positive f32 ({})", op,
             params.scaling_factor, factor);
  }
  return {t.size(0), experts};
}

}  // namespace

void check_router_params(const RouterParams& params, int64_t experts, const std::string& what) {
  MT_CHECK(params.top_k >= 1 && params.top_k <= experts, "{}: top_k ({}) must be in [1, E = {}]", what, params.top_k,
           experts);
  MT_CHECK(params.num_groups >= 1, "{}: num_groups ({}) must be at least 1", what, params.num_groups);
  MT_CHECK(experts % params.num_groups == 0, "{}: E = {} is not divisible by num_groups ({})", what, experts,
           params.num_groups);
  MT_CHECK(params.topk_groups >= 1 && params.topk_groups <= params.num_groups,
           "{}: topk_groups ({}) must be in [1, num_groups = {}]", what, params.topk_groups, params.num_groups);
  const int64_t group_size = experts / params.num_groups;
  const int64_t eligible = params.topk_groups * group_size;
  MT_CHECK(params.top_k <= eligible,
           "{}: top_k ({}) exceeds the experts of the kept groups: topk_groups ({}) x E / num_groups ({}) = {}", what,
           params.top_k, params.topk_groups, group_size, eligible);
  MT_CHECK(std::isfinite(params.scaling_factor) && params.scaling_factor > 0.0,
           "{}: scaling_factor ({}) must be finite and > 0", what, params.scaling_factor);
  if (params.topk_before_softmax) {
    MT_CHECK(!params.renormalize,
             "{}: topk_before_softmax takes no renormalize (the softmax over the k kept already sums to 1)", what);
    MT_CHECK(params.scaling_factor == 1.0, "{}: topk_before_softmax takes no scaling_factor but found {} (expected 1)",
             what, params.scaling_factor);
    MT_CHECK(params.num_groups == 1,
             "{}: topk_before_softmax takes no group-limited selection but found num_groups = {} (expected 1)", what,
             params.num_groups);
  }
}

namespace {

void router_forward_impl(Stream& stream, const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                         const Tensor& logits, const RouterParams& params, bool given, const char* op) {
  OpScope profile(stream, "router", op);
  const auto [tokens, experts] = check_router_shape(logits, params, op, "logits");
  const Device device = check_tensor_backend(stream, logits, op, "logits");
  const DType dtype = logits.dtype();
  check_argument(logits, {tokens, experts}, dtype, device, op, "logits");
  check_argument(probs, {tokens, experts}, dtype, device, op, "probs");
  check_argument(topk_index, {tokens, params.top_k}, DType::I32, device, op, "topk_index");
  check_argument(topk_weight, {tokens, params.top_k}, dtype, device, op, "topk_weight");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::router_forward(stream, probs, topk_index, topk_weight, logits, params, given);
    return;
  }
#endif
  if (given) {
    const int32_t* index = topk_index.data<int32_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t* row = index + t * params.top_k;
      for (int64_t s = 0; s < params.top_k; ++s) {
        MT_CHECK(row[s] >= 0 && row[s] < experts, "{}: topk_index[{}, {}] = {} is outside [0, E = {})", op, t, s,
                 row[s], experts);
        for (int64_t r = 0; r < s; ++r) {
          MT_CHECK(row[r] != row[s], "{}: topk_index[{}] names expert {} twice (slots {} and {})", op, t, row[s], r, s);
        }
      }
    }
  }
  cpu::router_forward(probs, topk_index, topk_weight, logits, params, given);
}

}  // namespace

void router_forward(Stream& stream, Tensor probs, Tensor topk_index, Tensor topk_weight, const Tensor& logits,
                    const RouterParams& params) {
  router_forward_impl(stream, probs, topk_index, topk_weight, logits, params, false, "router_forward");
}

void router_forward_given(Stream& stream, Tensor probs, const Tensor& topk_index, Tensor topk_weight,
                          const Tensor& logits, const RouterParams& params) {
  router_forward_impl(stream, probs, topk_index, topk_weight, logits, params, true, "router_forward_given");
}

void router_backward(Stream& stream, Tensor dlogits, const Tensor& dtopk_weight, const Tensor& dprobs,
                     const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                     const RouterParams& params) {
  constexpr const char* op = "router_backward";
  OpScope profile(stream, "router", op);
  const auto [tokens, experts] = check_router_shape(probs, params, op, "probs");
  const Device device = check_tensor_backend(stream, probs, op, "probs");
  const DType dtype = probs.dtype();
  check_argument(probs, {tokens, experts}, dtype, device, op, "probs");
  check_argument(dlogits, {tokens, experts}, dtype, device, op, "dlogits");
  check_argument(dtopk_weight, {tokens, params.top_k}, dtype, device, op, "dtopk_weight");
  if (dprobs.defined()) check_argument(dprobs, {tokens, experts}, dtype, device, op, "dprobs");
  check_argument(topk_index, {tokens, params.top_k}, DType::I32, device, op, "topk_index");
  check_argument(topk_weight, {tokens, params.top_k}, dtype, device, op, "topk_weight");
#if MOETRAIN_HAS_CUDA
  // On CUDA the index values live on the device: their range is the caller's contract (router_forward's output
  // always satisfies it), not checked here.
  if (device.is_cuda()) {
    cuda::router_backward(stream, dlogits, dtopk_weight, dprobs, probs, topk_index, topk_weight, params);
    return;
  }
#endif
  const int32_t* index = topk_index.data<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t s = 0; s < params.top_k; ++s) {
      const int32_t e = index[t * params.top_k + s];
      MT_CHECK(e >= 0 && e < experts, "{}: topk_index[{}, {}] = {} is outside [0, E = {})", op, t, s, e, experts);
    }
  }
  cpu::router_backward(dlogits, dtopk_weight, dprobs, probs, topk_index, topk_weight, params);
}

}  // namespace moetrain::ops
