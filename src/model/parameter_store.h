// defines: ParameterStore, the model's parameters and gradients in the engine's internal layout,
// and the mapping between that layout and Hugging Face tensor names. An internal tensor is the
// row-major concatenation of one or more HF tensors (experts stacked into [E, ...], gate and up
// projections fused into one [2I, H] weight), so every HF tensor is a contiguous block of it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace moetrain::io {
class SafetensorsReader;
}

namespace moetrain::model {

// One HF tensor inside an internal parameter, starting at element `offset`.
struct HfPiece {
  std::string hf_name;
  Shape hf_shape;
  int64_t offset = 0;
};

struct ParamSpec {
  std::string name;  // internal name, e.g. "layers.1.experts.gate_up"
  Shape shape;
  std::vector<HfPiece> pieces;  // cover the tensor exactly, in offset order
  // The name transformers (5.x) gives the whole tensor in memory when it fuses the checkpoint's
  // pieces (e.g. "model.layers.1.mlp.experts.gate_up_proj"); empty when it keeps the pieces.
  std::string hf_fused_name = "";
  bool is_matrix() const { return shape.size() >= 2; }  // weight decay applies to these
};

// The parameters are fp32 masters with fp32 gradients. With a bf16 compute dtype every matrix also
// has a bf16 copy that the forward and backward read (`weight`); norms and other 1-D tensors are
// read in fp32 (the kernels take their weights in f32). The copies follow the masters through
// refresh_compute_weights, which every write to the masters here calls (and whoever writes them
// elsewhere, e.g. a pipeline broadcast); train::AdamW writes the copies itself in its step.
class ParameterStore {
 public:
  // Allocates zero parameters and zero gradients for `specs` (fp32 masters on `device`). The
  // pieces of each spec must tile it exactly; names must be unique. bf16 compute needs CUDA.
  ParameterStore(std::vector<ParamSpec> specs, Device device = Device::cpu(), DType compute_dtype = DType::F32);

  const std::vector<ParamSpec>& specs() const { return specs_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  Tensor param(const std::string& name) const;
  Tensor grad(const std::string& name) const;
  // What compute reads: the bf16 copy of a matrix under bf16 compute, else the master itself.
  Tensor weight(const std::string& name) const;
  DType compute_dtype() const { return compute_dtype_; }
  // Rounds every master into its compute copy (nothing to do under f32 compute).
  void refresh_compute_weights();
  std::vector<Tensor> all_params() const { return params_; }
  std::vector<Tensor> all_grads() const { return grads_; }
  int64_t num_parameters() const;
  void zero_grads();

  // Fills every parameter from HF tensors. All checks run before any byte is copied: every
  // expected HF name present with the expected shape, no unexpected names; the error lists every
  // missing, unexpected and mis-shaped name at once. Tensors of another float dtype are converted.
  void load_hf(const io::SafetensorsReader& reader);
  // The same from tensors in memory (HF name -> CPU tensor), e.g. a checkpoint's weights.
  void load_hf_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors);
  // HF name -> tensor (copies), in spec order; `of_grads` exports the gradients instead.
  std::vector<std::pair<std::string, Tensor>> export_hf(bool of_grads = false) const;
  // Like export_hf, but a fused tensor is exported whole under its hf_fused_name when `use_fused`
  // says that name is wanted (how transformers names parameters and gradients in memory).
  std::vector<std::pair<std::string, Tensor>> export_hf_runtime(
      bool of_grads, const std::function<bool(const std::string&)>& use_fused) const;

  // Every parameter from N(0, std^2), norms (1-D) set to 1; each tensor from its own stream
  // Rng::for_key(seed, name), so the values do not depend on the order or the mesh.
  void init_random(uint64_t seed, double std);

 private:
  std::vector<ParamSpec> specs_;
  std::map<std::string, size_t> index_;
  std::vector<Tensor> params_;
  std::vector<Tensor> grads_;
  DType compute_dtype_ = DType::F32;
  std::vector<Tensor> compute_;  // per parameter: its bf16 copy, or the master
};

}  // namespace moetrain::model
