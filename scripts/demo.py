"""`make demo`: the embedded default model answers one prompt twice, plainly and with treespec.

Prints both texts, tokens/s of each, the speedup and the mean accepted length. Uses the trained
heads under heads/smollm2-135m-instruct/ when they exist, untrained heads (no speedup) otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import treespec

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_HEADS = ROOT / "heads" / "smollm2-135m-instruct"
PROMPT = "Explain in a few sentences why the sky is blue."


def load_heads(model, folder: Path) -> tuple[treespec.MedusaHeads, treespec.Tree | None, str]:
    """Trained heads (and their calibrated tree) if present, else untrained identity heads."""
    if (folder / "config.json").is_file():
        heads = treespec.MedusaHeads.from_pretrained(folder, model=model)
        tree = treespec.Tree.load(folder / "tree.json") if (folder / "tree.json").is_file() else None
        return heads, tree, f"trained heads from {folder.relative_to(ROOT)}"
    return (
        treespec.MedusaHeads.for_model(model, num_heads=4),
        None,
        "UNTRAINED heads (no trained heads shipped yet)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--heads", type=Path, default=DEFAULT_HEADS)
    parser.add_argument("--lookup", type=int, default=8, help="prompt-lookup branch nodes (0: heads only)")
    args = parser.parse_args(argv)

    print(f"loading {treespec.models.DEFAULT_MODEL_NAME} ({args.dtype}) ...", flush=True)
    model, tokenizer = treespec.load_model(dtype=args.dtype)
    heads, tree, heads_note = load_heads(model, args.heads)
    tree = tree or treespec.default_tree(32, heads.num_heads)
    print(f"{heads_note}; tree of {tree.num_nodes} nodes, depth {tree.max_depth}")
    torch.manual_seed(0)

    # warm-up so neither run pays one-time costs
    treespec.generate_baseline(model, "Hi", tokenizer=tokenizer, max_new_tokens=4)
    treespec.generate(
        model, heads, "Hi", tokenizer=tokenizer, tree=tree, max_new_tokens=4, lookup=args.lookup
    )

    plain = treespec.generate_baseline(
        model, args.prompt, tokenizer=tokenizer, max_new_tokens=args.max_new_tokens
    )
    fast = treespec.generate(
        model,
        heads,
        args.prompt,
        tokenizer=tokenizer,
        tree=tree,
        max_new_tokens=args.max_new_tokens,
        lookup=args.lookup,
    )
    print(f"\nprompt: {args.prompt}\n")
    print(f"--- plain decoding ({plain.stats.summary()})\n{plain.text}\n")
    print(f"--- treespec ({fast.stats.summary()})\n{fast.text}\n")
    speedup = fast.stats.tokens_per_second / plain.stats.tokens_per_second
    print(f"plain    : {plain.stats.tokens_per_second:6.1f} tokens/s")
    print(f"treespec : {fast.stats.tokens_per_second:6.1f} tokens/s")
    print(
        f"speedup  : {speedup:.2f}x   mean accepted length: {fast.stats.mean_accept_length:.2f} tokens/step"
    )
    same = "identical" if plain.token_ids == fast.token_ids else "DIFFERENT (bf16 near-tie; float32 is exact)"
    print(f"outputs  : {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
