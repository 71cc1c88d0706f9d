// defines: the CUDA permutation kernels (ops/cuda/permute.h): the routing plan (CUB's stable radix sort of the
// choices by expert, its inverse, per-expert offsets by binary search) and the row gathers / weighted sums.
#include "ops/cuda/permute.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cub/cub.cuh>

#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/group_parts.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

__global__ void iota_kernel(int32_t* values, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) values[i] = static_cast<int32_t>(i);
}

// choice_row is the inverse permutation of row_choice.
__global__ void invert_kernel(int32_t* choice_row, const int32_t* row_choice, int64_t n) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < n) choice_row[row_choice[r]] = static_cast<int32_t>(r);
}

// offsets[e] = the number of sorted choices whose expert is below e, for e in [0, E].
__global__ void offsets_kernel(int32_t* offsets, const uint32_t* sorted_experts, int64_t n, int64_t experts) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e > experts) return;
  int64_t lo = 0, hi = n;  // the first position whose expert is >= e
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(sorted_experts[mid]) < e) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  offsets[e] = static_cast<int32_t>(lo);
}

// The row kernels walk a row in packs of 8 elements (16-byte accesses) when `packed` (H a multiple of 8 and every
// row pointer 16-byte aligned: spans_of_8), one element at a time otherwise. Each output element's arithmetic is the
// same either way (sums over k in ascending order, products and sums rounded apart), so the two paths give the same
// bits; only unpermute_backward's dot product over H is summed in a different order.
constexpr int kRowPack = 8;

// permuted[r] = x[row_choice[r] / K], element by element: one block per row (rows whose length or start rules out
// 16-byte copies).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    permute_forward_kernel(T* permuted, const T* x, const int32_t* row_choice, int64_t top_k, int64_t hidden) {
  const int64_t r = blockIdx.x;
  const T* src = x + (row_choice[r] / top_k) * hidden;
  T* dst = permuted + r * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += kThreads) dst[h] = src[h];
}

// The same in 16-byte chunks by a warp (permute_forward_packed_kernel): each lane loads kCopyBatch chunks before it
// stores any, so a warp keeps a 4 KB row (hidden 2048 in bf16) in flight at once. One block per row with one chunk per
// thread left the copy bound by block launches (2.2 TB/s at the workload of record's 65,536 rows of 4 KB).
constexpr int kCopyBatch = 8;

// One warp copies a row's bytes to `count` rows, row_of(k) for k < count (a null row is skipped), reading it once:
// 16-byte chunks with kCopyBatch of them in flight per lane when `packed`, else one element per lane at a time.
template <typename T, typename RowOf>
__device__ __forceinline__ void copy_row_to_rows_by_warp(const T* from, int64_t hidden, int64_t lane, bool packed,
                                                         int64_t count, const RowOf& row_of) {
  // The loops run alike on every lane (a lane past the row's end idles), since row_of may exchange values across the
  // warp.
  if (!packed) {
    for (int64_t base = 0; base < hidden; base += 32) {
      const int64_t h = base + lane;
      const T value = h < hidden ? from[h] : T{};
      for (int64_t k = 0; k < count; ++k) {
        T* to = row_of(k);
        if (to != nullptr && h < hidden) to[h] = value;
      }
    }
    return;
  }
  const int64_t chunks = hidden * static_cast<int64_t>(sizeof(T)) / 16;
  const auto* src = reinterpret_cast<const uint4*>(from);
  for (int64_t base = 0; base < chunks; base += int64_t{32} * kCopyBatch) {
    const int64_t first = base + lane;
    uint4 v[kCopyBatch];
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u) {
      const int64_t c = first + int64_t{32} * u;
      if (c < chunks) v[u] = __ldg(src + c);
    }
    for (int64_t k = 0; k < count; ++k) {
      T* to = row_of(k);
      if (to == nullptr) continue;
      auto* dst = reinterpret_cast<uint4*>(to);
#pragma unroll
      for (int u = 0; u < kCopyBatch; ++u) {
        const int64_t c = first + int64_t{32} * u;
        if (c < chunks) dst[c] = v[u];
      }
    }
  }
}

// Choice k's value among a token's top_k choices, where lane k holds it (lane_value) for a top-k up to a warp's width;
// a wider one computes it on every lane (value_of(k)). Every lane of the warp calls it.
template <typename F>
__device__ __forceinline__ int64_t choice_from_lanes(int64_t lane_value, int64_t k, int64_t top_k, const F& value_of) {
  return top_k <= 32 ? __shfl_sync(kFullMask, lane_value, static_cast<int>(k)) : value_of(k);
}

