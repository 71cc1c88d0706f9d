// Tests for the strided HF pieces (model/hf_adapter.*): a de-interleaved [H, 2I] gate/up, a transposed tensor and
// experts stacked by offset land where the map says (checked element by element) and come back out bitwise; the
// tiling check refuses a gap, overlaps (contiguous and strided), pieces out of bounds and a wrong total, naming the
// parameter; the JSON form (with the MXFP4 flag) round-trips and malformed entries are refused naming their source;
// and a ParameterStore with strided pieces loads HF tensors and exports them back byte for byte.
#include "model/hf_adapter.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "model/parameter_store.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using nlohmann::json;

using moetrain::testing::error_message;

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

// 1, 2, 3, ...: every element distinct and exact in f32.
Tensor counting(const Shape& shape, float start = 1.0f) {
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + static_cast<float>(i);
  return t;
}

HfPiece block(std::string name, Shape shape, int64_t offset) {
  HfPiece piece;
  piece.hf_name = std::move(name);
  piece.hf_shape = std::move(shape);
  piece.offset = offset;
  return piece;
}

// GPT-OSS stores an expert's gate and up projections as one [H, 2I] tensor, columns interleaved (gate_i at 2i, up_i
// at 2i + 1); the engine's gate_up is [2I, H], gate rows first. Read as [H, I, 2], element (h, i, p) goes to row
// p * I + i, column h: strides {1, H, I * H}.
HfPiece deinterleaved_gate_up(std::string name, int64_t hidden, int64_t width, int64_t offset) {
  return strided_piece(std::move(name), {hidden, 2 * width}, offset, {hidden, width, 2}, {1, hidden, width * hidden});
}

constexpr int64_t kH = 3, kI = 4;

TEST(HfAdapter, DeinterleavedGateUpLandsInGateThenUpRowsAndComesBackBitwise) {
  const HfPiece piece = deinterleaved_gate_up("mlp.experts.gate_up_proj", kH, kI, 0);
  EXPECT_FALSE(piece.contiguous());
  EXPECT_EQ(piece.last_element(), 2 * kI * kH - 1);
  EXPECT_NO_THROW(check_pieces_tile({piece}, {2 * kI, kH}, "experts.gate_up"));
  const Tensor hf = counting({kH, 2 * kI});
  Tensor whole = Tensor::zeros({2 * kI, kH}, DType::F32);
  place_piece(whole, piece, hf);
  const float* w = whole.data<float>();
  const float* v = hf.data<float>();
  for (int64_t h = 0; h < kH; ++h) {
    for (int64_t i = 0; i < kI; ++i) {
      EXPECT_EQ(w[i * kH + h], v[h * 2 * kI + 2 * i]) << "gate row " << i << ", column " << h;
      EXPECT_EQ(w[(kI + i) * kH + h], v[h * 2 * kI + 2 * i + 1]) << "up row " << i << ", column " << h;
    }
  }
  const Tensor back = extract_piece(whole, piece);
  EXPECT_EQ(back.shape(), (Shape{kH, 2 * kI}));
  EXPECT_EQ(back.to_vector<float>(), hf.to_vector<float>());
}

TEST(HfAdapter, TransposedPieceLandsTransposedAndComesBackBitwise) {
  // HF [5, 3] into an internal [3, 5]: HF (a, b) is internal (b, a).
  const HfPiece piece = strided_piece("o_proj.weight", {5, 3}, 0, {5, 3}, {1, 5});
  EXPECT_NO_THROW(check_pieces_tile({piece}, {3, 5}, "o_proj"));
  const Tensor hf = counting({5, 3});
  Tensor whole = Tensor::zeros({3, 5}, DType::F32);
  place_piece(whole, piece, hf);
  for (int64_t a = 0; a < 5; ++a)
    for (int64_t b = 0; b < 3; ++b) EXPECT_EQ(whole.data<float>()[b * 5 + a], hf.data<float>()[a * 3 + b]);
  EXPECT_EQ(extract_piece(whole, piece).to_vector<float>(), hf.to_vector<float>());
}

