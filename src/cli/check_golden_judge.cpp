// defines: the judgement side of check-golden (check_golden_judge.h): errors, bounds, report lines and
// top-k flips, all on host tensors.
#include "cli/check_golden_judge.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain::cli::golden {

double bf16_bound(double theirs) { return kBf16Factor * theirs + kBf16Floor; }

Judged judge_bf16(std::string name, double ours, double theirs) {
  return {std::move(name), ours, theirs, bf16_bound(theirs)};
}

void widen_by_spread(Judged& judged, double spread) {
  judged.spread = spread;
  judged.bound += kEnsembleSpreads * spread;
}

namespace {

Tensor host_f64(const Tensor& t) { return (t.device().is_cpu() ? t : t.to(Device::cpu())).to(DType::F64); }

// Sums of (a - b)^2 and b^2 over two tensors of the same size.
std::pair<double, double> squared_sums(const Tensor& ours, const Tensor& ref) {
  MT_CHECK(ours.numel() == ref.numel(), "check-golden: comparing {} with reference {}", ours.describe(),
           ref.describe());
  const Tensor a = host_f64(ours), b = host_f64(ref);
  const double* pa = a.data<double>();
  const double* pb = b.data<double>();
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    diff += (pa[i] - pb[i]) * (pa[i] - pb[i]);
    norm += pb[i] * pb[i];
  }
  return {diff, norm};
}

double ratio(double diff, double norm) {
  if (norm == 0.0) return diff == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(diff / norm);
}

Tensor bf16ref_tensor(const io::SafetensorsReader& ref, const std::string& key) {
  const std::string name = "bf16ref." + key;
  MT_CHECK(ref.contains(name),
           "check-golden: the reference {} has no '{}', transformers' own bf16 result that --dtype bf16 is judged "
           "against; use a dump made by shared/golden/make_golden.py on 2026-12-01 or later (it writes bf16ref.*)",
           ref.path(), name);
  return ref.tensor(name);
}

}  // namespace

double largest_difference(const float* a, const float* b, int64_t experts) {
  double largest = 0.0;
  for (int64_t e = 0; e < experts; ++e) largest = std::max(largest, std::abs(double(a[e]) - double(b[e])));
  return largest;
}

double relative_error(const Tensor& ours, const Tensor& ref) {
  const auto [diff, norm] = squared_sums(ours, ref);
  return ratio(diff, norm);
}

void EnsembleStats::add(const std::string& name, const Tensor& member) {
  const Tensor values = host_f64(member);
  const double* v = values.data<double>();
  Running& r = quantities_[name];
  if (r.count == 0) {
    r.mean.assign(static_cast<size_t>(values.numel()), 0.0);
    r.m2.assign(static_cast<size_t>(values.numel()), 0.0);
  }
  MT_CHECK(static_cast<int64_t>(r.mean.size()) == values.numel(),
           "check-golden: ensemble member of '{}' has {} elements, the first had {}", name, values.numel(),
           r.mean.size());
  ++r.count;
  for (size_t i = 0; i < r.mean.size(); ++i) {
    const double delta = v[i] - r.mean[i];
    r.mean[i] += delta / r.count;
    r.m2[i] += delta * (v[i] - r.mean[i]);
  }
}

int EnsembleStats::members(const std::string& name) const {
  const auto it = quantities_.find(name);
  return it == quantities_.end() ? 0 : it->second.count;
}

std::pair<double, double> EnsembleStats::center_and_spread(const std::string& name, const Tensor& ref) const {
  const auto it = quantities_.find(name);
  MT_CHECK(it != quantities_.end() && it->second.count >= 2,
           "check-golden: the ensemble has {} member(s) of '{}', expected at least 2", members(name), name);
  const Running& r = it->second;
  const Tensor b = host_f64(ref);
  MT_CHECK(static_cast<int64_t>(r.mean.size()) == b.numel(), "check-golden: ensemble '{}' of {} elements against {}",
           name, r.mean.size(), ref.describe());
  const double* pb = b.data<double>();
  double diff = 0.0, norm = 0.0, variance = 0.0;
  for (size_t i = 0; i < r.mean.size(); ++i) {
    diff += (r.mean[i] - pb[i]) * (r.mean[i] - pb[i]);
    norm += pb[i] * pb[i];
    variance += r.m2[i] / (r.count - 1);
  }
  return {ratio(diff, norm), ratio(variance, norm)};
}

