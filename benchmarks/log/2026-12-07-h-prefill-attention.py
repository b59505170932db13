"""Log h (session 38): a prompt's causal attention from an empty cache, SDPA against treespec's CPU op, per
layer (float32, SmolLM2's 9 / 3 heads, D 64), at the token counts given:

    python benchmarks/log/2026-12-07-h-prefill-attention.py 256,768,2000,4000
"""
import torch, time, sys, treespec
import torch.nn.functional as F
from treespec import ops
ops.available("cpu")
torch.manual_seed(0)
for n in map(int, sys.argv[1].split(",")):
    q = torch.randn(1, 9, n, 64); k = torch.randn(1, 3, n, 64); v = torch.randn(1, 3, n, 64)
    fs = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True),
        "treespec": lambda: torch.ops.treespec.tree_attention(q, k, v, None, 0.125),
    }
    a = fs["sdpa"](); b = fs["treespec"]().transpose(1, 2)
    err = (a - b).abs().max().item()
    res = {name: [] for name in fs}
    reps = max(3, int(3000 / n))
    for r in range(5):
        for name, f in fs.items():
            t0 = time.perf_counter()
            for _ in range(reps): f()
            res[name].append((time.perf_counter() - t0) / reps)
    flops = n * n / 2 * 64 * 2 * 9
    print(f"n={n} err {err:.1e} " + "  ".join(f"{k}: {1e3*min(v):.2f} ms ({flops/min(v)/1e9:.0f} GFMA/s)" for k, v in res.items()), flush=True)