// In token order, a warp per token (grid-stride): its row read once and stored to the permuted rows of its K choices
// (choice_row). Walking the permuted rows in expert order instead read each token's row K times, mostly from HBM.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    permute_forward_packed_kernel(T* permuted, const T* x, const int32_t* choice_row, int64_t tokens, int64_t top_k,
                                  int64_t hidden) {
  const int64_t lane = threadIdx.x % 32;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int32_t* rows = choice_row + t * top_k;
    const auto row_at = [rows](int64_t k) -> int64_t { return rows[k]; };
    const int64_t lane_row = lane < top_k ? row_at(lane) : -1;
    copy_row_to_rows_by_warp(x + t * hidden, hidden, lane, true, top_k, [&](int64_t k) {
      return permuted + choice_from_lanes(lane_row, k, top_k, row_at) * hidden;
    });
  }
}

// out_row = sum over k (ascending) of w[k] * in[rows[k]] (of in[rows[k]] when w is null), each product and sum
// rounded apart: the block's threads take spans of 8 elements when packed, else single elements. With an addend row
// (null for none) the sum is rounded to TO, then the addend added and rounded again: the bits of accumulate after.
template <typename TO, typename T>
__device__ __forceinline__ void sum_choices(TO* out_row, const T* in, const int32_t* rows, const float* w,
                                            const TO* addend_row, int64_t top_k, int64_t hidden, bool packed) {
  const auto sum_spans = [&]<int K>() {
    for (int64_t h = threadIdx.x * K; h < hidden; h += kThreads * K) {
      float acc[K] = {};
      for (int64_t k = 0; k < top_k; ++k) {
        float v[K];
        load_span<K>(in + rows[k] * hidden + h, v);
#pragma unroll
        for (int i = 0; i < K; ++i) acc[i] = __fadd_rn(acc[i], w == nullptr ? v[i] : __fmul_rn(w[k], v[i]));
      }
      if (addend_row != nullptr) {
        float a[K];
        load_span<K>(addend_row + h, a);
#pragma unroll
        for (int i = 0; i < K; ++i) acc[i] = __fadd_rn(stored_value(acc[i], out_row), a[i]);
      }
      store_span<K>(out_row + h, acc);
    }
  };
  if (packed) {
    sum_spans.template operator()<kRowPack>();
  } else {
    sum_spans.template operator()<1>();
  }
}

// dx[t] = sum over k (ascending) of dpermuted[choice_row[t*K + k]].
template <typename TX, typename T>
__global__ void __launch_bounds__(kThreads)
    permute_backward_kernel(TX* dx, const T* dpermuted, const int32_t* choice_row, const TX* addend, int64_t top_k,
                            int64_t hidden, bool packed) {
  const int64_t t = blockIdx.x;
  sum_choices(dx + t * hidden, dpermuted, choice_row + t * top_k, nullptr,
              addend == nullptr ? nullptr : addend + t * hidden, top_k, hidden, packed);
}

// y[t] = sum over k (ascending) of weight[t, k] * expert_out[choice_row[t*K + k]], product and sum rounded apart.
template <typename TY, typename T>
__global__ void __launch_bounds__(kThreads)
    unpermute_forward_kernel(TY* y, const T* expert_out, const float* topk_weight, const int32_t* choice_row,
                             const TY* addend, int64_t top_k, int64_t hidden, bool packed) {
  const int64_t t = blockIdx.x;
  sum_choices(y + t * hidden, expert_out, choice_row + t * top_k, topk_weight + t * top_k,
              addend == nullptr ? nullptr : addend + t * hidden, top_k, hidden, packed);
}

// One block per choice c = t*K + k: dexpert_out[row] = weight[c] * dy[t] and dtopk_weight[c] = dot(dy[t], row),
// row = choice_row[c]. The dot: per-thread sums over the thread's elements in ascending order (packs thread, thread +
// 256, ... when packed; elements thread, thread + 256, ... otherwise), a butterfly within each warp, then the warps'
// sums in ascending order: an order fixed by H (and the packing) alone.
template <typename T, typename TY>
__global__ void __launch_bounds__(kThreads)
    unpermute_backward_kernel(T* dexpert_out, float* dtopk_weight, const TY* dy, const T* expert_out,
                              const float* topk_weight, const int32_t* choice_row, int64_t top_k, int64_t hidden,
                              bool packed) {
  __shared__ float warp_sums[kWarps];
  const int64_t c = blockIdx.x;
  const int64_t row = choice_row[c];
  const TY* g = dy + (c / top_k) * hidden;
  const T* e = expert_out + row * hidden;
  T* de = dexpert_out + row * hidden;
  const float w = topk_weight[c];
  float dot = 0.0f;
  const auto spans = [&]<int K>() {
    for (int64_t h = threadIdx.x * K; h < hidden; h += kThreads * K) {
      float gv[K], ev[K], dv[K];
      load_span<K>(g + h, gv);
      load_span<K>(e + h, ev);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        dv[i] = __fmul_rn(w, gv[i]);
        dot = __fadd_rn(dot, __fmul_rn(gv[i], ev[i]));
      }
      store_span<K>(de + h, dv);
    }
  };
  if (packed) {
    spans.template operator()<kRowPack>();
  } else {
    spans.template operator()<1>();
  }
  for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(kFullMask, dot, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dot;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int i = 0; i < kWarps; ++i) total += warp_sums[i];
    dtopk_weight[c] = total;
  }
}

