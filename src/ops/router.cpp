// defines: the public router ops: argument validation (shapes, dtypes, top_k, index ranges) and dispatch to the
// CPU reference.
#include "ops/router.h"

#include <cstdint>
#include <string>
#include <utility>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/router.h"

namespace moetrain::ops {

namespace {

void check_argument(const Tensor& t, const Shape& shape, DType dtype, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
  require_cpu(t, op);
}

// Checks the [T, E] tensor that fixes the shapes and returns {T, E}.
std::pair<int64_t, int64_t> check_router_shape(const Tensor& t, const RouterParams& params, const char* op,
                                               const char* name) {
  expect_defined(t, fmt::format("{}: {}", op, name));
  MT_CHECK(t.dim() == 2, "{}: expected {} [T, E] but found {}", op, name, t.describe());
  MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
           t.describe());
  const int64_t experts = t.size(1);
  MT_CHECK(params.top_k >= 1 && params.top_k <= experts, "{}: top_k ({}) must be in [1, E = {}]", op, params.top_k,
           experts);
  return {t.size(0), experts};
}

}  // namespace

void router_forward(Stream& stream, Tensor probs, Tensor topk_index, Tensor topk_weight, const Tensor& logits,
                    const RouterParams& params) {
  (void)stream;
  constexpr const char* op = "router_forward";
  const auto [tokens, experts] = check_router_shape(logits, params, op, "logits");
  const DType dtype = logits.dtype();
  check_argument(logits, {tokens, experts}, dtype, op, "logits");
  check_argument(probs, {tokens, experts}, dtype, op, "probs");
  check_argument(topk_index, {tokens, params.top_k}, DType::I32, op, "topk_index");
  check_argument(topk_weight, {tokens, params.top_k}, dtype, op, "topk_weight");
  cpu::router_forward(probs, topk_index, topk_weight, logits, params);
}

void router_backward(Stream& stream, Tensor dlogits, const Tensor& dtopk_weight, const Tensor& dprobs,
                     const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                     const RouterParams& params) {
  (void)stream;
  constexpr const char* op = "router_backward";
  const auto [tokens, experts] = check_router_shape(probs, params, op, "probs");
  const DType dtype = probs.dtype();
  check_argument(probs, {tokens, experts}, dtype, op, "probs");
  check_argument(dlogits, {tokens, experts}, dtype, op, "dlogits");
  check_argument(dtopk_weight, {tokens, params.top_k}, dtype, op, "dtopk_weight");
  if (dprobs.defined()) check_argument(dprobs, {tokens, experts}, dtype, op, "dprobs");
  check_argument(topk_index, {tokens, params.top_k}, DType::I32, op, "topk_index");
  check_argument(topk_weight, {tokens, params.top_k}, dtype, op, "topk_weight");
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
