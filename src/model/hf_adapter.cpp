// defines: the strided placement of HF tensors inside internal parameters (hf_adapter.h).
#include "model/hf_adapter.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetrain::model {

namespace {

// Calls visit(view_index_linear, internal_element) for every element of a strided piece, in row-major order.
template <class Visit>
void for_each_element(const HfPiece& piece, Visit&& visit) {
  const Shape& shape = piece.view_shape;
  const size_t dims = shape.size();
  std::vector<int64_t> index(dims, 0);
  const int64_t n = piece.numel();
  int64_t at = piece.offset;
  for (int64_t linear = 0; linear < n; ++linear) {
    visit(linear, at);
    for (size_t d = dims; d-- > 0;) {  // odometer: the last dimension moves fastest
      if (++index[d] < shape[d]) {
        at += piece.strides[d];
        break;
      }
      at -= (shape[d] - 1) * piece.strides[d];
      index[d] = 0;
    }
  }
}

// The integers of an HF piece's JSON: integers in int64 only (nlohmann's get<int64_t> truncates a float, and one
// outside int64's range is undefined behaviour).
int64_t json_int64(const nlohmann::json& value, const std::string& what) {
  MT_CHECK(value.is_number_integer() && (!value.is_number_unsigned() || value.get<uint64_t>() <= uint64_t{INT64_MAX}),
           "{} is {}, expected an integer in int64", what, value.dump().substr(0, 40));
  return value.get<int64_t>();
}

std::vector<int64_t> json_int64_list(const nlohmann::json& value, const std::string& what) {
  MT_CHECK(value.is_array(), "{} is {}, expected a list of integers", what, value.dump().substr(0, 40));
  std::vector<int64_t> out;
  for (const nlohmann::json& item : value) out.push_back(json_int64(item, what));
  return out;
}

}  // namespace

int64_t HfPiece::last_element() const {
  if (contiguous()) return offset + (numel() - 1);  // offset + numel() alone may pass int64 when the last does not
  int64_t last = offset;
  for (size_t d = 0; d < view_shape.size(); ++d) last += (view_shape[d] - 1) * strides[d];
  return last;
}

HfPiece strided_piece(std::string hf_name, Shape hf_shape, int64_t offset, Shape view_shape,
                      std::vector<int64_t> strides) {
  MT_CHECK(shape_numel(view_shape) == shape_numel(hf_shape) && view_shape.size() == strides.size(),
           "HF adapter: piece '{}' of shape {} viewed as {} with {} strides: the view must hold the same elements and "
           "name one stride per dimension",
           hf_name, shape_str(hf_shape), shape_str(view_shape), strides.size());
  for (int64_t s : strides) MT_CHECK(s > 0, "HF adapter: piece '{}' has a stride {} (expected > 0)", hf_name, s);
  HfPiece piece;
  piece.hf_name = std::move(hf_name);
  piece.hf_shape = std::move(hf_shape);
  piece.offset = offset;
  piece.view_shape = std::move(view_shape);
  piece.strides = std::move(strides);
  return piece;
}

void check_pieces_tile(const std::vector<HfPiece>& pieces, const Shape& shape, const std::string& what) {
  const int64_t total = shape_numel(shape);
  int64_t covered = 0;
  bool all_contiguous = true;
  for (const HfPiece& piece : pieces) {
    MT_CHECK(piece.offset >= 0 && piece.last_element() < total,
             "parameter store: piece '{}' of '{}' spans elements [{}, {}] outside its {} elements", piece.hf_name, what,
             piece.offset, piece.last_element(), total);
    covered += piece.numel();
    all_contiguous = all_contiguous && piece.contiguous();
  }
  MT_CHECK(covered == total, "parameter store: pieces of '{}' cover {} elements but it has {}", what, covered, total);
  if (all_contiguous) {  // sorted blocks that abut
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (const HfPiece& piece : pieces) spans.emplace_back(piece.offset, piece.offset + piece.numel());
    std::sort(spans.begin(), spans.end());
    int64_t expected = 0;
    for (const auto& [begin, end] : spans) {
      MT_CHECK(begin == expected, "parameter store: pieces of '{}' leave a gap or overlap at element {}", what,
               std::min(begin, expected));
      expected = end;
    }
    return;
  }
  // Strided pieces: mark every element once (a parameter's worth of bytes, at construction only).
  std::vector<uint8_t> seen(static_cast<size_t>(total), 0);
  for (const HfPiece& piece : pieces) {
    const auto mark = [&](int64_t, int64_t at) {
      MT_CHECK(seen[static_cast<size_t>(at)] == 0, "parameter store: pieces of '{}' overlap at element {} (in '{}')",
               what, at, piece.hf_name);
      seen[static_cast<size_t>(at)] = 1;
    };
    if (piece.contiguous()) {
      for (int64_t i = 0; i < piece.numel(); ++i) mark(i, piece.offset + i);
    } else {
      for_each_element(piece, mark);
    }
  }
}

