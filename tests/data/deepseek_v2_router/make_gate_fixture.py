# Makes gate.safetensors: what transformers 5.17's DeepSeek-V2 gate (DeepseekV2TopkRouter, topk_method
# "group_limited_greedy") computes for a small seeded case, the fixture of Router.MatchesTransformersDeepseekV2Gate
# (tests/ops/router_test.cpp). Run with the golden venv from the repository root:
#   /work/venv-golden/bin/python tests/data/deepseek_v2_router/make_gate_fixture.py
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

TOKENS, HIDDEN, EXPERTS, GROUPS, TOPK_GROUPS, TOP_K, SCALE = 64, 16, 16, 4, 2, 3, 16.0

torch.manual_seed(2026)
config = DeepseekV2Config(hidden_size=HIDDEN, num_attention_heads=1, n_routed_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, n_group=GROUPS, topk_group=TOPK_GROUPS,
                          topk_method="group_limited_greedy", routed_scaling_factor=SCALE)
gate = DeepseekV2TopkRouter(config)
with torch.no_grad():
    gate.weight.normal_(0.0, 1.0)
x = torch.randn(TOKENS, HIDDEN, dtype=torch.float32)
with torch.no_grad():
    logits, topk_weight, topk_idx = gate(x)

# The group mask must matter: some tokens' selection differs from the plain top-k of the softmax.
greedy = torch.topk(logits.softmax(dim=-1), k=TOP_K, dim=-1).indices
changed = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(topk_idx, greedy))
assert changed > 0, "the group mask changed no token's selection: pick another seed"

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gate.safetensors")
save_file({"x": x.contiguous(), "weight": gate.weight.detach().contiguous(), "logits": logits.contiguous(),
           "topk_idx": topk_idx.to(torch.int64).contiguous(), "topk_weight": topk_weight.contiguous()}, out,
          metadata={"transformers": transformers.__version__, "torch": torch.__version__, "num_groups": str(GROUPS),
                    "topk_groups": str(TOPK_GROUPS), "top_k": str(TOP_K), "scaling_factor": str(SCALE),
                    "tokens_changed_by_the_group_mask": str(changed)})
print(f"wrote {out}: {TOKENS} tokens, {changed} changed by the group mask")
