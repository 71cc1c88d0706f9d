// defines: where a row of one of several expert-ordered row sets lands when the sets are concatenated group by group
// (ops::concat_group_rows' layout, which ops::concat_permuted_rows shares): the parts' group offsets as one kernel
// argument, and the destination row of a part's row.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/row_gather.h"

namespace moetrain::ops::cuda {

// The parts' group offsets, passed by value (kMaxGroupParts pointers: 512 bytes of kernel parameters).
struct GroupParts {
  const int32_t* offsets[kMaxGroupParts];
  int count;
};

inline GroupParts group_parts(const std::vector<Tensor>& offsets) {
  GroupParts parts{};
  parts.count = static_cast<int>(offsets.size());
  for (size_t p = 0; p < offsets.size(); ++p) parts.offsets[p] = static_cast<const int32_t*>(offsets[p].raw_data());
  return parts;
}

// Row r of part `part`: its group g is the last with offsets[part][g] <= r; it goes after the rows of group g of the
// parts before it and of the groups before g of every part:
// sum_{q < part} offsets[q][g + 1] + sum_{q > part} offsets[q][g] + r.
__device__ __forceinline__ int64_t concat_destination(const GroupParts& parts, int part, int64_t groups, int64_t r) {
  const int32_t* mine = parts.offsets[part];
  int64_t lo = 0, hi = groups;  // the group lies in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (mine[mid] <= r) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  int64_t dest = r;
  for (int q = 0; q < parts.count; ++q) {
    if (q < part) dest += parts.offsets[q][lo + 1];
    if (q > part) dest += parts.offsets[q][lo];
  }
  return dest;
}

}  // namespace moetrain::ops::cuda
