// defines: the CPU permutation reference. Each output row is written by one thread; sums over a token's slots run
// in ascending k, so a token's result does not depend on the other tokens of the batch.
#include "ops/cpu/permute.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

template <typename T>
void permute_forward_impl(const Tensor& permuted, const Tensor& x, const RoutingPlan& plan) {
  const int64_t rows = plan.num_tokens * plan.top_k, hidden = x.size(1);
  const int32_t* row_choice = plan.row_choice.data<int32_t>();
  const T* xp = x.data<T>();
  T* pp = permuted.data<T>();
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = xp + (row_choice[r] / plan.top_k) * hidden;
    std::copy(src, src + hidden, pp + r * hidden);
  }
}

template <typename T>
void permute_backward_impl(const Tensor& dx, const Tensor& dpermuted, const RoutingPlan& plan) {
  const int64_t hidden = dx.size(1);
  const int32_t* choice_row = plan.choice_row.data<int32_t>();
  const T* dpp = dpermuted.data<T>();
  T* dxp = dx.data<T>();
#pragma omp parallel for
  for (int64_t t = 0; t < plan.num_tokens; ++t) {
    T* out = dxp + t * hidden;
    std::fill(out, out + hidden, T(0));
    for (int64_t k = 0; k < plan.top_k; ++k) {
      const T* src = dpp + choice_row[t * plan.top_k + k] * hidden;
      for (int64_t h = 0; h < hidden; ++h) out[h] += src[h];
    }
  }
}

template <typename T>
void unpermute_forward_impl(const Tensor& y, const Tensor& expert_out, const Tensor& topk_weight,
                            const RoutingPlan& plan) {
  const int64_t hidden = y.size(1);
  const int32_t* choice_row = plan.choice_row.data<int32_t>();
  const T* ep = expert_out.data<T>();
  const T* wp = topk_weight.data<T>();
  T* yp = y.data<T>();
#pragma omp parallel for
  for (int64_t t = 0; t < plan.num_tokens; ++t) {
    T* out = yp + t * hidden;
    std::fill(out, out + hidden, T(0));
    for (int64_t k = 0; k < plan.top_k; ++k) {
      const int64_t c = t * plan.top_k + k;
      const T w = wp[c];
      const T* src = ep + choice_row[c] * hidden;
      for (int64_t h = 0; h < hidden; ++h) out[h] += w * src[h];
    }
  }
}

template <typename T>
void unpermute_backward_impl(const Tensor& dexpert_out, const Tensor& dtopk_weight, const Tensor& dy,
                             const Tensor& expert_out, const Tensor& topk_weight, const RoutingPlan& plan) {
  const int64_t hidden = dy.size(1), choices = plan.num_tokens * plan.top_k;
  const int32_t* choice_row = plan.choice_row.data<int32_t>();
  const T* dyp = dy.data<T>();
  const T* ep = expert_out.data<T>();
  const T* wp = topk_weight.data<T>();
  T* dep = dexpert_out.data<T>();
  T* dwp = dtopk_weight.data<T>();
  // One (token, slot) choice per iteration: dexpert_out[row] = w * dy[t], dtopk_weight[t, k] = dot(dy[t], row).
#pragma omp parallel for
  for (int64_t c = 0; c < choices; ++c) {
    const int64_t row = choice_row[c];
    const T* g = dyp + (c / plan.top_k) * hidden;
    const T* e = ep + row * hidden;
    T* de = dep + row * hidden;
    const T w = wp[c];
    T dw = T(0);
    for (int64_t h = 0; h < hidden; ++h) {
      de[h] = w * g[h];
      dw += g[h] * e[h];
    }
    dwp[c] = dw;
  }
}

// A source's row r, from its token side: a copy, or the weighted product of unpermute_backward_impl's de[h].
template <typename T>
void make_permuted_row(T* out, const PermutedRows& source, int64_t r, int64_t hidden) {
  const int64_t c = source.plan.row_choice.data<int32_t>()[r];
  const T* token = source.tokens.data<T>() + (c / source.plan.top_k) * hidden;
  if (!source.weight.defined()) {
    std::copy(token, token + hidden, out);
    return;
  }
  const T w = source.weight.data<T>()[c];
  for (int64_t h = 0; h < hidden; ++h) out[h] = w * token[h];
}

