// defines: Tensor construction, views, copies and dtype conversion on the CPU.
#include "core/tensor.h"

#include <cstring>

#include <fmt/format.h>

namespace moetrain {

namespace {

// Refuses a stride past int64 even where the element count is 0 ([0, 2^40, 2^40] has no elements, but its strides
// would wrap).
Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t stride = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    strides[d] = stride;
    if (d > 0) {
      MT_CHECK(!__builtin_mul_overflow(stride, shape[d], &stride),
               "tensor: the strides of shape {} overflow 64 bits (an extent is far too large)", shape_str(shape));
    }
  }
  return strides;
}

void check_shape_valid(const Shape& shape) {
  for (int64_t extent : shape) {
    MT_CHECK(extent >= 0, "tensor: negative extent in shape {}", shape_str(shape));
  }
}

CopyBytesFn g_copy_bytes = nullptr;

// Reads element i of a buffer of `dtype` as a double (every stored value fits exactly, except
// 64-bit integers above 2^53, which conversion to a float type rounds anyway).
double load_as_double(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::F64: return static_cast<const double*>(base)[i];
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::BF16: return bf16_bits_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::F16: return f16_bits_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::F8E4M3: return e4m3_bits_to_f32(static_cast<const uint8_t*>(base)[i]);
    case DType::F8E5M2: return e5m2_bits_to_f32(static_cast<const uint8_t*>(base)[i]);
    case DType::I64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DType::I32: return static_cast<const int32_t*>(base)[i];
    case DType::I16: return static_cast<const int16_t*>(base)[i];
    case DType::I8: return static_cast<const int8_t*>(base)[i];
    case DType::U64: return static_cast<double>(static_cast<const uint64_t*>(base)[i]);
    case DType::U32: return static_cast<const uint32_t*>(base)[i];
    case DType::U16: return static_cast<const uint16_t*>(base)[i];
    case DType::U8: return static_cast<const uint8_t*>(base)[i];
    case DType::Bool: return static_cast<const uint8_t*>(base)[i] != 0;
  }
  MT_FAIL("tensor: unknown dtype");
}

void store_from_double(void* base, DType dtype, int64_t i, double v) {
  switch (dtype) {
    case DType::F64: static_cast<double*>(base)[i] = v; return;
    case DType::F32: static_cast<float*>(base)[i] = static_cast<float>(v); return;
    case DType::BF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16_bits(static_cast<float>(v)); return;
    case DType::F16: static_cast<uint16_t*>(base)[i] = f32_to_f16_bits(static_cast<float>(v)); return;
    case DType::F8E4M3: static_cast<uint8_t*>(base)[i] = f32_to_e4m3_bits(static_cast<float>(v)); return;
    case DType::F8E5M2: static_cast<uint8_t*>(base)[i] = f32_to_e5m2_bits(static_cast<float>(v)); return;
    case DType::I64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DType::I32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DType::I16: static_cast<int16_t*>(base)[i] = static_cast<int16_t>(v); return;
    case DType::I8: static_cast<int8_t*>(base)[i] = static_cast<int8_t>(v); return;
    case DType::U64: static_cast<uint64_t*>(base)[i] = static_cast<uint64_t>(v); return;
    case DType::U32: static_cast<uint32_t*>(base)[i] = static_cast<uint32_t>(v); return;
    case DType::U16: static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(v); return;
    case DType::U8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); return;
    case DType::Bool: static_cast<uint8_t*>(base)[i] = v != 0.0; return;
  }
  MT_FAIL("tensor: unknown dtype");
}

}  // namespace

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t extent : shape) {
    MT_CHECK(!__builtin_mul_overflow(n, extent, &n),
             "tensor: shape {} has more elements than 64 bits count (an extent is far too large)", shape_str(shape));
  }
  return n;
}

size_t shape_nbytes(const Shape& shape, DType dtype) {
  const int64_t n = shape_numel(shape);
  MT_CHECK(n >= 0, "tensor: shape {} has a negative extent", shape_str(shape));
  uint64_t bytes = 0;
  MT_CHECK(!__builtin_mul_overflow(static_cast<uint64_t>(n), uint64_t{dtype_size(dtype)}, &bytes) &&
               bytes <= kMaxTensorBytes,
           "tensor: shape {} of {} needs {} elements of {} bytes, more than the {} bytes any device holds",
           shape_str(shape), dtype_name(dtype), n, dtype_size(dtype), kMaxTensorBytes);
  return static_cast<size_t>(bytes);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  check_shape_valid(shape);
  Tensor t;
  t.strides_ = contiguous_strides(shape);  // first: its overflow check runs before anything is allocated
  t.storage_ = allocate_storage(shape_nbytes(shape, dtype), device);
  t.dtype_ = dtype;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, Device device, std::shared_ptr<void> owner) {
  check_shape_valid(shape);
  Tensor t;
  const size_t bytes = shape_nbytes(shape, dtype);
  t.storage_ = std::make_shared<Storage>();
  t.storage_->data = data;
  t.storage_->bytes = bytes;
  t.storage_->device = device;
  t.storage_->owner = std::move(owner);
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  return t;
}

