// defines: the CUDA kernels of the router's auxiliary losses (ops/cuda/router_aux.h): balance-set statistics,
// the running global counts, the load-balance value, the device-balance value, the gradient of both on the
// probabilities, the z-loss value and gradient, and the final fixed-order reduction of the three values into a
// device f32 [3]. Every float sum runs in f64 in a fixed order.
#include "ops/cuda/router_aux.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kTileExperts = 32;  // statistics: one lane per expert of a tile of 32 (coalesced rows)
constexpr int kRowGroups = 32;    // statistics: 32 warps walk the rows of a set, strided by 32
constexpr int kValueThreads = 256;
constexpr int kFinishThreads = 1024;
constexpr int kTokenThreads = 256;  // z-loss: one warp per token
constexpr int kTokenWarps = kTokenThreads / 32;
constexpr int kGradThreads = 256;

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// Butterfly: every lane ends with the same bits (each step adds a pair commutatively).
__device__ __forceinline__ double warp_sum(double x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// Tree over blockDim.x (a power of two) values in `scratch`: the order depends only on blockDim.x.
__device__ double block_sum(double x, double* scratch) {
  const unsigned tid = threadIdx.x;
  scratch[tid] = x;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (tid < stride) scratch[tid] += scratch[tid + stride];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

__device__ __forceinline__ void set_bounds(bool per_document, const int32_t* cu, int64_t set, int64_t tokens,
                                           int64_t& begin, int64_t& end) {
  begin = per_document ? cu[set] : 0;
  end = per_document ? cu[set + 1] : tokens;
}

// grid (sets, expert tiles), block (32 experts, 32 row groups): the sum of the probabilities and the number of
// selections of each expert over the set's rows. Row group g takes rows begin + g, begin + g + 32, ...; the 32
// partials are then added in ascending g, so the order depends only on the set's length.
__global__ void __launch_bounds__(kTileExperts* kRowGroups)
    stats_kernel(double* prob_sum, int32_t* counts, const float* probs, const int32_t* topk_index,
                 const int32_t* cu_seqlens, bool per_document, int64_t tokens, int experts, int top_k) {
  __shared__ double prob_part[kRowGroups][kTileExperts + 1];
  __shared__ int32_t count_part[kRowGroups][kTileExperts + 1];
  const int64_t set = blockIdx.x;
  const int lane = static_cast<int>(threadIdx.x), group = static_cast<int>(threadIdx.y);
  const int e = static_cast<int>(blockIdx.y) * kTileExperts + lane;
  int64_t begin = 0, end = 0;
  set_bounds(per_document, cu_seqlens, set, tokens, begin, end);
  double p = 0.0;
  int32_t c = 0;
  if (e < experts) {
    for (int64_t t = begin + group; t < end; t += kRowGroups) {
      p += static_cast<double>(probs[t * experts + e]);
      const int32_t* index = topk_index + t * top_k;
      for (int k = 0; k < top_k; ++k) c += index[k] == e ? 1 : 0;
    }
  }
  prob_part[group][lane] = p;
  count_part[group][lane] = c;
  __syncthreads();
  if (group == 0 && e < experts) {
    double ps = 0.0;
    int32_t cs = 0;
    for (int g = 0; g < kRowGroups; ++g) {
      ps += prob_part[g][lane];
      cs += count_part[g][lane];
    }
    prob_sum[set * experts + e] = ps;
    counts[set * experts + e] = cs;
  }
}

// global_batch: running[e] += this micro-batch's selections of e (one thread per expert: no atomics needed).
__global__ void running_kernel(int32_t* running, const int32_t* counts, int experts) {
  for (int e = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); e < experts;
       e += static_cast<int>(blockDim.x * gridDim.x)) {
    running[e] += counts[e];
  }
}

// One block per set: the fractions f_e (kept for the gradient) and the set's token-weighted value
// E * sum_e f_e * P_e * n / T, the same f64 expressions as model/router_loss.cpp.
__global__ void __launch_bounds__(kValueThreads)
    value_kernel(double* fraction, double* set_value, const double* prob_sum, const int32_t* counts,
                 const int32_t* running, const int32_t* cu_seqlens, bool per_document, int64_t tokens, int experts,
                 int top_k) {
  __shared__ double scratch[kValueThreads];
  const int64_t set = blockIdx.x;
  int64_t begin = 0, end = 0;
  set_bounds(per_document, cu_seqlens, set, tokens, begin, end);
  const int64_t n = end - begin;
  double running_total = 0.0;
  if (running != nullptr) {
    double part = 0.0;  // integers below 2^53: exact in any order
    for (int e = static_cast<int>(threadIdx.x); e < experts; e += kValueThreads) part += running[e];
    running_total = block_sum(part, scratch);
  }
  double part = 0.0;
  for (int e = static_cast<int>(threadIdx.x); e < experts; e += kValueThreads) {
    const int64_t i = set * experts + e;
    double f = 0.0;
    if (running != nullptr) {
      f = static_cast<double>(running[e]) / running_total;
    } else if (n > 0) {
      f = static_cast<double>(counts[i]) / static_cast<double>(n * top_k);
    }
    const double mean_prob = n > 0 ? prob_sum[i] / static_cast<double>(n) : 0.0;
    fraction[i] = f;
    part += static_cast<double>(experts) * f * mean_prob;
  }
  const double value = block_sum(part, scratch);
  if (threadIdx.x == 0) set_value[set] = value * static_cast<double>(n) / static_cast<double>(tokens);
}

// Device balance, one block: the micro-batch's statistics (its one set: prob_sum and counts [E]) summed over each of
// the D groups of E / D consecutive experts in ascending expert order (thread i takes groups i, i + 256, ...):
// F_i = choices of the group / (T * K), kept for the gradient, and the value D * sum_i F_i * sum_{e in i} P_e, with
// P_e = prob_sum_e / T. The same f64 expressions as value_kernel, so that D = E gives the micro_batch variant's bits.
__global__ void __launch_bounds__(kValueThreads)
    device_value_kernel(double* group_fraction, double* device_value, const double* prob_sum, const int32_t* counts,
                        int64_t tokens, int experts, int top_k, int groups) {
  __shared__ double scratch[kValueThreads];
  const int per_group = experts / groups;
  double part = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < groups; i += kValueThreads) {
    int64_t chosen = 0;  // integers: exact
    double prob = 0.0;
    for (int e = i * per_group; e < (i + 1) * per_group; ++e) {
      chosen += counts[e];
      prob += prob_sum[e] / static_cast<double>(tokens);
    }
    const double f = static_cast<double>(chosen) / static_cast<double>(tokens * top_k);
    group_fraction[i] = f;
    part += static_cast<double>(groups) * f * prob;
  }
  const double value = block_sum(part, scratch);
  if (threadIdx.x == 0) *device_value = value;
}