// Three experts' de-interleaved gate/up stacked into [E, 2I, H] by offsets, and beside it the contiguous case
// (Qwen's gate and up [I, H] blocks per expert); every piece round-trips and lands in its expert's slab only.
TEST(HfAdapter, StackedPiecesLandInTheirExpertsSlabs) {
  const int64_t experts = 3, slab = 2 * kI * kH;
  std::vector<HfPiece> strided, contiguous;
  for (int64_t e = 0; e < experts; ++e) {
    strided.push_back(deinterleaved_gate_up("experts." + std::to_string(e) + ".gate_up", kH, kI, e * slab));
    contiguous.push_back(block("experts." + std::to_string(e) + ".gate", {kI, kH}, e * slab));
    contiguous.push_back(block("experts." + std::to_string(e) + ".up", {kI, kH}, e * slab + kI * kH));
  }
  const Shape shape{experts, 2 * kI, kH};
  EXPECT_NO_THROW(check_pieces_tile(strided, shape, "experts.gate_up"));
  EXPECT_NO_THROW(check_pieces_tile(contiguous, shape, "experts.gate_up"));

  Tensor from_strided = Tensor::zeros(shape, DType::F32), from_contiguous = Tensor::zeros(shape, DType::F32);
  std::vector<Tensor> hf_strided, hf_contiguous;
  for (int64_t e = 0; e < experts; ++e) {
    hf_strided.push_back(counting({kH, 2 * kI}, 1000.0f * float(e + 1)));
    place_piece(from_strided, strided[size_t(e)], hf_strided.back());
    // The same values as gate [I, H] and up [I, H] blocks, written out here from the interleaved tensor.
    Tensor gate = Tensor::empty({kI, kH}, DType::F32), up = Tensor::empty({kI, kH}, DType::F32);
    for (int64_t i = 0; i < kI; ++i) {
      for (int64_t h = 0; h < kH; ++h) {
        gate.data<float>()[i * kH + h] = hf_strided.back().data<float>()[h * 2 * kI + 2 * i];
        up.data<float>()[i * kH + h] = hf_strided.back().data<float>()[h * 2 * kI + 2 * i + 1];
      }
    }
    place_piece(from_contiguous, contiguous[size_t(2 * e)], gate);
    place_piece(from_contiguous, contiguous[size_t(2 * e + 1)], up);
    hf_contiguous.push_back(gate);
    hf_contiguous.push_back(up);
  }
  // Both layouts describe the same internal tensor, and expert e's slab holds expert e's values (1000 (e + 1) + ...).
  EXPECT_EQ(from_strided.to_vector<float>(), from_contiguous.to_vector<float>());
  for (int64_t e = 0; e < experts; ++e) {
    for (float v : from_strided.select(e).clone().to_vector<float>()) {
      EXPECT_GE(v, 1000.0f * float(e + 1));
      EXPECT_LT(v, 1000.0f * float(e + 1) + float(slab));
    }
    EXPECT_EQ(extract_piece(from_strided, strided[size_t(e)]).to_vector<float>(),
              hf_strided[size_t(e)].to_vector<float>());
  }
  for (size_t p = 0; p < contiguous.size(); ++p)
    EXPECT_EQ(extract_piece(from_strided, contiguous[p]).to_vector<float>(), hf_contiguous[p].to_vector<float>());
}

// ---- check_pieces_tile: every refusal names the parameter. ----

TEST(HfAdapterTiling, RefusesAGapBetweenContiguousPieces) {
  // [0, 2), [3, 5), [4, 8) of 8: the total is right, element 2 is missing (and 4 covered twice).
  const std::string m = error_message([] {
    check_pieces_tile({block("a", {2}, 0), block("b", {2}, 3), block("c", {4}, 4)}, {8}, "layers.0.w");
  });
  EXPECT_TRUE(contains(m, "pieces of 'layers.0.w' leave a gap or overlap at element 2")) << m;
}

TEST(HfAdapterTiling, RefusesOverlappingContiguousPieces) {
  // [0, 4), [3, 7) of 8: the total is right, element 3 covered twice (and 7 missing).
  const std::string m = error_message([] {
    check_pieces_tile({block("a", {4}, 0), block("b", {2, 2}, 3)}, {2, 4}, "layers.0.w");
  });
  EXPECT_TRUE(contains(m, "pieces of 'layers.0.w' leave a gap or overlap at element 3")) << m;
}

TEST(HfAdapterTiling, RefusesOverlappingStridedPieces) {
  // Columns {0, 1} and {1, 2} of a [4, 4]: 16 elements in all, column 1 twice (first at element 1).
  const std::string m = error_message([] {
    check_pieces_tile(
        {strided_piece("left", {4, 2}, 0, {4, 2}, {4, 1}), strided_piece("right", {4, 2}, 1, {4, 2}, {4, 1})}, {4, 4},
        "layers.1.experts.gate_up");
  });
  EXPECT_TRUE(contains(m, "pieces of 'layers.1.experts.gate_up' overlap at element 1 (in 'right')")) << m;
}

