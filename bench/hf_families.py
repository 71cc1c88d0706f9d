# What users run today: HF transformers 5.17 training steps for other families at real dims (first 4 layers, bf16, 4 micro-batches of 4096 tokens per step).
# Copied from the project's shared baseline scripts; FAMILIES (e.g. "deepseek_v2_lite_4l") picks which to run (default: all).
import os, json, torch, transformers, time
from gpu_energy import gpu_energy_j, joules_between
from transformers import AutoModelForCausalLM
res = {}
def cfgs():
    yield "deepseek_v2_lite_4l", transformers.DeepseekV2Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, topk_method="greedy", max_position_embeddings=8192,
        tie_word_embeddings=False), "sdpa"
    yield "gpt_oss_20b_4l", transformers.GptOssConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=8192, tie_word_embeddings=False), "eager"
    # Qwen3.5-35B-A3B: transformers 5.17's Qwen3_5MoeTextConfig defaults are its dimensions; its first 4 layers.
    yield "qwen3_5_moe_4l", transformers.Qwen3_5MoeTextConfig(num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=8192, tie_word_embeddings=False), "sdpa"
def kernels_picked(model):
    # Which kernels transformers runs on this machine: the gated delta rule and conv1d come from flash-linear-attention
    # and causal-conv1d when importable (else its torch chunked / conv fallbacks); the experts from its experts backend.
    import importlib.util
    picked = {"fla": importlib.util.find_spec("fla") is not None,
              "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
              "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    import inspect, sys
    modeling = sys.modules.get(type(model).__module__)
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(modeling, name, None)
        if fn is not None:  # the wrapper of use_kernel_func_from_hub_with_fallback holds the implementation it chose
            impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
            picked[name] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
    return picked
wanted = [f for f in os.environ.get("FAMILIES", "").split(",") if f]
for name, cfg, attn in cfgs():
    if wanted and name not in wanted:
        continue
    try:
        torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn).cuda()
        B, S, ACC = 1, 4096, 4
        ids = torch.randint(0, cfg.vocab_size, (B, S), device="cuda")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        def step():
            for _ in range(ACC):
                out = m(input_ids=ids, labels=ids); (out.loss / ACC).backward()
            opt.step(); opt.zero_grad(set_to_none=True)
        timed = int(os.environ.get("HF_STEPS", 3))  # more for a steadier energy figure (the counter's windows)
        step(); torch.cuda.synchronize(); t0 = time.time(); j0 = gpu_energy_j()
        for _ in range(timed): step()
        torch.cuda.synchronize(); t = (time.time() - t0) / timed; joules = joules_between(j0, gpu_energy_j(), timed)
        res[name] = {"attn": attn, "tok_s": B * S * ACC / t, "step_s": t, "peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
                     "params": sum(p.numel() for p in m.parameters()), "kernels": kernels_picked(m)}
        if joules is not None: res[name].update(joules_per_step=joules, mean_power_W=joules / t)
        print(name, res[name], flush=True)
        del m, opt
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
json.dump(res, open(os.path.join(os.environ.get("RESULTS_DIR", "/tmp"), "hf_families.json"), "w"), indent=1)