// d_probs[t, e] = coef * E * f_e(set of t) * layer_scale (when fraction is given; tokens outside every set, none when
// cu[documents] = T, get 0) + device_coef * D * F_group(e) * layer_scale (when group_fraction is given), added in f64
// in that order and rounded to f32 once, as model/router_loss.cpp does.
__global__ void __launch_bounds__(kGradThreads)
    balance_grad_kernel(float* d_probs, const double* fraction, const int32_t* cu_seqlens, bool per_document,
                        int64_t sets, int64_t tokens, int experts, double coef, const double* group_fraction,
                        int groups, double device_coef, double layer_scale) {
  const int64_t total = tokens * experts;
  const int per_group = group_fraction != nullptr ? experts / groups : 1;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t t = i / experts;
    const int e = static_cast<int>(i % experts);
    int64_t set = 0;
    if (fraction != nullptr && per_document) {  // the last set whose start is <= t (skips empty documents)
      int64_t lo = 0, hi = sets;
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (cu_seqlens[mid] <= t) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      set = lo;
    }
    double grad = 0.0;
    if (fraction != nullptr && set < sets) {
      grad = coef * static_cast<double>(experts) * fraction[set * experts + e] * layer_scale;
    }
    if (group_fraction != nullptr) {
      grad += device_coef * static_cast<double>(groups) * group_fraction[e / per_group] * layer_scale;
    }
    d_probs[i] = static_cast<float>(grad);
  }
}