// concat_permuted_rows in token order: a warp per token t of source `part` (kWarps tokens a block, grid-stride) reads
// the token's row once and stores it to the rows of its K choices. Walking the rows in expert order instead read each
// token's row K times at scattered moments, mostly from HBM (12.2 ms a step at the workload of record against ~5 ms
// for its writes). Choice c = t*K + k is row choice_row[c] of the part, which goes where concat_group_rows puts a
// part's row (group_parts.cuh); lane k finds choice k's destination and the warp shares it. Each row is made as
// permute_forward copies its token (its bytes), or as unpermute_backward_kernel makes dexpert_out's row: one product
// __fmul_rn(w, dy) rounded once on store. Each lane loads kCopyBatch chunks or spans before it stores any (a warp
// keeps a whole bf16 row of hidden 2048 in flight).
template <typename TO, typename TI>
__global__ void __launch_bounds__(kThreads)
    concat_permuted_rows_kernel(TO* __restrict__ out, const TI* __restrict__ tokens, const float* weight,
                                const int32_t* choice_row, GroupParts parts, int part, int64_t groups,
                                int64_t num_tokens, int64_t out_rows, int64_t top_k, int64_t hidden, bool packed) {
  const int64_t lane = threadIdx.x % 32;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < num_tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    const auto destination_of = [&](int64_t k) {
      return concat_destination(parts, part, groups, choice_row[t * top_k + k]);
    };
    const int64_t lane_destination = lane < top_k ? destination_of(lane) : -1;
    // Choice k's row in out; outside it (bad offsets) the choice is skipped: never write outside out.
    const auto row_of = [&](int64_t k) -> TO* {
      const int64_t dest = choice_from_lanes(lane_destination, k, top_k, destination_of);
      return dest < 0 || dest >= out_rows ? nullptr : out + dest * hidden;
    };
    const TI* from = tokens + t * hidden;
    if constexpr (std::is_same_v<TO, TI>) {
      if (weight == nullptr) {  // the token's bytes, as permute_forward copies them (NaN payloads included)
        copy_row_to_rows_by_warp(from, hidden, lane, packed, top_k, row_of);
        continue;
      }
    }
    const auto spans = [&]<int K>() {
      for (int64_t base = 0; base < hidden; base += int64_t{32} * K * kCopyBatch) {  // alike on every lane
        const int64_t first = base + lane * K;
        float v[kCopyBatch][K];
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u) {
          const int64_t h = first + int64_t{32} * K * u;
          if (h < hidden) load_span<K>(from + h, v[u]);
        }
        for (int64_t k = 0; k < top_k; ++k) {
          TO* to = row_of(k);
          if (to == nullptr) continue;
          const float w = weight == nullptr ? 1.0f : weight[t * top_k + k];
#pragma unroll
          for (int u = 0; u < kCopyBatch; ++u) {
            const int64_t h = first + int64_t{32} * K * u;
            if (h >= hidden) continue;
            float product[K];
#pragma unroll
            for (int i = 0; i < K; ++i) product[i] = weight == nullptr ? v[u][i] : __fmul_rn(w, v[u][i]);
            store_span<K>(to + h, product);
          }
        }
      }
    };
    if (packed) {
      spans.template operator()<kRowPack>();
    } else {
      spans.template operator()<1>();
    }
  }
}

unsigned blocks_of(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.raw_data());
}

// Calls f.template operator()<T>() with T = float or __nv_bfloat16 for dtype f32 or bf16.
template <typename F>
void dispatch_activation(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::F32: f.template operator()<float>(); return;
    case DType::BF16: f.template operator()<__nv_bfloat16>(); return;
    default: MT_FAIL("{}: the CUDA kernels take f32 or bf16 but found {}", op, dtype_name(dtype));
  }
}

