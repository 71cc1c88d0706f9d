# Makes fixture.json: YaRN inv_freq and attention factor as transformers computes them (ROPE_INIT_FUNCTIONS["yarn"],
# i.e. modeling_rope_utils._compute_yarn_parameters) for a few configs, plus DeepSeek-V2's softmax scale
# (modeling_deepseek_v2.yarn_apply_mscale). Run: /work/venv-golden/bin/python make_fixture.py (torch, transformers 5.17).
# torch's f32 `base ** exponents` runs through SIMD pow (Sleef) in chunks of 2 vectors and libm powf for the rest, so
# its last bits depend on the CPU's vector width; the script also runs itself with ATEN_CPU_CAPABILITY=default
# (libm powf for every element) and keeps both results.
import json, os, subprocess, sys
import torch, transformers
from transformers import DeepseekV2Config, GptOssConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

def yarn(**rope): return dict(rope_type="yarn", **rope)
CASES = {  # name: (config, rotary_dim, qk_head_dim for the softmax scale or None)
    "deepseek_v2": (DeepseekV2Config(qk_rope_head_dim=64, qk_nope_head_dim=128, max_position_embeddings=163840,
        rope_parameters=yarn(rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                             beta_slow=1, mscale=0.707, mscale_all_dim=0.707)), 64, 192),
    "gpt_oss": (GptOssConfig(), 64, None),  # the released gpt-oss rope: the config's defaults
    "gpt_oss_golden": (GptOssConfig(head_dim=32, max_position_embeddings=4096), 32, None),  # shared/golden/gpt_oss
    # partial rotary (64 * 0.625 = 40), f32-inexact factor, mscale without mscale_all_dim (ignored by transformers)
    "partial_mscale_only": (LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=14600,
        rope_parameters=yarn(rope_theta=500000.0, factor=7.3, original_max_position_embeddings=2000, beta_fast=24,
                             beta_slow=2.5, mscale=0.5, partial_rotary_factor=0.625)), 40, None),
    # equal betas, no truncation: low == high, the ramp's +0.001 guard; explicit attention_factor
    "equal_betas": (LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=400,
        rope_parameters=yarn(rope_theta=10000.0, factor=4.0, original_max_position_embeddings=100, beta_fast=8,
                             beta_slow=8, attention_factor=0.9, truncate=False)), 16, None),
    # rotary 128 (two SIMD chunks), no truncation: a ramp whose f32 rounding differs from a double ramp
    "rotary128_untruncated": (LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=262144,
        rope_parameters=yarn(rope_theta=1e6, factor=32.0, original_max_position_embeddings=8192, beta_fast=24,
                             truncate=False)), 128, None),
    # tiny original length (low bound clamps to 0), mscale / mscale_all_dim ratio != 1
    "mscale_ratio": (DeepseekV2Config(qk_rope_head_dim=32, qk_nope_head_dim=64, max_position_embeddings=1024,
        rope_parameters=yarn(rope_theta=10000.0, factor=16.0, original_max_position_embeddings=64, mscale=1.0,
                             mscale_all_dim=0.5)), 32, 96),
}

def compute():
    out = {}
    for name, (config, rotary_dim, qk_head_dim) in CASES.items():
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        assert inv_freq.dtype == torch.float32 and inv_freq.numel() == rotary_dim // 2, name
        case = {"rotary_dim": rotary_dim, "rope_parameters": dict(config.rope_parameters),
                "attention_factor": float(attention_factor), "inv_freq": inv_freq.tolist()}
        if qk_head_dim is not None:
            case["qk_head_dim"] = qk_head_dim
            case["softmax_scale"] = yarn_apply_mscale(config.rope_parameters, qk_head_dim ** (-0.5))
        out[name] = case
    return out

if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(compute())); sys.exit()
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    scalar = json.loads(subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                                       capture_output=True, text=True).stdout)
    cases = compute()
    for name, case in cases.items():
        assert scalar[name]["attention_factor"] == case["attention_factor"]
        case["inv_freq_libm_pow"] = scalar[name]["inv_freq"]
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixture.json"), "w") as f:
        json.dump({"made_by": meta, "cases": cases}, f, indent=1)
        f.write("\n")
