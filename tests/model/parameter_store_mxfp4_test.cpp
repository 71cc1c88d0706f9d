// Tests for ParameterStore loading pieces given as MXFP4 pairs (X_blocks + X_scales, io/mxfp4.h), as GPT-OSS's
// released checkpoints give their experts: the parameters equal those loaded from the decoded tensor (f32 or bf16,
// in memory or from a safetensors file), transposed or not as the piece says, and export gives the decoded tensor
// under X; half a pair, wrong shapes and dtypes, a NaN scale, a piece that cannot be packed and X given twice over
// are listed together, before any byte is copied.
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "io/mxfp4.h"
#include "io/safetensors.h"
#include "model/parameter_store.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using Named = std::vector<std::pair<std::string, Tensor>>;

using moetrain::testing::error_message;

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

constexpr int64_t kE = 2, kH = 64, kI = 32;
const std::string kGateUp = "model.layers.0.mlp.experts.gate_up_proj";  // [E, H, 2I], packed along H
const std::string kDown = "model.layers.0.mlp.experts.down_proj";       // [E, I, H], packed along I
const std::string kProj = "model.layers.0.mlp.proj.weight";             // [I, H], packed along H, not transposed
const std::string kBias = "model.layers.0.mlp.router.bias";             // [E]: cannot be packed

// GPT-OSS's shapes in miniature: the expert banks in the engine's layout ([E, 2I, H] gate rows then up rows, [E, H,
// I]) behind the HF tensors transformers holds (gate_up columns interleaved, both transposed), packed transposed.
std::vector<ParamSpec> specs() {
  std::vector<ParamSpec> out;
  ParamSpec gate_up;
  gate_up.name = "layers.0.experts.gate_up";
  gate_up.shape = {kE, 2 * kI, kH};
  gate_up.role = ParamRole::ExpertBank;
  gate_up.layer = 0;
  // HF (e, h, i, p) -> internal (e, p * I + i, h).
  HfPiece gu = strided_piece(kGateUp, {kE, kH, 2 * kI}, 0, {kE, kH, kI, 2}, {2 * kI * kH, 1, kH, kI * kH});
  gu.mxfp4_transposed = true;
  gate_up.pieces.push_back(gu);
  out.push_back(gate_up);
  ParamSpec down;
  down.name = "layers.0.experts.down";
  down.shape = {kE, kH, kI};
  down.role = ParamRole::ExpertBank;
  down.layer = 0;
  HfPiece dp = strided_piece(kDown, {kE, kI, kH}, 0, {kE, kI, kH}, {kH * kI, 1, kI});  // HF (e, i, h) -> (e, h, i)
  dp.mxfp4_transposed = true;
  down.pieces.push_back(dp);
  out.push_back(down);
  out.push_back(single_piece_spec("layers.0.mlp.proj", {kI, kH}, ParamRole::Dense, 0, kProj));
  out.push_back(single_piece_spec("layers.0.router.bias", {kE}, ParamRole::Router, 0, kBias));
  return out;
}

// Random blocks (every byte value) and scales near 127 (finite values, as checkpoints hold).
std::pair<Tensor, Tensor> random_pair(const Shape& blocks_shape, uint64_t seed) {
  Rng rng(seed);
  Tensor blocks = Tensor::empty(blocks_shape, DType::U8);
  for (int64_t i = 0; i < blocks.numel(); ++i) blocks.data<uint8_t>()[i] = static_cast<uint8_t>(rng.next_u64() & 255);
  Tensor scales = Tensor::empty(Shape(blocks_shape.begin(), blocks_shape.end() - 1), DType::U8);
  for (int64_t i = 0; i < scales.numel(); ++i)
    scales.data<uint8_t>()[i] = static_cast<uint8_t>(118 + rng.next_u64() % 20);
  return {blocks, scales};
}

struct Checkpoint {
  Named packed;   // gate_up, down and proj as MXFP4 pairs
  Named decoded;  // the same tensors decoded (f32)
};

