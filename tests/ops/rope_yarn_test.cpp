// Tests for the YaRN parameters of ops/rope (rope_yarn_params, yarn_attention_factor, yarn_softmax_scale) against
// what transformers 5.17 computed (tests/data/rope_yarn/fixture.json), their structure (extrapolated high
// frequencies, interpolated low ones), the rope kernel driven by them, and the refusals of bad options.
#include "ops/rope.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "io/json_fields.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using nlohmann::json;
using testing::random_tensor;

void expect_error(const std::function<void()>& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "expected a moetrain::Error mentioning \"" << text << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

const json& fixture_cases() {
  static const json cases = io::read_json_object(testing::test_data_path("rope_yarn/fixture.json")).at("cases");
  return cases;
}

// The YarnOptions of a transformers rope_parameters dict, absent keys taking transformers' defaults.
YarnOptions options_from(const json& rope) {
  YarnOptions o;
  o.factor = rope.at("factor").get<double>();
  o.original_max_position_embeddings = rope.at("original_max_position_embeddings").get<int64_t>();
  if (rope.contains("beta_fast")) o.beta_fast = rope.at("beta_fast").get<double>();
  if (rope.contains("beta_slow")) o.beta_slow = rope.at("beta_slow").get<double>();
  if (rope.contains("mscale")) o.mscale = rope.at("mscale").get<double>();
  if (rope.contains("mscale_all_dim")) o.mscale_all_dim = rope.at("mscale_all_dim").get<double>();
  if (rope.contains("attention_factor")) o.attention_factor = rope.at("attention_factor").get<double>();
  if (rope.contains("truncate")) o.truncate = rope.at("truncate").get<bool>();
  return o;
}

RopeParams params_from(const json& c) {
  return rope_yarn_params(c.at("rotary_dim").get<int>(), c.at("rope_parameters").at("rope_theta").get<double>(),
                          options_from(c.at("rope_parameters")));
}

std::vector<float> floats(const json& values) {
  std::vector<float> out;
  for (const json& v : values) out.push_back(static_cast<float>(v.get<double>()));  // f32 values, exact in JSON
  return out;
}

// Distance in units in the last place between two positive finite floats.
int64_t ulp_distance(float a, float b) {
  int32_t ia = 0, ib = 0;
  std::memcpy(&ia, &a, sizeof(a));
  std::memcpy(&ib, &b, sizeof(b));
  return std::llabs(static_cast<int64_t>(ia) - static_cast<int64_t>(ib));
}

TEST(RopeYarn, FixtureCoversTheFamilies) {
  for (const char* name : {"deepseek_v2", "gpt_oss", "gpt_oss_golden", "partial_mscale_only", "equal_betas",
                           "rotary128_untruncated", "mscale_ratio"}) {
    EXPECT_TRUE(fixture_cases().contains(name)) << name;
  }
}

// transformers' arithmetic with torch's scalar (libm powf) pow for every element: ours is bit-identical.
TEST(RopeYarn, InvFreqBitIdenticalToTransformersWithLibmPow) {
  for (const auto& [name, c] : fixture_cases().items()) {
    SCOPED_TRACE(name);
    const RopeParams p = params_from(c);
    EXPECT_EQ(p.rotary_dim, c.at("rotary_dim").get<int>());
    EXPECT_FALSE(p.interleaved);
    EXPECT_EQ(p.inv_freq, floats(c.at("inv_freq_libm_pow")));
  }
}

// transformers as it ran on the fixture's machine (AVX512: SIMD Sleef pow on chunks of 32 elements, libm powf on the
// rest): ours differ by one ulp exactly where Sleef's pow rounds the other way (gpt_oss [6] and [10],
// rotary128_untruncated [37]); every other element is equal.
TEST(RopeYarn, InvFreqWithinOneUlpOfTransformersWithSimdPow) {
  int differing = 0, torch_paths_differing = 0;
  for (const auto& [name, c] : fixture_cases().items()) {
    SCOPED_TRACE(name);
    const std::vector<float> ours = params_from(c).inv_freq;
    const std::vector<float> theirs = floats(c.at("inv_freq"));
    const std::vector<float> libm = floats(c.at("inv_freq_libm_pow"));
    ASSERT_EQ(ours.size(), theirs.size());
    for (size_t i = 0; i < ours.size(); ++i) {
      torch_paths_differing += libm[i] != theirs[i];
      EXPECT_LE(ulp_distance(ours[i], theirs[i]), 1) << "i = " << i << ": " << ours[i] << " vs " << theirs[i];
      if (ours[i] != theirs[i]) {
        ++differing;
        EXPECT_NE(libm[i], theirs[i]) << "i = " << i << " differs although torch's two pow paths agree";
      }
    }
  }
  EXPECT_EQ(differing, torch_paths_differing);
  EXPECT_EQ(differing, 3);  // a change here means the fixture or the arithmetic changed
}

TEST(RopeYarn, AttentionFactorMatchesTransformers) {
  for (const auto& [name, c] : fixture_cases().items()) {
    SCOPED_TRACE(name);
    const double want = c.at("attention_factor").get<double>();
    const double got = yarn_attention_factor(options_from(c.at("rope_parameters")));
    EXPECT_NEAR(got / want, 1.0, 1e-7) << got << " vs " << want;
    EXPECT_EQ(params_from(c).attention_scaling, static_cast<float>(want));  // torch multiplies by f32(factor)
  }
  // By hand: DeepSeek-V2's equal mscales give 1; GPT-OSS's factor 32 gives 0.1 ln 32 + 1; a lone mscale is ignored.
  EXPECT_EQ(fixture_cases().at("deepseek_v2").at("attention_factor").get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(fixture_cases().at("gpt_oss").at("attention_factor").get<double>(), 0.1 * std::log(32.0) + 1.0);
  EXPECT_DOUBLE_EQ(fixture_cases().at("partial_mscale_only").at("attention_factor").get<double>(),
                   0.1 * std::log(7.3) + 1.0);
}

TEST(RopeYarn, DeepseekSoftmaxScaleMatchesTransformers) {
  int checked = 0;
  for (const auto& [name, c] : fixture_cases().items()) {
    if (!c.contains("softmax_scale")) continue;
    SCOPED_TRACE(name);
    const double base = std::pow(static_cast<double>(c.at("qk_head_dim").get<int>()), -0.5);  // Python's ** -0.5
    const double want = c.at("softmax_scale").get<double>();
    const double got = yarn_softmax_scale(base, options_from(c.at("rope_parameters")));
    EXPECT_NEAR(got / want, 1.0, 1e-7) << got << " vs " << want;
    EXPECT_EQ(static_cast<float>(got), static_cast<float>(want));
    ++checked;
  }
  EXPECT_EQ(checked, 2);
  // DeepSeek-V2: 192^-0.5 * (0.1 * 0.707 * ln 40 + 1)^2.
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(
      yarn_softmax_scale(1.0 / std::sqrt(192.0), options_from(fixture_cases().at("deepseek_v2").at("rope_parameters"))),
      m * m / std::sqrt(192.0));
  // Without mscale_all_dim (GPT-OSS) the scale is left alone.
  EXPECT_EQ(yarn_softmax_scale(0.125, options_from(fixture_cases().at("gpt_oss").at("rope_parameters"))), 0.125);
}

TEST(RopeYarn, GetMscale) {
  EXPECT_EQ(yarn_get_mscale(1.0, 0.707), 1.0);
  EXPECT_EQ(yarn_get_mscale(0.5), 1.0);
  EXPECT_DOUBLE_EQ(yarn_get_mscale(40.0, 0.707), 0.1 * 0.707 * std::log(40.0) + 1.0);
  EXPECT_DOUBLE_EQ(yarn_get_mscale(32.0), 0.1 * std::log(32.0) + 1.0);
}

// Below the ramp (the fast-rotating dims) YaRN keeps the default frequencies; above it (slow dims) it divides them
// by the factor; in between it blends them.
TEST(RopeYarn, ExtrapolatesHighAndInterpolatesLowFrequencies) {
  YarnOptions o;
  o.factor = 32;
  o.original_max_position_embeddings = 4096;
  o.truncate = false;
  const RopeParams yarn = rope_yarn_params(64, 150000.0, o);
  const RopeParams plain = rope_default_params(64, 150000.0);
  // ln(4096 / (beta 2 pi)) * 64 / (2 ln 150000): low ~ 8.09 (beta_fast 32), high ~ 17.4 (beta_slow 1).
  for (size_t i = 0; i < 32; ++i) {
    const float interpolated = 1.0f / (32.0f * (1.0f / plain.inv_freq[i]));
    if (i <= 8) {
      EXPECT_EQ(yarn.inv_freq[i], plain.inv_freq[i]) << "i = " << i;
    } else if (i >= 18) {
      EXPECT_NEAR(yarn.inv_freq[i] / interpolated, 1.0, 1e-6) << "i = " << i;
    } else {
      EXPECT_LT(yarn.inv_freq[i], plain.inv_freq[i]) << "i = " << i;
      EXPECT_GT(yarn.inv_freq[i], interpolated) << "i = " << i;
    }
  }
  EXPECT_FLOAT_EQ(yarn.attention_scaling, static_cast<float>(0.1 * std::log(32.0) + 1.0));

  // Truncation widens the ramp to whole dims: [8, 18].
  o.truncate = true;
  const RopeParams truncated = rope_yarn_params(64, 150000.0, o);
  EXPECT_EQ(truncated.inv_freq[8], plain.inv_freq[8]);
  EXPECT_NE(truncated.inv_freq[9], yarn.inv_freq[9]);
  // factor 1: the default rope, up to the rounding of the blend x * (1 - e) + x * e inside the ramp (transformers
  // rounds it the same way).
  o.factor = 1;
  const RopeParams unit = rope_yarn_params(64, 150000.0, o);
  for (size_t i = 0; i < 32; ++i) EXPECT_LE(ulp_distance(unit.inv_freq[i], plain.inv_freq[i]), 1) << "i = " << i;
  EXPECT_EQ(unit.attention_scaling, 1.0f);
}

// The rope kernel with YaRN parameters (GPT-OSS: rotate_half; DeepSeek-V2: interleaved) against a direct computation:
// angle f32(position * inv_freq), cos and sin times the attention factor; positions far past the original length.
TEST(RopeYarn, ForwardWithYarnParamsMatchesDirectComputation) {
  for (const char* name : {"gpt_oss", "deepseek_v2", "partial_mscale_only"}) {
    SCOPED_TRACE(name);
    const json& c = fixture_cases().at(name);
    RopeParams params = params_from(c);
    params.interleaved = std::string(name) == "deepseek_v2";
    const float scaling = static_cast<float>(c.at("attention_factor").get<double>());
    const std::vector<float> inv_freq = floats(c.at("inv_freq_libm_pow"));
    const int64_t tokens = 6, heads = 2, head_dim = 72, half = params.rotary_dim / 2;
    const std::vector<int32_t> positions{0, 1, 4095, 4096, 70000, 131071};
    Rng rng(31);
    const Tensor x = random_tensor({tokens, heads, head_dim}, DType::F32, rng);
    Tensor y = Tensor::empty(x.shape(), DType::F32);
    rope_forward(Stream::cpu(), y, x, Tensor::from_vector(positions, {tokens}), params);

    const auto xv = x.to_vector<float>();
    std::vector<double> want(xv.begin(), xv.end());
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float angle = static_cast<float>(positions[t]) * inv_freq[i];  // f32, as HF
          const double cs = std::cos(double(angle)) * scaling, sn = std::sin(double(angle)) * scaling;
          const int64_t ia = base + (params.interleaved ? 2 * i : i);
          const int64_t ib = base + (params.interleaved ? 2 * i + 1 : i + half);
          want[ia] = xv[ia] * cs - xv[ib] * sn;
          want[ib] = xv[ib] * cs + xv[ia] * sn;
        }
      }
    }
    EXPECT_LT(testing::relative_error(y.to(DType::F64), Tensor::from_vector(want, x.shape())), 1e-6);
  }
}

