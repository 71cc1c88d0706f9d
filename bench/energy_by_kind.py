# defines: the joules a TFLOP (or a GB) of each kind of work in the workload of record's step, at the GPU's power
# limit, through PyTorch's kernels on random operands, each held for ~1.5 s: dense GEMM (the head's forward shape),
# grouped GEMM (the experts' gate_up shape), cuDNN causal attention forward and forward + backward (the workload's
# shape), an HBM copy, and the idle power after them. A step at the limit is as fast as its joules allow, so these
# rates, weighted by the step's FLOPs and bytes, say where its joules go (docs/gpu_notes.md, twenty-fifth session).
#   python3 bench/energy_by_kind.py
import time, torch, torch.nn.functional as F
from gpu_energy import gpu_energy_j
dev = "cuda"
def measure(name, fn, work, unit):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t0 = time.time(); n = 0
    while time.time() - t0 < 0.3: fn(); n += 1
    torch.cuda.synchronize(); per = (time.time() - t0) / n; calls = max(10, int(1.5 / per))
    torch.cuda.synchronize(); j0 = gpu_energy_j(); t0 = time.time()
    for _ in range(calls): fn()
    torch.cuda.synchronize(); t = (time.time() - t0) / calls; j1 = gpu_energy_j()
    if j0 is None or j1 is None: raise SystemExit("energy_by_kind: NVML's energy counter cannot be read here")
    j = (j1 - j0) / calls
    print(f"{name:34s} {t*1e3:8.3f} ms {work/t:8.1f} {unit}/s {j/t:6.0f} W {j/work:7.3f} J/{unit}", flush=True)
x = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16); w = torch.randn(151936, 2048, device=dev, dtype=torch.bfloat16)
measure("dense gemm, head forward", lambda: x @ w.t(), 2 * 8192 * 2048 * 151936 / 1e12, "TFLOP")
del w
E, K, N, rows = 128, 2048, 1536, 65536
A = torch.randn(rows, K, device=dev, dtype=torch.bfloat16); Wt = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16)
offs = torch.cumsum(torch.full((E,), rows // E, dtype=torch.int32), 0).to(torch.int32).to(dev)
measure("grouped gemm, gate_up forward", lambda: torch._grouped_mm(A, Wt, offs=offs), 2 * rows * K * N / 1e12, "TFLOP")
del A, Wt
from torch.nn.attention import sdpa_kernel, SDPBackend
B, H, S, D = 2, 32, 4096, 128
q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
fl = 4 * B * H * S * S * D / 2 / 1e12
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    measure("cudnn attention forward", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), fl, "TFLOP")
    go = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
    measure("cudnn attention forward+backward", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(go), 3.5 * fl, "TFLOP")
del q, k, v
a = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
measure("hbm copy (read + write)", lambda: b.copy_(a), 2 * a.numel() / 1e9, "GB")
idle0 = gpu_energy_j(); time.sleep(1.0); print(f"{'idle':34s} {gpu_energy_j() - idle0:6.0f} W")
