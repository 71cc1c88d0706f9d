// defines: reduce_in_rank_order, the fixed-order reduction behind the in-process collectives.
#include "dist/local_reduce.h"

#include <cmath>
#include <type_traits>

#include "core/error.h"

namespace moetrain::dist::detail {

namespace {

template <typename Acc>
Acc combine(Acc acc, Acc v, ReduceOp op) {
  if (op == ReduceOp::Sum) return acc + v;
  // Max propagates NaN: a NaN anywhere makes the result NaN on every rank.
  if constexpr (std::is_floating_point_v<Acc>) {
    if (std::isnan(acc)) return acc;
    if (std::isnan(v)) return v;
  }
  return v > acc ? v : acc;
}

// Accumulates into Acc, loading element i of part r with load(part, i).
template <typename Acc, typename Load, typename Store>
void reduce_typed(const std::vector<const void*>& parts, int64_t count, ReduceOp op, Load load, Store store) {
  std::vector<Acc> acc(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) acc[i] = load(parts[0], i);
  for (size_t r = 1; r < parts.size(); ++r) {
    for (int64_t i = 0; i < count; ++i) acc[i] = combine<Acc>(acc[i], load(parts[r], i), op);
  }
  for (int64_t i = 0; i < count; ++i) store(i, acc[i]);
}

template <typename T>
void reduce_plain(void* out, const std::vector<const void*>& parts, int64_t count, ReduceOp op) {
  T* o = static_cast<T*>(out);
  reduce_typed<T>(
      parts, count, op, [](const void* p, int64_t i) { return static_cast<const T*>(p)[i]; },
      [o](int64_t i, T v) { o[i] = v; });
}

}  // namespace

void reduce_in_rank_order(DType dtype, ReduceOp op, void* out, const std::vector<const void*>& parts, int64_t count) {
  MT_CHECK(!parts.empty(), "dist: reduce_in_rank_order needs at least one contribution");
  switch (dtype) {
    case DType::F32: return reduce_plain<float>(out, parts, count, op);
    case DType::F64: return reduce_plain<double>(out, parts, count, op);
    case DType::I32: return reduce_plain<int32_t>(out, parts, count, op);
    case DType::I64: return reduce_plain<int64_t>(out, parts, count, op);
    case DType::BF16: {
      uint16_t* o = static_cast<uint16_t*>(out);
      return reduce_typed<float>(
          parts, count, op,
          [](const void* p, int64_t i) { return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]); },
          [o](int64_t i, float v) { o[i] = f32_to_bf16_bits(v); });
    }
    default: MT_FAIL("dist: reductions support f32, f64, bf16, i32 and i64; found {}", dtype_name(dtype));
  }
}

}  // namespace moetrain::dist::detail