TEST(HfAdapterTiling, RefusesAStridedPieceOverlappingAContiguousOne) {
  const std::string m = error_message([] {
    check_pieces_tile({block("rows", {2, 4}, 0), strided_piece("column", {4, 2}, 0, {4, 2}, {4, 1})}, {4, 4}, "mix");
  });
  EXPECT_TRUE(contains(m, "pieces of 'mix' overlap at element 0 (in 'column')")) << m;
}

TEST(HfAdapterTiling, RefusesPiecesOutOfBounds) {
  std::string m = error_message([] {
    check_pieces_tile({block("a", {4}, 0), block("b", {4}, 5)}, {8}, "w.contiguous");
  });
  EXPECT_TRUE(contains(m, "piece 'b' of 'w.contiguous' spans elements [5, 8] outside its 8 elements")) << m;
  m = error_message([] { check_pieces_tile({block("a", {8}, -1)}, {8}, "w.negative"); });
  EXPECT_TRUE(contains(m, "piece 'a' of 'w.negative' spans elements [-1, 6] outside its 8 elements")) << m;
  // Rows of a [4, 4] viewed from element 3: the last element is 3 + 3 * 4 + 1 * 1 = 16.
  m = error_message([] { check_pieces_tile({strided_piece("s", {4, 2}, 3, {4, 2}, {4, 1})}, {4, 4}, "w.strided"); });
  EXPECT_TRUE(contains(m, "piece 's' of 'w.strided' spans elements [3, 16] outside its 16 elements")) << m;
}

TEST(HfAdapterTiling, RefusesAWrongTotal) {
  std::string m = error_message([] { check_pieces_tile({block("a", {4}, 0)}, {2, 4}, "w.short"); });
  EXPECT_TRUE(contains(m, "pieces of 'w.short' cover 4 elements but it has 8")) << m;
  m = error_message([] { check_pieces_tile({}, {3}, "w.none"); });
  EXPECT_TRUE(contains(m, "pieces of 'w.none' cover 0 elements but it has 3")) << m;
}

TEST(HfAdapterTiling, StridedPieceRefusesAViewOfOtherElementsAndNonPositiveStrides) {
  std::string m = error_message([] { strided_piece("gate_up", {3, 8}, 0, {3, 4, 3}, {1, 3, 12}); });
  EXPECT_TRUE(contains(m, "piece 'gate_up' of shape [3, 8] viewed as [3, 4, 3] with 3 strides")) << m;
  m = error_message([] { strided_piece("gate_up", {3, 8}, 0, {3, 4, 2}, {1, 3}); });
  EXPECT_TRUE(contains(m, "piece 'gate_up' of shape [3, 8] viewed as [3, 4, 2] with 2 strides")) << m;
  m = error_message([] { strided_piece("gate_up", {3, 8}, 0, {3, 4, 2}, {1, 0, 12}); });
  EXPECT_TRUE(contains(m, "piece 'gate_up' has a stride 0")) << m;
}

TEST(HfAdapter, PlacePieceRefusesATensorOfAnotherShape) {
  Tensor whole = Tensor::zeros({2 * kI, kH}, DType::F32);
  const HfPiece piece = deinterleaved_gate_up("experts.0.gate_up_proj", kH, kI, 0);
  const std::string m = error_message([&] { place_piece(whole, piece, counting({2 * kI, kH})); });
  EXPECT_TRUE(contains(m, "tensor 'experts.0.gate_up_proj' is f32[8, 3]")) << m;
}

// ---- JSON ----

