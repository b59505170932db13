"""One attention call of a sliding-window layer past its window (window 512), against the compiled
tree-attention kernel over the whole prefix, at two public shapes' head layouts; best of 5 runs of 200 calls.

    python benchmarks/log/2026-12-08-a-window-attention.py
"""

from __future__ import annotations

import time
from functools import partial

import torch

from treespec.core.attention import AttentionPlan, treespec_attention
from treespec.core.tree import Tree


def best_us(f, reps: int = 200) -> float:
    for _ in range(10):
        f()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        runs.append((time.perf_counter() - t0) / reps * 1e6)
    return min(runs)


def main() -> None:
    torch.manual_seed(0)
    wide = Tree.from_choices([[i] for i in range(3)] + [[i, j] for i in range(3) for j in range(4)])
    for heads, kv_heads, dim, name in [(4, 1, 256, "Gemma-3-270M heads"), (32, 8, 128, "Mistral-7B heads")]:
        for prefix in (1024, 4096):
            for tree in (None, Tree.chain(3), wide):
                n = 1 if tree is None else tree.num_nodes
                plan = AttentionPlan.for_tree(tree, "compiled", "cpu")
                q = torch.randn(1, heads, n, dim)
                k, v = torch.randn(2, 1, kv_heads, prefix + n, dim)
                args = (None, q, k, v, None, 0.06)
                whole = best_us(partial(treespec_attention, *args, tree_attention=plan))
                window = best_us(partial(treespec_attention, *args, tree_attention=plan, sliding_window=512))
                capped = best_us(
                    partial(treespec_attention, *args, tree_attention=plan, sliding_window=512, softcap=50.0)
                )
                print(
                    f"| {name} | {prefix} | {n} | {whole:.0f} | {window:.0f} ({window / whole:.2f}x) | "
                    f"{capped:.0f} ({capped / whole:.2f}x) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