template <typename T>
void concat_permuted_rows_impl(const Tensor& out, const std::vector<PermutedRows>& sources) {
  // Where each output row comes from, (source, row of its plan): expert by expert, source by source.
  std::vector<std::pair<size_t, int64_t>> from;
  from.reserve(static_cast<size_t>(out.size(0)));
  for (int64_t e = 0; e < sources[0].plan.num_experts; ++e) {
    for (size_t p = 0; p < sources.size(); ++p) {
      const int32_t* offsets = sources[p].plan.expert_offsets.data<int32_t>();
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) from.emplace_back(p, r);
    }
  }
  const int64_t hidden = out.size(1);
  T* dst = out.data<T>();
#pragma omp parallel for
  for (int64_t i = 0; i < out.size(0); ++i) {
    const auto& [p, r] = from[static_cast<size_t>(i)];
    make_permuted_row(dst + i * hidden, sources[p], r, hidden);
  }
}

}  // namespace

RoutingPlan make_routing_plan(const Tensor& topk_index, int64_t num_experts) {
  const int64_t tokens = topk_index.size(0), top_k = topk_index.size(1), choices = tokens * top_k;
  const int32_t* index = topk_index.data<int32_t>();
  RoutingPlan plan;
  plan.num_tokens = tokens;
  plan.top_k = top_k;
  plan.num_experts = num_experts;
  plan.expert_offsets = Tensor::zeros({num_experts + 1}, DType::I32);
  plan.row_choice = Tensor::empty({choices}, DType::I32);
  plan.choice_row = Tensor::empty({choices}, DType::I32);
  int32_t* offsets = plan.expert_offsets.data<int32_t>();
  int32_t* row_choice = plan.row_choice.data<int32_t>();
  int32_t* choice_row = plan.choice_row.data<int32_t>();

  // Counting sort: counts, exclusive scan, then placement in ascending (t, k) order (stable).
  for (int64_t c = 0; c < choices; ++c) ++offsets[index[c] + 1];
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int32_t> cursor(offsets, offsets + num_experts);
  for (int64_t c = 0; c < choices; ++c) {
    const int32_t row = cursor[static_cast<size_t>(index[c])]++;
    row_choice[row] = static_cast<int32_t>(c);
    choice_row[c] = row;
  }
  return plan;
}

void permute_forward(const Tensor& permuted, const Tensor& x, const RoutingPlan& plan) {
  dispatch_float(x.dtype(), "permute_forward", [&]<typename T>() { permute_forward_impl<T>(permuted, x, plan); });
}

void permute_backward(const Tensor& dx, const Tensor& dpermuted, const RoutingPlan& plan) {
  dispatch_float(dx.dtype(), "permute_backward", [&]<typename T>() { permute_backward_impl<T>(dx, dpermuted, plan); });
}

void unpermute_forward(const Tensor& y, const Tensor& expert_out, const Tensor& topk_weight, const RoutingPlan& plan) {
  dispatch_float(y.dtype(), "unpermute_forward",
                 [&]<typename T>() { unpermute_forward_impl<T>(y, expert_out, topk_weight, plan); });
}

void unpermute_backward(const Tensor& dexpert_out, const Tensor& dtopk_weight, const Tensor& dy,
                        const Tensor& expert_out, const Tensor& topk_weight, const RoutingPlan& plan) {
  dispatch_float(dy.dtype(), "unpermute_backward", [&]<typename T>() {
    unpermute_backward_impl<T>(dexpert_out, dtopk_weight, dy, expert_out, topk_weight, plan);
  });
}

void concat_permuted_rows(const Tensor& out, const std::vector<PermutedRows>& sources) {
  dispatch_float(out.dtype(), "concat_permuted_rows",
                 [&]<typename T>() { concat_permuted_rows_impl<T>(out, sources); });
}

}  // namespace moetrain::ops::cpu
