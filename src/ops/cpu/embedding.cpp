// defines: the CPU embedding kernels. The weight gradient builds, for each vocabulary row, the list of its tokens
// in ascending order (a counting sort), then sums each row's tokens in one thread, rows in parallel.
#include "ops/cpu/embedding.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

void embedding_forward(const Tensor& y, const Tensor& ids, const Tensor& table) {
  dispatch_float(table.dtype(), "embedding_forward", [&]<typename T>() {
    const int64_t tokens = ids.numel();
    const int64_t hidden = table.size(1);
    const int32_t* id = ids.data<int32_t>();
    const T* w = table.data<T>();
    T* out = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      std::copy_n(w + static_cast<int64_t>(id[t]) * hidden, hidden, out + t * hidden);
    }
  });
}

void embedding_backward_weight(const Tensor& dtable, const Tensor& dy, const Tensor& ids) {
  dispatch_float(dtable.dtype(), "embedding_backward_weight", [&]<typename T>() {
    const int64_t tokens = ids.numel();
    const int64_t vocab = dtable.size(0);
    const int64_t hidden = dtable.size(1);
    const int32_t* id = ids.data<int32_t>();
    const T* g = dy.data<T>();
    T* dw = dtable.data<T>();

    // Counting sort of the tokens by id: tokens of row v are order[begin[v] .. begin[v + 1]), ascending.
    std::vector<int64_t> begin(static_cast<size_t>(vocab) + 1, 0);
    for (int64_t t = 0; t < tokens; ++t) ++begin[static_cast<size_t>(id[t]) + 1];
    for (int64_t v = 0; v < vocab; ++v) begin[v + 1] += begin[v];
    std::vector<int64_t> order(static_cast<size_t>(tokens));
    std::vector<int64_t> next(begin.begin(), begin.end() - 1);
    for (int64_t t = 0; t < tokens; ++t) order[next[id[t]]++] = t;

    // Only the rows that occur: their list, ascending by id.
    std::vector<int64_t> rows;
    for (int64_t v = 0; v < vocab; ++v) {
      if (begin[v + 1] > begin[v]) rows.push_back(v);
    }
    const int64_t used = static_cast<int64_t>(rows.size());
#pragma omp parallel
    {
      std::vector<T> acc(static_cast<size_t>(hidden));
#pragma omp for schedule(dynamic, 4)
      for (int64_t r = 0; r < used; ++r) {
        const int64_t v = rows[r];
        std::fill(acc.begin(), acc.end(), T(0));
        for (int64_t k = begin[v]; k < begin[v + 1]; ++k) {
          const T* gr = g + order[k] * hidden;
          for (int64_t h = 0; h < hidden; ++h) acc[h] += gr[h];
        }
        T* out = dw + v * hidden;
        for (int64_t h = 0; h < hidden; ++h) out[h] += acc[h];
      }
    }
  });
}

}  // namespace moetrain::ops::cpu
