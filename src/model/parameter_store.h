// defines: ParameterSpec (a parameter's name, shape, role, layer and HF pieces) and ParameterStore, the model's
// parameters and gradients in the engine's internal layout, loaded from and exported to Hugging Face tensors
// through each spec's pieces (model/hf_adapter.h: stacked, sliced, transposed or de-interleaved).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/hf_adapter.h"
#include "ops/gemm.h"  // GradientWrite

namespace moetrain::io {
class SafetensorsReader;
}

namespace moetrain::model {

struct ModelConfig;

// What a parameter is, as the engine above the families asks: the trainer, the partition, ZeRO-3 sharding,
// checkpoints and the exact admission read the role and the layer, never the name.
enum class ParamRole : uint8_t {
  Embedding,     // the token embedding [V, H] (also the head when tied)
  Head,          // the LM head [V, H]
  Norm,          // a norm's scale (1-D), the final norm included
  Dense,         // any other weight of a decoder layer: attention projections, a dense MLP, biases
  Router,        // a router's projection (and bias)
  ExpertBank,    // [E, ...] stacked routed experts, sharded over the ep ranks along dim 0
  SharedExpert,  // a shared expert's weights (every token goes through it)
};
const char* param_role_name(ParamRole role);

// How init_random fills a parameter. LogUniform: log(U(0.01, 16)), Gated DeltaNet's A_log as transformers starts it
// (the decay rates A spread over [0.01, 16]).
enum class ParamInit : uint8_t { Normal, Ones, Zeros, LogUniform };

struct ParamSpec {
  std::string name;  // internal name, e.g. "layers.1.experts.gate_up" (an identifier: nothing parses it)
  Shape shape;
  ParamRole role = ParamRole::Dense;
  int64_t layer = -1;           // the decoder layer it belongs to; -1: embedding, final norm, head
  std::vector<HfPiece> pieces;  // the HF adapter: cover the tensor exactly
  // The name transformers (5.x) gives the whole tensor in memory when it fuses the checkpoint's
  // pieces (e.g. "model.layers.1.mlp.experts.gate_up_proj"); empty when it keeps the pieces.
  std::string hf_fused_name = "";
  ParamInit init = ParamInit::Normal;
  // The family keeps it f32 under bf16 compute, naming the pin ("A_log", "dt_bias" of Gated DeltaNet; empty: not
  // pinned): the exact admission allows the certified pins a job declares.
  std::string fp32_pin;
  // Read in f32 under bf16 compute although it has two dims: a stack of vectors, e.g. an expert bank's biases
  // [E, N] (transformers keeps GPT-OSS's expert biases f32 and adds them in f32). Weight decay still applies.
  bool f32_compute = false;
  bool is_matrix() const { return shape.size() >= 2; }  // weight decay applies to these
};

// A spec whose one HF piece is the whole tensor; matrices start N(0, std^2), vectors 1 (norm scales).
ParamSpec single_piece_spec(std::string name, Shape shape, ParamRole role, int64_t layer, std::string hf_name);

// A decoder-only model's parameters under transformers' usual outer names: "embed" (model.embed_tokens.weight), then
// each decoder layer's specs as `layer_specs(layer)` gives them (pieces attached), then "final_norm"
// (model.norm.weight, initialised as `final_norm_init`: zeros for a zero-centred norm) and, unless the embeddings are
// tied, "lm_head" (lm_head.weight).
std::vector<ParamSpec> decoder_model_specs(const ModelConfig& config,
                                           const std::function<std::vector<ParamSpec>(int64_t layer)>& layer_specs,
                                           ParamInit final_norm_init = ParamInit::Ones);

// Attaches HF pieces that split the spec, seen as [rows, last dim], into len(hf_names) equal consecutive blocks of
// rows, in order: a fused gate_up [2I, H] from gate then up, an expert bank [E, 2I, H] from every expert's gate and up
// in turn, [E, H, I] from every expert's down. The rows must divide evenly (checked, naming the spec).
void attach_row_blocks(ParamSpec& spec, const std::vector<std::string>& hf_names);

// The HF names most families give a gated MLP under `hf_mlp` ("model.layers.3.mlp."): gate_proj and up_proj (the
// fused [2I, H], `gate_up`) or down_proj; for an expert bank (`experts`: [E, ...]) per expert under
// "<hf_mlp>experts.<e>.", with transformers' fused in-memory name "<hf_mlp>experts.gate_up_proj" / "down_proj".
void attach_hf_mlp_pieces(ParamSpec& spec, const std::string& hf_mlp, bool experts, bool gate_up);

// The parameters are fp32 masters with fp32 gradients. With a bf16 compute dtype every matrix (but those marked
// f32_compute) also has a bf16 copy that the forward and backward read (`weight`); norms and other 1-D tensors are
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
  // The spec of the one parameter of `role` outside the decoder layers (Embedding, Head); null when there is none
  // (a tied head).
  const ParamSpec* find_role(ParamRole role) const;
  Tensor param(const std::string& name) const;
  Tensor grad(const std::string& name) const;
  // What compute reads: the bf16 copy of a matrix under bf16 compute, else the master itself.
  Tensor weight(const std::string& name) const;
  DType compute_dtype() const { return compute_dtype_; }
  // Rounds every master into its compute copy (nothing to do under f32 compute).
  void refresh_compute_weights();
  // Whether compute reads the named matrix's fp32 master (true: its bf16 copy is dropped, as for f32_compute specs)
  // or its bf16 copy (false: made again from the master). Under f32 compute there is nothing to change. Call it
  // before an optimizer or ZeRO-3 takes the store's tensors: they keep the compute tensors they were given.
  void set_compute_in_f32(const std::string& name, bool f32);
  std::vector<Tensor> all_params() const { return params_; }
  std::vector<Tensor> all_grads() const { return grads_; }
  int64_t num_parameters() const;
  // Every gradient becomes zero, none is left to its first writer (see begin_accumulation).
  void zero_grads();