// One warp per token: lse = logsumexp(logits) in f64, lse^2 kept for the value, and
// d_logits = coef * 2 * lse * softmax * layer_scale when write_grad.
__global__ void __launch_bounds__(kTokenThreads)
    z_loss_kernel(double* lse_squared, float* d_logits, const float* logits, int64_t tokens, int experts, double coef,
                  double layer_scale) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTokenWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (t >= tokens) return;
  const float* z = logits + t * experts;
  float max_f = -INFINITY;
  for (int e = lane; e < experts; e += 32) max_f = fmaxf(max_f, z[e]);
  const double max = static_cast<double>(warp_max(max_f));
  double total = 0.0;
  for (int e = lane; e < experts; e += 32) total += exp(static_cast<double>(z[e]) - max);
  total = warp_sum(total);
  const double lse = max + log(total);
  if (lane == 0) lse_squared[t] = lse * lse;
  float* dz = d_logits + t * experts;
  for (int e = lane; e < experts; e += 32) {
    const double softmax = exp(static_cast<double>(z[e]) - lse);
    dz[e] = static_cast<float>(coef * 2.0 * lse * softmax * layer_scale);
  }
}

// One block: values[0] = sum over sets of their token-weighted values, values[1] = mean over tokens of lse^2,
// values[2] = the device balance; 0 for a loss that is off (its input pointer is null).
__global__ void __launch_bounds__(kFinishThreads)
    finish_kernel(float* values, const double* set_value, int64_t sets, const double* lse_squared, int64_t tokens,
                  const double* device_value) {
  __shared__ double scratch[kFinishThreads];
  double part = 0.0;
  if (set_value != nullptr) {
    for (int64_t s = threadIdx.x; s < sets; s += kFinishThreads) part += set_value[s];
  }
  const double load_balance = block_sum(part, scratch);
  part = 0.0;
  if (lse_squared != nullptr) {
    for (int64_t t = threadIdx.x; t < tokens; t += kFinishThreads) part += lse_squared[t];
  }
  const double z_sum = block_sum(part, scratch);
  if (threadIdx.x == 0) {
    values[0] = set_value != nullptr ? static_cast<float>(load_balance) : 0.0f;
    values[1] = lse_squared != nullptr ? static_cast<float>(z_sum / static_cast<double>(tokens)) : 0.0f;
    values[2] = device_value != nullptr ? static_cast<float>(*device_value) : 0.0f;
  }
}

unsigned capped_blocks(int64_t work, int threads) {
  return static_cast<unsigned>(std::clamp<int64_t>((work + threads - 1) / threads, 1, 8192));
}

}  // namespace

