# Time TreeKVCache.for_model inside generate() over the 26 Spec-Bench prompts, int8 plain loop (2026-12-07 d).
# usage: python benchmarks/log/2026-12-07-d-cache-allocation.py
import time, torch, treespec
from treespec.core.cache import TreeKVCache
from treespec.tools.workloads import build_workload
from treespec.api import DecodeOptions
model, tok = treespec.load_model(None, dtype="float32")
orig = TreeKVCache.for_model.__func__
costs = []
def timed(cls, *a, **k):
    t = time.perf_counter(); c = orig(cls, *a, **k); costs.append((time.perf_counter() - t, c.max_len)); return c
TreeKVCache.for_model = classmethod(timed)
qs = build_workload("spec-bench", tok, model, 26)
opts = DecodeOptions(numerics="int8")
treespec.generate(model, "hello", None, tok, max_new_tokens=8, options=opts)
costs.clear(); tot = 0
for q in qs:
    ids = q["ids"] if "ids" in q else q["turns"][0]
    t = time.perf_counter(); treespec.generate(model, ids, None, tok, max_new_tokens=128, options=opts); tot += time.perf_counter() - t
print(f"total {tot:.2f} s; cache allocation {sum(c for c, _ in costs):.3f} s over {len(costs)} caches")
print(sorted((round(c * 1e3, 1), n) for c, n in costs))
