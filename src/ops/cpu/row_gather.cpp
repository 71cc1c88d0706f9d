// defines: the CPU row gather (a memcpy per row) and segmented row sums (one output row per thread iteration, its
// segment summed in ascending order starting from the first row; bf16 through f32 registers).
#include "ops/cpu/row_gather.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

void gather_rows(const Tensor& out, const Tensor& in, const Tensor& index) {
  const int64_t rows = out.size(0);
  const size_t row_bytes = static_cast<size_t>(out.size(1)) * dtype_size(out.dtype());
  const int32_t* idx = index.data<int32_t>();
  const auto* src = static_cast<const unsigned char*>(in.raw_data());
  auto* dst = static_cast<unsigned char*>(out.raw_data());
  if (row_bytes == 0) return;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(dst + static_cast<size_t>(i) * row_bytes, src + static_cast<size_t>(idx[i]) * row_bytes, row_bytes);
  }
}

namespace {

// out[u] = in[rows[b]] + in[rows[b + 1]] + ... in ascending j, in the accumulator type A; load/store convert.
template <typename A, typename S, typename Load, typename Store>
void segment_sums(S* out, const S* in, const int32_t* offsets, const int32_t* rows, int64_t segments, int64_t hidden,
                  Load load, Store store) {
#pragma omp parallel
  {
    std::vector<A> acc(static_cast<size_t>(hidden));
#pragma omp for schedule(dynamic, 16)
    for (int64_t u = 0; u < segments; ++u) {
      const int32_t begin = offsets[u], end = offsets[u + 1];
      S* y = out + u * hidden;
      if (begin == end) {
        for (int64_t h = 0; h < hidden; ++h) y[h] = store(A(0));
        continue;
      }
      const S* first = in + static_cast<int64_t>(rows[begin]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) acc[static_cast<size_t>(h)] = load(first[h]);
      for (int32_t j = begin + 1; j < end; ++j) {
        const S* x = in + static_cast<int64_t>(rows[j]) * hidden;
        for (int64_t h = 0; h < hidden; ++h) acc[static_cast<size_t>(h)] += load(x[h]);
      }
      for (int64_t h = 0; h < hidden; ++h) y[h] = store(acc[static_cast<size_t>(h)]);
    }
  }
}

}  // namespace

void sum_rows(const Tensor& out, const Tensor& in, const Tensor& segment_offsets, const Tensor& segment_rows) {
  const int64_t segments = out.size(0);
  const int64_t hidden = out.size(1);
  const int32_t* offsets = segment_offsets.data<int32_t>();
  const int32_t* rows = segment_rows.data<int32_t>();
  if (out.dtype() == DType::BF16) {
    segment_sums<float>(
        static_cast<uint16_t*>(out.raw_data()), static_cast<const uint16_t*>(in.raw_data()), offsets, rows, segments,
        hidden, [](uint16_t bits) { return bf16_bits_to_f32(bits); }, [](float v) { return f32_to_bf16_bits(v); });
    return;
  }
  dispatch_float(out.dtype(), "sum_rows", [&]<typename T>() {
    segment_sums<T>(
        out.data<T>(), in.data<T>(), offsets, rows, segments, hidden, [](T v) { return v; }, [](T v) { return v; });
  });
}

void count_tokens_per_rank(const Tensor& counts, const Tensor& topk_index, int64_t experts_per_rank) {
  const int64_t ranks = counts.numel(), tokens = topk_index.size(0), k = topk_index.size(1);
  int32_t* out = counts.data<int32_t>();
  const int32_t* choice = topk_index.data<int32_t>();
  std::vector<char> hit(static_cast<size_t>(ranks));
  for (int64_t q = 0; q < ranks; ++q) out[q] = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(hit.begin(), hit.end(), 0);
    for (int64_t j = 0; j < k; ++j) hit[static_cast<size_t>(choice[t * k + j] / experts_per_rank)] = 1;
    for (int64_t q = 0; q < ranks; ++q) out[q] += hit[static_cast<size_t>(q)];
  }
}

void concat_group_offsets(const Tensor& out_offsets, const std::vector<Tensor>& offsets) {
  const int64_t bounds = out_offsets.numel();
  int32_t* out = out_offsets.data<int32_t>();
  for (int64_t g = 0; g < bounds; ++g) {
    int32_t sum = 0;
    for (const Tensor& o : offsets) sum += o.data<int32_t>()[g];
    out[g] = sum;
  }
}

// Group by group, part by part: each part's rows of the group are consecutive in both, so one memcpy moves them.
void concat_group_rows(const Tensor& out, const std::vector<Tensor>& parts, const std::vector<Tensor>& offsets) {
  const size_t row_bytes = static_cast<size_t>(out.size(1)) * dtype_size(out.dtype());
  const int64_t groups = offsets[0].numel() - 1;
  auto* dst = static_cast<unsigned char*>(out.raw_data());
  size_t at = 0;  // the next output row
  for (int64_t g = 0; g < groups; ++g) {
    for (size_t p = 0; p < parts.size(); ++p) {
      const int32_t* o = offsets[p].data<int32_t>();
      const size_t rows = static_cast<size_t>(o[g + 1] - o[g]);
      if (rows == 0 || row_bytes == 0) continue;
      const auto* src = static_cast<const unsigned char*>(parts[p].raw_data()) + static_cast<size_t>(o[g]) * row_bytes;
      std::memcpy(dst + at * row_bytes, src, rows * row_bytes);
      at += rows;
    }
  }
}

}  // namespace moetrain::ops::cpu
