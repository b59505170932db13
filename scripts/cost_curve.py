#!/usr/bin/env python
"""Measure this machine's cost curve and price the heads' trees with it.

    python scripts/cost_curve.py --dtype float32

1. Verification ms by node count (--nodes) and prefix length (--prefixes) for each path (--paths: eager,
   oneDNN or block linears, the block linears compiled, and the exact kernels of bitwise numerics;
   `treespec.training.costs`), printed and written as JSON (--out, default
   $TREESPEC_CACHE/costs/<model>-<dtype>-r<revision>.json). Dynamic trees measure a quick curve of
   the path they run there on first use (`costs.ensure_cost_curve`); this is the fuller one, and it
   replaces that file.
2. For each node budget (--budgets): the best tree for the heads' acceptance table (acceptance.json of
   the heads folder), its expected accepted length, and one whole speculative step timed through
   `Decoder.step` (drafting included, the decoder's default linears); the budget with the most expected
   tokens per second is written as a tree file (--tree-out, default next to the JSON) for `--tree` of
   generate and bench.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import treespec
from treespec.tools.models import default_heads_folder
from treespec.training.calibrate import choose_budget, format_budget_report, forward_costs
from treespec.training.costs import (
    NODES,
    PATHS,
    PREFIXES,
    cost_curve,
    default_cost_file,
    read_acceptance,
    save_cost_curve,
)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def relative(curve: dict, path: str, prefix: int) -> dict[int, float]:
    """n -> verify_ms(n) / verify_ms(1) for one path and prefix."""
    row = {int(n): ms for n, ms in curve["verify_ms"][path][str(prefix)].items()}
    return {n: ms / row[1] for n, ms in sorted(row.items())} if 1 in row else {}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model folder (default: embedded SmolLM2)")
    p.add_argument("--heads", default=None, help="heads folder (default: the default model's shipped heads)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--nodes", default=",".join(map(str, NODES)))
    p.add_argument("--prefixes", default=",".join(map(str, PREFIXES)))
    p.add_argument("--budgets", default="4,6,8,12,16,24,32", help="tree node budgets to price ('' = skip)")
    p.add_argument(
        "--paths",
        default="native,blocks,eager",
        help=f"verification paths to measure, of {','.join(PATHS)} (compiled: ~1 minute per node count)",
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None)
    p.add_argument("--tree-out", default=None)
    args = p.parse_args(argv)
    model, _ = treespec.load_model(args.model, dtype=args.dtype)
    out = Path(args.out) if args.out else default_cost_file(model)

    curve = cost_curve(
        model,
        ints(args.nodes),
        ints(args.prefixes),
        [p.strip() for p in args.paths.split(",") if p.strip()],
        repeats=args.repeats,
        progress=lambda label: print(f"  measuring {label}", file=sys.stderr, flush=True),
    )
    print(
        f"verification ms (x one-token step of the same path), {curve['dtype']}, {curve['threads']} threads"
    )
    for path, rows in curve["verify_ms"].items():
        for prefix, row in rows.items():
            rel = relative(curve, path, int(prefix))
            cells = "  ".join(f"{n}: {ms:6.1f} ({rel.get(int(n), 0):.2f}x)" for n, ms in row.items())
            print(f"{path:7s} prefix {prefix:>5s}  {cells}")

    save_cost_curve(out, curve)  # kept before the pricing below, which can take minutes
    budgets = ints(args.budgets)
    if budgets:
        folder = Path(args.heads) if args.heads else default_heads_folder()
        heads = treespec.MedusaHeads.from_pretrained(folder, model=model)
        table = read_acceptance(folder)
        if table is None:
            raise SystemExit(
                f"{folder} has no acceptance.json to price trees with: run scripts/calibrate_tree.py"
            )
        costs = forward_costs(model, budgets, heads, prefix=300, repeats=args.repeats, table=table)
        best, report = choose_budget(table, costs)
        print("\n" + format_budget_report(report, best))
        tree = treespec.Tree.from_acceptance(table, best)
        tree_out = Path(args.tree_out) if args.tree_out else out.with_name(out.stem + "-tree.json")
        tree_out.parent.mkdir(parents=True, exist_ok=True)
        tree.save(tree_out)
        curve["step"] = {
            "heads": str(folder),
            "verification": "timed steps",
            "budgets": {str(n): r for n, r in report.items()},
            "best_budget": best,
            "tree_file": str(tree_out),
        }
        print(f"wrote the {best}-node tree to {tree_out} (use it with --tree {tree_out})")
    save_cost_curve(out, curve)
    print(f"wrote {out}")
    return curve


if __name__ == "__main__":
    main()
