// defines: the public embedding ops: argument validation (shapes, dtypes, contiguity, devices, every id inside
// [0, V)) and dispatch to the CPU reference.
#include "ops/embedding.h"

#include <cstdint>
#include <string>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/embedding.h"

namespace moetrain::ops {

namespace {

void check_stream(const Stream& stream, const char* op) {
  MT_CHECK(stream.device().is_cpu(), "{}: no kernel for a {} stream in this build", op, stream.device().str());
}

void check_argument(const Tensor& t, const Shape& shape, DType dtype, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
  require_cpu(t, op);
}

// The table fixes V, H and the dtype.
void check_table(const Tensor& table, const char* op, const char* name) {
  expect_contiguous(table, fmt::format("{}: {}", op, name));
  require_cpu(table, op);
  MT_CHECK(table.dim() == 2, "{}: expected {} [V, H] but found {}", op, name, table.describe());
  MT_CHECK(table.dtype() == DType::F32 || table.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op,
           name, table.describe());
}

// ids i32 [T] with every entry in [0, V); returns T.
int64_t check_ids(const Tensor& ids, int64_t vocab, const char* op) {
  const std::string what = fmt::format("{}: ids", op);
  expect_dtype(ids, DType::I32, what);
  expect_contiguous(ids, what);
  require_cpu(ids, op);
  MT_CHECK(ids.dim() == 1, "{}: expected ids [T] but found {}", op, ids.describe());
  const int32_t* id = ids.data<int32_t>();
  for (int64_t t = 0; t < ids.numel(); ++t) {
    MT_CHECK(id[t] >= 0 && id[t] < vocab, "{}: ids[{}] = {} is outside the vocabulary [0, V = {})", op, t, id[t],
             vocab);
  }
  return ids.numel();
}

}  // namespace

void embedding_forward(Stream& stream, Tensor y, const Tensor& ids, const Tensor& table) {
  constexpr const char* op = "embedding_forward";
  check_stream(stream, op);
  check_table(table, op, "table");
  const int64_t tokens = check_ids(ids, table.size(0), op);
  check_argument(y, {tokens, table.size(1)}, table.dtype(), op, "y");
  cpu::embedding_forward(y, ids, table);
}

void embedding_backward_weight(Stream& stream, Tensor dtable, const Tensor& dy, const Tensor& ids) {
  constexpr const char* op = "embedding_backward_weight";
  check_stream(stream, op);
  check_table(dtable, op, "dtable");
  const int64_t tokens = check_ids(ids, dtable.size(0), op);
  check_argument(dy, {tokens, dtable.size(1)}, dtable.dtype(), op, "dy");
  cpu::embedding_backward_weight(dtable, dy, ids);
}

}  // namespace moetrain::ops
