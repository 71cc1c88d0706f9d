// defines: the public embedding ops: argument validation (shapes, dtypes, contiguity, devices, every id inside
// [0, V) for CPU ids) and dispatch to the backend of the stream's device: the CPU reference, or the CUDA kernels.
#include "ops/embedding.h"

#include <cstdint>
#include <string>

#include "ops/cpu/embedding.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/embedding.h"
#endif

namespace moetrain::ops {

namespace {

void check_argument(const Tensor& t, const Shape& shape, const Stream& stream, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_contiguous(t, what);
  check_on_stream_device(stream, t, op, name);
}

// The CPU reference computes in f32 or f64; the CUDA kernels take f32 or bf16.
void check_float_dtype(const Tensor& t, const Stream& stream, const char* op, const char* name) {
  if (stream.device().is_cuda()) {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, "{}: expected {} in f32 or bf16 (CUDA) but found {}",
             op, name, t.describe());
    return;
  }
  MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
           t.describe());
}

// The table fixes V and H.
void check_table(const Tensor& table, const Stream& stream, const char* op, const char* name) {
  expect_contiguous(table, fmt::format("{}: {}", op, name));
  check_on_stream_device(stream, table, op, name);
  MT_CHECK(table.dim() == 2, "{}: expected {} [V, H] but found {}", op, name, table.describe());
}

// ids i32 [T]; returns T. On the CPU every entry must be in [0, V). CUDA ids are not read here (that would copy
// device memory to the host inside an op): the trainer validates each batch on the host before it is copied, and
// the CUDA kernels keep an out-of-range id from touching memory outside the table (ops/cuda/embedding.h).
int64_t check_ids(const Tensor& ids, int64_t vocab, const Stream& stream, const char* op) {
  const std::string what = fmt::format("{}: ids", op);
  expect_dtype(ids, DType::I32, what);
  expect_contiguous(ids, what);
  check_on_stream_device(stream, ids, op, "ids");
  MT_CHECK(ids.dim() == 1, "{}: expected ids [T] but found {}", op, ids.describe());
  if (ids.device().is_cpu()) {
    const int32_t* id = ids.data<int32_t>();
    for (int64_t t = 0; t < ids.numel(); ++t) {
      MT_CHECK(id[t] >= 0 && id[t] < vocab, "{}: ids[{}] = {} is outside the vocabulary [0, V = {})", op, t, id[t],
               vocab);
    }
  }
  return ids.numel();
}

}  // namespace

void embedding_forward(Stream& stream, Tensor y, const Tensor& ids, const Tensor& table) {
  constexpr const char* op = "embedding_forward";
  OpScope profile(stream, "embedding", op);
  check_stream_backend(stream, op);
  check_table(table, stream, op, "table");
  check_float_dtype(table, stream, op, "table");
  const int64_t tokens = check_ids(ids, table.size(0), stream, op);
  check_argument(y, {tokens, table.size(1)}, stream, op, "y");
#if MOETRAIN_HAS_CUDA
  if (table.device().is_cuda()) {
    // y f32 or bf16, whatever the table's dtype (the gather converts).
    check_float_dtype(y, stream, op, "y");
    cuda::embedding_forward(stream, y, ids, table);
    return;
  }
#endif
  expect_dtype(y, table.dtype(), fmt::format("{}: y", op));
  cpu::embedding_forward(y, ids, table);
}

void embedding_backward_weight(Stream& stream, Tensor dtable, const Tensor& dy, const Tensor& ids) {
  constexpr const char* op = "embedding_backward_weight";
  OpScope profile(stream, "embedding", op);
  check_stream_backend(stream, op);
  check_table(dtable, stream, op, "dtable");
  const int64_t tokens = check_ids(ids, dtable.size(0), stream, op);
  check_argument(dy, {tokens, dtable.size(1)}, stream, op, "dy");
#if MOETRAIN_HAS_CUDA
  if (dtable.device().is_cuda()) {
    // Weight gradients are f32 on CUDA; dy f32 or bf16.
    expect_dtype(dtable, DType::F32, fmt::format("{}: dtable (CUDA)", op));
    check_float_dtype(dy, stream, op, "dy");
    cuda::embedding_backward_weight(stream, dtable, dy, ids);
    return;
  }
#endif
  check_float_dtype(dtable, stream, op, "dtable");
  expect_dtype(dy, dtable.dtype(), fmt::format("{}: dy", op));
  cpu::embedding_backward_weight(dtable, dy, ids);
}

}  // namespace moetrain::ops