void Report::group(const std::string& name, const std::vector<std::pair<std::string, double>>& errors,
                   double threshold) {
  double worst = 0.0;
  std::string worst_name = "-";
  for (const auto& [tensor, error] : errors) {
    if (worst_name == "-" || std::isnan(error) || (!std::isnan(worst) && error > worst)) {
      worst = error;
      worst_name = tensor;
    }
  }
  const bool ok = !errors.empty() && worst <= threshold;
  line(ok, fmt::format("{:<28} worst rel err {:.3e} (threshold {:.0e}) in {} [{} tensor(s)]", name, worst, threshold,
                       worst_name, errors.size()));
}

void Report::judged(const std::string& name, const std::vector<Judged>& tensors, const std::string& yardstick,
                    const std::string& rule, const std::string& measured) {
  // The deciding tensor: the one nearest to or furthest over its bound (NaN first).
  const Judged* decider = nullptr;
  double decider_ratio = -1.0;
  size_t over = 0;
  for (const Judged& t : tensors) {
    if (!t.within()) ++over;
    double r = t.ours / t.bound;  // a zero bound: inf over it, NaN (0 / 0) at it
    if (std::isnan(t.ours) || std::isnan(t.bound)) r = INFINITY;
    if (std::isnan(r)) r = 0.0;
    if (decider == nullptr || r > decider_ratio) {
      decider = &t;
      decider_ratio = r;
    }
  }
  const bool ok = !tensors.empty() && over == 0;
  if (decider == nullptr) {
    line(false, fmt::format("{:<28} nothing to compare [0 tensor(s)]", name));
    return;
  }
  line(ok, fmt::format("{:<28} {} {:.3e} {} {:.3e} bound {:.3e} in {} [{} tensor(s){}; bound = {}]", name, measured,
                       decider->ours, yardstick, decider->theirs, decider->bound, decider->name, tensors.size(),
                       over ? fmt::format(", {} over their bound", over) : std::string(), rule));
  if (!every_tensor_) return;
  for (const Judged& t : tensors) {
    info(fmt::format("{:<28} {} {:.3e} {} {:.3e} bound {:.3e} ({:.2f} of it) {}{}", name, measured, t.ours, yardstick,
                     t.theirs, t.bound, t.ours / t.bound, t.name,
                     t.spread >= 0.0 ? fmt::format(" spread {:.3e}", t.spread) : std::string()));
  }
}

void Report::line(bool ok, const std::string& text) {
  std::printf("[%s] %s\n", ok ? " ok " : "FAIL", text.c_str());
  std::fflush(stdout);
  (ok ? passed_ : failed_)++;
}

void Report::info(const std::string& text) {
  std::printf("[info] %s\n", text.c_str());
  std::fflush(stdout);
}

double theirs_error(const io::SafetensorsReader& ref, const std::string& key) {
  const Tensor theirs = bf16ref_tensor(ref, key);
  MT_CHECK(ref.contains(key), "check-golden: the reference {} has bf16ref.{} but no '{}'", ref.path(), key, key);
  return relative_error(theirs, ref.tensor(key));
}

double theirs_error_over(const io::SafetensorsReader& ref, const std::vector<std::string>& keys) {
  double diff = 0.0, norm = 0.0;
  for (const std::string& key : keys) {
    const Tensor theirs = bf16ref_tensor(ref, key);
    MT_CHECK(ref.contains(key), "check-golden: the reference {} has bf16ref.{} but no '{}'", ref.path(), key, key);
    const auto [d, n] = squared_sums(theirs, ref.tensor(key));
    diff += d;
    norm += n;
  }
  return ratio(diff, norm);
}

double mean_cross_entropy(const Tensor& logits, const Tensor& targets) {
  const int64_t vocab = logits.size(-1);
  MT_CHECK(vocab > 0 && logits.numel() == targets.numel() * vocab,
           "check-golden: cross-entropy of logits {} against targets {}", logits.describe(), targets.describe());
  const Tensor z = host_f64(logits);
  const std::vector<int64_t> tgt = targets.to(DType::I64).to_vector<int64_t>();
  double sum = 0.0;
  int64_t count = 0;
  for (size_t t = 0; t < tgt.size(); ++t) {
    if (tgt[t] == -100) continue;
    MT_CHECK(tgt[t] >= 0 && tgt[t] < vocab, "check-golden: target {} at position {} is outside the vocabulary ({})",
             tgt[t], t, vocab);
    const double* row = z.data<double>() + static_cast<int64_t>(t) * vocab;
    const double top = *std::max_element(row, row + vocab);
    double total = 0.0;
    for (int64_t v = 0; v < vocab; ++v) total += std::exp(row[v] - top);
    sum += top + std::log(total) - row[tgt[t]];
    ++count;
  }
  MT_CHECK(count > 0, "check-golden: cross-entropy over targets {} with no counted target", targets.describe());
  return sum / static_cast<double>(count);
}

