#!/usr/bin/env python
"""Calibrate the candidate tree of trained heads on held-out self-distillation data.

    python scripts/calibrate_tree.py --run runs/heads-smollm2

Measures acceptance[k][r] (head k's rank-r guess accepted given its parent was) on the held-out split,
builds the best tree for each node budget, times one verification step per budget on this machine,
picks the budget with the most expected tokens per second, writes `tree.json` and
`acceptance.json` into the heads folder, then decodes held-out prompts with that tree and prints the
expected next to the measured accepted length. Evaluation prompts (Spec-Bench) are never used here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import treespec
from treespec.training.calibrate import (
    acceptance_table,
    choose_budget,
    format_budget_report,
    forward_costs,
)
from treespec.training.distill import load_distill_data
from treespec.training.heads_train import cached_examples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="calibrate_tree.py", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="training run folder (scripts/train_heads.py --out)")
    p.add_argument("--heads", default=None, help="heads folder (default: <run>/heads)")
    p.add_argument("--budgets", default="8,16,24,32,48,64", help="node budgets to consider")
    p.add_argument("--max-rank", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--measure-prompts", type=int, default=16, help="held-out prompts decoded to check")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    run = Path(args.run)
    record = json.loads((run / "training.json").read_text())
    data = record["config"]["data"]
    heads_dir = Path(args.heads) if args.heads else run / "heads"
    model, tokenizer = treespec.load_model(record["config"]["extra"].get("model"), dtype=args.dtype)
    heads = treespec.MedusaHeads.from_pretrained(heads_dir, model=model)
    lm_head = model.get_output_embeddings().weight

    x, y = cached_examples(model, data, run / "cache", "eval", heads.num_heads, 4096)
    embedding = model.get_input_embeddings().weight
    table = acceptance_table(heads, lm_head, x, y, args.max_rank, embedding=embedding)
    print("acceptance[head][rank] (given the parent was accepted):")
    for k, row in enumerate(table):
        print(f"  head {k}: " + " ".join(f"{a:.3f}" for a in row))

    budgets = [int(b) for b in args.budgets.split(",")]
    costs = forward_costs(model, budgets, heads, table=table)
    best, report = choose_budget(table, costs)
    print("\n" + format_budget_report(report, best))
    tree = treespec.Tree.from_acceptance(table, best)
    tree.save(heads_dir / "tree.json")
    (heads_dir / "acceptance.json").write_text(
        json.dumps(
            {"acceptance": table, "budgets": {str(n): r for n, r in report.items()}, "chosen": best}, indent=1
        )
    )
    print(f"\nwrote {heads_dir / 'tree.json'} ({tree.num_nodes} nodes, depth {tree.max_depth})")

    # Check the prediction: decode held-out prompts (the training data's eval split) with the tree.
    held_out = load_distill_data(data, "eval")
    steps = accepted = 0
    for seq, plen in list(zip(held_out.sequences, held_out.prompt_lengths, strict=True))[
        : args.measure_prompts
    ]:
        drafter = treespec.as_drafter(model, heads, tree)
        res = treespec.generate(model, seq[:plen].tolist(), drafter, max_new_tokens=args.max_new_tokens)
        steps += res.stats.steps
        accepted += sum(res.stats.accept_lengths)
    measured = accepted / max(steps, 1)
    expected = report[best]["expected_accept_length"]
    print(
        f"accepted length on {args.measure_prompts} held-out prompts: expected {expected:.2f}, "
        f"measured {measured:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
