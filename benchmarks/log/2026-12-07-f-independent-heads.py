"""Session 36 (log f): independent (Medusa-1) heads of the default model's shape (4 heads, one residual block,
random weights: speed does not depend on them) proposing one row through torch and natively in float and
int8, with the full output vocabulary and with a 4096-token draft vocabulary. Medians of 100, warm caches.

    python benchmarks/log/2026-12-07-f-independent-heads.py
"""

import time

import torch

import treespec
from treespec.drafters.medusa import MedusaDrafter

torch.set_num_threads(2)
torch.set_grad_enabled(False)
model, _ = treespec.load_model()
hidden, root = torch.randn(1, model.config.hidden_size), torch.tensor([5])
print("draft vocab  heads drafted  torch ms  float ms  int8 ms")
for draft_vocab in (None, 4096):
    vocab = None if draft_vocab is None else torch.arange(draft_vocab)
    heads = treespec.MedusaHeads.for_model(model, num_heads=4, num_layers=1, draft_vocab=vocab)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape) * 0.02)
    tree = treespec.default_tree(16, 4)
    drafters = [
        MedusaDrafter(heads, tree, model.lm_head, native=False),
        MedusaDrafter(heads, tree, model.lm_head, native=True, int8=False),
        MedusaDrafter(heads, tree, model.lm_head, native=True, int8=True),
    ]
    for depth in (1, 2, 4):
        times = []
        for drafter in drafters:
            for _ in range(10):
                drafter.propose(hidden, root, depth)
            samples = []
            for _ in range(100):
                start = time.perf_counter()
                drafter.propose(hidden, root, depth)
                samples.append(time.perf_counter() - start)
            times.append(1e3 * sorted(samples)[50])
        print(f"{str(draft_vocab or 'full'):>11}  {depth:13d}  " + "  ".join(f"{t:8.3f}" for t in times))
