// Tests for core/tensor: construction, views, copies, checks.
#include "core/tensor.h"

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
