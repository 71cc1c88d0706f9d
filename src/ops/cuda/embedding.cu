// defines: the CUDA embedding kernels. The weight gradient sorts the (id, token) pairs by id with CUB's stable radix
// sort, so each id's tokens sit together in ascending token order; the block at the start of each id's run then sums
// those tokens' dy rows column by column in that order and adds the sum to dtable. No floating-point atomics: every
// dtable element is one thread's ascending sum, whatever T, the grid or the other ids.
#include "ops/cuda/embedding.h"

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cub/device/device_radix_sort.cuh>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxRowBlocks = int64_t(1) << 20;  // grid-stride over rows beyond this

// One block per token row (grid-stride), threads over spans of K columns (K = 8, 16-byte accesses, where the width
// and the addresses allow; else 1): a copy, so its bits do not depend on K.
template <int K, typename TTable, typename TOut>
__global__ void gather_kernel(TOut* y, const int32_t* ids, const TTable* table, int64_t tokens, int64_t vocab,
                              int64_t hidden) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t id = ids[t];
    TOut* out = y + t * hidden;
    const bool poisoned = id < 0 || id >= vocab;  // not validated on the device: poison the row, read nothing
    const TTable* row = table + (poisoned ? 0 : id) * hidden;
    for (int64_t h = int64_t{threadIdx.x} * K; h < hidden; h += int64_t{blockDim.x} * K) {
      float v[K];
      if (poisoned) {
#pragma unroll
        for (int i = 0; i < K; ++i) v[i] = __int_as_float(0x7fc00000);
      } else {
        load_span<K>(row + h, v);
      }
      store_span<K>(out + h, v);
    }
  }
}

// Sort input: key = id, or `vocab` (sorted last, then skipped) for an id outside [0, vocab); value = token index.
__global__ void make_pairs_kernel(uint32_t* keys, int32_t* tokens_of, const int32_t* ids, int64_t tokens,
                                  int64_t vocab) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens; t += stride) {
    const int64_t id = ids[t];
    keys[t] = static_cast<uint32_t>(id >= 0 && id < vocab ? id : vocab);
    tokens_of[t] = static_cast<int32_t>(t);
  }
}

// Block (i, c) works when sorted position i starts a run of one id: its threads own spans of K columns (K = 8 where
// the width and the addresses allow, else 1) from (c * blockDim.x + tid) * K and sum the run's dy rows in run order
// (ascending tokens, the sort is stable), each column on its own, then add the sum to dtable: the same bits for
// either K.
template <int K, typename TGrad>
__global__ void sum_runs_kernel(float* dtable, const TGrad* dy, const uint32_t* keys, const int32_t* tokens_of,
                                int64_t tokens, int64_t vocab, int64_t hidden) {
  const int64_t h = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * K;
  for (int64_t i = blockIdx.x; i < tokens; i += gridDim.x) {
    const uint32_t key = keys[i];
    if ((i > 0 && keys[i - 1] == key) || key >= vocab || h >= hidden) continue;
    float acc[K] = {};
    for (int64_t k = i; k < tokens && keys[k] == key; ++k) {
      float v[K];
      load_span<K>(dy + tokens_of[k] * hidden + h, v);
#pragma unroll
      for (int j = 0; j < K; ++j) acc[j] += v[j];
    }
    float* out = dtable + static_cast<int64_t>(key) * hidden + h;
    float sum[K];
    load_span<K>(out, sum);
#pragma unroll
    for (int j = 0; j < K; ++j) sum[j] = sum[j] + acc[j];
    store_span<K>(out, sum);
  }
}

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks); }

