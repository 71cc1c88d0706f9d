// defines: the CPU elementwise kernels: plain per-element loops, parallel over elements.
#include "ops/cpu/elementwise.h"

#include <cstdint>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

// Element loads and stores of the cast kernel, through the scalar rules of core/dtype.h.
double load(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::F64: return static_cast<const double*>(base)[i];
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::BF16: return bf16_bits_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: MT_FAIL("cast: no CPU conversion from {}", dtype_name(dtype));
  }
}

void store(void* base, DType dtype, int64_t i, double value) {
  switch (dtype) {
    case DType::F64: static_cast<double*>(base)[i] = value; return;
    case DType::F32: static_cast<float*>(base)[i] = static_cast<float>(value); return;
    case DType::BF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16_bits(static_cast<float>(value)); return;
    default: MT_FAIL("cast: no CPU conversion to {}", dtype_name(dtype));
  }
}

bool castable(DType dtype) { return dtype == DType::F64 || dtype == DType::F32 || dtype == DType::BF16; }

template <typename In, typename Out, typename Convert>
void convert_all(Out* out, const In* in, int64_t n, Convert convert) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = convert(in[i]);
}

}  // namespace

void add_forward(const Tensor& out, const Tensor& a, const Tensor& b) {
  dispatch_float(out.dtype(), "add_forward", [&]<typename T>() {
    T* o = out.data<T>();
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    const int64_t n = out.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] = pa[i] + pb[i];
  });
}

void accumulate(const Tensor& acc, const Tensor& x) {
  dispatch_float(acc.dtype(), "accumulate", [&]<typename T>() {
    T* pacc = acc.data<T>();
    const T* px = x.data<T>();
    const int64_t n = acc.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pacc[i] += px[i];
  });
}

void scale_inplace(const Tensor& x, double factor) {
  dispatch_float(x.dtype(), "scale_inplace", [&]<typename T>() {
    T* px = x.data<T>();
    const T f = static_cast<T>(factor);
    const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) px[i] *= f;
  });
}

void cast(const Tensor& out, const Tensor& in) {
  const int64_t n = in.numel();
  const DType from = in.dtype();
  const DType to = out.dtype();
  // Checked here too: nothing may throw inside the parallel loop below.
  MT_CHECK(castable(from) && castable(to), "cast: the CPU converts between f64, f32 and bf16 but found {} -> {}",
           dtype_name(from), dtype_name(to));
  // The common pairs get typed loops; the rest go through double, which holds every f32 and bf16 exactly.
  if (from == DType::F32 && to == DType::BF16) {
    convert_all(static_cast<uint16_t*>(out.raw_data()), in.data<float>(), n,
                [](float v) { return f32_to_bf16_bits(v); });
    return;
  }
  if (from == DType::BF16 && to == DType::F32) {
    convert_all(out.data<float>(), static_cast<const uint16_t*>(in.raw_data()), n,
                [](uint16_t v) { return bf16_bits_to_f32(v); });
    return;
  }
  const void* src = in.raw_data();
  void* dst = out.raw_data();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) store(dst, to, i, load(src, from, i));
}

void round_to_bf16_inplace(const Tensor& x) {
  float* px = x.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) px[i] = round_to_bf16(px[i]);
}

}  // namespace moetrain::ops::cpu