TEST(HfAdapterJson, ContiguousAndStridedPiecesRoundTrip) {
  const HfPiece contiguous = block("model.layers.0.mlp.up_proj.weight", {4, 3}, 12);
  const HfPiece strided = deinterleaved_gate_up("model.layers.0.mlp.experts.gate_up_proj", kH, kI, 24);
  EXPECT_EQ(piece_to_json(contiguous), json::parse(R"(["model.layers.0.mlp.up_proj.weight", [4, 3], 12])"));
  EXPECT_EQ(piece_to_json(strided),
            json::parse(R"(["model.layers.0.mlp.experts.gate_up_proj", [3, 8], 24, [3, 4, 2], [1, 3, 12]])"));
  for (const HfPiece& piece : {contiguous, strided}) {
    const HfPiece back = piece_from_json(json::parse(piece_to_json(piece).dump()), "layout.json");
    EXPECT_EQ(back.hf_name, piece.hf_name);
    EXPECT_EQ(back.hf_shape, piece.hf_shape);
    EXPECT_EQ(back.offset, piece.offset);
    EXPECT_EQ(back.view_shape, piece.view_shape);
    EXPECT_EQ(back.strides, piece.strides);
    EXPECT_EQ(back.contiguous(), piece.contiguous());
    EXPECT_FALSE(back.mxfp4_transposed);
  }
}

// GPT-OSS's experts come MXFP4-packed with their last two dims swapped: the flag rides after the map.
TEST(HfAdapterJson, Mxfp4TransposedFlagRoundTrips) {
  HfPiece contiguous = block("model.layers.0.mlp.experts.down_proj", {2, 32, 64}, 0);
  contiguous.mxfp4_transposed = true;
  HfPiece strided = deinterleaved_gate_up("model.layers.0.mlp.experts.gate_up_proj", kH, kI, 24);
  strided.mxfp4_transposed = true;
  EXPECT_EQ(piece_to_json(contiguous),
            json::parse(R"(["model.layers.0.mlp.experts.down_proj", [2, 32, 64], 0, {"mxfp4_transposed": true}])"));
  EXPECT_EQ(piece_to_json(strided), json::parse(R"(["model.layers.0.mlp.experts.gate_up_proj", [3, 8], 24, [3, 4, 2],
                                                    [1, 3, 12], {"mxfp4_transposed": true}])"));
  for (const HfPiece& piece : {contiguous, strided}) {
    const HfPiece back = piece_from_json(json::parse(piece_to_json(piece).dump()), "layout.json");
    EXPECT_EQ(back.hf_name, piece.hf_name);
    EXPECT_EQ(back.hf_shape, piece.hf_shape);
    EXPECT_EQ(back.offset, piece.offset);
    EXPECT_EQ(back.view_shape, piece.view_shape);
    EXPECT_EQ(back.strides, piece.strides);
    EXPECT_TRUE(back.mxfp4_transposed);
  }
  EXPECT_FALSE(piece_from_json(json::parse(R"(["w", [2, 3], 0, {"mxfp4_transposed": false}])"), "l").mxfp4_transposed);
}

TEST(HfAdapterJson, RefusesMalformedEntriesNamingTheSource) {
  const std::string source = "ckpt/step_10/layout.json";
  const std::vector<std::pair<std::string, std::string>> cases{
      {R"({"name": "w"})", "an HF piece must be [name, shape, offset]"},
      {R"(["w", [2, 3]])", "an HF piece must be [name, shape, offset]"},
      {R"(["w", [2, 3], 0, [2, 3]])", "an HF piece must be [name, shape, offset]"},
      {R"([7, [2, 3], 0])", "malformed HF piece"},
      {R"(["w", "2x3", 0])", "malformed HF piece"},
      {R"(["w", [2, 3], "zero"])", "malformed HF piece"},
      {R"(["w", [2, 3], 0, [2, 3], "strides"])", "malformed HF piece"},
      {R"(["w", [2, -3], 0])", "HF piece 'w' has a negative size"},
      {R"(["w", [2, 3], 0, {"transposed": true}])", "HF piece 'w' has an unknown flag 'transposed'"},
      {R"(["w", [2, 3], 0, {"mxfp4_transposed": 1}])", "malformed HF piece"},
      {R"(["w", [2, 3], {"mxfp4_transposed": true}])", "an HF piece must be [name, shape, offset]"},
      {R"(["w", [2, 3], 0, [2, 3], {"mxfp4_transposed": true}])", "an HF piece must be [name, shape, offset]"},
  };
  for (const auto& [text, expected] : cases) {
    const std::string m = error_message([&] { piece_from_json(json::parse(text), source); });
    EXPECT_TRUE(contains(m, source + ": ") && contains(m, expected)) << text << " -> " << m;
  }
}