  // A step's gradient accumulation with first writes. A block whose weight gradient has one writer that can replace
  // it (a dense or grouped weight GEMM, through a GradientWriter) registers it; begin_accumulation then zeroes every
  // other gradient and leaves the registered ones to their writer, whose first write of the step overwrites
  // (take_first_write says when): no pass zeroes them and the first micro-batch's GEMM never reads them. The sums are
  // the bytes of adding onto zeros. end_accumulation zeroes a registered gradient that no writer touched (a layer
  // another pipeline rank runs), so no step ever reads the one before's values. zero_grads still zeroes everything
  // (check-golden, ZeRO-3's shards, which reduce the gradients per micro-batch, and any caller that accumulates without
  // asking). Every writer of a registered gradient asks take_first_write: one that added without asking would add to
  // the last step's sums.
  size_t overwrite_on_first_write(const std::string& name);
  void begin_accumulation();
  // True for the first write of the gradient registered as `slot` since begin_accumulation (then false until the
  // next one; always false after zero_grads).
  bool take_first_write(size_t slot);
  void end_accumulation();

  // Fills every parameter from HF tensors. All checks run before any byte is copied: every
  // expected HF name present with the expected shape, no unexpected names; the error lists every
  // missing, unexpected and mis-shaped name at once. Tensors of another float dtype are converted.
  // A piece X may instead come as its MXFP4 pair X_blocks + X_scales (u8, the shapes io::mxfp4_blocks_shape gives
  // for hf_shape and the piece's mxfp4_transposed; no e8m0 NaN scale), as GPT-OSS's released checkpoints store their
  // experts: decoded to f32 as transformers does when the piece is placed. Half a pair, a pair of the wrong shape or
  // dtype, and X given both whole and as a pair are problems like the others.
  void load_hf(const io::SafetensorsReader& reader);
  // The same from tensors in memory (HF name -> CPU tensor), e.g. a checkpoint's weights.
  void load_hf_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors);
  // HF name -> tensor (copies), in spec order; `of_grads` exports the gradients instead.
  std::vector<std::pair<std::string, Tensor>> export_hf(bool of_grads = false) const;
  // Like export_hf, but a fused tensor is exported whole under its hf_fused_name when `use_fused`
  // says that name is wanted (how transformers names parameters and gradients in memory).
  std::vector<std::pair<std::string, Tensor>> export_hf_runtime(
      bool of_grads, const std::function<bool(const std::string&)>& use_fused) const;

  // Every parameter by its spec's init: N(0, std^2), ones or zeros; each tensor from its own stream
  // Rng::for_key(seed, name), so the values do not depend on the order or the mesh.
  void init_random(uint64_t seed, double std);

 private:
  std::vector<ParamSpec> specs_;
  std::map<std::string, size_t> index_;
  std::vector<Tensor> params_;
  std::vector<Tensor> grads_;
  DType compute_dtype_ = DType::F32;
  std::vector<Tensor> compute_;  // per parameter: its bf16 copy, or the master
  // Per parameter: its gradient's writer overwrites it on the first write of a step; and that write is still to come.
  std::vector<uint8_t> overwrites_first_;
  std::vector<uint8_t> first_write_pending_;
};

// A block's handle on a weight gradient it writes whole, once a micro-batch, left to its first write of each step
// (ParameterStore::overwrite_on_first_write): each write asks `next` how to write. A default-constructed writer
// always accumulates. Every writer of a registered gradient must hold one and ask (see begin_accumulation).
class GradientWriter {
 public:
  GradientWriter() = default;
  GradientWriter(ParameterStore& store, const std::string& name)
      : store_(&store), slot_(store.overwrite_on_first_write(name)) {}
  // Overwrite for the step's first write, then Accumulate.
  ops::GradientWrite next() const {
    return store_ != nullptr && store_->take_first_write(slot_) ? ops::GradientWrite::Overwrite
                                                                : ops::GradientWrite::Accumulate;
  }

 private:
  ParameterStore* store_ = nullptr;
  size_t slot_ = 0;
};

}  // namespace moetrain::model
