// defines: the layer partition of DualPipeV's 2P stages: balanced by per-token training FLOPs (an exact min-max
// dynamic programme over cut points) or from explicit cuts, both validated before a Partition is built.
#include "pipeline/partition.h"

#include <algorithm>
#include <limits>
#include <string>

#include "core/error.h"
#include "model/flops.h"

namespace moetrain::pipeline {
namespace {

// The sequence length the attention core is costed at: its FLOPs grow with the context while every matmul's do
// not, so the balance depends on it a little; 4096 is the workload of record (docs/design.md section 7).
constexpr int64_t kNominalSeqLen = 4096;

// Forward + backward FLOPs per token of decoder layer `layer` (model/flops.h, the trainer's MFU formula), the
// attention core costed at the nominal context.
double layer_cost(const model::ModelConfig& c, int64_t layer) {
  return model::layer_training_flops(c, layer, kNominalSeqLen);
}

// The LM head with the loss; the embedding lookup costs ~0.
double head_cost(const model::ModelConfig& c) { return model::head_training_flops(c); }

void check_pp(const model::ModelConfig& config, int pp, const char* who) {
  MT_CHECK(pp >= 1, "{}: parallel.pp must be >= 1, found {}", who, pp);
  const int64_t num_stages = 2 * int64_t(pp);
  MT_CHECK(config.num_hidden_layers >= num_stages,
           "{}: DualPipeV with pp = {} needs {} stages of >= 1 decoder layer each, but the model has {} layers; "
           "lower parallel.pp to at most {}",
           who, pp, num_stages, config.num_hidden_layers, config.num_hidden_layers / 2);
}

// Builds the Partition from 2P + 1 boundaries 0 = b[0] < b[1] < ... < b[2P] = num_layers.
Partition build(int pp, const std::vector<int64_t>& bounds) {
  Partition p;
  p.pp = pp;
  const int num_stages = 2 * pp;
  for (int s = 0; s < num_stages; ++s) {
    StageLayers st;
    st.stage = s;
    st.rank = s < pp ? s : num_stages - 1 - s;
    st.first_layer = bounds[static_cast<size_t>(s)];
    st.end_layer = bounds[static_cast<size_t>(s) + 1];
    st.has_embedding = s == 0;
    st.has_final_norm = s == num_stages - 1;
    st.has_head = s == num_stages - 1;
    p.stages.push_back(st);
  }
  return p;
}

}  // namespace

Partition partition_balanced(const model::ModelConfig& config, int pp) {
  check_pp(config, pp, "partition_balanced");
  const int64_t L = config.num_hidden_layers;
  const int S = 2 * pp;

  // prefix[i] = cost of layers [0, i); the head joins the last stage.
  std::vector<double> prefix(static_cast<size_t>(L) + 1, 0.0);
  for (int64_t l = 0; l < L; ++l) prefix[size_t(l) + 1] = prefix[size_t(l)] + layer_cost(config, l);
  const double head = head_cost(config);
  auto stage_cost = [&](int64_t begin, int64_t end, bool last) {
    return prefix[size_t(end)] - prefix[size_t(begin)] + (last ? head : 0.0);
  };

  // best[s][i]: the smallest possible max stage cost when stages 0..s-1 hold layers [0, i); cut[s][i] the start of
  // stage s-1 in that optimum. Ties keep the earliest cut, so the result is one deterministic function of the config.
  const double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(S) + 1, std::vector<double>(size_t(L) + 1, kInf));
  std::vector<std::vector<int64_t>> cut(size_t(S) + 1, std::vector<int64_t>(size_t(L) + 1, -1));
  best[0][0] = 0.0;
  for (int s = 1; s <= S; ++s) {
    const bool last = s == S;
    for (int64_t i = s; i <= L - (S - s); ++i) {  // each stage before and after keeps >= 1 layer
      for (int64_t j = s - 1; j < i; ++j) {
        if (best[size_t(s) - 1][size_t(j)] == kInf) continue;
        const double cost = std::max(best[size_t(s) - 1][size_t(j)], stage_cost(j, i, last));
        if (cost < best[size_t(s)][size_t(i)]) {
          best[size_t(s)][size_t(i)] = cost;
          cut[size_t(s)][size_t(i)] = j;
        }
      }
    }
  }

  std::vector<int64_t> bounds(size_t(S) + 1, 0);
  bounds[size_t(S)] = L;
  for (int s = S; s >= 1; --s) bounds[size_t(s) - 1] = cut[size_t(s)][size_t(bounds[size_t(s)])];
  return build(pp, bounds);
}

Partition partition_from_cuts(const model::ModelConfig& config, int pp, const std::vector<int64_t>& cuts) {
  check_pp(config, pp, "partition_from_cuts");
  const int64_t L = config.num_hidden_layers;
  const size_t expected = size_t(2 * pp - 1);
  MT_CHECK(cuts.size() == expected, "parallel.pp_cuts: pp = {} has {} stages and needs {} cut points, found {}", pp,
           2 * pp, expected, cuts.size());
  for (size_t i = 0; i < cuts.size(); ++i) {
    MT_CHECK(cuts[i] > 0 && cuts[i] < L,
             "parallel.pp_cuts[{}] = {} is outside (0, {}): a cut lies strictly between two of the model's {} layers",
             i, cuts[i], L, L);
    if (i > 0) {
      MT_CHECK(cuts[i] > cuts[i - 1],
               "parallel.pp_cuts[{}] = {} is not greater than pp_cuts[{}] = {}: cuts must be strictly increasing so "
               "every stage holds >= 1 layer",
               i, cuts[i], i - 1, cuts[i - 1]);
    }
  }
  std::vector<int64_t> bounds;
  bounds.push_back(0);
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(L);
  return build(pp, bounds);
}

}  // namespace moetrain::pipeline
