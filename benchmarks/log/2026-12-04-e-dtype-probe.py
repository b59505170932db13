"""float32 against bf16 for the default model on this CPU, in one process: which should `--dtype auto` pick?

Both copies of SmolLM2 are loaded; every held-out ShareGPT prompt (never Spec-Bench) is decoded by
HF generate and by treespec's plain loop and dynamic heads + warm suffix trees in each dtype, the order
rotating per prompt. Prints tokens/s per method and dtype (all tokens / all time).

    python benchmarks/log/2026-12-04-e-dtype-probe.py [--num-prompts 8] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import time

import torch

import treespec
from treespec.drafters.dynamic import DynamicTreeDrafter
from treespec.tools.bench import hf_greedy
from treespec.tools.models import default_heads_folder, default_suffix_cache_file
from treespec.tools.workloads import build_workload
from treespec.training.costs import verify_cost_model


def dynamic_suffix(model):
    """Dynamic trees over the shipped heads' tree + suffix trees from the shipped earlier answers."""
    heads = treespec.MedusaHeads.from_pretrained(default_heads_folder(), model=model)
    tree = heads.tree or treespec.default_tree(32, heads.num_heads)
    suffix = treespec.SuffixDrafter(
        treespec.SuffixCache.load(default_suffix_cache_file()), max_nodes=24, max_depth=16
    )
    union = treespec.UnionDrafter(treespec.make_drafter(heads, tree, model), suffix)
    return DynamicTreeDrafter(union, verify_cost_model(model))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args()
    torch.set_num_threads(2)
    models = {name: treespec.load_model(dtype=name) for name in ("float32", "bfloat16")}
    tokenizer = models["float32"][1]
    drafters = {name: dynamic_suffix(m) for name, (m, _) in models.items()}
    prompts = build_workload("sharegpt-heldout", tokenizer, num_prompts=args.num_prompts)
    runs = []
    for name, (model, _) in models.items():
        runs += [
            (f"hf {name}", model, "hf"),
            (f"plain {name}", model, None),
            (f"dynamic+suffix {name}", model, name),
        ]
    totals = {label: [0, 0.0] for label, _, _ in runs}
    for i, prompt in enumerate([{"ids": treespec.encode_prompt("Hi", tokenizer)}, *prompts]):
        order = runs[i % len(runs) :] + runs[: i % len(runs)]
        for label, model, how in order:
            t0 = time.perf_counter()
            if how == "hf":
                n = len(hf_greedy(model, tokenizer, prompt["ids"], args.max_new_tokens))
            else:
                drafter = drafters[how] if how else None
                n = len(
                    treespec.generate(
                        model, prompt["ids"], drafter, max_new_tokens=args.max_new_tokens
                    ).token_ids
                )
            if i > 0:  # the first prompt warms every path up
                totals[label][0] += n
                totals[label][1] += time.perf_counter() - t0
    for label, (tokens, seconds) in totals.items():
        print(f"{label:26s} {tokens / seconds:6.1f} tokens/s")


if __name__ == "__main__":
    main()
