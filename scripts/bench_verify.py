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
import functools
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
from treespec.core.decoder import full_forward

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
    for gamma in [int(g) for g in args.gammas.split(",")]:
        drafter = treespec.SelfSpeculativeDrafter(model, head, gamma)
        decoder = treespec.Decoder(model, drafter, acceptance="greedy", kernel="sdpa")
        decoder.prefill(prompt, max_new_tokens=gamma + 2)
        with torch.inference_mode():
            tokens = drafter.propose(decoder.hidden, decoder.roots).tokens  # [1, gamma + 1]
        scorers = {"upper": drafter.scorer(), "full": functools.partial(full_forward, model)}
        times = {"upper": [], "full": []}
        outputs = {}
        for _ in range(args.repeats):
            for name, scorer in scorers.items():
                t0 = time.perf_counter()
                outputs[name] = decoder.score(tokens, scorer)[0].float()  # [gamma + 1, V]; nothing committed
                times[name].append(time.perf_counter() - t0)
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
