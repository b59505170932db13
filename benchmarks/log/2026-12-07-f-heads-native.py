"""Session 36 (log f): the shipped sequential heads drafting one row through torch, the native heads in float and
in int8, levels 1-3, with their weights hot in the caches and cold (128 MB streamed before each call, as a
step streams ~100 MB before the next drafting); and how often int8 drafts the float heads' tokens, on the
hidden states of a real prompt.

    python benchmarks/log/2026-12-07-f-heads-native.py
"""

import time

import torch

import treespec
from treespec.drafters.medusa import SequentialDrafter
from treespec.tools.models import default_heads_folder

torch.set_num_threads(2)
torch.set_grad_enabled(False)
model, tokenizer = treespec.load_model()
heads = treespec.MedusaHeads.from_pretrained(default_heads_folder(), model=model)
args = (heads, heads.tree, model.get_output_embeddings(), model.get_input_embeddings())
drafters = {
    "torch": SequentialDrafter(*args, native=False),
    "float": SequentialDrafter(*args, native=True, int8=False),
    "int8": SequentialDrafter(*args, native=True, int8=True),
}
text = "The quick brown fox jumps over the lazy dog. Then it ran to the forest and found a small house where"
ids = tokenizer(text, return_tensors="pt").input_ids
out = model(ids, output_hidden_states=True)
hidden, roots = out.hidden_states[-1][0], out.logits[0].argmax(-1)  # [T, H], [T]
agree = total = 0
for t in range(hidden.shape[0]):
    a = drafters["int8"].propose(hidden[t : t + 1], roots[t : t + 1])
    b = drafters["torch"].propose(hidden[t : t + 1], roots[t : t + 1])
    agree += int((a.tokens == b.tokens).sum())
    total += a.tokens.numel()
print(f"int8 drafts the float heads' tokens at {agree}/{total} tree nodes ({hidden.shape[0]} positions)")
flush = torch.ones(32 * 1024 * 1024)  # 128 MB
print("levels  drafter  hot ms  cold ms  (medians of 50)")
for levels in (1, 2, 3):
    for name, drafter in drafters.items():
        times = {}
        for cold in (False, True):
            samples = []
            for _ in range(60):
                if cold:
                    flush.add_(1.0)
                start = time.perf_counter()
                drafter.propose(hidden[:1], roots[:1], levels)
                samples.append(time.perf_counter() - start)
            samples = sorted(samples[10:])
            times[cold] = 1e3 * samples[len(samples) // 2]
        print(f"{levels:6d}  {name:>7}  {times[False]:6.3f}  {times[True]:7.3f}")