// The same over two dtypes: f.template operator()<T0, T1>(). The token side (x's gradient, y, dy) may be an f32
// residual stream while the rows are bf16.
template <typename F>
void dispatch_activations(DType dtype0, DType dtype1, const char* op, F&& f) {
  dispatch_activation(dtype0, op, [&]<typename T0>() {
    dispatch_activation(dtype1, op, [&]<typename T1>() { f.template operator()<T0, T1>(); });
  });
}

}  // namespace

RoutingPlan make_routing_plan(const Stream& stream, const Tensor& topk_index, int64_t num_experts) {
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  const Device device = topk_index.device();
  const int64_t tokens = topk_index.size(0), top_k = topk_index.size(1), choices = tokens * top_k;
  RoutingPlan plan;
  plan.num_tokens = tokens;
  plan.top_k = top_k;
  plan.num_experts = num_experts;
  plan.expert_offsets = Tensor::empty({num_experts + 1}, DType::I32, device);
  plan.row_choice = Tensor::empty({choices}, DType::I32, device);
  plan.choice_row = Tensor::empty({choices}, DType::I32, device);

  // Scratch from the device's stream-ordered pool; its release is ordered after the kernels below.
  const Tensor sorted_experts = Tensor::empty({choices}, DType::I32, device);
  if (choices > 0) {
    const Tensor flat = Tensor::empty({choices}, DType::I32, device);
    iota_kernel<<<blocks_of(choices), kThreads, 0, s>>>(ptr<int32_t>(flat), choices);
    MT_CUDA_CHECK(cudaGetLastError());
    // Experts are in [0, E): sorting their low bit_width(E - 1) bits (at least one) as unsigned keys is exact.
    int end_bit = 1;
    while ((int64_t{1} << end_bit) < num_experts) ++end_bit;
    const auto* keys_in = ptr<const uint32_t>(topk_index);
    auto* keys_out = ptr<uint32_t>(sorted_experts);
    const auto* values_in = ptr<const int32_t>(flat);
    auto* values_out = ptr<int32_t>(plan.row_choice);
    const int num_items = static_cast<int>(choices);
    size_t temp_bytes = 0;
    MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, values_in, values_out,
                                                  num_items, 0, end_bit, s));
    const Tensor temp = Tensor::empty({static_cast<int64_t>(temp_bytes)}, DType::U8, device);
    MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw_data(), temp_bytes, keys_in, keys_out, values_in, values_out,
                                                  num_items, 0, end_bit, s));
    invert_kernel<<<blocks_of(choices), kThreads, 0, s>>>(ptr<int32_t>(plan.choice_row),
                                                          ptr<const int32_t>(plan.row_choice), choices);
    MT_CUDA_CHECK(cudaGetLastError());
  }
  offsets_kernel<<<blocks_of(num_experts + 1), kThreads, 0, s>>>(
      ptr<int32_t>(plan.expert_offsets), ptr<const uint32_t>(sorted_experts), choices, num_experts);
  MT_CUDA_CHECK(cudaGetLastError());
  return plan;
}

void permute_forward(const Stream& stream, const Tensor& permuted, const Tensor& x, const RoutingPlan& plan) {
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  const int64_t rows = plan.num_tokens * plan.top_k, hidden = x.size(1);
  dispatch_activation(x.dtype(), "permute_forward", [&]<typename T>() {
    if (rows == 0 || hidden == 0) return;
    if (spans_of_8(hidden, {permuted.raw_data(), x.raw_data()})) {
      const int64_t blocks = std::min<int64_t>((plan.num_tokens + kWarps - 1) / kWarps, int64_t{1} << 20);
      permute_forward_packed_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
          ptr<T>(permuted), ptr<const T>(x), ptr<const int32_t>(plan.choice_row), plan.num_tokens, plan.top_k, hidden);
    } else {
      permute_forward_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
          ptr<T>(permuted), ptr<const T>(x), ptr<const int32_t>(plan.row_choice), plan.top_k, hidden);
    }
    MT_CUDA_CHECK(cudaGetLastError());
  });
}

