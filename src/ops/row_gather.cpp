// defines: the public row gather and segmented row sums: argument validation (shapes, dtypes, contiguity, devices,
// and every index value of CPU index tensors) and dispatch to the CPU reference or the CUDA kernels.
#include "ops/row_gather.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ops/cpu/row_gather.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/row_gather.h"
#endif

namespace moetrain::ops {

namespace {

// A [rows, H] matrix: contiguous, on `device`.
void check_matrix(const Tensor& t, Device device, const char* op, const char* name) {
  expect_defined(t, fmt::format("{}: {}", op, name));
  check_on_device(t, device, op, name);
  expect_contiguous(t, fmt::format("{}: {}", op, name));
  MT_CHECK(t.dim() == 2, "{}: expected {} as a matrix [rows, H] but found {}", op, name, t.describe());
}

// An i32 vector, contiguous, on `device`; returns its length.
int64_t check_index_vector(const Tensor& t, Device device, const char* op, const char* name) {
  expect_defined(t, fmt::format("{}: {}", op, name));
  check_on_device(t, device, op, name);
  expect_dtype(t, DType::I32, fmt::format("{}: {}", op, name));
  expect_contiguous(t, fmt::format("{}: {}", op, name));
  MT_CHECK(t.dim() == 1, "{}: expected {} as a vector i32 [n] but found {}", op, name, t.describe());
  return t.size(0);
}

// Every value of a CPU index vector in [0, bound). CUDA vectors are not read (ops/row_gather.h says why).
void check_index_values(const Tensor& t, int64_t bound, const char* op, const char* name, const char* bound_name) {
  if (!t.device().is_cpu()) return;
  const int32_t* v = t.data<int32_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    MT_CHECK(v[i] >= 0 && v[i] < bound, "{}: {}[{}] = {} is outside [0, {} = {})", op, name, i, v[i], bound_name,
             bound);
  }
}

// 1 to kMaxGroupParts offsets vectors i32 [G + 1] on `device`, all of one length; returns G. CPU values: each from 0,
// non-decreasing, ending at parts_rows[p] when given.
int64_t check_group_parts(const std::vector<Tensor>& offsets, Device device, const char* op,
                          const std::vector<int64_t>* parts_rows) {
  const int64_t n = static_cast<int64_t>(offsets.size());
  MT_CHECK(n >= 1 && n <= kMaxGroupParts, "{}: expected 1 to {} parts but found {}", op, kMaxGroupParts, n);
  int64_t bounds = -1;
  for (int64_t p = 0; p < n; ++p) {
    const Tensor& o = offsets[static_cast<size_t>(p)];
    const std::string name = fmt::format("offsets[{}]", p);
    const int64_t len = check_index_vector(o, device, op, name.c_str());
    MT_CHECK(len >= 1, "{}: expected {} as i32 [G + 1] with at least one entry but found {}", op, name, o.describe());
    MT_CHECK(bounds < 0 || len == bounds, "{}: every part has the same groups; offsets[0] has {} entries but {} has {}",
             op, bounds, name, len);
    bounds = len;
    if (!device.is_cpu()) continue;
    const int32_t* v = o.data<int32_t>();
    MT_CHECK(v[0] == 0, "{}: {}[0] must be 0; found {}", op, name, v[0]);
    for (int64_t g = 0; g + 1 < len; ++g) {
      MT_CHECK(v[g + 1] >= v[g], "{}: {} must not decrease; found [{}] = {} > [{}] = {}", op, name, g, v[g], g + 1,
               v[g + 1]);
    }
    if (parts_rows != nullptr) {
      const int64_t rows = (*parts_rows)[static_cast<size_t>(p)];
      MT_CHECK(v[len - 1] == rows, "{}: {} must end at part {}'s row count ({}); found {}", op, name, p, rows,
               v[len - 1]);
    }
  }
  return bounds - 1;
}

}  // namespace

void gather_rows(Stream& stream, Tensor out, const Tensor& in, const Tensor& index) {
  constexpr const char* op = "gather_rows";
  OpScope profile(stream, "row_gather", op);
  check_stream_backend(stream, op);
  const Device device = check_tensor_backend(stream, in, op, "in");
  check_matrix(in, device, op, "in");
  const int64_t rows = check_index_vector(index, device, op, "index");
  check_argument(out, {rows, in.size(1)}, in.dtype(), stream, op, "out");
  check_index_values(index, in.size(0), op, "index", "rows of in");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::gather_rows(stream, out, in, index);
    return;
  }
#endif
  cpu::gather_rows(out, in, index);
}