double theirs_loss_error(const io::SafetensorsReader& ref, const std::string& prefix) {
  const double theirs = mean_cross_entropy(bf16ref_tensor(ref, prefix + "logits"), ref.tensor(prefix + "targets"));
  const double loss = ref.tensor(prefix + "loss").to(DType::F64).item<double>();
  return loss == 0.0 ? (theirs == 0.0 ? 0.0 : INFINITY) : std::abs(theirs - loss) / std::abs(loss);
}

std::vector<int> top_k_of(const float* row, int64_t experts, int64_t k) {
  std::vector<int> order(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) order[static_cast<size_t>(e)] = static_cast<int>(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
  order.resize(static_cast<size_t>(k));
  std::sort(order.begin(), order.end());
  return order;
}

bool flip_is_near_tie(double margin, double sigma) { return margin <= kNearTieSigmas * std::sqrt(2.0) * sigma; }

double robust_sigma(const Tensor& ours, const Tensor& ref) {
  MT_CHECK(ours.numel() == ref.numel() && ref.numel() > 0, "check-golden: comparing {} with reference {}",
           ours.describe(), ref.describe());
  const Tensor a = host_f64(ours), b = host_f64(ref);
  std::vector<double> diff(static_cast<size_t>(a.numel()));
  for (size_t i = 0; i < diff.size(); ++i) diff[i] = std::abs(a.data<double>()[i] - b.data<double>()[i]);
  const auto middle = diff.begin() + static_cast<std::ptrdiff_t>(diff.size() / 2);
  std::nth_element(diff.begin(), middle, diff.end());
  return 1.4826 * *middle;
}

void RoutingCheck::add_pass(const std::vector<Tensor>& ref_layers, const std::vector<Tensor>& our_layers, int64_t k,
                            const Tensor& cu_seqlens, const std::string& where) {
  MT_CHECK(ref_layers.size() == our_layers.size(),
           "check-golden: {} MoE layers of router logits against {} in the "
           "reference",
           our_layers.size(), ref_layers.size());
  const std::vector<int32_t> cu = cu_seqlens.to(DType::I32).to_vector<int32_t>();
  // Per token: the sequence it belongs to. Per sequence: the earliest token with an explained flip in the layers
  // seen so far of this pass (INT64_MAX when none).
  std::vector<size_t> sequence_of;
  for (size_t d = 0; d + 1 < cu.size(); ++d) sequence_of.insert(sequence_of.end(), size_t(cu[d + 1] - cu[d]), d);
  std::vector<int64_t> first_flip(cu.empty() ? 0 : cu.size() - 1, std::numeric_limits<int64_t>::max());
  for (size_t layer = 0; layer < ref_layers.size(); ++layer) {
    const Tensor r_all = host_f64(ref_layers[layer]).to(DType::F32);
    const Tensor o_all = host_f64(our_layers[layer]).to(DType::F32);
    MT_CHECK(r_all.dim() == 2 && o_all.numel() == r_all.numel() && size_t(r_all.size(0)) == sequence_of.size(),
             "check-golden: router logits of MoE layer {}: ours {} against reference {} for {} tokens", layer,
             our_layers[layer].describe(), ref_layers[layer].describe(), sequence_of.size());
    const int64_t experts = r_all.size(1);
    MT_CHECK(k > 0 && k < experts, "check-golden: top-{} of {} experts", k, experts);
    const double sigma = explain_near_ties ? robust_sigma(o_all, r_all) : 0.0;
    std::vector<Tensor> moved_all;  // per member: our router logits after one rounding, where given
    if (after_rounding != nullptr) {
      for (const std::vector<Tensor>& member : *after_rounding) {
        moved_all.push_back(host_f64(member.at(layer)).to(DType::F32));
        MT_CHECK(moved_all.back().numel() == o_all.numel(),
                 "check-golden: router logits of MoE layer {} after one rounding: {}", layer,
                 moved_all.back().describe());
      }
    }
    std::vector<int64_t> flipped_now;  // explained flips of this layer: they explain later layers only
    for (int64_t t = 0; t < r_all.size(0); ++t, ++choices) {
      const float* r = r_all.data<float>() + t * experts;
      const float* o = o_all.data<float>() + t * experts;
      if (top_k_of(r, experts, k) == top_k_of(o, experts, k)) continue;
      std::vector<float> sorted(r, r + experts);
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      const double margin = sorted[static_cast<size_t>(k - 1)] - sorted[static_cast<size_t>(k)];
      // How far one rounding of the weights moves this token's logits: the largest over the members.
      double moved = 0.0;
      for (const Tensor& member : moved_all) {
        moved = std::max(moved,
                         largest_difference(member.data<float>() + t * experts, moved_from_reference ? r : o, experts));
      }
      const bool by_sigma = explain_near_ties && flip_is_near_tie(margin, sigma);
      const bool by_rounding = explain_near_ties && !by_sigma && flip_is_near_tie(margin, moved);
      const bool near_tie = by_sigma || by_rounding;
      const bool downstream = explain_near_ties && first_flip[sequence_of[size_t(t)]] <= t;
      ++flips;
      if (near_tie || downstream) {
        near_tie_layers.insert(layer);
        flipped_now.push_back(t);
      } else {
        ++unexplained;
      }
      std::vector<std::string>& listed = near_tie || downstream ? explained_details : unexplained_details;
      if (listed.size() < kListedFlips) {
        const std::string why =
            by_sigma      ? fmt::format(" (near-tie: within {} x sqrt(2) x sigma, sigma {:.2e})", kNearTieSigmas, sigma)
            : by_rounding ? fmt::format(
                                " (near-tie: within {} x sqrt(2) x {:.2e}, how far one {} rounding of every weight "
                                "moves this token's router logits, the largest of {})",
                                kNearTieSigmas, moved, rounding, moved_all.size())
            : downstream
                ? std::string(" (after a near-tie flip of its sequence in an earlier MoE layer)")
                : fmt::format(" (not a near-tie: sigma {:.2e}{}; ours is off the reference by {:.2e})", sigma,
                              moved_all.empty() ? std::string()
                                                : fmt::format(", one {} rounding of every weight moves it {:.2e}, "
                                                              "the largest of {}",
                                                              rounding, moved, moved_all.size()),
                              largest_difference(o, r, experts));
        listed.push_back(
            fmt::format("{}MoE layer {} token {}: reference margin {:.2e}{}", where, layer, t, margin, why));
      }
    }
    for (int64_t t : flipped_now) {
      int64_t& first = first_flip[sequence_of[size_t(t)]];
      first = std::min(first, t);
    }
  }
}

std::string RoutingCheck::summary() const {
  // The unexplained flips first: they are what failed.
  std::string details;
  for (const auto* flips_of_a_kind : {&unexplained_details, &explained_details}) {
    for (const std::string& flip : *flips_of_a_kind) details += "; " + flip;
  }
  return fmt::format("{} top-k flip(s) in {} token-layer choices, {} not explained by rounding{}", flips, choices,
                     unexplained, details);
}

Excusal excuse_by_pinned_pass(std::vector<Judged> free, const std::vector<Judged>& pinned, bool flips_explained) {
  Excusal out;
  for (Judged& t : free) {
    const auto same = std::find_if(pinned.begin(), pinned.end(), [&t](const Judged& p) { return p.name == t.name; });
    const bool excused = flips_explained && !t.within() && same != pinned.end() && same->within();
    (excused ? out.excused : out.kept).push_back(std::move(t));
  }
  return out;
}

std::string excused_line(const std::string& label, const Excusal& excusal) {
  if (excusal.excused.empty()) return "";
  std::string text = fmt::format(
      "{:<28} over their bound after near-tie flips, within it with the routing pinned to the reference's, so not "
      "held to it:",
      label);
  for (const Judged& t : excusal.excused) text += fmt::format(" {} {:.2e} (bound {:.2e});", t.name, t.ours, t.bound);
  return text;
}

double RoutingChoice::closeness() const { return move > 0.0 ? margin / move : std::numeric_limits<double>::infinity(); }

std::string RoutingChoice::describe() const {
  return fmt::format("step {} mb {} MoE layer {} token {}: expert {} over {} by {:.3e}, {:.1f} x the ensemble's move",
                     step, micro_batch, layer, token, kept, passed_over, margin, closeness());
}

}  // namespace moetrain::cli::golden
