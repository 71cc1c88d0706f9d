// defines: the kernel behind fill_ragged_tables (ops/cuda/attention_cudnn.h): per-document sequence lengths and
// THD ragged offsets for cuDNN's SDPA graphs, computed on the device from cu_seqlens so no host copy is needed.
#include <cstdint>

#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 128;

// One thread per document slot b in [0, batch]: slot b < docs is document b, later slots are empty documents that
// start at the end of the run (offset T), so cuDNN reads nothing for them.
__global__ void ragged_tables_kernel(int32_t* seq_lens, int64_t* offsets, int64_t row_stride, const int32_t* cu,
                                     int64_t docs, int64_t batch, int64_t max_len, RaggedMultipliers m) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b > batch) return;
  const int64_t start = cu[b < docs ? b : docs];
  if (b < batch) {
    const int64_t len = b < docs ? cu[b + 1] - start : 0;
    // A document longer than the graph's sequence extent would make cuDNN read and write past its tiles: fail
    // loudly (a sticky launch error) instead. params.max_seqlen is the caller's contract.
    if (len > max_len) __trap();
    seq_lens[b] = static_cast<int32_t>(len);
  }
  offsets[0 * row_stride + b] = start * m.q;
  offsets[1 * row_stride + b] = start * m.k;
  offsets[2 * row_stride + b] = start * m.v;
  offsets[3 * row_stride + b] = start * m.o;
  offsets[4 * row_stride + b] = start * m.stats;
}

// One thread per boundary b in [0, D].
__global__ void check_dense_documents_kernel(const int32_t* cu, int64_t docs, int64_t seq) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b <= docs && cu[b] != b * seq) __trap();
}

// One thread per element of bhsd [B, nh, S]: bhsd[b][h][i] = lse[(b S + i) nh + h].
__global__ void stats_to_bhsd_kernel(float* bhsd, const float* lse, int64_t batch, int64_t seq, int64_t heads) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= batch * heads * seq) return;
  const int64_t i = n % seq, h = (n / seq) % heads, b = n / (seq * heads);
  bhsd[n] = lse[(b * seq + i) * heads + h];
}

}  // namespace

void stats_to_bhsd(const Stream& stream, const Tensor& bhsd, const Tensor& lse, int64_t batch, int64_t seq) {
  const int64_t heads = lse.dim() == 2 ? lse.size(1) : 0;
  MT_CHECK(lse.dtype() == DType::F32 && lse.dim() == 2 && lse.size(0) == batch * seq,
           "stats_to_bhsd: expected lse f32 [{} x {}, heads] but found {}", batch, seq, lse.describe());
  MT_CHECK(bhsd.dtype() == DType::F32 && bhsd.numel() == lse.numel(),
           "stats_to_bhsd: expected an f32 buffer of {} elements but found {}", lse.numel(), bhsd.describe());
  const int64_t n = lse.numel();
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  stats_to_bhsd_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream_handle(stream))>>>(
      static_cast<float*>(bhsd.raw_data()), static_cast<const float*>(lse.raw_data()), batch, seq, heads);
  MT_CUDA_CHECK(cudaGetLastError());
}

void check_dense_documents(const Stream& stream, const Tensor& cu_seqlens, int64_t seq) {
  MT_CHECK(cu_seqlens.dtype() == DType::I32 && cu_seqlens.numel() >= 2,
           "check_dense_documents: expected cu_seqlens i32 with at least 2 entries but found {}",
           cu_seqlens.describe());
  const int64_t docs = cu_seqlens.numel() - 1;
  const unsigned blocks = static_cast<unsigned>((docs + 1 + kThreads - 1) / kThreads);
  check_dense_documents_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream_handle(stream))>>>(
      static_cast<const int32_t*>(cu_seqlens.raw_data()), docs, seq);
  MT_CUDA_CHECK(cudaGetLastError());
}

void fill_ragged_tables(const Stream& stream, const Tensor& seq_lens, const Tensor& offsets, const Tensor& cu_seqlens,
                        int64_t batch, int64_t max_len, const RaggedMultipliers& multipliers) {
  MT_CHECK(seq_lens.dtype() == DType::I32 && seq_lens.numel() >= batch,
           "fill_ragged_tables: expected seq_lens i32 with at least {} entries but found {}", batch,
           seq_lens.describe());
  MT_CHECK(offsets.dtype() == DType::I64 && offsets.dim() == 2 && offsets.size(0) == 5 && offsets.size(1) > batch,
           "fill_ragged_tables: expected offsets i64 [5, >= {}] but found {}", batch + 1, offsets.describe());
  const int64_t docs = cu_seqlens.numel() - 1;
  MT_CHECK(docs >= 1 && docs <= batch, "fill_ragged_tables: {} documents do not fit a batch of {}", docs, batch);
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  const unsigned blocks = static_cast<unsigned>((batch + 1 + kThreads - 1) / kThreads);
  ragged_tables_kernel<<<blocks, kThreads, 0, s>>>(
      static_cast<int32_t*>(seq_lens.raw_data()), static_cast<int64_t*>(offsets.raw_data()), offsets.size(1),
      static_cast<const int32_t*>(cu_seqlens.raw_data()), docs, batch, max_len, multipliers);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
