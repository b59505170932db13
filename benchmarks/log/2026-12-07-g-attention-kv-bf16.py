"""Log g (session 37): the row-invariant attention op (`torch.ops.treespec.tree_attention_exact`) over float32
and over bf16 K/V under float32 queries, SmolLM2's heads (9 query, 3 KV, D 64), 30 layers' K/V of L keys (from
memory), n query tokens, causal; the fastest of five passes.

    python benchmarks/log/2026-12-07-g-attention-kv-bf16.py
"""
import torch, time, sys
from treespec import ops
ops.available("cpu")
f = torch.ops.treespec.tree_attention_exact
for threads in (1, 2):
    torch.set_num_threads(threads)
    for L in (1024, 4000):
        for n in (1, 4):
            q = torch.randn(1, 9, n, 64)
            res = {}
            for dt in (torch.float32, torch.bfloat16):
                ks = [torch.randn(1, 3, L, 64).to(dt) for _ in range(30)]; vs = [torch.randn(1, 3, L, 64).to(dt) for _ in range(30)]
                for _ in range(2):
                    for i in range(30): f(q, ks[i], vs[i], None, 0.125)
                best = 1e9
                for _ in range(5):
                    t0 = time.perf_counter()
                    for i in range(30): f(q, ks[i], vs[i], None, 0.125)
                    best = min(best, time.perf_counter() - t0)
                res[str(dt)[6:]] = best * 1e3
            print(f"threads {threads} L {L} n {n}: " + "  ".join(f"{k} {v:.2f} ms" for k, v in res.items()), flush=True)
