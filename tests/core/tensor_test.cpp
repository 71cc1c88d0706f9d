// Tests for core/tensor: construction, views, copies, checks.
#include "core/tensor.h"

#include <functional>
#include <string>

#include <gtest/gtest.h>

namespace moetrain {
namespace {

TEST(Tensor, ZerosHasShapeAndBytes) {
  Tensor t = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.nbytes(), 24u);
  for (float v : t.to_vector<float>()) EXPECT_EQ(v, 0.0f);
}

TEST(Tensor, SliceAndSelectShareStorage) {
  Tensor t = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {3, 2});
  Tensor rows = t.slice(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 2}));
  EXPECT_EQ(rows.to_vector<float>(), (std::vector<float>{2, 3, 4, 5}));
  rows.data<float>()[0] = 9;
  EXPECT_EQ(t.data<float>()[2], 9);
  EXPECT_EQ(t.select(2).to_vector<float>(), (std::vector<float>{4, 5}));
}

TEST(Tensor, ViewInfersOneDimension) {
  Tensor t = Tensor::zeros({4, 6}, DType::F32);
  EXPECT_EQ(t.view({-1, 3}).shape(), (Shape{8, 3}));
  EXPECT_THROW(t.view({5, -1}), Error);
  EXPECT_THROW(t.view({-1, -1}), Error);
}

TEST(Tensor, RejectsWrongDataType) {
  Tensor t = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(t.data<int32_t>(), Error);
}

TEST(Tensor, ConvertsBetweenDtypes) {
  Tensor t = Tensor::from_vector<float>({1.0f, -2.5f, 3.0f}, {3});
  Tensor bf = t.to(DType::BF16);
  EXPECT_EQ(bf.dtype(), DType::BF16);
  EXPECT_EQ(bf.to(DType::F32).to_vector<float>(), t.to_vector<float>());
  EXPECT_EQ(t.to(DType::I32).to_vector<int32_t>(), (std::vector<int32_t>{1, -2, 3}));
}

TEST(Tensor, ExpectShapeNamesExpectedAndFound) {
  Tensor t = Tensor::zeros({2, 3}, DType::F32);
  try {
    expect_shape(t, {3, 2}, "weight");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight: expected shape [3, 2] but found [2, 3]"), std::string::npos);
  }
}

// Every message must name the shape, so a user sees which size was too large.
void expect_size_error(const std::function<void()>& action, const std::string& shape_text) {
  try {
    action();
    FAIL() << "expected an error for " << shape_text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(shape_text), std::string::npos) << e.what();
  }
}

TEST(Tensor, ShapeNumelRefusesOverflow) {
  constexpr int64_t k2to62 = int64_t{1} << 62;
  EXPECT_EQ(shape_numel({k2to62, 1}), k2to62);
  expect_size_error([&] { shape_numel({k2to62, 2}); }, "[4611686018427387904, 2]");
  expect_size_error([&] { shape_numel({int64_t{1} << 32, int64_t{1} << 32}); }, "[4294967296, 4294967296]");
}

TEST(Tensor, ByteCountsRefuseOverflowWithoutAllocating) {
  const int64_t before = memory_stats(DeviceKind::CPU).live_bytes;
  // 2^61 f32 elements fit int64 but not 2^62 bytes; 2^62 + 1 elements of a byte wrap nothing but exceed the bound.
  expect_size_error([] { Tensor::empty({int64_t{1} << 61}, DType::F32); }, "[2305843009213693952]");
  expect_size_error([] { Tensor::empty({(int64_t{1} << 62) + 1}, DType::U8); }, "[4611686018427387905]");
  // The count of the vocab_size = 2^58 + 1 recipe of issue 20 (an f32 embedding of [2^58 + 1, 64]).
  expect_size_error([] { Tensor::zeros({(int64_t{1} << 58) + 1, 64}, DType::F32); }, "[288230376151711745, 64]");
  // No elements but wrapping strides.
  expect_size_error(
      [] {
        Tensor::empty({0, int64_t{1} << 40, int64_t{1} << 40}, DType::F32);
      },
      "[0, 1099511627776, 1099511627776]");
  int dummy = 0;
  expect_size_error(
      [&] {
        Tensor::from_blob(&dummy, {int64_t{1} << 62, 4}, DType::F32, Device::cpu(), nullptr);
      },
      "[4611686018427387904, 4]");
  EXPECT_EQ(memory_stats(DeviceKind::CPU).live_bytes, before);
}

TEST(Tensor, ViewRefusesOverflowingShape) {
  Tensor t = Tensor::zeros({4}, DType::F32);
  expect_size_error([&] { t.view({int64_t{1} << 62, 4, -1}); }, "[4611686018427387904, 4, -1]");
}

TEST(Tensor, AllocatorRefusesImpossibleSizes) {
  try {
    allocate_storage(~size_t{0} - 8, Device::cpu());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("18446744073709551607 bytes on cpu"), std::string::npos) << e.what();
  }
}

TEST(Tensor, CountsPeakMemory) {
  reset_peak_memory(DeviceKind::CPU);
  const int64_t before = memory_stats(DeviceKind::CPU).live_bytes;
  {
    Tensor t = Tensor::empty({1024}, DType::F32);
    EXPECT_GE(memory_stats(DeviceKind::CPU).live_bytes, before + 4096);
  }
  EXPECT_EQ(memory_stats(DeviceKind::CPU).live_bytes, before);
  EXPECT_GE(memory_stats(DeviceKind::CPU).peak_bytes, before + 4096);
}

}  // namespace
}  // namespace moetrain
