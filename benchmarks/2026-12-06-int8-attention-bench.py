#!/usr/bin/env python
"""The row-invariant attention kernel alone (torch.ops.treespec.tree_attention_exact) at SmolLM2-135M's
shapes: q [1, 9, n, 64], k / v [1, 3, c + n, 64], a chain of n nodes after a prefix of c keys; one thread,
process CPU time per call (the median of 5 x 300 calls), so another process on the machine changes little.
    python benchmarks/2026-12-06-int8-attention-bench.py
    PYTHONPATH=<an older checkout> python benchmarks/2026-12-06-int8-attention-bench.py   # its extension
"""

import time

import torch

from treespec import ops
from treespec.core.tree import pack_bits

assert ops.available("cpu")
torch.set_num_threads(1)


def bench(n: int, c: int, reps: int = 300) -> float:
    L = c + n
    k, v, q = torch.randn(1, 3, L, 64), torch.randn(1, 3, L, 64), torch.randn(1, 9, n, 64)
    bits = pack_bits(torch.tril(torch.ones(n, n, dtype=torch.bool)))
    f = torch.ops.treespec.tree_attention_exact
    for _ in range(20):
        f(q, k, v, bits, 0.125)
    ts = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(reps):
            f(q, k, v, bits, 0.125)
        ts.append((time.process_time() - t0) / reps * 1e6)
    return sorted(ts)[2]


for n, c in [(1, 128), (16, 128), (16, 512), (1, 512)]:
    us = bench(n, c)
    print(f"n={n:3d} c={c:4d}: {us:7.1f} us per layer call (1 thread), x30 layers = {us * 30 / 1000:.2f} ms")
