"""`make demo`: the embedded default model answers a few prompts with HF generate and with treespec.

Shows the first answer of HF generate and of treespec, then for every prompt the tokens/s of HF generate,
HF prompt lookup and treespec, the speedup over HF generate and the mean accepted length, and the overall
figures (all tokens / all time). One prompt says little: the accepted length varies from about 1.5 to 4
tokens per step from one prompt to the next.

treespec drafts with the recipe `--drafter` names (`treespec.recipes`; default auto, which for the default
model is dynamic+suffix): the default model's trained heads (heads/smollm2-135m-instruct/, packaged in the
wheel as well; untrained heads, no speedup, otherwise) merged with suffix trees over the prompt, the answer
and the model's shipped earlier answers, cut every step to the nodes worth verifying on this machine
(a `TreePlanner` on this machine's cost curve, measured once, then kept in ~/.cache/treespec/costs/);
one drafter serves every prompt, so what it learns carries over. `--drafter static` shows the heads' tree
priced on this machine + a prompt-lookup chain instead. `--compile` verifies through torch.compile: the
warm-up then compiles the step (one to two minutes per size class on a small CPU, with a message; the
code is kept on disk, the tracing is redone in each process).

Where the native step runs int8 numerics (`numerics="int8"`: 8-bit activations against the GGUF blocks,
another text than float32's, but speculation keeps its own plain loop's text bit for bit), the same recipe
and the int8 plain loop answer the prompts too, and a line shows their speed and which answers equal what
(`--no-int8` leaves them out).

When llama.cpp's environment exists (`make llamacpp-env`: .venv-llamacpp), llama.cpp answers the same
prompt ids too, greedy, on the same GGUF file the default model comes from, with torch's thread count, and
its line shows its tokens/s beside HF's (`tools.peers.LlamaCppPeer`); without it nothing changes.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

import treespec
from treespec import ops, recipes
from treespec.core.native import int8_reason
from treespec.core.tokens import eos_token_ids
from treespec.tools.bench import hf_greedy
from treespec.tools.drafter_options import MACHINE, pick_tree
from treespec.tools.models import default_heads_folder
from treespec.tools.peers import LlamaCppPeer, find_llamacpp_python

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
STATIC = "static"  # --drafter static: heads+lookup in the heads' tree priced on this machine


def load_heads(model, folder: Path, price: bool) -> tuple[treespec.MedusaHeads, treespec.Tree, str]:
    """Trained heads if present, else untrained identity heads, with their tree: priced on this machine
    (`price`: `--tree machine`, measured once, then kept), else their tree.json (the largest tree a
    dynamic drafter may use)."""
    if not (folder / "config.json").is_file():
        heads = treespec.MedusaHeads.for_model(model, num_heads=4)
        return heads, treespec.default_tree(16, 4), "UNTRAINED heads (no trained heads shipped yet)"
    heads = treespec.MedusaHeads.from_pretrained(folder, model=model)
    if price:
        tree, source = pick_tree(MACHINE, heads, "--tree", folder, model)
        return heads, tree, f"trained heads from {folder}; tree {source}"
    tree = heads.tree or treespec.default_tree(16, heads.num_heads)
    return heads, tree, f"trained heads from {folder}"


def demo_recipe(args, model) -> recipes.Recipe:
    """The recipe the demo runs: --drafter (default auto, the best shipped one: dynamic trees over the heads
    + the warm suffix cache); "static" is heads+lookup in the heads' tree priced on this machine; --lookup
    replaces the recipe's lookup length."""
    recipe = recipes.resolve("heads+lookup" if args.drafter == STATIC else args.drafter, model)
    return recipe if args.lookup is None else replace(recipe, lookup=args.lookup)


def make_drafter(model, recipe: recipes.Recipe, heads, tree, args, numerics: str = "fast"):
    """() -> the drafter for one prompt, from the recipes table (`treespec.recipes`): the same drafter for
    every prompt where the recipe learns (dynamic trees, suffix caches), else a new one each time; priced
    for the kernels of `numerics`."""
    given = {"heads": heads, "tree": tree if args.drafter == STATIC else None} if heads is not None else {}
    parts = recipes.Parts.shipped(model, recipe, compile=args.compile, numerics=numerics, **given)
    return recipes.drafter_factory(recipe, parts, compile=args.compile)


def int8_note(model, args) -> str | None:
    """None when the demo runs int8 numerics too, else why not."""
    if args.no_int8:
        return "left out (--no-int8)"
    if args.compile:
        return "not with --compile (int8 numerics run in the native step)"
    if not ops.available("cpu"):
        return "treespec's compiled CPU ops did not build here"
    reason = int8_reason(model)
    return None if reason is None else f"not for this model: {reason}"


