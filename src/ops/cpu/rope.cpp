// defines: the CPU rope kernels. For pair (a, b) with angle f32(position * inv_freq[i]), c = cos * scaling and
// s = sin * scaling: forward (a, b) -> (a*c - b*s, b*c + a*s) as HF's q*cos + rotate_half(q)*sin; the backward is
// the transpose, the same rotation with -s.
#include "ops/cpu/rope.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

// cos and sin of the angle of pair i at `position`. In f32 the angle is the f32 product HF forms
// (inv_freq @ position_ids) and its cos / sin are evaluated in double and rounded once to f32, the closest match
// to torch's results; in f64 (gradient checks) everything stays in double.
template <typename T>
void angle_cos_sin(int32_t position, float inv_freq, float scaling, T* c, T* s);

template <>
void angle_cos_sin<float>(int32_t position, float inv_freq, float scaling, float* c, float* s) {
  const float angle = static_cast<float>(position) * inv_freq;
  *c = static_cast<float>(std::cos(static_cast<double>(angle))) * scaling;
  *s = static_cast<float>(std::sin(static_cast<double>(angle))) * scaling;
}

template <>
void angle_cos_sin<double>(int32_t position, float inv_freq, float scaling, double* c, double* s) {
  const double angle = static_cast<double>(position) * static_cast<double>(inv_freq);
  *c = std::cos(angle) * static_cast<double>(scaling);
  *s = std::sin(angle) * static_cast<double>(scaling);
}

// out = rotation of in by the angles of each token; sin_sign -1 applies the transpose (backward).
template <typename T>
void rotate(T* out, const T* in, const int32_t* position_ids, int64_t tokens, int64_t heads, int64_t head_dim,
            const RopeParams& params, T sin_sign) {
  const int64_t half = params.rotary_dim / 2;
#pragma omp parallel
  {
    std::vector<T> cos_t(static_cast<size_t>(half));
    std::vector<T> sin_t(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        angle_cos_sin<T>(position_ids[t], params.inv_freq[static_cast<size_t>(i)], params.attention_scaling, &cos_t[i],
                         &sin_t[i]);
        sin_t[i] *= sin_sign;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const T* x_head = in + (t * heads + h) * head_dim;
        T* y_head = out + (t * heads + h) * head_dim;
        if (out != in) {  // the dims outside the rotation, copied (in place they stay)
          for (int64_t d = 0; d < params.first_rotated_dim; ++d) y_head[d] = x_head[d];
          for (int64_t d = params.first_rotated_dim + params.rotary_dim; d < head_dim; ++d) y_head[d] = x_head[d];
        }
        const T* x = x_head + params.first_rotated_dim;
        T* y = y_head + params.first_rotated_dim;
        for (int64_t i = 0; i < half; ++i) {
          // rotate_half pairs (i, i + half); interleaved pairs (2i, 2i + 1).
          const int64_t ia = params.interleaved ? 2 * i : i;
          const int64_t ib = params.interleaved ? 2 * i + 1 : i + half;
          const T a = x[ia];
          const T b = x[ib];
          y[ia] = a * cos_t[i] - b * sin_t[i];
          y[ib] = b * cos_t[i] + a * sin_t[i];
        }
      }
    }
  }
}

void run(const Tensor& out, const Tensor& in, const Tensor& position_ids, const RopeParams& params, bool backward,
         const char* op) {
  dispatch_float(in.dtype(), op, [&]<typename T>() {
    rotate<T>(out.data<T>(), in.data<T>(), position_ids.data<int32_t>(), in.size(0), in.size(1), in.size(2), params,
              backward ? T(-1) : T(1));
  });
}

}  // namespace

void rope_forward(const Tensor& y, const Tensor& x, const Tensor& position_ids, const RopeParams& params) {
  run(y, x, position_ids, params, false, "rope_forward");
}

void rope_backward(const Tensor& dx, const Tensor& dy, const Tensor& position_ids, const RopeParams& params) {
  run(dx, dy, position_ids, params, true, "rope_backward");
}

}  // namespace moetrain::ops::cpu
