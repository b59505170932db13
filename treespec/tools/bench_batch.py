"""Batched decoding benchmark: total tokens/s at several batch sizes, treespec against HF and vLLM.

    python scripts/bench_batch.py --batch-sizes 1,4,8,16 --num-prompts 16 --dtype float32

The same Spec-Bench prompts run at every batch size B, in groups of B (so every B decodes the same
tokens), greedy. Methods:

    hf               HF `generate` on the group, left-padded (its own batching)
    hf_prompt_lookup HF `generate` with prompt_lookup_num_tokens=10, one prompt after the other (HF's
                     prompt lookup takes batch 1, so it runs at the smallest B only and its throughput
                     is reported at every B)
    plain            treespec's batched decoder, one token per row per step (the recipe "plain")
    treespec         the recipe "heads": the heads' tree every step (plain_above=None)
    treespec_auto    "heads" where it pays, plain steps where not (plain_above="auto")
    treespec_lookup  "heads+lookup" (--lookup replaces its chain length), plain_above="auto"
    eagle            "eagle" (the default model's shipped layer, or --eagle FOLDER with --eagle-tree),
                     plain_above="auto"
    RECIPE           any other recipe of `treespec.recipes` whose drafter decodes batches, plain_above="auto"
    vllm             vLLM's CPU engine on the group (`make vllm-env`)

Each group runs every method back to back, the order rotating per group. It reports tokens/s per method
and B, the ratios against HF at the same B, how many rows equal their single-sequence (B = 1) output,
and the crossover: the smallest B at which always speculating is slower than plain batched decoding.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import torch
import transformers

import treespec

from .. import recipes
from ..core.generate import encode_prompt
from ..core.tokens import eos_token_ids
from . import bench
from . import drafter_options as options

# the batch benchmark's method names -> (recipe, plain_above); any other recipe name runs with "auto"
RECIPE_METHODS = {
    "plain": ("plain", None),
    "treespec": ("heads", None),
    "treespec_auto": ("heads", "auto"),
    "treespec_lookup": ("heads+lookup", "auto"),
    "eagle": ("eagle", "auto"),
}
RECIPE_METHODS |= {name: (name, "auto") for name in recipes.RECIPES if name not in RECIPE_METHODS}
METHODS = ("hf", "hf_prompt_lookup", *RECIPE_METHODS, "vllm")
ONE_AT_A_TIME = ("hf_prompt_lookup",)  # methods that decode one prompt after the other: measured once
DEFAULT_METHODS = ("hf", "hf_prompt_lookup", "plain", "treespec", "treespec_auto", "vllm")


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    bench.add_shared_arguments(p, "batch", tree="machine")
    p.add_argument("--batch-sizes", default="1,4,8,16", help="comma list (default 1,4,8,16)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per batch size (default 16)")
    p.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS), help=f"comma list from {','.join(METHODS)}"
    )
    p.set_defaults(dtype="float32", tree_size=32)
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    if any(
        "eagle" in recipes.RECIPES[RECIPE_METHODS[m][0]].sources for m in args.methods if m in RECIPE_METHODS
    ):
        try:  # the default model's shipped drafter unless --eagle names one
            args.eagle = options.eagle_folder(args.eagle, args.model)
        except ValueError as e:
            p.error(str(e))
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    if min(args.batch_sizes) < 1 or args.num_prompts < max(args.batch_sizes):
        p.error("batch sizes must be >= 1 and --num-prompts at least the largest batch size")
    return args


def make_runners(args, model, tokenizer, eos: list[int]) -> tuple[dict, dict]:
    """name -> run(prompts, max_new_tokens) -> token lists; and a description of the setup."""
    runners, setup = {}, {"heads": "-", "tree": "-"}

    def ours(make_drafter, plain_above):
        def run(prompts, max_new_tokens):
            options = treespec.DecodeOptions(plain_above=plain_above, compile=args.compile)
            results = treespec.generate(
                model, prompts, make_drafter(), max_new_tokens=max_new_tokens, eos_token_id=eos,
                options=options,
            )  # fmt: skip
            return [r.token_ids for r in results]

        return run

    runners["hf"] = lambda prompts, m: bench.hf_batch(model, tokenizer, prompts, m)
    runners["hf_prompt_lookup"] = lambda prompts, m: [
        bench.hf_greedy(model, tokenizer, p, m, prompt_lookup_num_tokens=10) for p in prompts
    ]
    wanted = [recipes.RECIPES[RECIPE_METHODS[m][0]] for m in args.methods if m in RECIPE_METHODS]
    given = {}
    if any("heads" in r.sources for r in wanted):
        heads, tree, setup["heads"], setup["tree"] = bench.load_heads_and_tree(args, model)
        setup["tree_choices"] = [list(c) for c in tree.choices]
        given |= {"heads": heads, "tree": tree}
    if any("eagle" in r.sources for r in wanted):
        eagle = options.load_eagle_option(args.eagle, model, args.eagle_tree)
        setup["eagle"] = eagle.description
        given["eagle"] = lambda: eagle.drafter(model)
    for name in [m for m in args.methods if m in RECIPE_METHODS]:
        recipe_name, plain_above = RECIPE_METHODS[name]
        recipe = recipes.RECIPES[recipe_name]
        if args.lookup is not None and recipe.lookup:
            recipe = replace(recipe, lookup=args.lookup)
        parts = recipes.Parts.shipped(model, recipe, compile=args.compile, **given)
        runners[name] = ours(recipes.drafter_factory(recipe, parts, args.compile), plain_above)
    return {m: runners[m] for m in args.methods if m in runners}, setup


def warm_up_sizes(batch_sizes: list[int], compile: bool) -> list[int]:
    """Row counts of the warm-up calls: 1, 2 and 3 (one row and several), and under torch.compile every
    measured batch size too, so that no compile of a new row count lands in a timed group."""
    return sorted({1, 2, 3} | (set(batch_sizes) if compile else set()))


def run_groups(prompts, runners, batch_sizes, max_new_tokens, compile: bool = False) -> list[dict]:
    """Every method on every group of every batch size; one record per (batch size, group, method)."""
    records = []
    for run in runners.values():  # warm-up: a first call pays for allocations, lazy loading, compiling
        for size in warm_up_sizes(batch_sizes, compile):
            run(prompts[:size], 8)
    for size in batch_sizes:
        groups = [prompts[i : i + size] for i in range(0, len(prompts) - size + 1, size)]
        # one-at-a-time methods decode the same way at every B: measured at the smallest only
        names_here = [n for n in runners if size == batch_sizes[0] or n not in ONE_AT_A_TIME]
        for g, group in enumerate(groups):
            names = list(names_here)
            names = names[g % len(names) :] + names[: g % len(names)]  # rotating order
            for name in names:
                t0 = time.perf_counter()
                outputs = runners[name](group, max_new_tokens)
                seconds = time.perf_counter() - t0
                records.append(
                    {"batch": size, "group": g, "method": name, "seconds": seconds, "outputs": outputs}
                )
            print(
                f"B={size} group {g + 1}/{len(groups)}: "
                + ", ".join(f"{r['method']} {r['seconds']:.1f} s" for r in records[-len(names) :]),
                file=sys.stderr,
                flush=True,
            )
    return records


def summarize(records: list[dict], methods: list[str], batch_sizes: list[int]) -> list[dict]:
    """Per (batch size, method): tokens, seconds, tokens/s, ratio to HF at that B, rows equal to B = 1."""
    single = {}  # (method, group-of-one index) -> outputs at B = 1, by prompt position
    for r in records:
        if r["batch"] == 1:
            single[(r["method"], r["group"])] = r["outputs"][0]
    rows = []
    for size in batch_sizes:
        for method in methods:
            mine = [r for r in records if r["batch"] == size and r["method"] == method]
            measured_at = size
            if not mine and method in ONE_AT_A_TIME:  # one prompt after the other: the same at every B
                measured_at = min(batch_sizes)
                mine = [r for r in records if r["batch"] == measured_at and r["method"] == method]
            if not mine:
                continue
            tokens = sum(len(o) for r in mine for o in r["outputs"])
            seconds = sum(r["seconds"] for r in mine)
            same = total = 0
            for r in mine:
                for i, out in enumerate(r["outputs"]):
                    reference = single.get((method, r["group"] * r["batch"] + i))
                    if reference is not None:
                        total += 1
                        same += out == reference
            rows.append(
                {
                    "batch": size,
                    "method": method,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_second": tokens / seconds if seconds else 0.0,
                    "same_as_single": [same, total],
                    "measured_at": measured_at,
                }
            )
    for row in rows:
        hf = next((r for r in rows if r["batch"] == row["batch"] and r["method"] == "hf"), None)
        row["vs_hf"] = row["tokens_per_second"] / hf["tokens_per_second"] if hf else None
        row["vs_plain_groups"] = group_ratios(records, row["batch"], row["method"])
    return rows


def group_ratios(records: list[dict], size: int, method: str, base: str = "plain") -> list[float]:
    """Per group of batch size `size`, sorted: `method`'s tokens/s over `base`'s on the same group, run
    back to back (a paired comparison: the machine's drift between groups cancels out)."""

    def speed(r):
        return sum(len(o) for o in r["outputs"]) / r["seconds"]

    mine = {r["group"]: r for r in records if r["batch"] == size and r["method"] == method}
    other = {r["group"]: r for r in records if r["batch"] == size and r["method"] == base}
    return sorted(speed(mine[g]) / speed(other[g]) for g in mine if g in other and other[g]["seconds"])


def crossover(summary: list[dict], method: str = "treespec", plain: str = "plain") -> int | None:
    """The smallest batch size at which `method` is slower than plain batched decoding (None: never)."""
    speed = {(r["batch"], r["method"]): r["tokens_per_second"] for r in summary}
    for size in sorted({r["batch"] for r in summary}):
        if (
            (size, method) in speed
            and (size, plain) in speed
            and speed[(size, method)] < speed[(size, plain)]
        ):
            return size
    return None


def format_table(summary: list[dict]) -> str:
    lines = [
        "| B | method | tokens/s | x HF | x plain per group (min / median / max, n) | rows = B=1 output |",
        "|---|---|---|---|---|---|",
    ]
    for r in summary:
        ratio = f"{r['vs_hf']:.2f}" if r["vs_hf"] is not None else "-"
        same = "{}/{}".format(*r["same_as_single"]) if r["batch"] > 1 else "-"
        if r.get("measured_at", r["batch"]) != r["batch"]:
            same = f"- (one prompt at a time, run at B = {r['measured_at']})"
        g = r.get("vs_plain_groups") or []
        paired = f"{g[0]:.2f} / {g[len(g) // 2]:.2f} / {g[-1]:.2f} ({len(g)})" if g else "-"
        lines.append(
            f"| {r['batch']} | {r['method']} | {r['tokens_per_second']:.1f} | {ratio} | {paired} | {same} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    prog = prog or "python scripts/bench_batch.py"
    args = parse_args(argv, prog)
    command = f"{prog} " + shlex.join(sys.argv[1:] if argv is None else [str(a) for a in argv])
    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(args.data) if args.data else bench.default_data_file()
    questions = bench.select_prompts(bench.load_questions(data), args.num_prompts)
    model, tokenizer = treespec.load_model(args.model, dtype=args.dtype, device=args.device)
    eos = eos_token_ids(model, tokenizer)
    prompts = [encode_prompt(q["turns"][0], tokenizer) for q in questions]
    runners, setup = make_runners(args, model, tokenizer, eos)
    peer = bench.start_peers(args, model).get("vllm")  # the one peer method here
    if peer is not None:
        runners["vllm"] = lambda group, m: peer.run_batch(group, m, 0.0, None, eos)
    try:
        t0 = time.perf_counter()
        records = run_groups(prompts, runners, args.batch_sizes, args.max_new_tokens, args.compile)
        wall = time.perf_counter() - t0
    finally:
        if peer is not None:
            peer.close()
    methods = [m for m in args.methods if m in runners]
    summary = summarize(records, methods, args.batch_sizes)
    cross = crossover(summary)
    config = {
        "command": command,
        "model": args.model or model.config.name_or_path,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "batch_sizes": args.batch_sizes,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "methods": methods,
        "lookup": args.lookup if "treespec_lookup" in methods else None,
        "compile": args.compile,
        **setup,
        "vllm": peer.info if peer is not None else None,
        "timing": "wall clock per group call (prefill included), after warm-up calls of "
        + ", ".join(map(str, warm_up_sizes(args.batch_sizes, args.compile)))
        + " rows",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "platform": platform.platform(),
        "started": datetime.now().isoformat(timespec="seconds"),
    }
    print(f"{command}\n{len(prompts)} prompts, {args.max_new_tokens} new tokens, {wall:.0f} s\n")
    print(format_table(summary))
    print(f"\ncrossover (treespec slower than plain batched decoding from B =): {cross}")
    result = {
        "config": config,
        "wall_seconds": wall,
        "summary": summary,
        "crossover": cross,
        "records": records,
    }
    bench.write_result(result, args.out, "batch")
    return result
