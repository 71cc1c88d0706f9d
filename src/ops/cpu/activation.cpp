// defines: the CPU SwiGLU kernels. silu(g) = g / (1 + exp(-g)) as torch's CPU kernel writes g * sigmoid(g);
// d silu / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))). The clamped variant (GPT-OSS) in transformers' order:
// g = min(gate, limit), u = clamp(up, -limit, limit), glu = g * sigmoid(g * alpha), y = (u + 1) * glu;
// d glu / dg = s * (1 + alpha * g * (1 - s)) with s = sigmoid(g * alpha).
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

// min(x, limit) and clamp(x, -limit, limit) as torch writes them: a NaN stays NaN.
template <typename T>
T clamp_max(T x, T limit) {
  return x > limit ? limit : x;
}

template <typename T>
T clamp_both(T x, T limit) {
  return x < -limit ? -limit : (x > limit ? limit : x);
}

template <typename T>
void clamped_forward_rows(T* y, const T* gate_up, int64_t rows, int64_t width, T alpha, T limit) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    const T* gate = gate_up + n * 2 * width;
    const T* up = gate + width;
    T* yr = y + n * width;
    for (int64_t j = 0; j < width; ++j) {
      const T g = clamp_max(gate[j], limit);
      const T u = clamp_both(up[j], limit);
      const T glu = g * (T(1) / (T(1) + std::exp(-(g * alpha))));
      yr[j] = (u + T(1)) * glu;
    }
  }
}

// torch 2.15's clamp backward (the golden reference's) passes the gradient strictly inside, min < x < max (a
// comparison of the unclamped input): at the limit itself and beyond it the gradient is 0. gate has no lower clamp.
template <typename T>
void clamped_backward_rows(T* dgate_up, const T* dy, const T* gate_up, int64_t rows, int64_t width, T alpha, T limit) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    const T* gate = gate_up + n * 2 * width;
    const T* up = gate + width;
    const T* dyr = dy + n * width;
    T* dgate = dgate_up + n * 2 * width;
    T* dup = dgate + width;
    for (int64_t j = 0; j < width; ++j) {
      const T gate_in = gate[j];
      const T up_in = up[j];
      const T g = clamp_max(gate_in, limit);
      const T u = clamp_both(up_in, limit);
      const T sigmoid = T(1) / (T(1) + std::exp(-(g * alpha)));
      const T glu = g * sigmoid;
      const T dglu = sigmoid * (T(1) + alpha * g * (T(1) - sigmoid));
      dgate[j] = gate_in < limit ? dyr[j] * (u + T(1)) * dglu : T(0);
      dup[j] = (up_in > -limit && up_in < limit) ? dyr[j] * glu : T(0);
    }
  }
}

template <typename T>
T sigmoid_of(T g) {
  return T(1) / (T(1) + std::exp(-g));
}

// gate_width is width (a gate per element) or 1 (a gate per row).
template <typename T>
void sigmoid_gate_forward_rows(T* y, const T* x, const T* gate, int64_t rows, int64_t width, int64_t gate_width) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    const T* xr = x + n * width;
    const T* gr = gate + n * gate_width;
    T* yr = y + n * width;
    for (int64_t j = 0; j < width; ++j) yr[j] = xr[j] * sigmoid_of(gr[gate_width == 1 ? 0 : j]);
  }
}

template <typename T>
void sigmoid_gate_backward_rows(T* dx, T* dgate, const T* dy, const T* x, const T* gate, int64_t rows, int64_t width,
                                int64_t gate_width) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    const T* xr = x + n * width;
    const T* gr = gate + n * gate_width;
    const T* dyr = dy + n * width;
    T* dxr = dx + n * width;
    T* dgr = dgate + n * gate_width;
    if (gate_width == 1) {
      const T s = sigmoid_of(gr[0]);
      T sum = T(0);
      for (int64_t j = 0; j < width; ++j) {
        const T d = dyr[j];
        sum += d * xr[j];
        dxr[j] = d * s;
      }
      dgr[0] = sum * (s * (T(1) - s));
    } else {
      for (int64_t j = 0; j < width; ++j) {
        const T s = sigmoid_of(gr[j]);
        const T d = dyr[j];
        dgr[j] = (d * xr[j]) * (s * (T(1) - s));
        dxr[j] = d * s;
      }
    }
  }
}

}  // namespace

void sigmoid_gate_forward(const Tensor& y, const Tensor& x, const Tensor& gate) {
  dispatch_float(x.dtype(), "sigmoid_gate_forward", [&]<typename T>() {
    sigmoid_gate_forward_rows<T>(y.data<T>(), x.data<T>(), gate.data<T>(), x.size(0), x.size(1), gate.size(1));
  });
}

void sigmoid_gate_backward(const Tensor& dx, const Tensor& dgate, const Tensor& dy, const Tensor& x,
                           const Tensor& gate) {
  dispatch_float(x.dtype(), "sigmoid_gate_backward", [&]<typename T>() {
    sigmoid_gate_backward_rows<T>(dx.data<T>(), dgate.data<T>(), dy.data<T>(), x.data<T>(), gate.data<T>(), x.size(0),
                                  x.size(1), gate.size(1));
  });
}

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

void clamped_swiglu_forward(const Tensor& y, const Tensor& gate_up, const ClampedSwigluParams& params) {
  const int64_t rows = gate_up.size(0);
  const int64_t width = gate_up.size(1) / 2;
  dispatch_float(gate_up.dtype(), "clamped_swiglu_forward", [&]<typename T>() {
    clamped_forward_rows<T>(y.data<T>(), gate_up.data<T>(), rows, width, static_cast<T>(params.alpha),
                            static_cast<T>(params.limit));
  });
}

void clamped_swiglu_backward(const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up,
                             const ClampedSwigluParams& params) {
  const int64_t rows = gate_up.size(0);
  const int64_t width = gate_up.size(1) / 2;
  dispatch_float(gate_up.dtype(), "clamped_swiglu_backward", [&]<typename T>() {
    clamped_backward_rows<T>(dgate_up.data<T>(), dy.data<T>(), gate_up.data<T>(), rows, width,
                             static_cast<T>(params.alpha), static_cast<T>(params.limit));
  });
}

}  // namespace moetrain::ops::cpu
