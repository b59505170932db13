"""Session 36 (log f): A/B in one process, the 13 held-out ShareGPT prompts alternated: a recipe with its heads
drafting natively in int8 / float or through torch, and optionally the planner's level count forced.

    python benchmarks/log/2026-12-07-f-heads-recipes-ab.py NUMERICS RECIPE CONFIGS [ROUNDS]
    python benchmarks/log/2026-12-07-f-heads-recipes-ab.py int8 dynamic+suffix int8,float,int8:1,int8:2
    python benchmarks/log/2026-12-07-f-heads-recipes-ab.py int8 heads int8,float,torch
"""
import sys, time, torch, treespec
from treespec.core import planner as P
from treespec.tools.workloads import sharegpt_heldout
from treespec.drafters.medusa import SequentialDrafter
torch.set_num_threads(2)
numerics, recipe, configs = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
orig = P.TreePlanner.choose_levels
def choose(self, rates, drafted):
    orig(self, rates, drafted)
    if getattr(self, "forced", -1) >= 0: self.levels = self.forced
P.TreePlanner.choose_levels = choose
model, tok = treespec.load_model()
opts = treespec.DecodeOptions(numerics=numerics)
prompts = [p["turns"][0] for p in sharegpt_heldout(13)]
drafters = {}
for name in configs:  # e.g. int8, float, torch, int8:2 (levels forced to 2)
    kind, _, forced = name.partition(":")
    rec = treespec.recipes.resolve(recipe, model)
    parts = treespec.recipes.Parts.shipped(model, rec, numerics=numerics)
    d = treespec.recipes.build(rec, parts)
    for s in getattr(d, "sources", [d]):
        if isinstance(s, SequentialDrafter):
            s.wants_native = kind != "torch"; s.int8 = kind == "int8"; s._bind_native()
    if forced:
        d.forced = d.levels = int(forced)
    treespec.generate(model, prompts[0], d, tok, max_new_tokens=16, options=opts)
    drafters[name] = d
T = dict.fromkeys(configs, 0.0); N = dict.fromkeys(configs, 0); S = dict.fromkeys(configs, 0)
D = dict.fromkeys(configs, 0.0); V = dict.fromkeys(configs, 0.0)
for r in range(rounds):
    for i, p in enumerate(prompts):
        order = configs if (i + r) % 2 == 0 else configs[::-1]
        for k in order:
            t = time.perf_counter()
            res = treespec.generate(model, p, drafters[k], tok, max_new_tokens=128, options=opts)
            T[k] += time.perf_counter() - t; N[k] += len(res.token_ids); S[k] += res.stats.steps
            D[k] += res.stats.time_draft; V[k] += res.stats.time_verify
for k in configs:
    d = drafters[k]
    nodes = d.counts["nodes"] / d.counts["steps"] if hasattr(d, "counts") else float("nan")
    print(f"{recipe}@{numerics} {k:>8}: {N[k]/T[k]:6.1f} tok/s  accept {N[k]/S[k]:.2f}  draft {1000*D[k]/S[k]:.2f}  verify {1000*V[k]/S[k]:.2f} ms/step  nodes {nodes:.2f}")