template <typename TTable>
void launch_gather(const Stream& stream, const Tensor& y, const Tensor& ids, const TTable* table, int64_t vocab) {
  const int64_t tokens = ids.numel();
  const int64_t hidden = y.size(1);
  const int32_t* id = static_cast<const int32_t*>(ids.raw_data());
  const bool packed = spans_of_8(hidden, {y.raw_data(), table});
  const auto launch = [&]<typename TOut>(TOut* out) {
    if (packed) {
      gather_kernel<8><<<row_blocks(tokens), kThreads, 0, native(stream)>>>(out, id, table, tokens, vocab, hidden);
    } else {
      gather_kernel<1><<<row_blocks(tokens), kThreads, 0, native(stream)>>>(out, id, table, tokens, vocab, hidden);
    }
  };
  switch (y.dtype()) {
    case DType::F32: launch(static_cast<float*>(y.raw_data())); break;
    case DType::BF16: launch(static_cast<__nv_bfloat16*>(y.raw_data())); break;
    default: MT_FAIL("embedding_forward (CUDA): expected y in f32 or bf16 but found {}", y.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void embedding_forward(const Stream& stream, const Tensor& y, const Tensor& ids, const Tensor& table) {
  if (y.numel() == 0) return;
  const int64_t vocab = table.size(0);
  switch (table.dtype()) {
    case DType::F32: launch_gather(stream, y, ids, static_cast<const float*>(table.raw_data()), vocab); return;
    case DType::BF16: launch_gather(stream, y, ids, static_cast<const __nv_bfloat16*>(table.raw_data()), vocab); return;
    default: MT_FAIL("embedding_forward (CUDA): expected table in f32 or bf16 but found {}", table.describe());
  }
}

void embedding_backward_weight(const Stream& stream, const Tensor& dtable, const Tensor& dy, const Tensor& ids) {
  const int64_t tokens = ids.numel();
  const int64_t vocab = dtable.size(0);
  const int64_t hidden = dtable.size(1);
  MT_CHECK(dtable.dtype() == DType::F32, "embedding_backward_weight (CUDA): expected dtable in f32 but found {}",
           dtable.describe());
  MT_CHECK(dy.dtype() == DType::F32 || dy.dtype() == DType::BF16,
           "embedding_backward_weight (CUDA): expected dy in f32 or bf16 but found {}", dy.describe());
  // Keys go up to vocab (the out-of-range marker) in u32; token indices are i32; columns tile the grid's y.
  MT_CHECK(vocab < (int64_t(1) << 31) - 1 && tokens < (int64_t(1) << 31) && (hidden + kThreads - 1) / kThreads < 65536,
           "embedding_backward_weight (CUDA): V = {} and T = {} must be below 2^31 and H = {} below 2^24", vocab,
           tokens, hidden);
  if (tokens == 0 || hidden == 0) return;
  const cudaStream_t cu_stream = native(stream);
  const Device device = dtable.device();

  Tensor keys_in = Tensor::empty({tokens}, DType::U32, device);
  Tensor keys_out = Tensor::empty({tokens}, DType::U32, device);
  Tensor tokens_in = Tensor::empty({tokens}, DType::I32, device);
  Tensor tokens_out = Tensor::empty({tokens}, DType::I32, device);
  const unsigned pair_blocks = static_cast<unsigned>((tokens + kThreads - 1) / kThreads);
  make_pairs_kernel<<<pair_blocks, kThreads, 0, cu_stream>>>(
      static_cast<uint32_t*>(keys_in.raw_data()), static_cast<int32_t*>(tokens_in.raw_data()),
      static_cast<const int32_t*>(ids.raw_data()), tokens, vocab);
  MT_CUDA_CHECK(cudaGetLastError());

  // Only the bits that keys up to `vocab` use: fewer radix passes for a small vocabulary.
  int end_bit = 1;
  while ((int64_t(1) << end_bit) <= vocab) ++end_bit;
  const auto* k_in = static_cast<const uint32_t*>(keys_in.raw_data());
  auto* k_out = static_cast<uint32_t*>(keys_out.raw_data());
  const auto* v_in = static_cast<const int32_t*>(tokens_in.raw_data());
  auto* v_out = static_cast<int32_t*>(tokens_out.raw_data());
  const int items = static_cast<int>(tokens);
  size_t temp_bytes = 0;
  MT_CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, k_in, k_out, v_in, v_out, items, 0, end_bit, cu_stream));
  Tensor temp = Tensor::empty({static_cast<int64_t>(temp_bytes)}, DType::U8, device);
  MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw_data(), temp_bytes, k_in, k_out, v_in, v_out, items, 0,
                                                end_bit, cu_stream));

  float* out = static_cast<float*>(dtable.raw_data());
  const bool packed = spans_of_8(hidden, {out, dy.raw_data()});
  const int64_t spans = packed ? hidden / 8 : hidden;
  const dim3 grid(row_blocks(tokens), static_cast<unsigned>((spans + kThreads - 1) / kThreads));
  const auto launch = [&]<typename TGrad>(const TGrad* grad) {
    if (packed) {
      sum_runs_kernel<8><<<grid, kThreads, 0, cu_stream>>>(out, grad, k_out, v_out, tokens, vocab, hidden);
    } else {
      sum_runs_kernel<1><<<grid, kThreads, 0, cu_stream>>>(out, grad, k_out, v_out, tokens, vocab, hidden);
    }
  };
  if (dy.dtype() == DType::F32) {
    launch(static_cast<const float*>(dy.raw_data()));
  } else {
    launch(static_cast<const __nv_bfloat16*>(dy.raw_data()));
  }
  MT_CUDA_CHECK(cudaGetLastError());
  // The temporaries return to the stream-ordered pool after the work queued above (the pool's stream is the
  // backend's compute stream, the one the ops run on).
}

}  // namespace moetrain::ops::cuda
