// Tests for exact/wire_checks: the wire tensor (bf16 [T, H], contiguous) and every malformed cu_seqlens case (missing,
// int64, not 1-D, too short, not starting at 0, not ending at the token count, not strictly increasing, q/k spans
// unequal, max length too small); each refusal names the stage or micro-batch and the entry.
#include "exact/wire_checks.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "testing/error_message.h"

namespace moetrain::exact {
namespace {

using moetrain::testing::error_message;

// Passes when `needle` occurs in `text`; prints the whole text otherwise.
::testing::AssertionResult contains(const std::string& text, const std::string& needle) {
  if (text.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected to find\n  " << needle << "\nin\n  " << text;
}

Tensor cu(const std::vector<int32_t>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
}

// 10 tokens in documents of 3, 5 and 2 tokens.
model::MicroBatch packed_batch() {
  std::vector<int32_t> ids(10);
  for (int32_t i = 0; i < 10; ++i) ids[static_cast<size_t>(i)] = i;
  const Tensor t = Tensor::from_vector(ids, {10});
  return model::MicroBatch::packed(t, t, cu({0, 3, 8, 10}));
}

// ---- wire tensor ----

TEST(ExactWire, AcceptsABf16ContiguousTokensByHiddenTensor) {
  const Tensor t = Tensor::zeros({10, 16}, DType::BF16);
  EXPECT_NO_THROW(check_wire_tensor(t, 2, 3));
  EXPECT_NO_THROW(check_wire_tensor(t, 2, 3, 10, 16));
}

TEST(ExactWire, RefusesANonBf16WireTensor) {
  for (DType dtype : {DType::F32, DType::F16, DType::F64}) {
    const Tensor t = Tensor::zeros({4, 8}, dtype);
    const std::string message = error_message([&] { check_wire_tensor(t, 2, 3); });
    EXPECT_TRUE(contains(message, "exact: refused: wire tensor: stage 2, micro-batch 3: declared dtype bf16, found " +
                                      std::string(dtype_name(dtype)) + "[4, 8] on cpu"));
  }
}

TEST(ExactWire, RefusesAWireTensorThatIsNotTwoDimensional) {
  const Tensor t = Tensor::zeros({2, 4, 8}, DType::BF16);
  EXPECT_TRUE(contains(error_message([&] { check_wire_tensor(t, 1, 0); }),
                       "exact: refused: wire tensor: stage 1, micro-batch 0: declared a 2-D [T, H] tensor, found "
                       "bf16[2, 4, 8] on cpu"));
}

TEST(ExactWire, RefusesAMissingWireTensor) {
  EXPECT_TRUE(contains(error_message([&] { check_wire_tensor(Tensor(), 0, 5); }),
                       "exact: refused: wire tensor: stage 0, micro-batch 5: declared bf16 [T, H], found missing"));
}

TEST(ExactWire, RefusesAWireTensorOfTheWrongShape) {
  const Tensor t = Tensor::zeros({10, 16}, DType::BF16);
  EXPECT_TRUE(contains(error_message([&] { check_wire_tensor(t, 3, 1, 12, 16); }),
                       "exact: refused: wire tensor: stage 3, micro-batch 1: declared shape [12, 16] (T, H), found "
                       "bf16[10, 16] on cpu"));
}

// ---- varlen metadata ----

TEST(ExactVarlen, AcceptsPackedAndFixedWindowBatches) {
  EXPECT_NO_THROW(check_varlen_metadata(packed_batch(), 5, 0));
  const Tensor rows = Tensor::zeros({3, 4}, DType::I32);
  EXPECT_NO_THROW(check_varlen_metadata(model::MicroBatch::from_rows(rows, rows), 4, 0));
  EXPECT_NO_THROW(check_varlen_metadata(cu({0, 3, 8, 10}), cu({0, 3, 8, 10}), 10, 8, 0));
}

TEST(ExactVarlen, RefusesMissingCuSeqlens) {
  model::MicroBatch b = packed_batch();
  b.cu_seqlens_host = Tensor();
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 5, 4); }),
                       "exact: refused: varlen metadata: micro-batch 4, cu_seqlens_q: declared i32 [D + 1] on the "
                       "host, found missing"));
  b = packed_batch();
  b.cu_seqlens = Tensor();  // the host copy is there, the tensor the kernels read is not
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 5, 4); }),
                       "exact: refused: varlen metadata: micro-batch 4, cu_seqlens: declared i32 [4] beside its host "
                       "copy, found missing"));
}

TEST(ExactVarlen, RefusesInt64CuSeqlens) {
  model::MicroBatch b = packed_batch();
  b.cu_seqlens_host = Tensor::from_vector<int64_t>({0, 3, 8, 10}, {4});
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 5, 1); }),
                       "exact: refused: varlen metadata: micro-batch 1, cu_seqlens_q: declared dtype i32, found "
                       "i64[4] on cpu"));
  b = packed_batch();
  b.cu_seqlens = Tensor::from_vector<int64_t>({0, 3, 8, 10}, {4});
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 5, 1); }),
                       "exact: refused: varlen metadata: micro-batch 1, cu_seqlens: declared contiguous i32 [4] like "
                       "its host copy, found i64[4] on cpu"));
}

