// defines: MicroBatch construction and validation.
#include "model/batch.h"

#include <algorithm>
#include <vector>

#include "ops/attention.h"
#include "ops/loss.h"

namespace moetrain::model {

namespace {

Tensor positions_for(const Tensor& cu_seqlens, int64_t num_tokens) {
  std::vector<int32_t> positions(static_cast<size_t>(num_tokens));
  const int32_t* cu = cu_seqlens.data<int32_t>();
  for (int64_t d = 0; d + 1 < cu_seqlens.numel(); ++d) {
    for (int32_t t = cu[d]; t < cu[d + 1]; ++t) positions[static_cast<size_t>(t)] = t - cu[d];
  }
  return Tensor::from_vector(positions, {num_tokens});
}

}  // namespace

MicroBatch MicroBatch::to(Device device) const {
  if (device == this->device()) return *this;
  MicroBatch out = *this;
  out.input_ids = input_ids.to(device);
  out.targets = targets.to(device);
  out.position_ids = position_ids.to(device);
  out.cu_seqlens = cu_seqlens.to(device);
  return out;
}

std::vector<MicroBatch> to_device(const std::vector<MicroBatch>& batches, Device device) {
  constexpr int64_t kAlign = 64;  // i32 elements: 256 bytes, a device allocation's own alignment
  const auto fields = [](MicroBatch& b) {
    return std::vector<Tensor*>{&b.input_ids, &b.targets, &b.position_ids, &b.cu_seqlens};
  };
  std::vector<MicroBatch> out = batches;
  int64_t total = 0;
  for (MicroBatch& b : out) {
    if (b.device() == device) continue;
    for (Tensor* t : fields(b)) {
      MT_CHECK(t->dtype() == DType::I32 && t->dim() == 1 && t->is_contiguous() && t->device().is_cpu(),
               "micro-batch upload: expected contiguous i32 [n] tensors on the cpu but found {}", t->describe());
      total += (t->numel() + kAlign - 1) / kAlign * kAlign;
    }
  }
  if (total == 0) return out;
  Tensor staged = Tensor::zeros({total}, DType::I32, Device::cpu());
  int32_t* at = staged.data<int32_t>();
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (MicroBatch& b : out) {
    if (b.device() == device) continue;
    for (Tensor* t : fields(b)) {
      std::copy_n(t->data<int32_t>(), t->numel(), at + offset);
      offsets.push_back(offset);
      offset += (t->numel() + kAlign - 1) / kAlign * kAlign;
    }
  }
  const Tensor uploaded = staged.to(device);
  size_t next = 0;
  for (MicroBatch& b : out) {
    if (b.device() == device) continue;
    for (Tensor* t : fields(b)) {
      const int64_t begin = offsets[next++];
      *t = uploaded.slice(begin, begin + t->numel());
    }
  }
  return out;
}

MicroBatch MicroBatch::from_rows(const Tensor& input_ids, const Tensor& targets) {
  expect_dtype(input_ids, DType::I32, "micro-batch input_ids");
  MT_CHECK(input_ids.dim() == 2, "micro-batch input_ids: expected [B, T] but found {}", input_ids.describe());
  expect_shape(targets, input_ids.shape(), "micro-batch targets");
  const int64_t rows = input_ids.size(0), cols = input_ids.size(1);
  std::vector<int32_t> cu(static_cast<size_t>(rows + 1));
  for (int64_t b = 0; b <= rows; ++b) cu[static_cast<size_t>(b)] = static_cast<int32_t>(b * cols);
  return packed(input_ids.clone().view({-1}), targets.clone().view({-1}), Tensor::from_vector(cu, {rows + 1}));
}

MicroBatch MicroBatch::packed(const Tensor& input_ids, const Tensor& targets, const Tensor& cu_seqlens) {
  MicroBatch mb;
  mb.input_ids = input_ids.view({-1});
  mb.targets = targets.view({-1});
  mb.cu_seqlens = cu_seqlens.view({-1});
  ops::validate_cu_seqlens(mb.cu_seqlens, mb.input_ids.numel(), "micro-batch cu_seqlens");
  mb.cu_seqlens_host = mb.cu_seqlens;
  mb.position_ids = positions_for(mb.cu_seqlens, mb.input_ids.numel());
  const int32_t* t = mb.targets.data<int32_t>();
  for (int64_t i = 0; i < mb.targets.numel(); ++i) mb.num_targets_ += t[i] != ops::kIgnoreIndex;
  return mb;
}

MicroBatch MicroBatch::decode_step(const Tensor& input_ids, const Tensor& position_ids) {
  expect_dtype(input_ids, DType::I32, "decode step input_ids");
  expect_dtype(position_ids, DType::I32, "decode step position_ids");
  MT_CHECK(input_ids.dim() == 1 && input_ids.numel() >= 1 && input_ids.device().is_cpu(),
           "decode step input_ids: expected a non-empty [B] on the CPU but found {}", input_ids.describe());
  expect_shape(position_ids, input_ids.shape(), "decode step position_ids");
  const int64_t rows = input_ids.numel();
  const int32_t* pos = position_ids.data<int32_t>();
  for (int64_t t = 0; t < rows; ++t) {
    MT_CHECK(pos[t] >= 0, "decode step position_ids: position {} of token {} is negative", pos[t], t);
  }
  std::vector<int32_t> cu(static_cast<size_t>(rows + 1));
  for (int64_t t = 0; t <= rows; ++t) cu[static_cast<size_t>(t)] = static_cast<int32_t>(t);
  MicroBatch mb;
  mb.input_ids = input_ids.clone();
  mb.targets = Tensor::from_vector(std::vector<int32_t>(static_cast<size_t>(rows), ops::kIgnoreIndex), {rows});
  mb.cu_seqlens = Tensor::from_vector(cu, {rows + 1});
  mb.cu_seqlens_host = mb.cu_seqlens;
  mb.position_ids = position_ids.clone();
  return mb;
}

int64_t MicroBatch::max_document_length() const {
  if (!cu_seqlens_host.defined() || !cu_seqlens_host.device().is_cpu()) return 0;
  const int32_t* cu = cu_seqlens_host.data<int32_t>();
  int64_t longest = 0;
  for (int64_t d = 0; d + 1 < cu_seqlens_host.numel(); ++d) longest = std::max<int64_t>(longest, cu[d + 1] - cu[d]);
  return longest;
}

void MicroBatch::validate(int64_t vocab_size) const {
  MT_CHECK(device().is_cpu(), "micro-batch: validate a batch on the host, before moving it to {}", device().str());
  expect_dtype(input_ids, DType::I32, "micro-batch input_ids");
  expect_dtype(targets, DType::I32, "micro-batch targets");
  expect_dtype(position_ids, DType::I32, "micro-batch position_ids");
  MT_CHECK(input_ids.dim() == 1 && input_ids.numel() > 0,
           "micro-batch input_ids: expected a non-empty [T] but found {}", input_ids.describe());
  expect_shape(targets, input_ids.shape(), "micro-batch targets");
  expect_shape(position_ids, input_ids.shape(), "micro-batch position_ids");
  ops::validate_cu_seqlens(cu_seqlens, num_tokens(), "micro-batch cu_seqlens");
  const int32_t* ids = input_ids.data<int32_t>();
  const int32_t* tgt = targets.data<int32_t>();
  const int32_t* pos = position_ids.data<int32_t>();
  const int32_t* cu = cu_seqlens.data<int32_t>();
  for (int64_t t = 0; t < num_tokens(); ++t) {
    MT_CHECK(ids[t] >= 0 && ids[t] < vocab_size,
             "micro-batch: token id {} at position {} is outside the vocabulary [0, {})", ids[t], t, vocab_size);
    MT_CHECK(tgt[t] == ops::kIgnoreIndex || (tgt[t] >= 0 && tgt[t] < vocab_size),
             "micro-batch: target {} at position {} is neither -100 nor inside the vocabulary [0, {})", tgt[t], t,
             vocab_size);
  }
  for (int64_t d = 0; d < num_documents(); ++d) {
    for (int32_t t = cu[d]; t < cu[d + 1]; ++t) {
      MT_CHECK(pos[t] == t - cu[d],
               "micro-batch: position_ids[{}] is {} but document {} starts at token {}, so {} was expected", t, pos[t],
               d, cu[d], t - cu[d]);
    }
  }
}

}  // namespace moetrain::model
