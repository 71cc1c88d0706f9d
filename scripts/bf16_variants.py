# defines: transformers' own bf16 run of a reference dump with more precise placements of its roundings, the
# yardstick of what an implementation as good as transformers gets under check-golden's bf16 rule. Under
# torch.autocast the torch fallback of the gated delta rule runs its matmuls in bf16 and the causal conv rounds its
# output before the SiLU rounds again; V1 runs the delta rule with autocast off (f32 matmuls), V12 also the conv and
# its SiLU (one rounding of their output). V0 is autocast as the dump's own bf16ref (a check of the harness). Writes,
# per gradient tensor (and the logits), the relative error of each run against the dump's fp32 reference, and
# transformers' own (bf16ref) as "theirs". Needs torch and transformers 5.17 (the GPU machine has both).
# Usage: DEV=cuda python3 scripts/bf16_variants.py DUMP_DIR OUT.json
import os
import sys
import json

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

DEV = os.environ.get("DEV", "cuda")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
MODULES = (modeling_qwen3_5, modeling_qwen3_5_moe)
ORIGINAL = {m: (m.torch_chunk_gated_delta_rule, m.causal_conv1d_fn) for m in MODULES}


def without_autocast(fn):
    def run(*args, **kwargs):
        with torch.autocast(DEV, enabled=False):
            return fn(*args, **kwargs)
    return run


def use_variant(name):
    for module, (rule, conv) in ORIGINAL.items():
        module.torch_chunk_gated_delta_rule = without_autocast(rule) if name in ("V1", "V12") else rule
        module.causal_conv1d_fn = without_autocast(conv) if name == "V12" else conv


def relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(dump, out_path):
    ref = load_file(os.path.join(dump, "reference.safetensors"))
    ids = ref["input_ids"].long().to(DEV)
    targets = ref["targets"].long().to(DEV)
    counted = int((targets != -100).sum())
    model = AutoModelForCausalLM.from_pretrained(dump, dtype=torch.float32, attn_implementation="eager").to(DEV)
    names = [k[len("grad."):] for k in ref if k.startswith("grad.")]
    out = {"theirs": {k: relative(ref["bf16ref.grad." + k], ref["grad." + k]) for k in names}}
    out["theirs"]["logits"] = relative(ref["bf16ref.logits"], ref["logits"])
    for variant in ("V0", "V1", "V12"):
        use_variant(variant)
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100,
                               reduction="sum") / counted
        loss.backward()
        grads = {k: p.grad.detach().cpu() for k, p in model.named_parameters() if p.grad is not None}
        out[variant] = {k: relative(grads[k], ref["grad." + k]) for k in names}
        out[variant]["logits"] = relative(logits.float().detach().cpu(), ref["logits"])
    with open(out_path, "w") as f:
        json.dump(out, f)
    for variant in ("V0", "V1", "V12"):
        worst = max(names, key=lambda k: out[variant][k] / (1.5 * out["theirs"][k] + 1 / 256))
        print(f"{dump} {variant}: logits {out[variant]['logits']:.3f} (theirs {out['theirs']['logits']:.3f}); worst "
              f"{worst} {out[variant][worst]:.3f} (theirs {out['theirs'][worst]:.3f})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
