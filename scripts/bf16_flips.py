# defines: check-golden's top-k flip rule applied to transformers' own bf16 routing of a Qwen3.5-MoE reference dump,
# the yardstick of the rule itself: a rule that fails transformers' own bf16 run fails any correct implementation.
# For the batch case it runs the dump's model in fp32 (the reference's router logits), 8 members of a rounding
# ensemble (every weight moved by one bf16 rounding, u = 2^-9, routing pinned to the reference's), and transformers'
# bf16 variants (scripts/bf16_variants.py: V0 autocast as the dump's bf16ref, V1 its delta rule in f32). Each bf16
# flip is judged as check-golden judges ours (src/cli/check_golden_judge.h, RoutingCheck): a near tie when the
# reference's margin is within 5 x sqrt(2) x the scale, or downstream of an explained flip of its row in an earlier
# MoE layer. Three scales are printed: sigma alone, max(sigma, the first member's move), and max(sigma, the largest
# move of the 8 members), the rule check-golden runs; and the share of all token-layer choices where a flip would be
# excused by sigma and by the rule. Needs torch and transformers 5.17.
# Usage: DEV=cpu python3 scripts/bf16_flips.py DUMP_DIR [DUMP_DIR ...]
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bf16_variants  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
bf16_variants.DEV = DEV
MEMBERS = 8
UNIT_BF16 = 2.0 ** -9
NEAR_TIE_SIGMAS = 5.0
PINNED = {"indices": None, "next": 0}  # the reference's top-k per MoE layer, in call order, while pinned


def route(self, hidden_states):
    """transformers' Qwen3_5MoeTopKRouter.forward, with the selection taken from PINNED when it is set."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    if PINNED["indices"] is None:
        values, indices = torch.topk(probs, self.top_k, dim=-1)
    else:
        indices = PINNED["indices"][PINNED["next"]]
        PINNED["next"] += 1
        values = probs.gather(1, indices)
    values = values / values.sum(dim=-1, keepdim=True)
    return logits, values.to(logits.dtype), indices


modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter.forward = route


def router_logits(model, ids):
    return [r.float() for r in model(input_ids=ids, output_router_logits=True).router_logits]


def member_moves(model, ids, reference, k):
    """Per member, per MoE layer: the largest |moved - reference| over each token's experts."""
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    moves = []
    for member in range(1, MEMBERS + 1):
        generator = torch.Generator().manual_seed(member)
        for _, p in model.named_parameters():
            noise = 2 * torch.rand(p.shape, generator=generator, dtype=torch.float64) - 1
            p.mul_((1 + UNIT_BF16 * noise).float().to(p.device))
        PINNED["indices"], PINNED["next"] = [torch.topk(r, k, dim=-1).indices for r in reference], 0
        moved = router_logits(model, ids)
        PINNED["indices"] = None
        moves.append([(m - r).abs().max(dim=-1).values for m, r in zip(moved, reference)])
        for n, p in model.named_parameters():
            p.copy_(kept[n])
    return moves


def judge(reference, ours, scales, rows, k):
    """Unexplained flips (first three listed) under per-layer, per-token scales; and how many flips there were."""
    tokens_per_row = reference[0].shape[0] // rows
    first_flip = [math.inf] * rows
    flips, unexplained = 0, []
    for layer, (r, o) in enumerate(zip(reference, ours)):
        explained_now = []
        ref_top = torch.topk(r, k, dim=-1).indices.sort(dim=-1).values
        our_top = torch.topk(o, k, dim=-1).indices.sort(dim=-1).values
        for t in torch.nonzero((ref_top != our_top).any(dim=-1)).flatten().tolist():
            ranked = torch.sort(r[t], descending=True).values
            margin = float(ranked[k - 1] - ranked[k])
            flips += 1
            near_tie = margin <= NEAR_TIE_SIGMAS * math.sqrt(2) * float(scales[layer][t])
            if near_tie or first_flip[t // tokens_per_row] <= t:
                explained_now.append(t)
            else:
                unexplained.append(f"layer {layer} token {t} margin {margin:.2e}")
        for t in explained_now:
            first_flip[t // tokens_per_row] = min(first_flip[t // tokens_per_row], t)
    return flips, unexplained


def excusable_share(reference, scales, k):
    """The share of token-layer choices whose reference margin is within the rule's bound at these scales."""
    within = total = 0
    for r, scale in zip(reference, scales):
        ranked = torch.sort(r, dim=-1, descending=True).values
        within += int((ranked[:, k - 1] - ranked[:, k] <= NEAR_TIE_SIGMAS * math.sqrt(2) * scale).sum())
        total += r.shape[0]
    return within / total


def main(dumps):
    for dump in dumps:
        ids = load_file(os.path.join(dump, "reference.safetensors"))["input_ids"].long().to(DEV)
        model = AutoModelForCausalLM.from_pretrained(dump, dtype=torch.float32, attn_implementation="eager").to(DEV)
        k = model.config.num_experts_per_tok
        with torch.no_grad():
            reference = router_logits(model, ids)
            moves = member_moves(model, ids, reference, k)
            largest = [torch.stack([m[layer] for m in moves]).max(dim=0).values for layer in range(len(reference))]
            for variant in ("V0", "V1"):
                bf16_variants.use_variant(variant)
                with torch.autocast(DEV, dtype=torch.bfloat16):
                    ours = router_logits(model, ids)
                bf16_variants.use_variant("V0")
                sigmas = [1.4826 * float((o - r).abs().flatten().median()) for o, r in zip(ours, reference)]
                by_sigma = [torch.full_like(m, s) for m, s in zip(largest, sigmas)]
                scales = {"sigma": by_sigma,
                          "first member": [torch.maximum(s, m) for s, m in zip(by_sigma, moves[0])],
                          f"largest of {MEMBERS}": [torch.maximum(s, m) for s, m in zip(by_sigma, largest)]}
                verdicts = []
                for name, scale in scales.items():
                    flips, unexplained = judge(reference, ours, scale, ids.shape[0], k)
                    listed = f" ({'; '.join(unexplained[:3])})" if unexplained else ""
                    verdicts.append(f"{name} {len(unexplained)}{listed}")
                covered = {name: excusable_share(reference, scale, k) for name, scale in scales.items()}
                print(f"{dump} {variant}: {flips} flips; unexplained by {', by '.join(verdicts)}; excusable choices: "
                      f"sigma {covered['sigma']:.3f}, largest of {MEMBERS} {covered[f'largest of {MEMBERS}']:.3f}",
                      flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
