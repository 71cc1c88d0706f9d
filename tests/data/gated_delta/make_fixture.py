"""Makes tests/data/gated_delta/fixture.safetensors: what transformers 5.17's Qwen3.5 Gated DeltaNet functions compute
(forward and, through autograd, backward) on small seeded inputs, in f32 on the CPU. Run with
/work/venv-golden/bin/python tests/data/gated_delta/make_fixture.py (torch and transformers 5.17 needed).

- The rule: raw q, k [B, S, Hk, dk] (L2-normalised inside, use_qk_l2norm_in_kernel=True, as Qwen3_5GatedDeltaNet calls
  it), v [B, S, Hv, dv], g and beta from the gates of Qwen3_5GatedDeltaNet.forward (a, b, A_log, dt_bias), q and k
  repeat_interleave'd to Hv heads as the layer does. Both torch_recurrent_gated_delta_rule and
  torch_chunk_gated_delta_rule (chunk 16, so a chunk boundary falls inside each sequence) run; the gradients are the
  recurrent form's, the chunked form's output is saved beside it to show they agree. Each batch row is one document.
- The conv: causal_conv1d_fn (silu) on x [B, C, S] with w [C, K].
- The gated norm: Qwen3_5RMSNormGated on x, z [N, D].
Every loss is sum(output * upstream) with a seeded upstream gradient, saved as d<name>.
"""

import os

import torch
from safetensors.torch import save_file
from transformers.models.qwen3_5 import modeling_qwen3_5 as m

torch.manual_seed(1234)
B, S, HK, HV, DK, DV = 2, 24, 1, 2, 8, 4
out = {}


def leaf(name, t):
    t = t.detach().clone().requires_grad_(True)
    out[name] = t.detach().clone()
    return t


# The rule, with the gates in front as the layer computes them.
q = leaf("q", torch.randn(B, S, HK, DK))
k = leaf("k", torch.randn(B, S, HK, DK))
v = leaf("v", torch.randn(B, S, HV, DV))
a = leaf("a", torch.randn(B, S, HV))
b = leaf("b", torch.randn(B, S, HV))
A_log = leaf("A_log", torch.log(torch.empty(HV).uniform_(0.5, 4.0)))
dt_bias = leaf("dt_bias", torch.randn(HV) * 0.5)
beta = b.sigmoid()
g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
rq, rk = q.repeat_interleave(HV // HK, dim=2), k.repeat_interleave(HV // HK, dim=2)
rec, _ = m.torch_recurrent_gated_delta_rule(rq, rk, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
with torch.no_grad():
    chunk, _ = m.torch_chunk_gated_delta_rule(rq, rk, v, g=g, beta=beta, chunk_size=16, use_qk_l2norm_in_kernel=True)
out["g"], out["beta"], out["out"], out["out_chunk"] = g.detach(), beta.detach(), rec.detach(), chunk
dout = torch.randn_like(rec)
out["dout"] = dout
(rec * dout).sum().backward()
for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
    out["d" + name] = t.grad.detach().clone()

# The causal conv with its SiLU: x [B, C, S] as the layer passes it (mixed_qkv.transpose(1, 2)).
C, K = 6, 4
conv_x = leaf("conv_x", torch.randn(B, C, S))
conv_w = leaf("conv_w", torch.randn(C, K) * 0.5)
conv_y = m.causal_conv1d_fn(conv_x, conv_w, None, activation="silu")
out["conv_y"] = conv_y.detach()
conv_dy = torch.randn_like(conv_y)
out["conv_dy"] = conv_dy
(conv_y * conv_dy).sum().backward()
out["conv_dx"], out["conv_dw"] = conv_x.grad.detach().clone(), conv_w.grad.detach().clone()

# The gated output norm.
N, D = 10, 8
norm = m.Qwen3_5RMSNormGated(D, eps=1e-6)
with torch.no_grad():
    norm.weight.copy_(torch.randn(D) * 0.5 + 1.0)
norm_x = leaf("norm_x", torch.randn(N, D))
norm_z = leaf("norm_z", torch.randn(N, D))
out["norm_w"] = norm.weight.detach().clone()
norm_y = norm(norm_x, norm_z)
out["norm_y"] = norm_y.detach()
norm_dy = torch.randn_like(norm_y)
out["norm_dy"] = norm_dy
(norm_y * norm_dy).sum().backward()
out["norm_dx"], out["norm_dz"] = norm_x.grad.detach().clone(), norm_z.grad.detach().clone()
out["norm_dw"] = norm.weight.grad.detach().clone()

out = {name: t.contiguous().to(torch.float32) for name, t in out.items()}
chunk_vs_recurrent = ((out["out_chunk"] - out["out"]).norm() / out["out"].norm()).item()
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixture.safetensors")
import transformers  # noqa: E402

save_file(out, path, metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                               "chunk_vs_recurrent_rel": f"{chunk_vs_recurrent:.3e}"})
print(f"wrote {path} ({os.path.getsize(path)} bytes); chunked vs recurrent relative difference {chunk_vs_recurrent:.3e}")
