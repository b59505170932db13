#!/usr/bin/env python
"""What self-speculative drafting saves at verification: upper layers only vs a full forward.

    python scripts/bench_verify.py --exit-head heads/smollm2-135m-instruct-exit10 --dtype bfloat16

For each gamma: prefill a prompt, draft a chain with the exit head (the lower layers' K/V go into the
cache), then time (a) the verification the self-speculative drafter runs (layers [k, L) from the kept
layer-k states) and (b) a full forward over the same tokens and positions, as a draft-model or Medusa
verification would. Both include the final norm and the logits over the chain. Median of --repeats,
interleaved; also the largest difference between the two logits (they compute the same thing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import treespec
from treespec.core.cache import TreeKVCache
from treespec.core.generate import _base_forward, _logits

PROMPT = "Explain how a refrigerator works, step by step, for a curious twelve-year-old."


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model id or folder (default: embedded SmolLM2)")
    p.add_argument("--exit-head", required=True, help="exit head folder (train_heads.py --exit-layer)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--gammas", default="1,2,3,4,6", help="comma list")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    model, tokenizer = treespec.load_model(args.model, dtype=args.dtype)
    head = treespec.MedusaHeads.from_pretrained(args.exit_head, model=model)
    prompt = treespec.encode_prompt(PROMPT, tokenizer)
    rows = []
    with torch.inference_mode(), treespec.tree_attention_enabled(model):
        for gamma in [int(g) for g in args.gammas.split(",")]:
            drafter = treespec.SelfSpeculativeDrafter(model, head, gamma)
            cache = TreeKVCache.for_model(model, len(prompt) + gamma + 2)
            ids = torch.tensor([prompt])
            hidden = _base_forward(model, ids, torch.arange(len(prompt))[None], cache, None, "sdpa")[-1]
            cache.commit_all()
            root = int(_logits(model, hidden[None])[0].argmax())
            drafter.reset(prompt + [root], target_cache=cache, kernel="sdpa")
            tokens = drafter.draft(hidden, root)[None]  # [1, gamma + 1]
            tree = drafter.tree
            positions = (len(prompt) + tree.depth)[None]
            mask = tree.ancestor_mask
            times = {"upper": [], "full": []}
            outputs = {}
            for _ in range(args.repeats):
                for name in ("upper", "full"):
                    t0 = time.perf_counter()
                    if name == "upper":
                        h = drafter.verify_forward(model, tokens, positions, cache, mask, "sdpa")
                    else:
                        h = _base_forward(model, tokens, positions, cache, mask, "sdpa")
                    outputs[name] = _logits(model, h).float()  # [gamma + 1, V]
                    times[name].append(time.perf_counter() - t0)
                    cache.pending = 0  # nothing is committed: the next call writes the same block
            upper, full = (1e3 * statistics.median(times[n]) for n in ("upper", "full"))
            diff = (outputs["upper"] - outputs["full"]).abs().max().item()
            rows.append({"gamma": gamma, "upper_ms": upper, "full_ms": full, "max_logit_diff": diff})
    k, n = head.exit_layer, model.config.num_hidden_layers
    what = f"({args.dtype}, median of {args.repeats})"
    print(f"verification of gamma + 1 tokens, layers [{k}, {n}) vs all {n} {what}")
    print("gamma  upper ms  full ms  saved  max |logit diff|")
    for r in rows:
        saved = 1 - r["upper_ms"] / r["full_ms"]
        print(
            f"{r['gamma']:5d}  {r['upper_ms']:8.1f}  {r['full_ms']:7.1f}  {saved:5.0%}"
            f"  {r['max_logit_diff']:.2e}"
        )
    return rows


if __name__ == "__main__":
    main()
