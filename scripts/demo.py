"""`make demo`: the embedded default model answers a few prompts twice, plainly and with treespec.

Shows the first answer from both runs, then for every prompt the tokens/s of each run, the speedup and
the mean accepted length, and the overall speedup (all tokens / all time). One prompt says little:
the accepted length varies from about 1.5 to 4 tokens per step from one prompt to the next. Uses the
default model's trained heads and their calibrated tree (heads/smollm2-135m-instruct/, packaged in the
wheel as well) when they exist, untrained heads (no speedup) otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import treespec
from treespec.tools.models import default_heads_folder

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    "Give me five tips for staying focused while studying.",
    "Summarize in two sentences: The Moon is Earth's only natural satellite. It formed about 4.5 billion "
    "years ago, probably from debris left after a Mars-sized body collided with the young Earth. Its "
    "gravity causes the ocean tides, and it always shows the same face to Earth because its rotation is "
    "tidally locked to its orbit.",
    "Translate into French: The weather is nice today, so we are going to the park.",
]


def load_heads(model, folder: Path) -> tuple[treespec.MedusaHeads, treespec.Tree | None, str]:
    """Trained heads (and their calibrated tree, heads.tree) if present, else untrained identity heads."""
    if (folder / "config.json").is_file():
        heads = treespec.MedusaHeads.from_pretrained(folder, model=model)
        return heads, heads.tree, f"trained heads from {folder}"
    return (
        treespec.MedusaHeads.for_model(model, num_heads=4),
        None,
        "UNTRAINED heads (no trained heads shipped yet)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=None, help="one prompt instead of the built-in five")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--heads", type=Path, default=default_heads_folder())
    parser.add_argument("--lookup", type=int, default=8, help="prompt-lookup branch nodes (0: heads only)")
    args = parser.parse_args(argv)
    prompts = [args.prompt] if args.prompt else PROMPTS

    dtype = treespec.tools.models.fast_dtype() if args.dtype == "auto" else args.dtype
    name = str(dtype).removeprefix("torch.")
    print(f"loading {treespec.tools.models.DEFAULT_MODEL_NAME} ({name}) ...", flush=True)
    model, tokenizer = treespec.load_model(dtype=dtype)
    heads, tree, heads_note = load_heads(model, args.heads)
    tree = tree or treespec.default_tree(32, heads.num_heads)
    print(f"{heads_note}; tree of {tree.num_nodes} nodes, depth {tree.max_depth}; lookup {args.lookup}")
    torch.manual_seed(0)

    def plain(prompt, n):
        return treespec.generate_baseline(model, prompt, tokenizer=tokenizer, max_new_tokens=n)

    def fast(prompt, n):
        return treespec.generate(
            model, heads, prompt, tokenizer=tokenizer, tree=tree, max_new_tokens=n, lookup=args.lookup
        )

    plain("Hi", 4), fast("Hi", 4)  # warm-up so neither run pays one-time costs
    rows, totals = [], {"plain": [0, 0.0], "treespec": [0, 0.0]}
    for i, prompt in enumerate(prompts):
        a, b = plain(prompt, args.max_new_tokens), fast(prompt, args.max_new_tokens)
        if i == 0:
            print(f"\nprompt: {prompt}\n")
            print(f"--- plain decoding ({a.stats.summary()})\n{a.text}\n")
            print(f"--- treespec ({b.stats.summary()})\n{b.text}\n")
        for name, res in (("plain", a), ("treespec", b)):
            totals[name][0] += res.stats.new_tokens
            totals[name][1] += res.stats.time_total
        rows.append((prompt, a, b))

    print(f"{'prompt':<42} {'plain tok/s':>11} {'treespec tok/s':>14} {'speedup':>8} {'accepted':>8}  same")
    for prompt, a, b in rows:
        short = (prompt[:39] + "...") if len(prompt) > 42 else prompt
        speedup = b.stats.tokens_per_second / a.stats.tokens_per_second
        same = "yes" if a.token_ids == b.token_ids else "no"
        print(
            f"{short:<42} {a.stats.tokens_per_second:11.1f} {b.stats.tokens_per_second:14.1f} "
            f"{speedup:7.2f}x {b.stats.mean_accept_length:8.2f}  {same}"
        )
    plain_rate = totals["plain"][0] / totals["plain"][1]
    fast_rate = totals["treespec"][0] / totals["treespec"][1]
    steps = sum(b.stats.steps for _, _, b in rows)
    accepted = sum(sum(b.stats.accept_lengths) for _, _, b in rows)
    print(f"\nplain    : {plain_rate:6.1f} tokens/s")
    print(f"treespec : {fast_rate:6.1f} tokens/s")
    print(f"speedup  : {fast_rate / plain_rate:.2f}x   mean accepted length: {accepted / steps:.2f}")
    print("same     : answers that differ from plain decoding are bf16 near-ties (float32 is exact)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
