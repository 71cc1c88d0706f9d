// defines: Tensor, the engine's small value type: a view (dtype, shape, strides, byte offset) on a
// shared Storage. No autograd and no lazy graph: ops take their outputs as arguments, and most ops
// require contiguous row-major inputs and check for it rather than copy.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"

namespace moetrain {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);
// The element count of `shape`; an extent product past int64 is an Error naming the shape (never a wrapped count).
int64_t shape_numel(const Shape& shape);
// The bytes of a contiguous `shape` of `dtype`; a count past kMaxTensorBytes is an Error naming the shape.
size_t shape_nbytes(const Shape& shape, DType dtype);
// 2^62 bytes: more than any host or device holds, and far enough below 2^64 that offsets into it cannot wrap.
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 62;

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // A tensor over memory that someone else owns; `owner` keeps it alive (a mapped file, ...).
  static Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device, std::shared_ptr<void> owner);
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::cpu(); }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int dim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return shape_nbytes(shape_, dtype_); }
  bool is_contiguous() const;
  std::string describe() const;  // "f32[2, 48] on cpu"
  // The allocation this tensor views, shared with every view of it (ZeRO-3 frees and re-allocates its bytes while
  // the views stay valid: core/allocator.h), and where the view starts in it.
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  size_t storage_offset_bytes() const { return offset_bytes_; }

  void* raw_data() const;
  template <typename T>
  T* data() const {
    MT_CHECK(dtype_ == dtype_of<T>(), "tensor: data<{}>() on a {} tensor", dtype_name(dtype_of<T>()),
             dtype_name(dtype_));
    return static_cast<T*>(raw_data());
  }

  // Views. All keep the storage alive and never copy.
  Tensor view(const Shape& shape) const;           // contiguous only; one entry may be -1
  Tensor slice(int64_t begin, int64_t end) const;  // rows [begin, end) of dim 0
  Tensor select(int64_t index) const;              // row `index` of dim 0, one dimension less

  // Copies.
  Tensor clone() const;
  Tensor to(DType dtype) const;          // CPU conversion through the scalar rules of dtype.h
  Tensor to(Device device) const;        // needs the target backend's copy (registered by it)
  void copy_from(const Tensor& source);  // same shape and dtype; any device pair with a copy
  void zero_();

  template <typename T>
  std::vector<T> to_vector() const;
  template <typename T>
  T item() const;

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  DType dtype_ = DType::F32;
  Shape shape_;
  Shape strides_;
};

// Copies between devices; the CUDA backend registers one at setup. CPU<->CPU is built in.
using CopyBytesFn = void (*)(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void register_copy_bytes(CopyBytesFn fn);
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

// Checks shared by every op's argument validation. `what` names the argument in the message.
void expect_shape(const Tensor& t, const Shape& shape, std::string_view what);
void expect_dtype(const Tensor& t, DType dtype, std::string_view what);
void expect_contiguous(const Tensor& t, std::string_view what);
void expect_defined(const Tensor& t, std::string_view what);
void expect_same_device(const Tensor& a, const Tensor& b, std::string_view what);

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  MT_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), "tensor: from_vector with {} values for shape {}",
           values.size(), shape_str(shape));
  Tensor t = empty(shape, dtype_of<T>());
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  MT_CHECK(is_contiguous(), "tensor: to_vector on a non-contiguous tensor {}", describe());
  const Tensor host = device().is_cpu() ? *this : to(Device::cpu());
  const T* p = host.data<T>();
  return std::vector<T>(p, p + numel());
}

template <typename T>
T Tensor::item() const {
  MT_CHECK(numel() == 1, "tensor: item() on {} which has {} elements", describe(), numel());
  return to_vector<T>()[0];
}

}  // namespace moetrain
