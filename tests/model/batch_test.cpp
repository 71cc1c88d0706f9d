// Tests for model::to_device, a step's micro-batches uploaded in one copy: on the CPU nothing moves; on CUDA every
// tensor arrives with its bytes, at a 256-byte boundary of one buffer, with the host copy of cu_seqlens, the target
// count and the step's settings kept; a batch already there is left as it is; a tensor it cannot view is refused.
#include "model/batch.h"

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "ops/loss.h"
#include "testing/gpu.h"

namespace moetrain::model {
namespace {

MicroBatch packed_batch(std::vector<int32_t> ids, std::vector<int32_t> targets, std::vector<int32_t> cu) {
  const auto n = static_cast<int64_t>(ids.size());
  return MicroBatch::packed(Tensor::from_vector(ids, {n}), Tensor::from_vector(targets, {n}),
                            Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}));
}

std::vector<MicroBatch> three_batches() {
  return {packed_batch({5, 6, 7}, {6, 7, ops::kIgnoreIndex}, {0, 3}),
          packed_batch({1, 2, 3, 4, 5, 6, 7}, {2, 3, 4, ops::kIgnoreIndex, 6, 7, 8}, {0, 2, 7}),
          packed_batch({9}, {ops::kIgnoreIndex}, {0, 1})};
}

template <typename T>
std::vector<T> host_values(const Tensor& t) {
  return (t.device().is_cpu() ? t : t.to(Device::cpu())).to_vector<T>();
}

TEST(MicroBatchUpload, OnTheCpuTheBatchesStayAsTheyAre) {
  const std::vector<MicroBatch> batches = three_batches();
  const std::vector<MicroBatch> out = to_device(batches, Device::cpu());
  ASSERT_EQ(out.size(), batches.size());
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].input_ids.raw_data(), batches[i].input_ids.raw_data());
    EXPECT_EQ(out[i].cu_seqlens.raw_data(), batches[i].cu_seqlens.raw_data());
    EXPECT_EQ(out[i].num_targets(), batches[i].num_targets());
  }
  EXPECT_TRUE(to_device({}, Device::cpu()).empty());
}

TEST(CudaMicroBatchUpload, EveryTensorArrivesWithItsBytesAtItsOwnBoundaryOfOneBuffer) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  std::vector<MicroBatch> batches = three_batches();
  batches.push_back(three_batches()[1].to(cuda));  // already on the device: kept as it is
  const std::vector<MicroBatch> out = to_device(batches, cuda);
  ASSERT_EQ(out.size(), batches.size());
  const void* buffer_of_first = nullptr;
  for (size_t i = 0; i < out.size(); ++i) {
    const MicroBatch& b = out[i];
    const MicroBatch& want = batches[i];
    for (const auto& [got, expected] : {std::pair{&b.input_ids, &want.input_ids},
                                        {&b.targets, &want.targets},
                                        {&b.position_ids, &want.position_ids},
                                        {&b.cu_seqlens, &want.cu_seqlens}}) {
      EXPECT_TRUE(got->device() == cuda);
      EXPECT_EQ(got->shape(), expected->shape());
      EXPECT_EQ(host_values<int32_t>(*got), host_values<int32_t>(*expected)) << "batch " << i;
      EXPECT_EQ(reinterpret_cast<uintptr_t>(got->raw_data()) % 256, 0u) << "batch " << i;
      if (i < 3) {
        EXPECT_EQ(got->storage_offset_bytes() % 256, 0u);
        if (buffer_of_first == nullptr) buffer_of_first = static_cast<const char*>(got->raw_data());
      }
    }
    EXPECT_TRUE(b.cu_seqlens_host.device().is_cpu());
    EXPECT_EQ(host_values<int32_t>(b.cu_seqlens_host), host_values<int32_t>(want.cu_seqlens_host));
    EXPECT_EQ(b.num_targets(), want.num_targets());
  }
  // One buffer for the three uploaded batches: every view lies within 256-byte steps of the first.
  const auto* first = static_cast<const char*>(buffer_of_first);
  const auto* last = static_cast<const char*>(out[2].cu_seqlens.raw_data());
  EXPECT_EQ((last - first) % 256, 0);
  EXPECT_EQ(last - first, 256 * 11);  // 12 views of at most 64 i32 elements, one 256-byte step each
  EXPECT_EQ(out[3].input_ids.raw_data(), batches[3].input_ids.raw_data());

  // A tensor the upload cannot view in its i32 buffer is refused by name, before anything is copied.
  MicroBatch bad = three_batches()[0];
  bad.targets = Tensor::zeros({3}, DType::F32);
  try {
    to_device({three_batches()[1], bad}, cuda);
    ADD_FAILURE() << "an f32 target tensor was uploaded";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("micro-batch upload"), std::string::npos) << what;
    EXPECT_NE(what.find("i32"), std::string::npos) << what;
    EXPECT_NE(what.find("f32"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace moetrain::model