TEST(RopeYarn, RejectsBadOptions) {
  YarnOptions good;
  good.factor = 32;
  good.original_max_position_embeddings = 4096;
  EXPECT_NO_THROW(rope_yarn_params(64, 150000.0, good));
  auto refused = [&](const std::function<void(YarnOptions&)>& edit, const std::string& text) {
    YarnOptions o = good;
    edit(o);
    expect_error([&] { rope_yarn_params(64, 150000.0, o); }, "rope_yarn_params: " + text);
    expect_error([&] { yarn_attention_factor(o); }, "yarn_attention_factor: " + text);
    expect_error([&] { yarn_softmax_scale(0.125, o); }, "yarn_softmax_scale: " + text);
  };
  refused([](YarnOptions& o) { o.factor = 0; }, "expected a finite YaRN factor >= 1 but found 0");
  refused([](YarnOptions& o) { o.factor = 0.5; }, "expected a finite YaRN factor >= 1 but found 0.5");
  refused([](YarnOptions& o) { o.factor = NAN; }, "expected a finite YaRN factor >= 1 but found nan");
  refused([](YarnOptions& o) { o.original_max_position_embeddings = 0; },
          "expected original_max_position_embeddings > 0 but found 0");
  refused([](YarnOptions& o) { o.original_max_position_embeddings = -4096; },
          "expected original_max_position_embeddings > 0 but found -4096");
  refused([](YarnOptions& o) { o.beta_fast = 0; }, "expected a finite beta_fast > 0 but found 0");
  refused([](YarnOptions& o) { o.beta_slow = -1; }, "expected a finite beta_slow > 0 but found -1");
  refused([](YarnOptions& o) { o.beta_slow = INFINITY; }, "expected a finite beta_slow > 0 but found inf");
  refused([](YarnOptions& o) { o.beta_fast = 0.5; }, "expected beta_fast (0.5) >= beta_slow (1)");
  refused([](YarnOptions& o) { o.mscale = -0.707; }, "expected a finite mscale >= 0 (0: absent) but found -0.707");
  refused([](YarnOptions& o) { o.mscale_all_dim = NAN; },
          "expected a finite mscale_all_dim >= 0 (0: absent) but found nan");
  refused([](YarnOptions& o) { o.attention_factor = 0.0; }, "expected a finite attention_factor > 0 but found 0");
  refused([](YarnOptions& o) { o.attention_factor = -1.5; }, "expected a finite attention_factor > 0 but found -1.5");

  expect_error([&] { rope_yarn_params(63, 150000.0, good); },
               "rope_yarn_params: expected an even rotary_dim > 0 but found 63");
  expect_error([&] { rope_yarn_params(0, 150000.0, good); },
               "rope_yarn_params: expected an even rotary_dim > 0 but found 0");
  expect_error([&] { rope_yarn_params(64, 1.0, good); },
               "rope_yarn_params: expected a finite rope theta > 1 (YaRN divides by ln theta) but found 1");
  expect_error([&] { rope_yarn_params(64, INFINITY, good); },
               "rope_yarn_params: expected a finite rope theta > 1 (YaRN divides by ln theta) but found inf");

  // Equal betas are what transformers accepts (its ramp then gets a 0.001 width).
  YarnOptions equal = good;
  equal.beta_fast = equal.beta_slow = 8;
  EXPECT_NO_THROW(rope_yarn_params(64, 150000.0, equal));
}

}  // namespace
}  // namespace moetrain::ops
