# Makes tests/data/mxfp4/experts.safetensors: a small synthetic MXFP4 pair as GPT-OSS checkpoints store expert weights
# (`blocks` u8 [E, R, G, 16], `scales` u8 e8m0 [E, R, G]) and what transformers 5.17's own decoder,
# integrations.mxfp4.convert_moe_packed_tensors, makes of it: `dequantized_bf16` (its default dtype, the one its
# loader uses) and `dequantized_f32` (dtype=float32), both [E, G * 32, R] (it ends with transpose(1, 2)). The fixture
# of tests/io/mxfp4_test.cpp. Run from the repository root with the golden venv:
#   /work/venv-golden/bin/python scripts/make_mxfp4_fixture.py
# The bytes are seeded; the tensors repeat bit for bit, the header's metadata order may not.
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

EXPERTS, ROWS, GROUPS = 3, 6, 4  # decoded [3, 128, 6]

gen = torch.Generator().manual_seed(2027)
blocks = torch.randint(0, 256, (EXPERTS, ROWS, GROUPS, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
# Scales: the extremes (2^-127, the subnormal scale, up to 2^127, where 2.0 and above overflow to inf), the values
# next to 127, then half near 127 (where real checkpoints sit) and half across the whole valid range [0, 254].
extremes = [0, 1, 2, 63, 125, 126, 127, 128, 129, 191, 252, 253, 254]
count = EXPERTS * ROWS * GROUPS
rest = count - len(extremes)
near = torch.randint(110, 145, (rest // 2,), generator=gen, dtype=torch.int32)
wide = torch.randint(0, 255, (rest - rest // 2,), generator=gen, dtype=torch.int32)
flat = torch.cat([torch.tensor(extremes, dtype=torch.int32), near, wide])
flat = flat[torch.randperm(count, generator=gen)]
scales = flat.to(torch.uint8).reshape(EXPERTS, ROWS, GROUPS)

low, high = set((blocks & 0x0F).flatten().tolist()), set((blocks >> 4).flatten().tolist())
assert low == set(range(16)) and high == set(range(16)), "some nibble value is missing: pick another seed"
assert set(extremes) <= set(scales.flatten().tolist()) and 255 not in scales.flatten().tolist()

bf16 = convert_moe_packed_tensors(blocks.clone(), scales.clone())
f32 = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
assert bf16.dtype == torch.bfloat16 and bf16.shape == (EXPERTS, GROUPS * 32, ROWS)
assert torch.equal(bf16.float(), f32), "the bf16 and f32 decodings differ: every value should be exact in both"
assert torch.isinf(f32).any() and (f32.abs() < 2.0**-126).logical_and(f32 != 0).any(), "no overflow / subnormal"

# What transformers makes of scale byte 255 (e8m0 NaN), which the engine refuses: ldexp by 128, so +-0.5 -> +-2^127,
# +-1 .. +-6 -> +-inf, +-0 -> +-0 (no NaN). Checked here so the engine's documentation of it stays true.
probe = torch.tensor([[[[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] + [0] * 8]]], dtype=torch.uint8)
got = convert_moe_packed_tensors(probe, torch.full((1, 1, 1), 255, dtype=torch.uint8), dtype=torch.float32)
want = torch.tensor([v * 2.0**128 if v != 0 else v for v in FP4_VALUES], dtype=torch.float64).float()
assert torch.equal(got[0, :16, 0], want), got[0, :16, 0]

out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "mxfp4")
os.makedirs(out_dir, exist_ok=True)
out = os.path.normpath(os.path.join(out_dir, "experts.safetensors"))
save_file({"blocks": blocks.contiguous(), "scales": scales.contiguous(), "dequantized_bf16": bf16.contiguous(),
           "dequantized_f32": f32.contiguous()}, out,
          metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                    "function": "transformers.integrations.mxfp4.convert_moe_packed_tensors"})
print(f"wrote {out} ({os.path.getsize(out)} bytes): blocks {list(blocks.shape)}, scales {list(scales.shape)}, "
      f"decoded {list(f32.shape)}, {int(torch.isinf(f32).sum())} infinite values")
