// defines: the DualPipeV executor: the commit-point transfers, the ops of a rank's list, and the step's loss.
#include "pipeline/dualpipev_executor.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "ops/attention.h"
#include "ops/elementwise.h"

namespace moetrain::pipeline {

namespace {

const char* kind_name(TransferKind kind) { return kind == TransferKind::Activation ? "activation" : "gradient"; }

Tensor on_device(const Tensor& host, Device device) { return device.is_cpu() ? host : host.to(device); }

// The steps of a stage chunk split after each compute step: a slice is one compute step and the communication
// steps that follow it (those a GPU executor launches on its communication stream before the other micro-batch's
// next compute step).
std::vector<std::vector<const ChunkStep*>> slices_of(const std::vector<ChunkStep>& steps) {
  std::vector<std::vector<const ChunkStep*>> slices;
  for (const ChunkStep& step : steps) {
    if (!step.communication || slices.empty()) slices.emplace_back();
    slices.back().push_back(&step);
  }
  return slices;
}

}  // namespace

void check_wire_dtype(const model::CausalLm& model, DType wire, const char* who) {
  const DType stream = model.stream_dtype();
  MT_CHECK(wire == stream || (wire == DType::BF16 && stream == DType::F32),
           "{}: the wire dtype must be the model's residual stream dtype ({}) or bf16 with an f32 stream, found {}",
           who, dtype_name(stream), dtype_name(wire));
}

Tensor activation_to_wire(const Tensor& activation, DType wire, const std::string& what) {
  if (activation.dtype() == wire) return activation;
  MT_CHECK(activation.dtype() == DType::F32 && wire == DType::BF16,
           "pipeline: {} is {} but the wire carries {}; only f32 activations are cast (to bf16)", what,
           activation.describe(), dtype_name(wire));
  Stream& stream = default_stream(activation.device());
  Tensor out = Tensor::empty(activation.shape(), DType::BF16, activation.device());
  ops::cast(stream, out, activation);
  // Fail closed: the cast must be exact (every value already on the bf16 grid, as exact mode makes it).
  Tensor back = Tensor::empty(activation.shape(), DType::F32, activation.device());
  ops::cast(stream, back, out);
  const std::vector<float> want = activation.to_vector<float>(), got = back.to_vector<float>();
  for (size_t i = 0; i < want.size(); ++i) {
    MT_CHECK(std::memcmp(&want[i], &got[i], sizeof(float)) == 0,
             "pipeline: {} is not on the bf16 grid (element {} is {} but bf16 carries {}); a bf16 wire with an f32 "
             "model needs exact mode (CausalLm::set_exact), which rounds every stage boundary to bf16",
             what, i, want[i], got[i]);
  }
  return out;
}

Tensor activation_from_wire(const Tensor& wire, DType stream) {
  return ops::in_dtype(default_stream(wire.device()), wire, stream);
}

Tensor encode_metadata(const model::MicroBatch& batch, Device device) {
  std::vector<int32_t> meta = batch.cu_seqlens.to_vector<int32_t>();
  const std::vector<int32_t> positions = batch.position_ids.to_vector<int32_t>();
  meta.insert(meta.end(), positions.begin(), positions.end());
  return on_device(Tensor::from_vector(meta, {static_cast<int64_t>(meta.size())}), device);
}

model::MicroBatch decode_metadata(const Tensor& meta, int64_t num_tokens, int64_t num_documents, Device device,
                                  const std::string& what) {
  const int64_t T = num_tokens, docs = num_documents;
  MT_CHECK(meta.dtype() == DType::I32 && meta.dim() == 1 && meta.numel() == docs + 1 + T,
           "pipeline: the metadata received with {} should be i32 [{}] (D + 1 + T) but is {}", what, docs + 1 + T,
           meta.describe());
  const Tensor host_meta = meta.device().is_cpu() ? meta : meta.to(Device::cpu());
  model::MicroBatch batch;
  batch.cu_seqlens_host = host_meta.slice(0, docs + 1).clone();
  const std::string cu_what = fmt::format("pipeline: cu_seqlens received with {}", what);
  ops::validate_cu_seqlens(batch.cu_seqlens_host, T, cu_what.c_str());
  const Tensor positions = host_meta.slice(docs + 1, docs + 1 + T).clone();
  const int32_t* cu = batch.cu_seqlens_host.data<int32_t>();
  const int32_t* pos = positions.data<int32_t>();
  for (int64_t d = 0; d < docs; ++d) {
    for (int32_t k = cu[d]; k < cu[d + 1]; ++k) {
      MT_CHECK(pos[k] == k - cu[d],
               "pipeline: received position_ids[{}] = {} with {}, but document {} starts at token {}", k, pos[k], what,
               d, cu[d]);
    }
  }
  batch.cu_seqlens = on_device(batch.cu_seqlens_host, device);
  batch.position_ids = on_device(positions, device);
  return batch;
}

DualPipeVExecutor::DualPipeVExecutor(const model::CausalLm& model, const Partition& partition,
                                     dist::Communicator& pp_comm, dist::Communicator* ep)
    : model_(model),
      partition_(partition),
      comm_(pp_comm),
      rank_(pp_comm.rank()),
      num_ranks_(pp_comm.size()),
      wire_dtype_(model.stream_dtype()) {
  MT_CHECK(partition.pp == num_ranks_,
           "pipeline: the partition is for pp = {} ranks but the pipeline communicator '{}' has {} ranks", partition.pp,
           comm_.name(), num_ranks_);
  MT_CHECK(partition.stages.size() == static_cast<size_t>(2 * num_ranks_),
           "pipeline: a DualPipeV partition over {} ranks has {} stages, found {}", num_ranks_, 2 * num_ranks_,
           partition.stages.size());
  const int64_t num_layers = static_cast<int64_t>(model.layers().size());
  MT_CHECK(partition.stages.back().end_layer == num_layers,
           "pipeline: the partition covers layers [0, {}) but the model has {} decoder layers",
           partition.stages.back().end_layer, num_layers);
  for (int c = 0; c < 2; ++c) {
    const StageLayers& stage = c == 0 ? partition.down_stage(rank_) : partition.up_stage(rank_);
    MT_CHECK(stage.stage == dualpipev_stage(num_ranks_, rank_, c) && stage.rank == rank_,
             "pipeline: rank {} chunk {} should run stage {} but the partition gives stage {} of rank {}", rank_, c,
             dualpipev_stage(num_ranks_, rank_, c), stage.stage, stage.rank);
    chunks_.push_back(std::make_unique<StageChunk>(model, stage, ep));
  }
  MT_CHECK(chunks_[1]->is_loss_stage() == dualpipev_is_loss_chunk(rank_, 1) && !chunks_[0]->is_loss_stage(),
           "pipeline: the head and the loss must be on the last stage (rank 0's chunk 1); rank {} finds it on "
           "chunk {}",
           rank_, chunks_[0]->is_loss_stage() ? 0 : 1);
  MT_CHECK(chunks_[0]->has_embedding() == (rank_ == 0) && !chunks_[1]->has_embedding(),
           "pipeline: the embedding must be on the first stage (rank 0's chunk 0)");
}

void DualPipeVExecutor::set_wire_dtype(DType dtype) {
  check_wire_dtype(model_, dtype, "pipeline");
  wire_dtype_ = dtype;
}

int64_t DualPipeVExecutor::live_records() const { return chunks_[0]->live_records() + chunks_[1]->live_records(); }

DualPipeVExecutor::Message DualPipeVExecutor::take(const MessageKey& key, const char* what) {
  const auto it = inbox_.find(key);
  MT_CHECK(it != inbox_.end(),
           "pipeline: rank {} needs the {} of chunk {} micro-batch {} for its {} but it was not "
           "received",
           rank_, kind_name(std::get<0>(key)), std::get<1>(key), std::get<2>(key), what);
  Message message = std::move(it->second);
  inbox_.erase(it);
  return message;
}

void DualPipeVExecutor::commit(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs) {
  if (sends.empty() && recvs.empty()) return;
  Stream& stream = default_stream(model_.device());
  const Device device = model_.device();
  const int64_t H = model_.config().hidden_size;

  // Round 1: headers. Activations go out in the wire dtype (checked by the wire check).
  std::vector<const Message*> outgoing;
  std::vector<Tensor> send_headers, recv_headers, send_payload;
  for (const Transfer& t : sends) {
    const auto it = outbox_.find({t.kind, t.chunk, t.microbatch});
    MT_CHECK(it != outbox_.end(), "pipeline: rank {} is scheduled to send {} but has not computed it", rank_,
             describe(t));
    const Message& m = it->second;
    const int64_t docs = t.kind == TransferKind::Activation ? m.batch.cu_seqlens.numel() - 1 : 0;
    outgoing.push_back(&m);
    if (t.kind == TransferKind::Activation) {
      send_payload.push_back(
          activation_to_wire(m.payload, wire_dtype_, fmt::format("rank {}: {}", rank_, describe(t))));
      if (wire_check_) wire_check_(send_payload.back(), m.batch);
    } else {
      send_payload.push_back(m.payload);
    }
    send_headers.push_back(
        on_device(Tensor::from_vector(std::vector<int32_t>{kWireMagic, static_cast<int32_t>(t.kind), t.chunk,
                                                           t.microbatch, static_cast<int32_t>(m.payload.size(0)),
                                                           static_cast<int32_t>(H), static_cast<int32_t>(docs)},
                                      {kHeaderInts}),
                  device));
  }
  for (size_t i = 0; i < recvs.size(); ++i) recv_headers.push_back(Tensor::empty({kHeaderInts}, DType::I32, device));
  comm_.group_start();
  for (size_t i = 0; i < sends.size(); ++i) comm_.send(stream, send_headers[i], sends[i].peer);
  for (size_t i = 0; i < recvs.size(); ++i) comm_.recv(stream, recv_headers[i], recvs[i].peer);
  comm_.group_end();

  // Round 2: payloads (and the metadata of activations), sized by the headers.
  std::vector<Tensor> send_meta(sends.size());
  for (size_t i = 0; i < sends.size(); ++i) {
    if (sends[i].kind == TransferKind::Activation) send_meta[i] = encode_metadata(outgoing[i]->batch, device);
  }
  std::vector<Tensor> recv_payload(recvs.size()), recv_meta(recvs.size());
  std::vector<std::vector<int32_t>> headers(recvs.size());
  for (size_t i = 0; i < recvs.size(); ++i) {
    const Transfer& t = recvs[i];
    headers[i] = recv_headers[i].to_vector<int32_t>();
    const std::vector<int32_t>& h = headers[i];
    MT_CHECK(h[0] == kWireMagic && h[1] == static_cast<int32_t>(t.kind) && h[2] == t.chunk && h[3] == t.microbatch,
             "pipeline: rank {} expected the header of {} but received (magic {:#x}, kind {}, chunk {}, micro-batch "
             "{})",
             rank_, describe(t), h[0], h[1], h[2], h[3]);
    MT_CHECK(h[4] > 0 && h[5] == H && (t.kind == TransferKind::Gradient || h[6] >= 1),
             "pipeline: rank {}: {} announces [T = {}, H = {}] with {} documents; expected T > 0, H = {} and at least "
             "one document",
             rank_, describe(t), h[4], h[5], h[6], H);
    const DType dtype = t.kind == TransferKind::Activation ? wire_dtype_ : model_.stream_dtype();
    recv_payload[i] = Tensor::empty({h[4], H}, dtype, device);
    if (t.kind == TransferKind::Activation)
      recv_meta[i] = Tensor::empty({int64_t{h[6]} + 1 + h[4]}, DType::I32, device);
  }
  comm_.group_start();
  for (size_t i = 0; i < sends.size(); ++i) {
    comm_.send(stream, send_payload[i], sends[i].peer);
    if (send_meta[i].defined()) comm_.send(stream, send_meta[i], sends[i].peer);
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    comm_.recv(stream, recv_payload[i], recvs[i].peer);
    if (recv_meta[i].defined()) comm_.recv(stream, recv_meta[i], recvs[i].peer);
  }
  comm_.group_end();

  for (const Transfer& t : sends) outbox_.erase({t.kind, t.chunk, t.microbatch});
  for (size_t i = 0; i < recvs.size(); ++i) {
    const Transfer& t = recvs[i];
    Message m;
    m.payload = recv_payload[i];
    if (t.kind == TransferKind::Activation) {
      m.batch = decode_metadata(recv_meta[i], headers[i][4], headers[i][6], device,
                                fmt::format("rank {}: {}", rank_, describe(t)));
      m.batch.router_loss = (*batches_)[static_cast<size_t>(t.microbatch)].router_loss;
      if (wire_check_) wire_check_(m.payload, m.batch);
      m.payload = activation_from_wire(m.payload, model_.stream_dtype());
    }
    const MessageKey key{t.kind, t.chunk, t.microbatch};
    MT_CHECK(inbox_.count(key) == 0, "pipeline: rank {} received {} twice", rank_, describe(t));
    inbox_.emplace(key, std::move(m));
  }
}

model::MicroBatch DualPipeVExecutor::forward_batch(int chunk, int microbatch, Tensor& input) {
  const StageChunk& c = *chunks_[static_cast<size_t>(chunk)];
  if (c.has_embedding()) return on_device_.at(static_cast<size_t>(microbatch));
  Message m = take({TransferKind::Activation, chunk, microbatch}, "forward");
  input = m.payload;
  if (!c.is_loss_stage()) return m.batch;
  // The loss stage is on rank 0, which holds the data: it reads the targets (and the metadata) itself.
  model::MicroBatch batch = on_device_.at(static_cast<size_t>(microbatch));
  MT_CHECK(batch.num_tokens() == input.size(0),
           "pipeline: micro-batch {} has {} tokens but the activation reaching the last stage has {} rows", microbatch,
           batch.num_tokens(), input.size(0));
  return batch;
}

Tensor DualPipeVExecutor::output_grad(int chunk, int microbatch) {
  if (chunks_[static_cast<size_t>(chunk)]->is_loss_stage()) return Tensor();
  return take({TransferKind::Gradient, chunk, microbatch}, "backward").payload;
}

void DualPipeVExecutor::after_forward(int chunk, int microbatch, const model::MicroBatch& batch, ChunkForward result) {
  const size_t layers = model_.layers().size();
  for (auto& [layer, values] : result.router_losses) {  // read at the step's end (on CUDA they stay on the device)
    router_values_.push_back(values);
    router_slots_.push_back((static_cast<size_t>(microbatch) * layers + static_cast<size_t>(layer)) * 3);
  }
  if (chunks_[static_cast<size_t>(chunk)]->is_loss_stage()) {
    losses_[static_cast<size_t>(microbatch)] = result.loss;
    return;
  }
  Message m;
  m.payload = std::move(result.hidden);
  m.batch = batch;
  if (rank_ == num_ranks_ - 1 && chunk == 0) {
    inbox_[{TransferKind::Activation, 1, microbatch}] = std::move(m);  // the bottom of the V: no message
  } else {
    outbox_[{TransferKind::Activation, chunk, microbatch}] = std::move(m);
  }
}

void DualPipeVExecutor::after_backward(int chunk, int microbatch, Tensor d_input) {
  if (chunks_[static_cast<size_t>(chunk)]->has_embedding()) return;
  Message m;
  m.payload = std::move(d_input);
  if (rank_ == num_ranks_ - 1 && chunk == 1) {
    inbox_[{TransferKind::Gradient, 0, microbatch}] = std::move(m);
  } else {
    outbox_[{TransferKind::Gradient, chunk, microbatch}] = std::move(m);
  }
}

void DualPipeVExecutor::run_steps(const std::vector<ChunkStep>& steps) {
  for (const ChunkStep& step : steps) {
    if (trace_) trace_->push_back(step.label);
    step.run();
  }
}

void DualPipeVExecutor::compute(const PipelineOp& op) {
  if (trace_) trace_->push_back("op: " + describe(op));
  switch (op.kind) {
    case OpKind::Forward: {
      const int c = op.forward.chunk, mb = op.forward.microbatch;
      Tensor input;
      const model::MicroBatch batch = forward_batch(c, mb, input);
      run_steps(chunks_[static_cast<size_t>(c)]->plan_forward(mb, batch, input, loss_scale_));
      after_forward(c, mb, batch, chunks_[static_cast<size_t>(c)]->finish_forward(mb));
      return;
    }
    case OpKind::BackwardInput:
    case OpKind::BackwardFull: {
      const int c = op.backward.chunk, mb = op.backward.microbatch;
      const bool full = op.kind == OpKind::BackwardFull;
      StageChunk& chunk = *chunks_[static_cast<size_t>(c)];
      run_steps(chunk.plan_backward(mb, output_grad(c, mb), loss_scale_, full));
      after_backward(c, mb, chunk.finish_backward(mb));
      if (!full) weight_queue_.push_back(op.backward);
      return;
    }
    case OpKind::Weight: {
      MT_CHECK(!weight_queue_.empty() && weight_queue_.front() == op.backward,
               "pipeline: rank {} op '{}' runs the weight gradients of chunk {} micro-batch {} but the oldest deferred "
               "one is {}",
               rank_, describe(op), op.backward.chunk, op.backward.microbatch,
               weight_queue_.empty() ? std::string("none")
                                     : fmt::format("chunk {} micro-batch {}", weight_queue_.front().chunk,
                                                   weight_queue_.front().microbatch));
      chunks_[static_cast<size_t>(op.backward.chunk)]->backward_weight(op.backward.microbatch);
      weight_queue_.pop_front();
      return;
    }
    case OpKind::OverlappedPair: {
      // DualPipe's overlapped_forward_backward: the forward of one micro-batch and the full backward of another,
      // stage by stage (F s1, B s5, F s3, B s3, F s5, B s1 per layer), each compute step followed by its
      // micro-batch's dispatch/combine, so that a communication of one always sits before a compute of the other.
      const int fc = op.forward.chunk, fmb = op.forward.microbatch;
      const int bc = op.backward.chunk, bmb = op.backward.microbatch;
      StageChunk& fwd = *chunks_[static_cast<size_t>(fc)];
      StageChunk& bwd = *chunks_[static_cast<size_t>(bc)];
      Tensor input;
      const model::MicroBatch batch = forward_batch(fc, fmb, input);
      const std::vector<ChunkStep> f_steps = fwd.plan_forward(fmb, batch, input, loss_scale_);
      const std::vector<ChunkStep> b_steps = bwd.plan_backward(bmb, output_grad(bc, bmb), loss_scale_, true);
      const auto f_slices = slices_of(f_steps), b_slices = slices_of(b_steps);
      for (size_t i = 0; i < std::max(f_slices.size(), b_slices.size()); ++i) {
        for (const auto* slices : {&f_slices, &b_slices}) {
          if (i >= slices->size()) continue;
          for (const ChunkStep* step : (*slices)[i]) {
            if (trace_) trace_->push_back(step->label);
            step->run();
          }
        }
      }
      after_forward(fc, fmb, batch, fwd.finish_forward(fmb));
      after_backward(bc, bmb, bwd.finish_backward(bmb));
      return;
    }
  }
  MT_FAIL("pipeline: op '{}' has an unknown kind", describe(op));
}

model::StepLoss DualPipeVExecutor::run_step(const std::vector<model::MicroBatch>& batches, int64_t global_num_targets) {
  const int n = static_cast<int>(batches.size());
  const std::vector<PipelineOp> ops = dualpipev_schedule(num_ranks_, rank_, n);  // refuses n < 2P
  for (auto& chunk : chunks_) chunk->clear();
  inbox_.clear();
  outbox_.clear();
  weight_queue_.clear();
  batches_ = &batches;
  const size_t layers = model_.layers().size();
  losses_.assign(static_cast<size_t>(n), model::LossSum{});
  router_table_.assign(static_cast<size_t>(n) * layers * 3, 0.0);
  router_values_.clear();
  router_slots_.clear();

  int64_t denominator = 0, num_tokens = 0;
  if (rank_ == 0) {
    int64_t local_targets = 0;
    for (const model::MicroBatch& b : batches) {
      b.validate(model_.config().vocab_size);
      local_targets += b.num_targets();
      num_tokens += b.num_tokens();
    }
    denominator = global_num_targets > 0 ? global_num_targets : local_targets;
    MT_CHECK(denominator > 0, "pipeline: the step has no counted targets (every target is -100)");
    loss_scale_ = 1.0 / static_cast<double>(denominator);
  }
  // Rank 0 holds the data (the embedding and the loss stage): its validated micro-batches go to the device in one copy.
  on_device_ = rank_ == 0 ? model::to_device(batches, model_.device()) : std::vector<model::MicroBatch>{};

  for (size_t k = 0; k < ops.size(); ++k) {
    commit(k == 0 ? std::vector<Transfer>{} : ops[k - 1].sends, ops[k].recvs);
    compute(ops[k]);
  }
  if (!ops.empty()) commit(ops.back().sends, {});
  batches_ = nullptr;
  on_device_.clear();
  MT_CHECK(inbox_.empty() && outbox_.empty() && weight_queue_.empty() && live_records() == 0,
           "pipeline: rank {} ended the step with {} unread messages, {} unsent, {} deferred weight gradients and {} "
           "live records",
           rank_, inbox_.size(), outbox_.size(), weight_queue_.size(), live_records());

  // The step's loss: rank 0 holds the cross-entropy, each rank the router losses of its layers; summed over pp in
  // rank order (x + 0 = x), then every rank adds them up in the single-rank driver's order.
  model::resolve_all(router_values_);
  for (size_t i = 0; i < router_values_.size(); ++i) {
    const model::RouterLossValues& values = router_values_[i];
    const size_t at = router_slots_[i];
    router_table_[at] = values.load_balance * static_cast<double>(values.tokens);
    router_table_[at + 1] = values.z_loss * static_cast<double>(values.tokens);
    router_table_[at + 2] = values.device_balance * static_cast<double>(values.tokens);
  }
  std::vector<double> sums(4 + router_table_.size(), 0.0);
  if (rank_ == 0) {
    model::resolve_losses(losses_);
    int64_t targets = 0;
    for (const model::LossSum& l : losses_) {
      sums[0] += l.ce_sum();
      targets += l.num_targets();
    }
    sums[1] = static_cast<double>(targets);
    sums[2] = static_cast<double>(num_tokens);
    sums[3] = static_cast<double>(denominator);
  }
  std::copy(router_table_.begin(), router_table_.end(), sums.begin() + 4);
  Tensor reduced = on_device(Tensor::from_vector(sums, {static_cast<int64_t>(sums.size())}), model_.device());
  comm_.all_reduce(default_stream(model_.device()), reduced, dist::ReduceOp::Sum);
  sums = reduced.to_vector<double>();

  model::StepLoss step;
  step.ce_sum = sums[0];
  step.num_targets = static_cast<int64_t>(sums[1]);
  step.num_tokens = static_cast<int64_t>(sums[2]);
  step.loss = step.ce_sum / sums[3];
  // Each layer's place among the MoE layers (-1: dense): step.layer_load_balance as finish_router_losses sums it
  // (per layer, over the micro-batches in order), the same bits as the plain executor's.
  std::vector<int64_t> moe_index;
  int64_t moe_layers = 0;
  for (const auto& layer : model_.layers()) moe_index.push_back(layer->has_experts() ? moe_layers++ : -1);
  step.layer_load_balance.assign(static_cast<size_t>(moe_layers), 0.0);
  for (size_t mb = 0; mb < static_cast<size_t>(n); ++mb) {
    for (size_t l = 0; l < layers; ++l) {
      step.load_balance += sums[4 + (mb * layers + l) * 3];
      step.z_loss += sums[4 + (mb * layers + l) * 3 + 1];
      step.device_balance += sums[4 + (mb * layers + l) * 3 + 2];
      if (moe_index[l] >= 0)
        step.layer_load_balance[static_cast<size_t>(moe_index[l])] += sums[4 + (mb * layers + l) * 3];
    }
  }
  const double weight = static_cast<double>(step.num_tokens) * static_cast<double>(std::max<int64_t>(moe_layers, 1));
  step.load_balance /= weight;
  step.z_loss /= weight;
  step.device_balance /= weight;
  for (double& lb : step.layer_load_balance) lb /= static_cast<double>(step.num_tokens);
  return step;
}

}  // namespace moetrain::pipeline
