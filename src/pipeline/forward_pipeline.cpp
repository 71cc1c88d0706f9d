// defines: the forward-only pipeline: each micro-batch in turn through the stages of the V, and its transfers.
#include "pipeline/forward_pipeline.h"

#include <string>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "pipeline/dualpipev_schedule.h"

namespace moetrain::pipeline {

namespace {

Tensor on_device(const Tensor& host, Device device) { return device.is_cpu() ? host : host.to(device); }

}  // namespace

ForwardPipeline::ForwardPipeline(const model::CausalLm& model, const Partition& partition, dist::Communicator& pp,
                                 dist::Communicator* ep)
    : model_(model),
      partition_(partition),
      pp_(pp),
      ep_(ep),
      rank_(pp.rank()),
      num_ranks_(pp.size()),
      wire_dtype_(model.stream_dtype()) {
  MT_CHECK(partition.pp == num_ranks_,
           "forward pipeline: the partition is for pp = {} ranks but the pipeline communicator '{}' has {} ranks",
           partition.pp, pp_.name(), num_ranks_);
  MT_CHECK(partition.stages.size() == static_cast<size_t>(2 * num_ranks_),
           "forward pipeline: a DualPipeV partition over {} ranks has {} stages, found {}", num_ranks_, 2 * num_ranks_,
           partition.stages.size());
  const int64_t num_layers = static_cast<int64_t>(model.layers().size());
  MT_CHECK(partition.stages.back().end_layer == num_layers,
           "forward pipeline: the partition covers layers [0, {}) but the model has {} decoder layers",
           partition.stages.back().end_layer, num_layers);
  for (int s = 0; s < 2 * num_ranks_; ++s) {
    const StageLayers& stage = partition.stages[static_cast<size_t>(s)];
    const int owner = s < num_ranks_ ? s : 2 * num_ranks_ - 1 - s;
    MT_CHECK(stage.stage == s && stage.rank == owner,
             "forward pipeline: stage {} of the V belongs to rank {} but the partition gives stage {} of rank {}", s,
             owner, stage.stage, stage.rank);
  }
  for (int c = 0; c < 2; ++c) {
    const StageLayers& stage = c == 0 ? partition.down_stage(rank_) : partition.up_stage(rank_);
    chunks_.push_back(std::make_unique<StageChunk>(model, stage, ep));
  }
  MT_CHECK(chunks_[1]->is_loss_stage() == (rank_ == 0) && !chunks_[0]->is_loss_stage(),
           "forward pipeline: the head and the loss must be on the last stage (rank 0's chunk 1)");
  MT_CHECK(chunks_[0]->has_embedding() == (rank_ == 0) && !chunks_[1]->has_embedding(),
           "forward pipeline: the embedding must be on the first stage (rank 0's chunk 0)");
}

ForwardPipeline::~ForwardPipeline() = default;

void ForwardPipeline::set_wire_dtype(DType dtype) {
  check_wire_dtype(model_, dtype, "forward pipeline");
  wire_dtype_ = dtype;
}

void ForwardPipeline::set_wire_check(WireCheck check) { wire_check_ = std::move(check); }

// One all_gather of {count, failed} over pp, then one over ep (with the pp group's verdict): every rank of the
// mesh slice learns whether every rank can go on before any transfer or exchange, and they all fail together.
void ForwardPipeline::agree(int64_t count, const std::string& local_error) {
  const Device device = model_.device();
  Stream& stream = default_stream(device);
  std::string failure;  // the first failure this rank learns of, to be thrown by every rank
  int64_t failed = local_error.empty() ? 0 : 1;
  for (dist::Communicator* comm : {&pp_, ep_}) {
    if (comm == nullptr) continue;
    const int n = comm->size();
    const Tensor mine = on_device(Tensor::from_vector<int64_t>({count, failed}, {2}), device);
    Tensor all = Tensor::empty({static_cast<int64_t>(n), 2}, DType::I64, device);
    try {
      comm->all_gather(stream, all, mine);
    } catch (const Error&) {
      // A rank that already failed after the first gather may abort this one: a rank with its own error says why.
      if (!local_error.empty()) MT_FAIL("{}", local_error);
      throw;
    }
    const std::vector<int64_t> host = all.to_vector<int64_t>();
    for (int p = 0; p < n && failure.empty(); ++p) {
      if (host[static_cast<size_t>(2 * p + 1)] != 0 && p != comm->rank()) {
        failure = fmt::format(
            "forward pipeline: rank {} of '{}' refused the micro-batches (or learnt that another rank did; its own "
            "error says why); rank {} stops too",
            p, comm->name(), comm->rank());
      } else if (host[static_cast<size_t>(2 * p)] != count) {
        failure = fmt::format(
            "forward pipeline: every rank of '{}' must run the same number of micro-batches; rank {} has {} but rank "
            "{} has {}",
            comm->name(), comm->rank(), count, p, host[static_cast<size_t>(2 * p)]);
      }
    }
    if (!failure.empty()) failed = 1;
  }
  if (!local_error.empty()) MT_FAIL("{}", local_error);
  if (!failure.empty()) MT_FAIL("{}", failure);
}

void ForwardPipeline::send_activation(int stage, int mb, const Tensor& hidden, const model::MicroBatch& batch,
                                      int peer) {
  const Device device = model_.device();
  Stream& stream = default_stream(device);
  const int chunk = stage < num_ranks_ ? 0 : 1;
  const std::string what =
      fmt::format("rank {}: the activation of micro-batch {} leaving stage {} for rank {}", rank_, mb, stage, peer);
  const Tensor wire = activation_to_wire(hidden, wire_dtype_, what);
  if (wire_check_) wire_check_(wire, batch);
  const int64_t docs = batch.cu_seqlens.numel() - 1;
  const Tensor header = on_device(
      Tensor::from_vector(std::vector<int32_t>{kWireMagic, static_cast<int32_t>(TransferKind::Activation), chunk, mb,
                                               static_cast<int32_t>(hidden.size(0)),
                                               static_cast<int32_t>(hidden.size(1)), static_cast<int32_t>(docs)},
                          {kHeaderInts}),
      device);
  const Tensor meta = encode_metadata(batch, device);
  pp_.group_start();
  pp_.send(stream, header, peer);
  pp_.group_end();
  pp_.group_start();
  pp_.send(stream, wire, peer);
  pp_.send(stream, meta, peer);
  pp_.group_end();
}

Tensor ForwardPipeline::recv_activation(int stage, int mb, int peer, const model::MicroBatch& local,
                                        model::MicroBatch& batch) {
  const Device device = model_.device();
  Stream& stream = default_stream(device);
  const int chunk = stage < num_ranks_ ? 0 : 1;
  const int64_t H = model_.config().hidden_size;
  Tensor header = Tensor::empty({kHeaderInts}, DType::I32, device);
  pp_.group_start();
  pp_.recv(stream, header, peer);
  pp_.group_end();
  const std::vector<int32_t> h = header.to_vector<int32_t>();
  MT_CHECK(h[0] == kWireMagic && h[1] == static_cast<int32_t>(TransferKind::Activation) && h[2] == chunk && h[3] == mb,
           "forward pipeline: rank {} expected the header of the activation of chunk {} micro-batch {} from rank {} "
           "but received (magic {:#x}, kind {}, chunk {}, micro-batch {})",
           rank_, chunk, mb, peer, h[0], h[1], h[2], h[3]);
  MT_CHECK(h[4] > 0 && h[5] == H && h[6] >= 1,
           "forward pipeline: rank {}: the activation of micro-batch {} announces [T = {}, H = {}] with {} documents; "
           "expected T > 0, H = {} and at least one document",
           rank_, mb, h[4], h[5], h[6], H);
  Tensor wire = Tensor::empty({h[4], H}, wire_dtype_, device);
  Tensor meta = Tensor::empty({int64_t{h[6]} + 1 + h[4]}, DType::I32, device);
  pp_.group_start();
  pp_.recv(stream, wire, peer);
  pp_.recv(stream, meta, peer);
  pp_.group_end();
  const std::string what =
      fmt::format("rank {}: the activation of micro-batch {} entering stage {} from rank {}", rank_, mb, stage, peer);
  batch = decode_metadata(meta, h[4], h[6], device, what);
  batch.router_loss = local.router_loss;
  if (wire_check_) wire_check_(wire, batch);
  return activation_from_wire(wire, model_.stream_dtype());
}

std::vector<Tensor> ForwardPipeline::run(const std::vector<model::MicroBatch>& batches, model::StepLoss* loss) {
  const int n = static_cast<int>(batches.size());
  std::string error;
  try {
    MT_CHECK(n >= 1, "forward pipeline: expected at least one micro-batch but found none");
    if (rank_ == 0) {
      for (const model::MicroBatch& b : batches) b.validate(model_.config().vocab_size);
    }
  } catch (const Error& e) {
    error = e.what();
  }
  agree(static_cast<int64_t>(n), error);
  for (auto& chunk : chunks_) chunk->clear();
  // Rank 0 holds the data (the embedding and the loss stage): its micro-batches go to the device in one copy.
  const std::vector<model::MicroBatch> on_device =
      rank_ == 0 ? model::to_device(batches, model_.device()) : std::vector<model::MicroBatch>{};

  // Each micro-batch in turn through stages 0 .. 2P - 1. Every rank (and every ep peer of it) walks the same loop,
  // so the point-to-point transfers pair up and the ep peers run their MoE exchanges in the same order.
  const int stages = 2 * num_ranks_;
  std::vector<Tensor> logprobs;
  std::vector<model::LossSum> losses;  // the loss stage's, read at the end
  model::StepLoss sums;
  for (int mb = 0; mb < n; ++mb) {
    const model::MicroBatch& local = batches[static_cast<size_t>(mb)];
    Tensor hidden;            // the activation handed over locally to this rank's next stage
    model::MicroBatch batch;  // its metadata
    for (int s = 0; s < stages; ++s) {
      const StageLayers& stage = partition_.stages[static_cast<size_t>(s)];
      if (stage.rank != rank_) continue;
      StageChunk& chunk = *chunks_[static_cast<size_t>(s < num_ranks_ ? 0 : 1)];
      Tensor input;
      model::MicroBatch in_batch;
      if (s == 0) {
        in_batch = on_device.at(static_cast<size_t>(mb));
      } else if (partition_.stages[static_cast<size_t>(s - 1)].rank == rank_) {
        input = std::move(hidden);  // the bottom of the V (or pp = 1): no wire
        in_batch = std::move(batch);
      } else {
        input = recv_activation(s, mb, partition_.stages[static_cast<size_t>(s - 1)].rank, local, in_batch);
      }
      if (chunk.is_loss_stage()) {
        // The loss stage is on rank 0, which holds the data: it reads the targets (and the metadata) itself.
        const int64_t T = in_batch.position_ids.numel();
        in_batch = on_device.at(static_cast<size_t>(mb));
        MT_CHECK(in_batch.num_tokens() == T,
                 "forward pipeline: micro-batch {} has {} tokens but the activation reaching the last stage has {} "
                 "rows",
                 mb, in_batch.num_tokens(), T);
      }
      ChunkForward out = chunk.forward(mb, in_batch, input, /*loss_scale=*/0.0);
      chunk.drop(mb);
      if (chunk.is_loss_stage()) {
        logprobs.push_back(std::move(out.token_logprobs));
        losses.push_back(std::move(out.loss));
        sums.num_tokens += in_batch.num_tokens();
        continue;
      }
      const int next = partition_.stages[static_cast<size_t>(s + 1)].rank;
      if (next == rank_) {
        hidden = std::move(out.hidden);
        batch = std::move(in_batch);
      } else {
        send_activation(s, mb, out.hidden, in_batch, next);
      }
    }
  }
  model::resolve_losses(losses);
  for (const model::LossSum& l : losses) {
    sums.ce_sum += l.ce_sum();
    sums.num_targets += l.num_targets();
  }
  sums.loss = sums.num_targets > 0 ? sums.ce_sum / static_cast<double>(sums.num_targets) : 0.0;
  if (loss != nullptr) *loss = sums;
  return logprobs;
}

}  // namespace moetrain::pipeline
