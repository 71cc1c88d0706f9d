// Tests for dist/nccl_communicator that run anywhere: a build without CUDA refuses the NCCL
// factories with a clear error. (The NCCL backend itself runs on GPU machines: CudaNccl* suites.)
#include "dist/nccl_communicator.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace moetrain::dist {
namespace {

TEST(NcclCommunicator, CpuOnlyBuildRefusesClearly) {
  if (nccl_available()) GTEST_SKIP() << "this build has the NCCL backend";
  try {
    create_nccl_communicator(NcclId{}, 0, 1, Device::cuda(0));
    ADD_FAILURE() << "a CPU-only build must refuse the NCCL backend";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs the NCCL backend, but this build has no CUDA"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(nccl_unique_id(), Error);
  EXPECT_THROW(connect_nccl_world(LaunchEnv{}, Device::cuda(0)), Error);
}

}  // namespace
}  // namespace moetrain::dist