// A strided entry that parses but whose map is wrong is refused like one whose types are wrong: naming the file.
TEST(HfAdapterJson, RefusesAnInconsistentStridedMapNamingTheSource) {
  const std::string source = "ckpt/step_10/layout.json";
  for (const char* text : {R"(["w", [2, 3], 0, [4, 2], [1, 1]])", R"(["w", [2, 3], 0, [2, 3], [0, 1]])"}) {
    const std::string m = error_message([&] { piece_from_json(json::parse(text), source); });
    EXPECT_TRUE(contains(m, source)) << text << " -> " << m;
  }
}

// Issue 20 (checkpoint_shards fuzz target): a piece's span [offset, last_element()] must be exact for the bound checks
// of its readers: a negative offset or view extent, or a span past int64, is refused by name.
TEST(HfAdapterJson, RefusesPiecesWhoseSpanIsNotExact) {
  const std::string source = "ckpt/step_10/shards.json";
  const std::vector<std::pair<std::string, std::string>> cases{
      {R"(["w", [3], -1])", "HF piece 'w' has the offset -1, expected >= 0"},
      // view [-1, -1, 4] holds 4 elements like [4], but last_element() would say 2996 while element 3000 is read.
      {R"(["w", [4], 0, [-1, -1, 4], [1, 1, 1000]])", "HF piece 'w' has a negative view size"},
      {R"(["w", [4], 9223372036854775806])", "spans elements past 2^63"},
      {R"(["w", [3], 9223372036854775806])", "spans elements past 2^63"},
      // A fuzzer finding: nlohmann's get<int64_t> of this double (it is past uint64) is undefined behaviour.
      {R"(["w", [3], 922337666666626854775806])", "its offset is 9.223376666666269e+23, expected an integer in int64"},
      {R"(["w", [3], 1.5])", "its offset is 1.5, expected an integer in int64"},
      {R"(["w", [3], 9223372036854775808])", "its offset is 9223372036854775808, expected an integer in int64"},
      {R"(["w", [3.0], 0])", "its shape is 3.0, expected an integer in int64"},
      {R"(["w", [4], 0, [2, 2], [2, 1e30]])", "its strides is 1e+30, expected an integer in int64"},
      {R"(["w", [2, 2], 0, [2, 2], [4611686018427387904, 4611686018427387904]])", "spans elements past 2^63"},
  };
  for (const auto& [text, expected] : cases) {
    const std::string m = error_message([&] { piece_from_json(json::parse(text), source); });
    EXPECT_TRUE(contains(m, source + ": ") && contains(m, expected)) << text << " -> " << m;
  }
  // The last element exactly at 2^63 - 1 is accepted, and last_element() reaches it without wrapping (a fuzzer
  // finding: offset + numel() passed int64 before the - 1).
  const HfPiece edge = piece_from_json(json::parse(R"(["w", [2], 9223372036854775806])"), source);
  EXPECT_EQ(edge.last_element(), INT64_MAX);
}

// ---- A parameter store with strided pieces. ----

std::vector<ParamSpec> strided_specs(int64_t experts) {
  std::vector<ParamSpec> specs;
  ParamSpec gate_up;
  gate_up.name = "layers.0.experts.gate_up";
  gate_up.shape = {experts, 2 * kI, kH};
  gate_up.role = ParamRole::ExpertBank;
  gate_up.layer = 0;
  for (int64_t e = 0; e < experts; ++e)
    gate_up.pieces.push_back(deinterleaved_gate_up("model.layers.0.mlp.experts." + std::to_string(e) + ".gate_up_proj",
                                                   kH, kI, e * 2 * kI * kH));
  specs.push_back(gate_up);
  ParamSpec o_proj;
  o_proj.name = "layers.0.attn.o_proj";
  o_proj.shape = {3, 5};
  o_proj.layer = 0;
  o_proj.pieces.push_back(strided_piece("model.layers.0.self_attn.o_proj.weight", {5, 3}, 0, {5, 3}, {1, 5}));
  specs.push_back(o_proj);
  specs.push_back(single_piece_spec("final_norm", {kH}, ParamRole::Norm, -1, "model.norm.weight"));
  return specs;
}