void permute_backward(const Stream& stream, const Tensor& dx, const Tensor& dpermuted, const RoutingPlan& plan,
                      const Tensor& addend) {
  if (addend.defined() && addend.dtype() != dx.dtype()) {  // the kernel adds a token-side row of dx's dtype
    permute_backward(stream, dx, dpermuted, plan);
    accumulate(stream, dx, addend);
    return;
  }
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  const int64_t hidden = dx.size(1);
  const void* addend_base = addend.defined() ? addend.raw_data() : dx.raw_data();
  dispatch_activations(dx.dtype(), dpermuted.dtype(), "permute_backward", [&]<typename TX, typename T>() {
    if (plan.num_tokens == 0 || hidden == 0) return;
    permute_backward_kernel<TX, T><<<static_cast<unsigned>(plan.num_tokens), kThreads, 0, s>>>(
        ptr<TX>(dx), ptr<const T>(dpermuted), ptr<const int32_t>(plan.choice_row),
        addend.defined() ? ptr<const TX>(addend) : nullptr, plan.top_k, hidden,
        spans_of_8(hidden, {dx.raw_data(), dpermuted.raw_data(), addend_base}));
    MT_CUDA_CHECK(cudaGetLastError());
  });
}

void unpermute_forward(const Stream& stream, const Tensor& y, const Tensor& expert_out, const Tensor& topk_weight,
                       const RoutingPlan& plan, const Tensor& addend) {
  if (addend.defined() && addend.dtype() != y.dtype()) {  // the kernel adds a token-side row of y's dtype
    unpermute_forward(stream, y, expert_out, topk_weight, plan);
    accumulate(stream, y, addend);
    return;
  }
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  const int64_t hidden = y.size(1);
  const void* addend_base = addend.defined() ? addend.raw_data() : y.raw_data();
  dispatch_activations(y.dtype(), expert_out.dtype(), "unpermute_forward", [&]<typename TY, typename T>() {
    if (plan.num_tokens == 0 || hidden == 0) return;
    unpermute_forward_kernel<TY, T><<<static_cast<unsigned>(plan.num_tokens), kThreads, 0, s>>>(
        ptr<TY>(y), ptr<const T>(expert_out), ptr<const float>(topk_weight), ptr<const int32_t>(plan.choice_row),
        addend.defined() ? ptr<const TY>(addend) : nullptr, plan.top_k, hidden,
        spans_of_8(hidden, {y.raw_data(), expert_out.raw_data(), addend_base}));
    MT_CUDA_CHECK(cudaGetLastError());
  });
}

void unpermute_backward(const Stream& stream, const Tensor& dexpert_out, const Tensor& dtopk_weight, const Tensor& dy,
                        const Tensor& expert_out, const Tensor& topk_weight, const RoutingPlan& plan) {
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  const int64_t hidden = dy.size(1), choices = plan.num_tokens * plan.top_k;
  dispatch_activations(expert_out.dtype(), dy.dtype(), "unpermute_backward", [&]<typename T, typename TY>() {
    if (choices == 0) return;
    unpermute_backward_kernel<T, TY><<<static_cast<unsigned>(choices), kThreads, 0, s>>>(
        ptr<T>(dexpert_out), ptr<float>(dtopk_weight), ptr<const TY>(dy), ptr<const T>(expert_out),
        ptr<const float>(topk_weight), ptr<const int32_t>(plan.choice_row), plan.top_k, hidden,
        spans_of_8(hidden, {dexpert_out.raw_data(), dy.raw_data(), expert_out.raw_data()}));
    MT_CUDA_CHECK(cudaGetLastError());
  });
}

void concat_permuted_rows(const Stream& stream, const Tensor& out, const std::vector<PermutedRows>& sources) {
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  std::vector<Tensor> offsets;
  for (const PermutedRows& source : sources) offsets.push_back(source.plan.expert_offsets);
  const GroupParts table = group_parts(offsets);
  const int64_t hidden = out.size(1), groups = sources[0].plan.num_experts;
  for (size_t p = 0; p < sources.size(); ++p) {
    const PermutedRows& source = sources[p];
    const int64_t token_count = source.plan.num_tokens;
    if (token_count == 0 || source.plan.top_k == 0 || hidden == 0) continue;
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((token_count + kWarps - 1) / kWarps, int64_t{1} << 20));
    dispatch_activations(out.dtype(), source.tokens.dtype(), "concat_permuted_rows", [&]<typename TO, typename TI>() {
      concat_permuted_rows_kernel<TO, TI><<<blocks, kThreads, 0, s>>>(
          ptr<TO>(out), ptr<const TI>(source.tokens),
          source.weight.defined() ? ptr<const float>(source.weight) : nullptr,
          ptr<const int32_t>(source.plan.choice_row), table, static_cast<int>(p), groups, token_count, out.size(0),
          source.plan.top_k, hidden, spans_of_8(hidden, {out.raw_data(), source.tokens.raw_data()}));
      MT_CUDA_CHECK(cudaGetLastError());
    });
  }
}

}  // namespace moetrain::ops::cuda
