#!/usr/bin/env python
"""Compare trained heads on the same held-out positions: acceptance per head and the expected accepted length
of the best tree at each node budget.

    python scripts/compare_heads.py --data data/distill/smollm2-135m-instruct \
        --heads heads/smollm2-135m-instruct,runs/heads-1m/heads [--eagle runs/eagle/drafter]

EAGLE-style drafters (--eagle) join the table from the acceptance.json that scripts/train_eagle.py measured on
the same eval split (per chain step instead of per head).

The positions are the data's eval split (held-out ShareGPT prompts, never Spec-Bench); their hidden
states are computed once and kept in --cache. Each heads folder is narrowed to --draft-vocab tokens
first when it drafts from more, so heads are compared as they would be shipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import treespec
from treespec.training.calibrate import acceptance_table
from treespec.training.heads_train import cached_examples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compare_heads.py", description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="self-distillation data folder (its eval split is used)")
    p.add_argument("--heads", default="", help="heads folders, joined by commas")
    p.add_argument("--eagle", default="", help="EAGLE drafter folders with acceptance.json, joined by commas")
    p.add_argument("--budgets", default="4,8,16,32", help="node budgets (root included)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="narrow heads drafting from more tokens")
    p.add_argument("--cache", default="runs/compare-heads-cache", help="hidden-state cache folder")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)

    model, _ = treespec.load_model(dtype=args.dtype)
    lm_head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    budgets = [int(b) for b in args.budgets.split(",")]
    sizes = " / ".join(map(str, budgets))
    header = "| heads | rank-0 acceptance per head (parent accepted) | expected accepted length"
    print(f"{header}, {sizes} nodes |")
    print("|---|---|---|")
    for folder in filter(None, args.heads.split(",")):
        heads = treespec.MedusaHeads.from_pretrained(folder, model=model)
        if heads.draft_vocab_size > args.draft_vocab:
            heads = heads.narrowed(args.draft_vocab)
        x, y = cached_examples(model, args.data, Path(args.cache), "eval", heads.num_heads, 4096)
        table = acceptance_table(heads, lm_head, x, y, max_rank=10, embedding=embedding)
        print(row(folder, table, budgets))
    for folder in filter(None, args.eagle.split(",")):
        print(row(folder, json.loads((Path(folder) / "acceptance.json").read_text())["acceptance"], budgets))
    return 0


def row(name: str, table: list[list[float]], budgets: list[int]) -> str:
    """A table row: rank-0 acceptance per head (or chain step), the best tree's expected length per budget."""
    top1 = " ".join(f"{r[0]:.3f}" for r in table)
    expected = [treespec.Tree.from_acceptance(table, n).expected_accept_length(table) for n in budgets]
    return f"| {name} | {top1} | {' / '.join(f'{e:.2f}' for e in expected)} |"


if __name__ == "__main__":
    sys.exit(main())