void router_aux_losses(const Stream& stream, const Tensor& values, const Tensor& d_probs, const Tensor& d_logits,
                       const Tensor& logits, const Tensor& probs, const Tensor& topk_index, const Tensor& cu_seqlens,
                       const Tensor& running_counts, const RouterAuxParams& params) {
  const int64_t tokens = logits.size(0), experts = logits.size(1), top_k = topk_index.size(1);
  MT_CHECK(experts <= INT_MAX / kTileExperts && top_k <= INT_MAX,
           "router aux losses: E = {} and K = {} exceed the CUDA kernels' range", experts, top_k);
  const Device device = logits.device();
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  const bool load_balance = params.load_balance_coef > 0.0, z_loss = params.z_loss_coef > 0.0;
  const bool device_balance = params.device_balance_coef > 0.0;
  MT_CHECK(!device_balance || (params.device_groups >= 1 && experts % params.device_groups == 0),
           "router aux losses: the device balance needs D >= 1 groups dividing E = {}, but D = {}", experts,
           params.device_groups);
  const int64_t sets = params.per_document ? cu_seqlens.numel() - 1 : 1;
  const int e_count = static_cast<int>(experts), k_count = static_cast<int>(top_k);
  const int groups = device_balance ? static_cast<int>(params.device_groups) : 1;
  if (tokens == 0) {  // no token: every value is 0 (the CPU path's would divide by zero)
    MT_CUDA_CHECK(cudaMemsetAsync(values.raw_data(), 0, values.nbytes(), s));
    return;
  }
  const int32_t* cu = params.per_document ? cu_seqlens.data<int32_t>() : nullptr;

  Tensor set_value, prob_sum, counts, fraction;
  if (load_balance) {
    prob_sum = Tensor::empty({std::max<int64_t>(sets, 1), experts}, DType::F64, device);
    counts = Tensor::empty({std::max<int64_t>(sets, 1), experts}, DType::I32, device);
    fraction = Tensor::empty({std::max<int64_t>(sets, 1), experts}, DType::F64, device);
    set_value = Tensor::empty({std::max<int64_t>(sets, 1)}, DType::F64, device);
    if (sets > 0) {
      const dim3 grid(static_cast<unsigned>(sets), static_cast<unsigned>((experts + kTileExperts - 1) / kTileExperts));
      stats_kernel<<<grid, dim3(kTileExperts, kRowGroups), 0, s>>>(prob_sum.data<double>(), counts.data<int32_t>(),
                                                                   probs.data<float>(), topk_index.data<int32_t>(), cu,
                                                                   params.per_document, tokens, e_count, k_count);
      MT_CUDA_CHECK(cudaGetLastError());
      int32_t* running = nullptr;
      if (params.use_running) {
        running = running_counts.data<int32_t>();
        running_kernel<<<capped_blocks(experts, kValueThreads), kValueThreads, 0, s>>>(running, counts.data<int32_t>(),
                                                                                       e_count);
        MT_CUDA_CHECK(cudaGetLastError());
      }
      value_kernel<<<static_cast<unsigned>(sets), kValueThreads, 0, s>>>(
          fraction.data<double>(), set_value.data<double>(), prob_sum.data<double>(), counts.data<int32_t>(), running,
          cu, params.per_document, tokens, e_count, k_count);
      MT_CUDA_CHECK(cudaGetLastError());
    }
  }
  Tensor group_fraction, device_value;
  if (device_balance) {
    // The micro-batch as one set: the load balance's statistics when it has that one set (counts are this
    // micro-batch's even with use_running), else computed here.
    Tensor batch_prob_sum = prob_sum, batch_counts = counts;
    if (!load_balance || params.per_document) {
      batch_prob_sum = Tensor::empty({experts}, DType::F64, device);
      batch_counts = Tensor::empty({experts}, DType::I32, device);
      const dim3 grid(1, static_cast<unsigned>((experts + kTileExperts - 1) / kTileExperts));
      stats_kernel<<<grid, dim3(kTileExperts, kRowGroups), 0, s>>>(
          batch_prob_sum.data<double>(), batch_counts.data<int32_t>(), probs.data<float>(), topk_index.data<int32_t>(),
          nullptr, false, tokens, e_count, k_count);
      MT_CUDA_CHECK(cudaGetLastError());
    }
    group_fraction = Tensor::empty({params.device_groups}, DType::F64, device);
    device_value = Tensor::empty({1}, DType::F64, device);
    device_value_kernel<<<1, kValueThreads, 0, s>>>(group_fraction.data<double>(), device_value.data<double>(),
                                                    batch_prob_sum.data<double>(), batch_counts.data<int32_t>(), tokens,
                                                    e_count, k_count, groups);
    MT_CUDA_CHECK(cudaGetLastError());
  }
  if (load_balance || device_balance) {
    balance_grad_kernel<<<capped_blocks(tokens * experts, kGradThreads), kGradThreads, 0, s>>>(
        d_probs.data<float>(), load_balance ? fraction.data<double>() : nullptr, cu, params.per_document, sets, tokens,
        e_count, params.load_balance_coef, device_balance ? group_fraction.data<double>() : nullptr, groups,
        params.device_balance_coef, params.layer_scale);
    MT_CUDA_CHECK(cudaGetLastError());
  }
  Tensor lse_squared;
  if (z_loss) {
    lse_squared = Tensor::empty({tokens}, DType::F64, device);
    const auto blocks = static_cast<unsigned>((tokens + kTokenWarps - 1) / kTokenWarps);
    z_loss_kernel<<<blocks, kTokenThreads, 0, s>>>(lse_squared.data<double>(), d_logits.data<float>(),
                                                   logits.data<float>(), tokens, e_count, params.z_loss_coef,
                                                   params.layer_scale);
    MT_CUDA_CHECK(cudaGetLastError());
  }
  finish_kernel<<<1, kFinishThreads, 0, s>>>(values.data<float>(), load_balance ? set_value.data<double>() : nullptr,
                                             sets, z_loss ? lse_squared.data<double>() : nullptr, tokens,
                                             device_balance ? device_value.data<double>() : nullptr);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