int64_t Tensor::size(int d) const {
  const int rank = dim();
  const int index = d < 0 ? d + rank : d;
  MT_CHECK(index >= 0 && index < rank, "tensor: dimension {} out of range for {}", d, describe());
  return shape_[index];
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_); }

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  return fmt::format("{}{} on {}", dtype_name(dtype_), shape_str(shape_), device().str());
}

void* Tensor::raw_data() const {
  MT_CHECK(defined(), "tensor: data access on an undefined tensor");
  MT_CHECK(storage_->data != nullptr || storage_->bytes == 0,
           "tensor: data access on {} whose storage bytes are released (a sharded parameter or gradient used "
           "outside its gather; see dist/sharded_parameters.h)",
           describe());
  return static_cast<char*>(storage_->data) + offset_bytes_;
}

Tensor Tensor::view(const Shape& shape) const {
  MT_CHECK(is_contiguous(), "tensor: view of a non-contiguous tensor {}", describe());
  Shape resolved = shape;
  int inferred = -1;
  int64_t known = 1;
  for (size_t d = 0; d < resolved.size(); ++d) {
    if (resolved[d] == -1) {
      MT_CHECK(inferred < 0, "tensor: view {} has more than one -1", shape_str(shape));
      inferred = static_cast<int>(d);
    } else {
      MT_CHECK(!__builtin_mul_overflow(known, resolved[d], &known),
               "tensor: view {} has more elements than 64 bits count", shape_str(shape));
    }
  }
  if (inferred >= 0) {
    MT_CHECK(known > 0 && numel() % known == 0, "tensor: cannot view {} as {}", describe(), shape_str(shape));
    resolved[inferred] = numel() / known;
  }
  MT_CHECK(shape_numel(resolved) == numel(), "tensor: cannot view {} as {} ({} vs {} elements)", describe(),
           shape_str(shape), numel(), shape_numel(resolved));
  Tensor t = *this;
  t.shape_ = resolved;
  t.strides_ = contiguous_strides(resolved);
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  MT_CHECK(dim() >= 1, "tensor: slice of a scalar {}", describe());
  MT_CHECK(0 <= begin && begin <= end && end <= shape_[0], "tensor: slice [{}, {}) out of range for {}", begin, end,
           describe());
  Tensor t = *this;
  t.offset_bytes_ += static_cast<size_t>(begin * strides_[0]) * dtype_size(dtype_);
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::select(int64_t index) const {
  MT_CHECK(dim() >= 1, "tensor: select on a scalar {}", describe());
  MT_CHECK(0 <= index && index < shape_[0], "tensor: select {} out of range for {}", index, describe());
  Tensor t = slice(index, index + 1);
  t.shape_.erase(t.shape_.begin());
  t.strides_.erase(t.strides_.begin());
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  MT_CHECK(device().is_cpu(), "tensor: dtype conversion of {} needs a CPU tensor", describe());
  MT_CHECK(is_contiguous(), "tensor: dtype conversion of a non-contiguous tensor {}", describe());
  if (dtype == dtype_) return clone();
  Tensor t = empty(shape_, dtype);
  const void* src = raw_data();
  void* dst = t.raw_data();
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) store_from_double(dst, dtype, i, load_as_double(src, dtype_, i));
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& source) {
  MT_CHECK(source.shape_ == shape_ && source.dtype_ == dtype_, "tensor: copy {} into {}", source.describe(),
           describe());
  MT_CHECK(is_contiguous() && source.is_contiguous(), "tensor: copy needs contiguous tensors ({} <- {})", describe(),
           source.describe());
  copy_bytes(raw_data(), device(), source.raw_data(), source.device(), nbytes());
}

void Tensor::zero_() {
  MT_CHECK(is_contiguous(), "tensor: zero_ on a non-contiguous tensor {}", describe());
  zero_storage(raw_data(), nbytes(), device());
}

void register_copy_bytes(CopyBytesFn fn) { g_copy_bytes = fn; }

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memmove(dst, src, bytes);
    return;
  }
  MT_CHECK(g_copy_bytes != nullptr, "tensor: no copy registered between {} and {}", src_device.str(), dst_device.str());
  g_copy_bytes(dst, dst_device, src, src_device, bytes);
}

void expect_defined(const Tensor& t, std::string_view what) {
  MT_CHECK(t.defined(), "{}: expected a tensor but found an undefined one", what);
}

void expect_shape(const Tensor& t, const Shape& shape, std::string_view what) {
  expect_defined(t, what);
  MT_CHECK(t.shape() == shape, "{}: expected shape {} but found {}", what, shape_str(shape), shape_str(t.shape()));
}

void expect_dtype(const Tensor& t, DType dtype, std::string_view what) {
  expect_defined(t, what);
  MT_CHECK(t.dtype() == dtype, "{}: expected dtype {} but found {}", what, dtype_name(dtype), dtype_name(t.dtype()));
}

void expect_contiguous(const Tensor& t, std::string_view what) {
  expect_defined(t, what);
  MT_CHECK(t.is_contiguous(), "{}: expected a contiguous tensor but found {}", what, t.describe());
}

void expect_same_device(const Tensor& a, const Tensor& b, std::string_view what) {
  MT_CHECK(a.device() == b.device(), "{}: expected tensors on one device but found {} and {}", what, a.device().str(),
           b.device().str());
}

}  // namespace moetrain