void sum_rows(Stream& stream, Tensor out, const Tensor& in, const Tensor& segment_offsets, const Tensor& segment_rows) {
  constexpr const char* op = "sum_rows";
  OpScope profile(stream, "row_gather", op);
  check_stream_backend(stream, op);
  const Device device = check_tensor_backend(stream, in, op, "in");
  check_matrix(in, device, op, "in");
  if (device.is_cuda()) {
    MT_CHECK(in.dtype() == DType::F32 || in.dtype() == DType::BF16,
             "{}: expected in in f32 or bf16 (CUDA) but found {}", op, in.describe());
  } else {
    MT_CHECK(in.dtype() == DType::F32 || in.dtype() == DType::F64 || in.dtype() == DType::BF16,
             "{}: expected in in f32, f64 or bf16 but found {}", op, in.describe());
  }
  const int64_t bounds = check_index_vector(segment_offsets, device, op, "segment_offsets");
  MT_CHECK(bounds >= 1, "{}: expected segment_offsets i32 [U + 1] with at least one entry but found {}", op,
           segment_offsets.describe());
  const int64_t segments = bounds - 1;
  const int64_t listed = check_index_vector(segment_rows, device, op, "segment_rows");
  check_argument(out, {segments, in.size(1)}, in.dtype(), stream, op, "out");
  if (device.is_cpu()) {
    const int32_t* o = segment_offsets.data<int32_t>();
    MT_CHECK(o[0] == 0, "{}: segment_offsets[0] must be 0; found {}", op, o[0]);
    for (int64_t u = 0; u < segments; ++u) {
      MT_CHECK(o[u + 1] >= o[u],
               "{}: segment_offsets must not decrease; found segment_offsets[{}] = {} > "
               "segment_offsets[{}] = {}",
               op, u, o[u], u + 1, o[u + 1]);
    }
    MT_CHECK(o[segments] == listed,
             "{}: segment_offsets must end at the length of segment_rows ({}); found segment_offsets[{}] = {}", op,
             listed, segments, o[segments]);
    check_index_values(segment_rows, in.size(0), op, "segment_rows", "rows of in");
  }
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::sum_rows(stream, out, in, segment_offsets, segment_rows);
    return;
  }
#endif
  cpu::sum_rows(out, in, segment_offsets, segment_rows);
}

void count_tokens_per_rank(Stream& stream, Tensor counts, const Tensor& topk_index, int64_t experts_per_rank) {
  constexpr const char* op = "count_tokens_per_rank";
  OpScope profile(stream, "row_gather", op);
  check_stream_backend(stream, op);
  const Device device = check_tensor_backend(stream, topk_index, op, "topk_index");
  expect_defined(topk_index, fmt::format("{}: topk_index", op));
  expect_dtype(topk_index, DType::I32, fmt::format("{}: topk_index", op));
  expect_contiguous(topk_index, fmt::format("{}: topk_index", op));
  MT_CHECK(topk_index.dim() == 2, "{}: expected topk_index i32 [T, K] but found {}", op, topk_index.describe());
  const int64_t ranks = check_index_vector(counts, device, op, "counts");
  MT_CHECK(ranks >= 1 && ranks <= 64 && experts_per_rank >= 1,
           "{}: expected 1 to 64 ranks and >= 1 expert per rank but found {} ranks of {}", op, ranks, experts_per_rank);
  check_index_values(topk_index, ranks * experts_per_rank, op, "topk_index", "ranks x experts_per_rank");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::count_tokens_per_rank(stream, counts, topk_index, experts_per_rank);
    return;
  }
#endif
  cpu::count_tokens_per_rank(counts, topk_index, experts_per_rank);
}

void concat_group_offsets(Stream& stream, Tensor out_offsets, const std::vector<Tensor>& offsets) {
  constexpr const char* op = "concat_group_offsets";
  OpScope profile(stream, "row_gather", op);
  check_stream_backend(stream, op);
  MT_CHECK(!offsets.empty(), "{}: expected 1 to {} parts but found none", op, kMaxGroupParts);
  const Device device = check_tensor_backend(stream, offsets[0], op, "offsets[0]");
  const int64_t groups = check_group_parts(offsets, device, op, nullptr);
  check_argument(out_offsets, {groups + 1}, DType::I32, stream, op, "out_offsets");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::concat_group_offsets(stream, out_offsets, offsets);
    return;
  }
#endif
  cpu::concat_group_offsets(out_offsets, offsets);
}

void concat_group_rows(Stream& stream, Tensor out, const std::vector<Tensor>& parts,
                       const std::vector<Tensor>& offsets) {
  constexpr const char* op = "concat_group_rows";
  OpScope profile(stream, "row_gather", op);
  check_stream_backend(stream, op);
  MT_CHECK(!parts.empty() && parts.size() == offsets.size(),
           "{}: expected one offsets vector per part, 1 to {} parts, "
           "but found {} parts and {} offsets vectors",
           op, kMaxGroupParts, parts.size(), offsets.size());
  const Device device = check_tensor_backend(stream, parts[0], op, "parts[0]");
  std::vector<int64_t> rows;
  int64_t total = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const std::string name = fmt::format("parts[{}]", p);
    check_matrix(parts[p], device, op, name.c_str());
    MT_CHECK(parts[p].dtype() == parts[0].dtype() && parts[p].size(1) == parts[0].size(1),
             "{}: every part is [rows, {}] {}; found {} {}", op, parts[0].size(1), dtype_name(parts[0].dtype()), name,
             parts[p].describe());
    rows.push_back(parts[p].size(0));
    total += parts[p].size(0);
  }
  // The result's group offsets are i32, as every part's are: its rows must be counted by one too.
  MT_CHECK(total <= std::numeric_limits<int32_t>::max(),
           "{}: the parts hold {} rows together, more than i32 group offsets count ({}); concatenate fewer parts", op,
           total, std::numeric_limits<int32_t>::max());
  check_group_parts(offsets, device, op, &rows);
  check_argument(out, {total, parts[0].size(1)}, parts[0].dtype(), stream, op, "out");
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::concat_group_rows(stream, out, parts, offsets);
    return;
  }
#endif
  cpu::concat_group_rows(out, parts, offsets);
}

}  // namespace moetrain::ops