TEST(ExactVarlen, RefusesCuSeqlensThatAreNotOneDimensional) {
  model::MicroBatch b = packed_batch();
  b.cu_seqlens_host = Tensor::from_vector<int32_t>({0, 3, 8, 10}, {2, 2});
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 5, 2); }),
                       "exact: refused: varlen metadata: micro-batch 2, cu_seqlens_q: declared a 1-D tensor, found "
                       "i32[2, 2] on cpu"));
}

TEST(ExactVarlen, RefusesCuSeqlensWithFewerThanTwoEntries) {
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(cu({0}), cu({0}), 10, 10, 6); }),
                       "exact: refused: varlen metadata: micro-batch 6, cu_seqlens_q: declared >= 2 entries (one "
                       "document), found 1"));
}

TEST(ExactVarlen, RefusesCuSeqlensNotStartingAtZero) {
  model::MicroBatch b = packed_batch();
  b.cu_seqlens_host = cu({1, 3, 8, 10});
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 5, 7); }),
                       "exact: refused: varlen metadata: micro-batch 7, cu_seqlens_q entry [0]: declared 0, found 1"));
}

TEST(ExactVarlen, RefusesCuSeqlensNotEndingAtTheTokenCount) {
  model::MicroBatch b = packed_batch();
  b.cu_seqlens_host = cu({0, 3, 8, 9});
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 5, 3); }),
                       "exact: refused: varlen metadata: micro-batch 3, cu_seqlens_q entry [3] (the last): declared "
                       "the token count 10, found 9"));
}

TEST(ExactVarlen, RefusesCuSeqlensNotStrictlyIncreasing) {
  model::MicroBatch b = packed_batch();
  b.cu_seqlens_host = cu({0, 3, 3, 10});  // an empty document
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 10, 2); }),
                       "exact: refused: varlen metadata: micro-batch 2, cu_seqlens_q entry [2]: declared strictly "
                       "increasing (> entry [1] = 3), found 3"));
  b.cu_seqlens_host = cu({0, 8, 3, 10});  // a step backwards
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 10, 2); }),
                       "exact: refused: varlen metadata: micro-batch 2, cu_seqlens_q entry [2]: declared strictly "
                       "increasing (> entry [1] = 8), found 3"));
}

TEST(ExactVarlen, RefusesAMaxLengthShorterThanTheLongestSpan) {
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(packed_batch(), 4, 9); }),
                       "exact: refused: varlen metadata: micro-batch 9, cu_seqlens_q entry [2]: declared max_seqlen 4, "
                       "found the span [3, 8) of 5 tokens"));
}

TEST(ExactVarlen, RefusesUnequalQueryAndKeySpans) {
  EXPECT_TRUE(contains(error_message([&] {
                         check_varlen_metadata(cu({0, 3, 8, 10}), cu({0, 4, 8, 10}), 10, 8, 5);
                       }),
                       "exact: refused: varlen metadata: micro-batch 5, cu_seqlens_k entry [1]: declared 3 (equal to "
                       "cu_seqlens_q: equal q/k spans), found 4"));
  EXPECT_TRUE(contains(error_message([&] {
                         check_varlen_metadata(cu({0, 3, 8, 10}), cu({0, 8, 10}), 10, 8, 5);
                       }),
                       "exact: refused: varlen metadata: micro-batch 5, cu_seqlens_k: declared the 4 entries of "
                       "cu_seqlens_q (equal q/k spans), found 3"));
  // A malformed key side is refused under its own name.
  EXPECT_TRUE(contains(error_message([&] {
                         check_varlen_metadata(cu({0, 3, 8, 10}), cu({0, 3, 8, 11}), 10, 8, 5);
                       }),
                       "exact: refused: varlen metadata: micro-batch 5, cu_seqlens_k entry [3] (the last): declared "
                       "the token count 10, found 11"));
}

TEST(ExactVarlen, RefusesAKernelCopyThatDiffersFromTheHostCopy) {
  model::MicroBatch b = packed_batch();
  b.cu_seqlens = cu({0, 4, 8, 10});
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 5, 8); }),
                       "exact: refused: varlen metadata: micro-batch 8, cu_seqlens entry [1]: declared 3 (its host "
                       "copy), found 4"));
  b.cu_seqlens = cu({0, 3, 10});
  EXPECT_TRUE(contains(error_message([&] { check_varlen_metadata(b, 5, 8); }),
                       "exact: refused: varlen metadata: micro-batch 8, cu_seqlens: declared contiguous i32 [4] like "
                       "its host copy, found i32[3] on cpu"));
}

}  // namespace
}  // namespace moetrain::exact
