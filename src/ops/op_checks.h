// defines: the device and stream checks shared by the public ops (src/ops/<family>.cpp): which backends this build
// has, and that a tensor and the op's stream are on one device; zero_on_stream, the zeros an op writes before
// accumulating, and copy_on_stream. Internal to src/ops; not part of the ops API.
#pragma once

#include <string_view>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

#if MOETRAIN_HAS_CUDA
inline constexpr bool kHasCuda = true;
#else
inline constexpr bool kHasCuda = false;
#endif

inline bool on_cuda(const Tensor& t) { return t.device().is_cuda(); }

// The build has a backend for the stream's device: the CPU, or a CUDA device in a build with CUDA.
void check_stream_backend(const Stream& stream, std::string_view op);

// `t` lives on the stream's device: CPU tensors on the CPU stream, CUDA tensors on their device's stream.
void check_on_stream_device(const Stream& stream, const Tensor& t, std::string_view op, std::string_view name);

// `t` is defined and its device picks the backend: the CPU (whose stream must be the CPU one), or a CUDA device in a
// build with CUDA (whose stream must run on it). Returns that device, which every other argument must be on.
Device check_tensor_backend(const Stream& stream, const Tensor& t, std::string_view op, std::string_view name);

// `t` is on `device` (that of the argument which picked the backend); a CPU device also needs a CPU kernel for t.
void check_on_device(const Tensor& t, Device device, std::string_view op, std::string_view name);

// `t` has `shape` and `dtype`, is contiguous and lives on the stream's device.
void check_argument(const Tensor& t, const Shape& shape, DType dtype, const Stream& stream, std::string_view op,
                    std::string_view name);

// `t` has `shape` and `dtype`, is contiguous and lives on `device` (that of the argument which picked the backend).
void check_argument(const Tensor& t, const Shape& shape, DType dtype, Device device, std::string_view op,
                    std::string_view name);

// `t` has the shape and dtype of `like`, is contiguous and lives on the stream's device.
void check_like(const Tensor& t, const Tensor& like, const Stream& stream, std::string_view op, std::string_view name);

// Whether the bytes of a and b overlap (an empty tensor overlaps nothing).
bool share_memory(const Tensor& a, const Tensor& b);

// Class targets i32 [tokens] of a loss over `vocab` classes. On the CPU every entry must be in [0, vocab) or equal
// to ignore_index. CUDA targets are not read (that would copy device memory to the host inside an op): the trainer
// validates each batch on the host, and the CUDA kernels turn an out-of-range target into a NaN loss (and a NaN
// gradient row) instead of reading outside the row.
void check_class_targets(const Tensor& targets, int64_t tokens, int64_t vocab, int ignore_index, const Stream& stream,
                         std::string_view op);

// Zeros `t` on the op's stream (on CUDA, ordered before the kernels the op queues next on it).
void zero_on_stream(const Stream& stream, Tensor& t);
// dst.copy_from(src) on the op's stream (on CUDA, ordered after the kernels the op queued on it).
void copy_on_stream(const Stream& stream, Tensor& dst, const Tensor& src);

}  // namespace moetrain::ops