def hf_generate(model, tokenizer, prompt_ids, n, **extra) -> tuple[list[int], float]:
    """HF `generate` greedy on the same prompt ids (`tools.bench.hf_greedy`): (new tokens, seconds)."""
    t0 = time.perf_counter()
    tokens = hf_greedy(model, tokenizer, prompt_ids, n, **extra)
    return tokens, time.perf_counter() - t0


def start_llamacpp(model, tokenizer) -> LlamaCppPeer | None:
    """llama.cpp on the default model's GGUF file when its environment exists (`make llamacpp-env`), else
    None; torch's threads, HF's end tokens."""
    if find_llamacpp_python() is None:
        return None
    peer = LlamaCppPeer(threads=torch.get_num_threads(), stop_token_ids=eos_token_ids(model, tokenizer))
    print(f"llama.cpp: {peer.engine_name()}, {peer.info['threads']} threads, {peer.info['model']}")
    return peer


def timed_generate(model, tokenizer, ids, drafter, args, numerics: str = "fast"):
    """treespec.generate on prompt ids: (tokens, seconds, result)."""
    options = treespec.DecodeOptions(compile=args.compile, numerics=numerics)
    t0 = time.perf_counter()
    res = treespec.generate(
        model, ids, drafter, tokenizer, max_new_tokens=args.max_new_tokens, options=options
    )
    return list(res.token_ids), time.perf_counter() - t0, res


def run_all(model, tokenizer, new_drafter, prompts, args, llama=None, new_int8_drafter=None) -> list[dict]:
    """Every prompt through HF generate, HF prompt lookup and treespec (and llama.cpp when given, and the
    recipe and the plain loop in int8 numerics when new_int8_drafter is): tokens, seconds, accepted."""
    runs = []
    for prompt in prompts:
        ids = treespec.encode_prompt(prompt, tokenizer)
        hf, t_hf = hf_generate(model, tokenizer, ids, args.max_new_tokens)
        lookup, t_lookup = hf_generate(
            model, tokenizer, ids, args.max_new_tokens, prompt_lookup_num_tokens=10
        )
        tokens, seconds, res = timed_generate(model, tokenizer, ids, new_drafter(), args)
        runs.append(
            {
                "prompt": prompt,
                "hf": (hf, t_hf),
                "hf_prompt_lookup": (lookup, t_lookup),
                "treespec": (tokens, seconds),
                "result": res,
            }
        )
        if new_int8_drafter is not None:
            runs[-1]["int8"] = timed_generate(model, tokenizer, ids, new_int8_drafter(), args, "int8")[:2]
            runs[-1]["int8_plain"] = timed_generate(model, tokenizer, ids, None, args, "int8")[:2]
        if llama is not None:
            t0 = time.perf_counter()
            tokens = llama.run(ids, args.max_new_tokens)["token_ids"]
            runs[-1]["llamacpp"] = (tokens, time.perf_counter() - t0)
    return runs