Tensor extract_piece(const Tensor& whole, const HfPiece& piece) {
  expect_dtype(whole, DType::F32, "HF adapter: internal tensor");
  MT_CHECK(whole.device().is_cpu() && whole.is_contiguous(), "HF adapter: extract_piece needs a contiguous CPU tensor");
  if (piece.contiguous())
    return whole.view({-1}).slice(piece.offset, piece.offset + piece.numel()).clone().view(piece.hf_shape);
  Tensor out = Tensor::empty(piece.hf_shape, DType::F32);
  float* dst = out.data<float>();
  const float* src = whole.data<float>();
  for_each_element(piece, [&](int64_t linear, int64_t at) { dst[linear] = src[at]; });
  return out;
}

void place_piece(Tensor& whole, const HfPiece& piece, const Tensor& value) {
  expect_dtype(whole, DType::F32, "HF adapter: internal tensor");
  MT_CHECK(whole.device().is_cpu() && whole.is_contiguous(), "HF adapter: place_piece needs a contiguous CPU tensor");
  MT_CHECK(value.shape() == piece.hf_shape, "HF adapter: tensor '{}' is {} but {} was expected", piece.hf_name,
           value.describe(), shape_str(piece.hf_shape));
  Tensor source = value.dtype() == DType::F32 ? value : value.to(DType::F32);
  if (!source.device().is_cpu()) source = source.to(Device::cpu());
  if (!source.is_contiguous()) source = source.clone();
  if (piece.contiguous()) {
    whole.view({-1}).slice(piece.offset, piece.offset + piece.numel()).copy_from(source.view({-1}));
    return;
  }
  float* dst = whole.data<float>();
  const float* src = source.data<float>();
  for_each_element(piece, [&](int64_t linear, int64_t at) { dst[at] = src[linear]; });
}

nlohmann::json piece_to_json(const HfPiece& piece) {
  nlohmann::json entry = {piece.hf_name, piece.hf_shape, piece.offset};
  if (!piece.contiguous()) {
    entry.push_back(piece.view_shape);
    entry.push_back(piece.strides);
  }
  if (piece.mxfp4_transposed) entry.push_back(nlohmann::json::object({{"mxfp4_transposed", true}}));
  return entry;
}

HfPiece piece_from_json(const nlohmann::json& entry, const std::string& source) {
  // A trailing object holds the piece's flags.
  const bool flags = entry.is_array() && !entry.empty() && entry.back().is_object();
  const size_t size = entry.is_array() ? entry.size() - (flags ? 1 : 0) : 0;
  MT_CHECK(entry.is_array() && (size == 3 || size == 5),
           "{}: an HF piece must be [name, shape, offset] or [name, shape, offset, view_shape, strides] (then "
           "optionally {{\"mxfp4_transposed\": true}}) but found {}",
           source, entry.dump().substr(0, 80));
  const std::string malformed = "malformed HF piece " + entry.dump().substr(0, 80);
  try {
    HfPiece piece;
    piece.hf_name = entry.at(0).get<std::string>();
    piece.hf_shape = json_int64_list(entry.at(1), malformed + ": its shape");
    piece.offset = json_int64(entry.at(2), malformed + ": its offset");
    for (int64_t d : piece.hf_shape) MT_CHECK(d >= 0, "{}: HF piece '{}' has a negative size", source, piece.hf_name);
    if (size == 5)
      piece = strided_piece(piece.hf_name, piece.hf_shape, piece.offset,
                            json_int64_list(entry.at(3), malformed + ": its view shape"),
                            json_int64_list(entry.at(4), malformed + ": its strides"));
    // The span [offset, last_element()] is what callers bound-check against the parameter: it must be exact, so no
    // negative offset or view extent (which would put the true last element past it) and no sum that wraps int64.
    // (The messages get `source` from the catch below.)
    MT_CHECK(piece.offset >= 0, "HF piece '{}' has the offset {}, expected >= 0", piece.hf_name, piece.offset);
    for (int64_t d : piece.view_shape) MT_CHECK(d >= 0, "HF piece '{}' has a negative view size", piece.hf_name);
    int64_t last = piece.offset;
    bool wraps = false;
    if (piece.numel() > 0) {
      if (piece.contiguous()) {
        wraps = __builtin_add_overflow(last, piece.numel() - 1, &last);
      } else {
        for (size_t d = 0; d < piece.view_shape.size(); ++d) {
          int64_t term = 0;
          wraps = wraps || __builtin_mul_overflow(piece.view_shape[d] - 1, piece.strides[d], &term) ||
                  __builtin_add_overflow(last, term, &last);
        }
      }
    }
    MT_CHECK(!wraps, "HF piece '{}' at offset {} spans elements past 2^63", piece.hf_name, piece.offset);
    if (flags) {
      for (const auto& [key, value] : entry.back().items()) {
        MT_CHECK(key == "mxfp4_transposed", "HF piece '{}' has an unknown flag '{}' (known: mxfp4_transposed)",
                 piece.hf_name, key);
        piece.mxfp4_transposed = value.get<bool>();
      }
    }
    return piece;
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("{}: malformed HF piece {}: {}", source, entry.dump().substr(0, 80), e.what());
  } catch (const Error& e) {  // an inconsistent strided map: name the file it came from
    MT_FAIL("{}: {}", source, e.what());
  }
}

}  // namespace moetrain::model