TEST(HfAdapterStore, LoadsStridedPiecesAndExportsThemBackIdentically) {
  const int64_t experts = 2;
  ParameterStore store(strided_specs(experts));
  Rng rng(61);
  std::vector<std::pair<std::string, Tensor>> hf;
  for (int64_t e = 0; e < experts; ++e)
    hf.emplace_back("model.layers.0.mlp.experts." + std::to_string(e) + ".gate_up_proj",
                    testing::random_tensor({kH, 2 * kI}, DType::F32, rng));
  hf.emplace_back("model.layers.0.self_attn.o_proj.weight", testing::random_tensor({5, 3}, DType::F32, rng));
  hf.emplace_back("model.norm.weight", testing::random_tensor({kH}, DType::F32, rng));
  // Given in another order than the specs': loading goes by name.
  std::vector<std::pair<std::string, Tensor>> shuffled(hf.rbegin(), hf.rend());
  store.load_hf_tensors(shuffled);

  // Where the values landed, written out from the maps' meaning.
  const Tensor gate_up = store.param("layers.0.experts.gate_up");
  for (int64_t e = 0; e < experts; ++e) {
    const float* v = hf[size_t(e)].second.data<float>();
    const float* w = gate_up.data<float>() + e * 2 * kI * kH;
    for (int64_t h = 0; h < kH; ++h) {
      for (int64_t i = 0; i < kI; ++i) {
        ASSERT_EQ(w[i * kH + h], v[h * 2 * kI + 2 * i]);
        ASSERT_EQ(w[(kI + i) * kH + h], v[h * 2 * kI + 2 * i + 1]);
      }
    }
  }
  const float* o_hf = hf[size_t(experts)].second.data<float>();
  const Tensor o_proj = store.param("layers.0.attn.o_proj");
  for (int64_t a = 0; a < 5; ++a)
    for (int64_t b = 0; b < 3; ++b) ASSERT_EQ(o_proj.data<float>()[b * 5 + a], o_hf[a * 3 + b]);

  const auto expect_exported = [&](const std::vector<std::pair<std::string, Tensor>>& exported) {
    ASSERT_EQ(exported.size(), hf.size());
    for (size_t i = 0; i < hf.size(); ++i) {  // in spec order, each the tensor that was given
      EXPECT_EQ(exported[i].first, hf[i].first);
      EXPECT_EQ(exported[i].second.shape(), hf[i].second.shape()) << hf[i].first;
      EXPECT_EQ(exported[i].second.to_vector<float>(), hf[i].second.to_vector<float>()) << hf[i].first;
    }
  };
  expect_exported(store.export_hf());
  // Gradients go out through the same maps.
  for (const ParamSpec& spec : store.specs()) store.grad(spec.name).copy_from(store.param(spec.name));
  expect_exported(store.export_hf(/*of_grads=*/true));
}

TEST(HfAdapterStore, LoadsABf16TensorIntoAStridedPieceByConverting) {
  ParameterStore store(strided_specs(1));
  Rng rng(62);
  const Tensor gate_up = testing::random_tensor({kH, 2 * kI}, DType::F32, rng).to(DType::BF16);
  store.load_hf_tensors({{"model.layers.0.mlp.experts.0.gate_up_proj", gate_up},
                         {"model.layers.0.self_attn.o_proj.weight", Tensor::zeros({5, 3}, DType::F32)},
                         {"model.norm.weight", Tensor::zeros({kH}, DType::F32)}});
  const auto exported = store.export_hf();
  EXPECT_EQ(exported[0].second.to_vector<float>(), gate_up.to(DType::F32).to_vector<float>());
}

TEST(HfAdapterStore, RefusesAStridedPieceGivenInItsInternalShape) {
  ParameterStore store(strided_specs(1));
  const std::string m = error_message([&] {
    store.load_hf_tensors({{"model.layers.0.mlp.experts.0.gate_up_proj", Tensor::zeros({2 * kI, kH}, DType::F32)},
                           {"model.layers.0.self_attn.o_proj.weight", Tensor::zeros({5, 3}, DType::F32)},
                           {"model.norm.weight", Tensor::zeros({kH}, DType::F32)}});
  });
  EXPECT_TRUE(
      contains(m, "tensor 'model.layers.0.mlp.experts.0.gate_up_proj' has shape [8, 3] but the config implies [3, 8]"))
      << m;
}

TEST(HfAdapterStore, RefusesSpecsWhosePiecesDoNotTileNamingTheParameter) {
  std::vector<ParamSpec> specs = strided_specs(2);
  specs[0].pieces.pop_back();
  const std::string m = error_message([&] { ParameterStore store(specs); });
  EXPECT_TRUE(contains(m, "pieces of 'layers.0.experts.gate_up' cover 24 elements but it has 48")) << m;
}

}  // namespace
}  // namespace moetrain::model