def report(runs: list[dict], tokenizer, int8: str | None = None) -> None:
    """The first answers, a line per prompt, the totals; int8: why int8 numerics did not run (or None)."""
    first = runs[0]
    print(f"\nprompt: {first['prompt']}\n")
    print(f"--- HF generate\n{tokenizer.decode(first['hf'][0], skip_special_tokens=True)}\n")
    print(f"--- treespec ({first['result'].stats.summary()})\n{first['result'].text}\n")
    print(
        f"{'prompt':<42} {'HF tok/s':>8} {'HF lookup':>9} {'treespec':>8} {'speedup':>8} "
        f"{'accepted':>8}  same"
    )
    rate = lambda run: len(run[0]) / run[1]  # noqa: E731
    for r in runs:
        short = (r["prompt"][:39] + "...") if len(r["prompt"]) > 42 else r["prompt"]
        same = "yes" if r["treespec"][0] == r["hf"][0] else "no"
        print(
            f"{short:<42} {rate(r['hf']):8.1f} {rate(r['hf_prompt_lookup']):9.1f} {rate(r['treespec']):8.1f} "
            f"{rate(r['treespec']) / rate(r['hf']):7.2f}x {r['result'].stats.mean_accept_length:8.2f}  {same}"
        )
    total = {
        m: sum(len(r[m][0]) for r in runs) / sum(r[m][1] for r in runs)
        for m in ("hf", "hf_prompt_lookup", "treespec")
    }
    steps = sum(r["result"].stats.steps for r in runs)
    accepted = sum(sum(r["result"].stats.accept_lengths) for r in runs)
    print(f"\nHF generate      : {total['hf']:6.1f} tokens/s")
    print(
        f"HF prompt lookup : {total['hf_prompt_lookup']:6.1f} tokens/s "
        f"({total['hf_prompt_lookup'] / total['hf']:.2f}x)"
    )
    print(f"treespec         : {total['treespec']:6.1f} tokens/s")
    print(
        f"speedup          : {total['treespec'] / total['hf']:.2f}x over HF generate   "
        f"mean accepted length: {accepted / steps:.2f}"
    )
    if all("llamacpp" in r for r in runs):
        total["llamacpp"] = sum(len(r["llamacpp"][0]) for r in runs) / sum(r["llamacpp"][1] for r in runs)
        same = sum(r["llamacpp"][0] == r["hf"][0] for r in runs)
        ratio = total["llamacpp"] / total["hf"]
        print(
            f"llama.cpp        : {total['llamacpp']:6.1f} tokens/s ({ratio:.2f}x HF generate)   "
            f"answers equal to HF's: {same}/{len(runs)} (it computes on the Q4_1 blocks)"
        )
    if all("int8" in r for r in runs):
        for m in ("int8", "int8_plain"):
            total[m] = sum(len(r[m][0]) for r in runs) / sum(r[m][1] for r in runs)
        own = sum(r["int8"][0] == r["int8_plain"][0] for r in runs)
        same = sum(r["int8"][0] == r["hf"][0] for r in runs)
        versus = f"{total['int8'] / total['hf']:.2f}x HF generate"
        if "llamacpp" in total:
            versus += f", {total['int8'] / total['llamacpp']:.2f}x llama.cpp"
        print(
            f"treespec int8    : {total['int8']:6.1f} tokens/s ({versus}; its plain int8 loop "
            f"{total['int8_plain']:.1f})   answers equal to its plain int8 loop's: {own}/{len(runs)}, to "
            f"HF's: {same}/{len(runs)} (8-bit activations: another text than float32's)"
        )
    elif int8 is not None:
        print(f"treespec int8    : {int8}")
    print("same             : answers equal to HF generate's (float32 is exact; bf16 near-ties can flip)")
    print(
        "vLLM             : not in this environment; scripts/bench.py --methods ...,vllm,vllm_ngram "
        "runs it beside these (make vllm-env)"
    )
    if not all("llamacpp" in r for r in runs):
        print("llama.cpp        : not in this environment; `make llamacpp-env` adds its line here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=None, help="one prompt instead of the built-in five")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--heads", type=Path, default=default_heads_folder())
    parser.add_argument(
        "--drafter",
        default=recipes.AUTO,
        choices=[*recipes.names(), STATIC],
        metavar="RECIPE",
        help="a recipe from treespec.recipes (default auto: dynamic trees over the heads + the warm suffix "
        "cache, pruned to what pays here); static: heads+lookup in the heads' tree priced on this machine",
    )
    parser.add_argument(
        "--lookup", type=int, default=None, help="lookup nodes instead of the recipe's (0: none)"
    )
    parser.add_argument(
        "--no-int8", action="store_true", help="leave out the int8-numerics runs (recipe and plain loop)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="verify through torch.compile (faster steps after a compile of one to two minutes per size "
        "class in the warm-up)",
    )
    args = parser.parse_args(argv)
    prompts = [args.prompt] if args.prompt else PROMPTS
    dtype = treespec.tools.models.fast_dtype(block_weights=True) if args.dtype == "auto" else args.dtype
    name = str(dtype).removeprefix("torch.")
    print(f"loading {treespec.tools.models.DEFAULT_MODEL_NAME} ({name}) ...", flush=True)
    model, tokenizer = treespec.load_model(dtype=dtype)
    recipe = demo_recipe(args, model)
    heads = tree = None
    if "heads" in recipe.sources:
        heads, tree, heads_note = load_heads(model, args.heads, price=args.drafter == STATIC)
        print(f"{heads_note}\ntree of {tree.num_nodes} nodes, depth {tree.max_depth}")
    print(f"drafter: {recipe.name} ({recipe.description}; lookup {recipe.lookup})")
    new_drafter = make_drafter(model, recipe, heads, tree, args)
    int8 = int8_note(model, args)
    new_int8_drafter = make_drafter(model, recipe, heads, tree, args, "int8") if int8 is None else None
    llama = start_llamacpp(model, tokenizer)
    try:
        torch.manual_seed(0)
        print("warming up ...", flush=True)
        warm_up = argparse.Namespace(max_new_tokens=8, compile=args.compile)
        # one-node steps, a whole tree, then the demo's drafter: with --compile, every graph the timed
        # prompts use is compiled here
        whole = (lambda: treespec.as_drafter(model, heads, tree)) if heads is not None else (lambda: None)
        for drafter in (lambda: None, whole, new_drafter):
            run_all(model, tokenizer, drafter, ["Hi"], warm_up, llama, new_int8_drafter)
        runs = run_all(model, tokenizer, new_drafter, prompts, args, llama, new_int8_drafter)
        report(runs, tokenizer, int8)
    finally:
        if llama is not None:
            llama.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