Checkpoint checkpoint() {
  Checkpoint c;
  const auto [gub, gus] = random_pair({kE, 2 * kI, kH / 32, 16}, 1);
  const auto [db, ds] = random_pair({kE, kH, kI / 32, 16}, 2);
  const auto [pb, ps] = random_pair({kI, kH / 32, 16}, 3);
  c.packed = {{kGateUp + "_blocks", gub}, {kGateUp + "_scales", gus}, {kDown + "_blocks", db},
              {kDown + "_scales", ds},    {kProj + "_blocks", pb},    {kProj + "_scales", ps}};
  c.decoded = {{kGateUp, io::dequantize_mxfp4_transposed(gub, gus)},
               {kDown, io::dequantize_mxfp4_transposed(db, ds)},
               {kProj, io::dequantize_mxfp4(pb, ps)}};
  Rng rng(4);
  const Tensor bias = testing::random_tensor({kE}, DType::F32, rng);
  c.packed.emplace_back(kBias, bias);
  c.decoded.emplace_back(kBias, bias);
  return c;
}

void expect_same_params(const ParameterStore& a, const ParameterStore& b) {
  for (const ParamSpec& spec : a.specs())
    EXPECT_EQ(a.param(spec.name).to_vector<float>(), b.param(spec.name).to_vector<float>()) << spec.name;
}

Named with(Named tensors, const std::string& name, const Tensor& value) {
  for (auto& [n, t] : tensors)
    if (n == name) t = value;
  return tensors;
}

Named without(Named tensors, const std::string& name) {
  std::erase_if(tensors, [&](const auto& t) { return t.first == name; });
  return tensors;
}

TEST(ParameterStoreMxfp4, LoadsPairsLikeTheirDecodedTensors) {
  const Checkpoint c = checkpoint();
  ParameterStore packed(specs()), decoded(specs()), bf16(specs());
  packed.load_hf_tensors(c.packed);
  decoded.load_hf_tensors(c.decoded);
  expect_same_params(packed, decoded);
  // The decoded values are exact in bf16 (at most 2 significant bits): a bf16 checkpoint of them loads the same.
  Named as_bf16 = c.decoded;
  for (auto& [name, t] : as_bf16)
    if (name != kBias) t = t.to(DType::BF16);
  bf16.load_hf_tensors(as_bf16);
  expect_same_params(packed, bf16);

  // The transposed decode lands as the strided map says: HF gate_up (e, h, 2i + p) is internal (e, p * I + i, h).
  const float* hf = c.decoded[0].second.data<float>();
  const float* w = packed.param("layers.0.experts.gate_up").data<float>();
  for (int64_t e = 0; e < kE; ++e)
    for (int64_t h = 0; h < kH; ++h)
      for (int64_t i = 0; i < kI; ++i)
        for (int64_t p = 0; p < 2; ++p)
          ASSERT_EQ(w[(e * 2 * kI + p * kI + i) * kH + h], hf[(e * kH + h) * 2 * kI + 2 * i + p]);
  // Export writes the decoded tensors under their own names.
  const auto exported = packed.export_hf();
  ASSERT_EQ(exported.size(), c.decoded.size());
  for (size_t i = 0; i < exported.size(); ++i) {
    EXPECT_EQ(exported[i].first, c.decoded[i].first);
    EXPECT_EQ(exported[i].second.to_vector<float>(), c.decoded[i].second.to_vector<float>()) << exported[i].first;
  }
}

// Through a safetensors file: the u8 tensors are views into the mapping.
TEST(ParameterStoreMxfp4, LoadsPairsFromASafetensorsFile) {
  const Checkpoint c = checkpoint();
  const std::string path = testing::make_temp_dir("mxfp4_store") + "/model.safetensors";
  io::write_safetensors(path, c.packed);
  ParameterStore from_file(specs()), decoded(specs());
  from_file.load_hf(io::SafetensorsReader::open(path));
  decoded.load_hf_tensors(c.decoded);
  expect_same_params(from_file, decoded);
}

