// defines: the model a job runs (job_model.h).
#include "train/job_model.h"

#include "core/device.h"
#include "ops/cuda/runtime.h"

namespace moetrain::train {

std::unique_ptr<model::CausalLm> job_model(const io::JobConfig& config) {
  const Device device = parse_device(config.model.device);
  if (device.is_cuda()) ops::cuda::setup_cuda(device.index);
  const model::ModelConfig model_config = model::load_model_config(config.model.config);
  const DType compute_dtype = config.model.compute_dtype == "bf16" ? DType::BF16 : DType::F32;
  auto model = std::make_unique<model::CausalLm>(model_config, device, compute_dtype);
  model->set_head_chunk(config.model.head_chunk);
  if (config.model.residual_dtype == "f32") model->set_stream_dtype(DType::F32);
  model->set_recompute_activation(config.model.recompute == "activation");
  return model;
}

}  // namespace moetrain::train
