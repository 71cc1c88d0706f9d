// defines: the CPU SwiGLU kernels. silu(g) = g / (1 + exp(-g)) as torch's CPU kernel writes g * sigmoid(g);
// d silu / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
#include "ops/cpu/activation.h"

#include <cmath>
#include <cstdint>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

template <typename T>
void forward_rows(T* y, const T* gate_up, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    const T* gate = gate_up + n * 2 * width;
    const T* up = gate + width;
    T* yr = y + n * width;
    for (int64_t j = 0; j < width; ++j) {
      const T g = gate[j];
      const T silu = g / (T(1) + std::exp(-g));
      yr[j] = silu * up[j];
    }
  }
}

template <typename T>
void backward_rows(T* dgate_up, const T* dy, const T* gate_up, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    const T* gate = gate_up + n * 2 * width;
    const T* up = gate + width;
    const T* dyr = dy + n * width;
    T* dgate = dgate_up + n * 2 * width;
    T* dup = dgate + width;
    for (int64_t j = 0; j < width; ++j) {
      const T g = gate[j];
      const T u = up[j];
      const T denominator = T(1) + std::exp(-g);
      const T sigmoid = T(1) / denominator;
      const T silu = g / denominator;
      const T dsilu = sigmoid * (T(1) + g * (T(1) - sigmoid));
      dgate[j] = dyr[j] * u * dsilu;
      dup[j] = dyr[j] * silu;
    }
  }
}

}  // namespace

void swiglu_forward(const Tensor& y, const Tensor& gate_up) {
  const int64_t rows = gate_up.size(0);
  const int64_t width = gate_up.size(1) / 2;
  dispatch_float(gate_up.dtype(), "swiglu_forward",
                 [&]<typename T>() { forward_rows<T>(y.data<T>(), gate_up.data<T>(), rows, width); });
}

void swiglu_backward(const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up) {
  const int64_t rows = gate_up.size(0);
  const int64_t width = gate_up.size(1) / 2;
  dispatch_float(gate_up.dtype(), "swiglu_backward", [&]<typename T>() {
    backward_rows<T>(dgate_up.data<T>(), dy.data<T>(), gate_up.data<T>(), rows, width);
  });
}

}  // namespace moetrain::ops::cpu