// Every problem at once, and no parameter touched: the store keeps its values.
TEST(ParameterStoreMxfp4, ListsEveryPairProblemBeforeCopyingAnything) {
  const Checkpoint c = checkpoint();
  Named bad = without(c.packed, kGateUp + "_scales");                                   // half a pair
  bad = with(bad, kDown + "_blocks", Tensor::zeros({kE, kI, kH / 32, 16}, DType::U8));  // not transposed
  bad = with(bad, kDown + "_scales", Tensor::zeros({kE, kI, kH / 32}, DType::U8));      // likewise
  bad = with(bad, kProj + "_blocks", Tensor::zeros({kI, kH / 32, 16}, DType::F32));     // not u8
  bad = with(bad, kProj + "_scales", Tensor::zeros({kI, kH / 32}, DType::I8));          // not u8
  bad = without(bad, kBias);
  bad.emplace_back(kBias + "_blocks", Tensor::zeros({1, 16}, DType::U8));  // [E] = [2] cannot be packed
  bad.emplace_back(kBias + "_scales", Tensor::zeros({1}, DType::U8));
  bad.emplace_back("model.layers.0.mlp.other_blocks", Tensor::zeros({1, 16}, DType::U8));  // no such piece

  ParameterStore store(specs());
  store.init_random(9, 0.1);
  const std::vector<float> before = store.param("layers.0.experts.gate_up").to_vector<float>();
  const std::string m = error_message([&] { store.load_hf_tensors(bad); });
  EXPECT_TRUE(contains(m, "model weights: 7 problem(s)")) << m;
  EXPECT_TRUE(contains(
      m, "missing tensor '" + kGateUp + "_scales' (the MXFP4 scales of '" + kGateUp + "', expected u8 [2, 64, 2])"))
      << m;
  EXPECT_TRUE(contains(m, "tensor '" + kDown +
                              "_blocks' has shape [2, 32, 2, 16] but the config implies [2, 64, 1, 16] "
                              "(the MXFP4 blocks of '" +
                              kDown + "' [2, 32, 64])"))
      << m;
  EXPECT_TRUE(contains(m, "tensor '" + kDown + "_scales' has shape [2, 32, 2] but the config implies [2, 64, 1]")) << m;
  EXPECT_TRUE(contains(
      m, "tensor '" + kProj + "_blocks' has dtype f32 but u8 was expected (the MXFP4 blocks of '" + kProj + "')"))
      << m;
  EXPECT_TRUE(contains(m, "tensor '" + kProj + "_scales' has dtype i8 but u8 was expected")) << m;
  EXPECT_TRUE(contains(m, "tensor '" + kBias + "' (shape [2]) is given as an MXFP4 pair ('" + kBias + "_blocks' / '" +
                              kBias + "_scales') but cannot be one: its packed dim (2) is not a multiple of 32"))
      << m;
  EXPECT_TRUE(contains(m, "unexpected tensor 'model.layers.0.mlp.other_blocks'")) << m;
  EXPECT_FALSE(contains(m, "unexpected tensor '" + kDown)) << m;
  EXPECT_EQ(store.param("layers.0.experts.gate_up").to_vector<float>(), before);
}

TEST(ParameterStoreMxfp4, RefusesATensorGivenBothWholeAndAsAPair) {
  const Checkpoint c = checkpoint();
  Named both = c.packed;
  both.emplace_back(kDown, c.decoded[1].second);
  ParameterStore store(specs());
  const std::string m = error_message([&] { store.load_hf_tensors(both); });
  EXPECT_TRUE(
      contains(m, "tensor '" + kDown + "' is given both whole and as MXFP4 ('" + kDown + "_blocks'): keep one of them"))
      << m;
  EXPECT_TRUE(contains(m, "1 problem(s)")) << m;  // the pair is neither unexpected nor checked as well
  // Whole beside a lone scales tensor: the same.
  Named lone = c.decoded;
  lone.emplace_back(kProj + "_scales", Tensor::zeros({kI, kH / 32}, DType::U8));
  const std::string l = error_message([&] { store.load_hf_tensors(lone); });
  EXPECT_TRUE(contains(l, "tensor '" + kProj + "' is given both whole and as MXFP4 ('" + kProj + "_scales')")) << l;
}

TEST(ParameterStoreMxfp4, RefusesAnE8m0NanScaleNamingTheTensor) {
  const Checkpoint c = checkpoint();
  Tensor scales = c.packed[3].second.clone();  // down_proj_scales [2, 64, 1]
  ASSERT_EQ(scales.shape(), (Shape{kE, kH, 1}));
  scales.data<uint8_t>()[kH + 5] = 255;
  ParameterStore store(specs());
  const std::string m = error_message([&] { store.load_hf_tensors(with(c.packed, kDown + "_scales", scales)); });
  EXPECT_TRUE(contains(m, "tensor '" + kDown + "_scales': scale [1, 5, 0] is 255, e8m0's NaN: refused")) << m;
}

TEST(ParameterStoreMxfp4, MissingPieceStillNamesTheWholeTensor) {
  const Checkpoint c = checkpoint();
  ParameterStore store(specs());
  const Named none = without(without(c.packed, kDown + "_blocks"), kDown + "_scales");
  const std::string m = error_message([&] { store.load_hf_tensors(none); });
  EXPECT_TRUE(contains(m, "missing tensor '" + kDown + "' (expected shape [2, 32, 64])")) << m;
}

}  // namespace
}  // namespace moetrain::model
