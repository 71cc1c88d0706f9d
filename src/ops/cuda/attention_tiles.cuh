// defines: what the attention kernels share about where a row's keys are (ops/cuda/attention.cu on the CUDA cores,
// ops/cuda/attention_mma.cu on the tensor cores): the visibility rules of the CPU reference and the tiles that start
// at each document's first token. `D` is a kernel's dimensions, with `causal` and `window` (0: unlimited).
#pragma once

#include <cstdint>

namespace moetrain::ops::cuda::attention_tiles {

// The visibility rules of the CPU reference (ops/cpu/attention.h): key j is seen by query i of the same document
// when j in [key_begin(i), key_end(i)), equivalently i in [query_begin(j), query_end(j)).
template <class D>
__device__ __forceinline__ int key_begin(int i, int doc_begin, const D& n) {
  return n.window > 0 ? max(doc_begin, i - n.window + 1) : doc_begin;
}
template <class D>
__device__ __forceinline__ int key_end(int i, int doc_end, const D& n) {
  if (n.causal) return i + 1;
  return n.window > 0 ? min(doc_end, i + n.window) : doc_end;
}
template <class D>
__device__ __forceinline__ int query_begin(int j, int doc_begin, const D& n) {
  if (n.causal) return j;
  return n.window > 0 ? max(doc_begin, j - n.window + 1) : doc_begin;
}
template <class D>
__device__ __forceinline__ int query_end(int j, int doc_end, const D& n) {
  return n.window > 0 ? min(doc_end, j + n.window) : doc_end;
}

// Rows [begin, end) of document [doc_begin, doc_end).
struct Tile {
  int begin, end, doc_begin, doc_end;
};

// Tiles of `tile_rows` rows start at each document's first token. Document d owns the tile indices
// [cu[d] / tile_rows + d, cu[d + 1] / tile_rows + d + 1), at least ceil(len_d / tile_rows) of them, so
// T / tile_rows + D tiles cover every document; a tile past its document's end is empty (returns false).
__device__ __forceinline__ bool find_tile(const int32_t* cu, int num_docs, int tile, int tile_rows, Tile* out) {
  int lo = 0, hi = num_docs - 1;  // the last document whose first tile index is <= tile
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] / tile_rows + mid <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int doc_begin = cu[lo], doc_end = cu[lo + 1];
  const int begin = doc_begin + (tile - (doc_begin / tile_rows + lo)) * tile_rows;
  *out = {begin, min(begin + tile_rows, doc_end), doc_begin, doc_end};
  return begin < doc_end;
}

}  // namespace moetrain::ops::cuda::attention_tiles
