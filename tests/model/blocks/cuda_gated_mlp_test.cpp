// Tests for the gated MLP block's expert bank on CUDA: the weight gradients of several records at once
// (GatedMlp::backward_weight_together: the records' rows concatenated group by group, one grouped GEMM per weight over
// them, the step's first write overwriting) against backward_weight record by record, in bf16 compute at widths where
// the CUTLASS grouped GEMMs run, with experts empty in some records and in all. Run on a GPU; skipped elsewhere.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/blocks/block_testing.h"
#include "model/blocks/gated_mlp.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using testing::host_f32;
using testing::on_gpu;

// Both forms read the same bf16 operands and sum in f32; they differ in the order of each expert's sums (a record's
// partial sum added to the running gradient, or one running sum over all the records' rows): ~1e-7 relative, a few
// units of f32 rounding over sums of up to ~100 rows per expert and record. A misplaced or lost row moves it by O(1).
constexpr double kSummationOrder = 1e-5;

TEST(CudaGatedMlpBlock, WeightGradientsOfSeveralRecordsAtOnceAreTheirSum) {
  MT_REQUIRE_GPU();
  GatedMlpOptions o;
  o.hidden_size = 256;
  o.intermediate_size = 192;
  o.num_experts = 16;
  o.role = ParamRole::ExpertBank;
  const std::vector<ParamSpec> specs = block_testing::with_whole_pieces(GatedMlp::param_specs(o, "experts.", 0));
  ParameterStore one_by_one(specs, Device::cuda(0), DType::BF16), together(specs, Device::cuda(0), DType::BF16);
  block_testing::fill_random(one_by_one, 61, 0.05);
  block_testing::fill_random(together, 61, 0.05);
  const GatedMlp mlp_a(o, one_by_one, "experts."), mlp_b(o, together, "experts.");
  for (ParameterStore* store : {&one_by_one, &together}) store->begin_accumulation();
  Rng rng(62);
  const std::vector<int64_t> rows = {1500, 700, 1100, 0};  // expert 15 empty in every record, one record empty
  std::vector<MlpRecord> a(rows.size()), b(rows.size());
  std::vector<MlpRecord*> held;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Tensor x = on_gpu(testing::random_tensor({rows[i], o.hidden_size}, DType::F32, rng).to(DType::BF16));
    const Tensor d_y = on_gpu(testing::random_tensor({rows[i], o.hidden_size}, DType::F32, rng).to(DType::BF16));
    const Tensor offsets = on_gpu(
        Tensor::from_vector(testing::random_group_offsets(o.num_experts, rows[i], rng, 15), {o.num_experts + 1}));
    mlp_a.forward(a[i], x, offsets);
    mlp_b.forward(b[i], x, offsets);
    mlp_a.backward_input(a[i], d_y);
    mlp_b.backward_input(b[i], d_y);
    GatedMlp::keep_for_weight_work(b[i]);
    mlp_a.backward_weight(a[i]);
    held.push_back(&b[i]);
  }
  mlp_b.backward_weight_together(held);
  for (ParameterStore* store : {&one_by_one, &together}) store->end_accumulation();
  for (const char* name : {"experts.gate_up", "experts.down"}) {
    const Tensor want = host_f32(one_by_one.grad(name)), got = host_f32(together.grad(name));
    EXPECT_LT(testing::relative_error(got, want), kSummationOrder) << name;
    for (float v : block_testing::values(got.select(15).clone())) ASSERT_EQ(v, 0.0f) << name << ": expert 15";
  }
}

}  // namespace
}  // namespace moetrain::model
