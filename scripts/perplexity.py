#!/usr/bin/env python
"""Perplexity of the base model's forwards on held-out text, per numerics: how much int8 numerics cost.

    python scripts/perplexity.py --texts 40 --max-tokens 512

The texts are the held-out (eval split) ShareGPT prompts of data/sharegpt_prompts.json, the split the
distillation data keeps out of training (`training.distill.is_eval`, 5%); Spec-Bench is not read. Each text
is scored teacher-forced in one causal forward per numerics through `Decoder.score`'s scorer: "hf" is
transformers' forward (the reference), "fast" the native step in float32 and "int8" the native step with
int8 activations (`numerics="int8"`); a "+kv-bf16" suffix ("int8+kv-bf16", "bitwise+kv-bf16") stores the
K/V in bf16 (`kv_dtype="bfloat16"`). Prints the perplexity of each and the int8 / float32 ratio, and writes
JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import treespec
from treespec.core.attention import AttentionPlan
from treespec.core.cache import TreeKVCache
from treespec.core.decoder import Decoder, full_forward, output_logits
from treespec.tools.bench import split_numerics
from treespec.training.distill import is_eval, load_prompts

DATA = Path(__file__).resolve().parents[1] / "data" / "sharegpt_prompts.json"
EVAL_FRACTION = 0.05  # the distillation data's held-out share (data/distill/*/meta.json)


@torch.inference_mode()
def negative_log_likelihood(model, decoder: Decoder | None, ids: list[int]) -> tuple[float, int]:
    """(sum of -log p(token | before) over ids[1:], tokens scored) in one causal forward: `decoder`'s
    native step, or transformers' forward when None."""
    cache = TreeKVCache.for_model(model, max_len=len(ids) + 1, dtype=decoder.kv_dtype if decoder else None)
    cache.begin([0], len(ids))
    tokens = torch.tensor([ids])  # [1, T]
    positions = cache.positions(torch.arange(len(ids)))  # [1, T]
    if decoder is None:
        hidden = full_forward(model, tokens, positions, cache, cache.attention_plan(AttentionPlan("sdpa")))
        logits = output_logits(model, hidden)
    else:
        with decoder.running():
            decoder.native.refresh()
            hidden = decoder.native(tokens, positions, cache, cache.attention_plan(AttentionPlan("exact")))
            logits = decoder.native.logits(hidden)
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # [T - 1, V]
    target = torch.tensor(ids[1:])[:, None]
    return float(-logp.gather(1, target).sum()), len(ids) - 1


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=40, help="held-out prompts to score")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per text (longer ones are cut)")
    p.add_argument("--min-tokens", type=int, default=32, help="shorter texts are skipped")
    p.add_argument(
        "--numerics",
        default="hf,fast,int8",
        help="of hf (transformers), fast, bitwise, int8; +kv-bf16 (e.g. int8+kv-bf16): K/V stored in bf16",
    )
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)

    model, tokenizer = treespec.load_model(dtype="float32")
    prompts, _ = load_prompts(DATA)
    held_out = [q for q in prompts if is_eval(q.id, EVAL_FRACTION)]
    texts = []
    for prompt in held_out:
        ids = tokenizer(prompt.text)["input_ids"][: args.max_tokens]
        if len(ids) >= args.min_tokens:
            texts.append(ids)
        if len(texts) == args.texts:
            break
    names = [x.strip() for x in args.numerics.split(",") if x.strip()]
    results = {}
    for name in names:
        decoder = None
        if name != "hf":
            settings = split_numerics(name)  # (numerics, kv_dtype), as `treespec bench --numerics` reads them
            if settings is None:
                known = "hf, fast, bitwise, int8, bitwise+kv-bf16, int8+kv-bf16"
                raise SystemExit(f"unknown numerics {name!r}: {known}")
            decoder = Decoder(model, numerics=settings[0], step="native", kv_dtype=settings[1])
        nll, count, t0 = 0.0, 0, time.perf_counter()
        for ids in texts:
            total, n = negative_log_likelihood(model, decoder, ids)
            nll, count = nll + total, count + n
        results[name] = {
            "perplexity": math.exp(nll / count),
            "nll_per_token": nll / count,
            "tokens": count,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"{name:>8}: perplexity {results[name]['perplexity']:.4f} over {count} tokens", flush=True)
    reference = "fast" if "fast" in results else next(iter(results))
    for r in results.values():
        r["x_" + reference] = r["perplexity"] / results[reference]["perplexity"]
    if "int8" in results and reference != "int8":
        print(f"int8 / {reference} perplexity: {results['int8']['x_' + reference]:.4f}")
    report = {
        "texts": len(texts),
        "max_tokens": args.max_tokens,
        "source": "data/sharegpt_prompts.json, eval split (training.distill.is_eval, fraction 0.05)",
        "machine_threads": torch.get_num_threads(),
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
