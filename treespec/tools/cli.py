"""The ``treespec`` command: generate text, draw trees and traces, tune, benchmark, train.

    treespec generate "Why is the sky blue?" --stream --show-tree --trace run.json
    treespec viz tree.json -o tree.png [--acceptance table.json]
    treespec viz --trace run.json -o run.html          (or -o step.png --step 3)
    treespec tune --exit-head FOLDER                   choose gamma for a chain drafter
    treespec export --out DIR [--heads F | --eagle F | --model-only]   for vLLM / SGLang
    treespec bench ...  /  treespec train ...          treespec.tools.bench / treespec.tools.train_heads

Everything works from an installed wheel: the default model's trained heads and the Spec-Bench
questions ship inside it (`models.default_heads_folder`, `models.default_data_file`).

Errors a user can cause (a bad or missing file, a malformed option) print one line naming the
problem and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import treespec

from .. import recipes
from ..core.decoder import KV_DTYPES, NUMERICS
from . import drafter_options as options
from .models import MissingDefaultModelError, default_data_file, default_suffix_cache_file
from .trace import Trace

PROGRAMS = {  # subcommand -> (module with main(argv, prog), one-line help); they parse their own options
    "bench": ("treespec.tools.bench", "benchmark against HF generate on Spec-Bench"),
    "train": ("treespec.tools.train_heads", "train Medusa heads (or an exit head) on self-distillation data"),
}
PICTURES = (".png", ".svg")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    try:
        if command in PROGRAMS:  # everything after the name belongs to the program's own parser
            return run_program(command, argv[1:])
        args = build_parser().parse_args(argv)
        return args.run(args)
    except (ValueError, OSError, MissingDefaultModelError) as e:
        print(f"treespec {command}: error: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _message(error: Exception) -> str:
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    return str(error)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treespec",
        description="Tree-speculative (Medusa-style) decoding: generate, visualise, benchmark, train.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(commands)
    _add_chat(commands)
    _add_viz(commands)
    _add_tune(commands)
    _add_export(commands)
    for name, (_, help_text) in PROGRAMS.items():
        commands.add_parser(name, help=help_text, description=f"{help_text}; options: treespec {name} --help")
    return parser


# ----- treespec export -----


def _add_export(commands) -> None:
    p = commands.add_parser(
        "export",
        help="write trained drafters (or the default model) in the formats vLLM and SGLang load",
        description="Independent Medusa heads -> vLLM's Medusa format; an EAGLE-style drafter -> the "
        "EAGLE-3 format (vLLM, SGLang); --model-only: the target model as a plain HF folder. Formats that "
        "cannot express a drafter (sequential heads, exit heads) are refused with what to use instead.",
    )
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--model", default=None, help="HF model id or folder (default: embedded SmolLM2-135M)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--heads", metavar="FOLDER", help="Medusa heads folder (independent heads)")
    which.add_argument("--eagle", metavar="FOLDER", help="EAGLE-style drafter folder (train_eagle.py)")
    which.add_argument("--model-only", action="store_true", help="the target model itself (HF folder)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.set_defaults(run=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from . import export

    folder = args.heads or args.eagle
    if folder:
        options.existing_folder(folder, "--heads" if args.heads else "--eagle")
    model, tokenizer = treespec.load_model(args.model, dtype="float32")
    dtype = getattr(torch, args.dtype)
    if args.heads:
        heads = treespec.MedusaHeads.from_pretrained(folder, model=model)
        out = export.export_medusa(heads, model, args.out, dtype)
    elif args.eagle:
        draft = treespec.EagleDraftModel.from_pretrained(folder, model=model)
        out = export.export_eagle3(draft, model, args.out, dtype)
    else:
        out = export.export_model(model, tokenizer, args.out)
    print(f"written to {out}")
    return 0


# ----- treespec tune -----


def _add_tune(commands) -> None:
    p = commands.add_parser(
        "tune",
        help="choose gamma for a draft model or exit head on this machine",
        description="Measure this machine's step costs and the drafter's acceptance on held-out "
        "self-distillation prompts (never Spec-Bench), choose the gamma with the most tokens per second, "
        "print predicted and measured speedups, and store the choice as tune.json in the drafter's folder.",
    )
    p.add_argument("--model", default=None, help="HF model id or folder (default: embedded SmolLM2-135M)")
    _add_chain_drafter_options(p, required=True)
    p.add_argument(
        "--data",
        default=str(default_data_file("distill/smollm2-135m-instruct")),
        help="self-distillation folder whose eval prompts are used (default: the checkout's data/distill/"
        "smollm2-135m-instruct, made by scripts/make_distill_data.py; not in the wheel)",
    )
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts to measure on (default 8)")
    p.add_argument("--max-gamma", type=int, default=8, help="largest gamma tried (default 8)")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens per measured generation (default 64)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--no-save", action="store_true", help="print the choice without writing tune.json")
    p.set_defaults(run=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from ..training.distill import load_distill_data
    from ..training.tune import tune_drafter

    if args.max_gamma < 1 or args.prompts < 1:
        raise ValueError("--max-gamma and --prompts must be >= 1")
    if not Path(args.data).is_dir():
        raise ValueError(
            f"--data {args.data}: no self-distillation data folder (make one with "
            "scripts/make_distill_data.py, or pass --data FOLDER)"
        )
    flag = "--draft-model" if args.draft_model else "--exit-head"
    options.existing_folder(args.draft_model or args.exit_head, flag)  # before the model loads
    data = load_distill_data(args.data, "eval")
    prompts = [s[:p].tolist() for s, p in zip(data.sequences, data.prompt_lengths, strict=True)][
        : args.prompts
    ]
    model, _ = treespec.load_model(args.model, dtype=args.dtype)
    make_drafter = chain_drafter_factory(args, model)  # loads the draft model or exit head once

    def run(drafter, ids, max_new_tokens):
        return treespec.generate(model, ids, drafter, max_new_tokens=max_new_tokens, eos_token_id=[])

    from ..training.costs import default_cost_file, verify_cost_model

    # this machine's verification cost curve when one was measured (a corrupt file is refused); tuning
    # times whole steps without one, so it measures none of its own
    curve = default_cost_file(model)
    verify_seconds = verify_cost_model(model) if curve.is_file() else None
    how = "this machine's cost curve" if verify_seconds else f"timed steps (no cost curve at {curve})"
    print(f"verification costs: {how}", file=sys.stderr)
    result = tune_drafter(
        make_drafter,
        run,
        prompts,
        max_gamma=args.max_gamma,
        max_new_tokens=args.max_new_tokens,
        progress=lambda line: print(line, file=sys.stderr),
        verify_seconds=verify_seconds,
    )
    result.measured |= {"storage": args.storage, "branching": args.branching}  # the settings tuned for
    print(result.format())
    if not args.no_save:
        print(f"written to {result.save(args.draft_model or args.exit_head)}")
    return 0


# ----- treespec generate -----


def _add_generate(commands) -> None:
    p = commands.add_parser(
        "generate",
        help="generate text with tree speculation",
        description="Generate text with tree speculation and print it, then a statistics summary.",
    )
    p.add_argument("prompt", help="the prompt (goes through the chat template when the model has one)")
    p.add_argument("--model", default=None, help="HF model id or folder (default: embedded SmolLM2-135M)")
    options.add_heads_arguments(p)
    _add_sampling_and_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--show-tree", action="store_true", help="print each step's tree, path highlighted")
    p.add_argument("--trace", metavar="OUT.json", default=None, help="save the step-by-step trace here")
    p.add_argument(
        "--lookup",
        type=int,
        default=None,
        help="a prompt-lookup chain of N tokens beside the tree (default: the recipe's own; 0: none)",
    )
    p.add_argument(
        "--drafter",
        default=recipes.AUTO,
        choices=[*recipes.names(), "none"],
        metavar="RECIPE",
        help="a recipe (treespec.recipes): auto (default: the best shipped one for the model, "
        f"{recipes.DEFAULT_RECIPE} for the default model, plain for another; heads with --heads / --tree, "
        "eagle with --eagle), none (= plain), or: "
        + "; ".join(f"{n}: {r.description}" for n, r in recipes.RECIPES.items()),
    )
    p.add_argument(
        "--suffix-cache",
        metavar="FILE.json",
        default=None,
        help="recipes with suffix trees: earlier answers to draft from, loaded when the file exists (else "
        "the default model starts from its shipped answers) and saved back with this answer added",
    )
    _add_chain_drafter_options(p, eagle=True)
    p.set_defaults(run=cmd_generate)


def sampling_config(args) -> treespec.SamplingConfig:
    """The sampling options of `generate` and `chat` (checked before the model loads)."""
    return treespec.SamplingConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
    )


def _add_sampling_and_model_arguments(p) -> None:
    """Options `generate` and `chat` share: sampling, the model's dtype and device, the numerics."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="sampling keeps the tokens of at least this fraction of the most likely one's probability "
        "(default 0: off)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="HF's repetition_penalty (default 1.0: off; e.g. 1.2 makes tokens already in the text less "
        "likely); greedy output still equals HF greedy with the same penalty",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="default auto: bfloat16 where the hardware computes it natively (CUDA, a CPU with "
        "AVX512-BF16 / AMX), else float32 (emulated bf16 is ~3x slower); float32 gives HF's tokens exactly",
    )
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    p.add_argument(
        "--numerics",
        default="fast",
        choices=list(NUMERICS),
        help="bitwise: row-invariant kernels, so the output is bit for bit the plain loop's (CPU; slower "
        "for large trees); int8: the same with 8-bit activations in every linear of the native step (the "
        "fastest on a CPU with VNNI; its text is its own plain loop's, not the float model's); fast "
        "(default): the fastest float kernels (core.decoder.NUMERICS lists every value)",
    )
    p.add_argument(
        "--kv-dtype",
        default="model",
        choices=list(KV_DTYPES),
        help="what the KV cache stores: model (its dtype, default) or bfloat16 (a float32 model's cache in "
        "half the bytes; with --numerics int8 or bitwise, whose text it changes a little)",
    )


def _add_chain_drafter_options(p, required: bool = False, eagle: bool = False) -> None:
    """--draft-model / --exit-head (instead of Medusa heads), --gamma, --storage; with `eagle`, also
    --eagle / --eagle-tree."""
    which = p.add_mutually_exclusive_group(required=required)
    if eagle:
        which.add_argument(
            "--eagle",
            metavar="FOLDER",
            help="draft with this EAGLE-style draft layer (scripts/train_eagle.py) instead of heads",
        )
        options.add_eagle_tree_argument(p)
    which.add_argument(
        "--draft-model", metavar="FOLDER", help="draft with this HF causal LM (same tokenizer)"
    )
    which.add_argument(
        "--exit-head",
        metavar="FOLDER",
        help="self-speculative: draft with the model's first layers and this exit head "
        "(train_heads.py --exit-layer)",
    )
    p.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="tokens drafted per step (default: the folder's tune.json, else 4)",
    )
    p.add_argument(
        "--branching",
        default=None,
        metavar="D:K,...",
        help="draft model only: add its top-K guesses at depth D as leaves beside the chain (e.g. 1:4)",
    )
    p.add_argument(
        "--storage",
        default="model",
        choices=["model", "float32", "bfloat16", "float16", "int8"],
        help="precision of the draft model's speculative KV cache (default: the model's dtype)",
    )


def chain_drafter_factory(args: argparse.Namespace, model) -> Callable[[int | None], object] | None:
    """gamma -> the draft-model or self-speculative drafter the options ask for (gamma None: --gamma,
    else the folder's tune.json, else 4), its model or exit head loaded once; None when neither option
    is given."""
    if args.branching and not args.draft_model:
        raise ValueError("--branching applies to --draft-model only")
    chain = options.load_chain_option(model, args.draft_model, args.exit_head, args.gamma)
    if chain is None:
        return None
    return lambda gamma=None: chain.drafter(model, gamma, storage=args.storage, branching=args.branching)


def suffix_start(cache_file: str | None, default_model: bool) -> Path | None:
    """The saved suffix cache a suffix recipe starts from: `cache_file` when it exists, else (default_model)
    the default model's shipped earlier answers, else None (an empty cache)."""
    shipped = default_suffix_cache_file() if default_model else None
    return next((Path(f) for f in (cache_file, shipped) if f is not None and Path(f).is_file()), None)


def generate_recipe(args: argparse.Namespace) -> str | None:
    """The recipe name `treespec generate` runs ("auto" resolved once the model is loaded), or None when
    a chain drafter (--draft-model / --exit-head) drafts; option errors raise ValueError before the model
    loads."""
    name = "plain" if args.drafter == "none" else args.drafter
    if args.draft_model or args.exit_head:
        if name != recipes.AUTO:
            raise ValueError(f"--draft-model / --exit-head draft themselves: drop --drafter {args.drafter}")
        flag = "--draft-model" if args.draft_model else "--exit-head"
        options.existing_folder(args.draft_model or args.exit_head, flag)
        return None
    if name == recipes.AUTO and args.eagle:
        name = "eagle"
    elif name == recipes.AUTO and (args.heads or args.tree):
        name = "heads"
    if name == recipes.AUTO:
        return name
    sources = recipes.RECIPES[name].sources
    if (args.heads or args.tree) and "heads" not in sources:
        raise ValueError(f"--drafter {args.drafter} drafts without heads: drop --heads / --tree")
    if (args.eagle or args.eagle_tree) and "eagle" not in sources:
        raise ValueError(
            f"--drafter {args.drafter} drafts without an EAGLE layer: drop --eagle / --eagle-tree"
        )
    if args.eagle:
        options.existing_folder(args.eagle, "--eagle")
    if "eagle" in sources:
        options.eagle_folder(args.eagle, args.model)  # the shipped layer fits the default model only
    return name


def recipe_parts(args: argparse.Namespace, model, recipe: recipes.Recipe, tree_choice) -> recipes.Parts:
    """The parts of `recipe` the options name (heads and their tree, the EAGLE layer, the suffix cache),
    the rest shipped (`recipes.Parts.shipped`)."""
    given = {}
    if "heads" in recipe.sources:
        folder = options.heads_folder(args.heads, args.model)
        heads, _ = options.load_heads(folder, model, args.num_heads)
        tree, _ = options.pick_tree(tree_choice, heads, args.tree or "--tree", folder, model)
        given |= {"heads": heads, "tree": tree if tree_choice is not None or not recipe.dynamic else None}
    if "eagle" in recipe.sources:
        source = options.load_eagle_option(
            options.eagle_folder(args.eagle, args.model), model, args.eagle_tree
        )
        given["eagle"] = lambda: source.drafter(model)
    if "suffix" in recipe.sources:
        start = suffix_start(args.suffix_cache, args.model is None and recipe.warm)
        given["suffix_cache"] = (lambda: treespec.SuffixCache.load(start)) if start else treespec.SuffixCache
    return recipes.Parts.shipped(model, recipe, numerics=args.numerics, **given)


def generate_drafter(args: argparse.Namespace, model, name: str | None, tree_choice):
    """(drafter, parts) for `treespec generate`: the chain drafter, or the recipe's drafter built from
    the options' parts (parts None for a chain drafter)."""
    if name is None:
        drafter = chain_drafter_factory(args, model)()
        if args.lookup and drafter is not None:
            drafter = treespec.TreePlanner([drafter, treespec.PromptLookup(args.lookup)])
        return drafter, None
    recipe = recipes.resolve(name, model)
    if args.lookup is not None:
        if args.lookup and "suffix" in recipe.sources:
            raise ValueError(f"the suffix trees of {recipe.name} match the prompt themselves: drop --lookup")
        recipe = replace(recipe, lookup=args.lookup)
    if args.suffix_cache and "suffix" not in recipe.sources:
        with_suffix = [n for n, r in recipes.RECIPES.items() if "suffix" in r.sources]
        raise ValueError(
            f"--suffix-cache goes with a recipe that drafts suffix trees: {', '.join(with_suffix)}"
        )
    parts = recipe_parts(args, model, recipe, tree_choice)
    return recipes.build(recipe, parts), parts


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from transformers import TextStreamer

    # option errors (a missing folder, a bad tree file) are reported before the model loads
    name = generate_recipe(args)
    if name is not None and args.heads:
        options.heads_folder(args.heads, args.model)
    tree_choice = None if args.tree is None else options.parse_tree(args.tree)
    sampling = sampling_config(args)
    model, tokenizer = treespec.load_model(args.model, dtype=args.dtype, device=args.device)
    drafter, parts = generate_drafter(args, model, name, tree_choice)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if args.stream else None
    want_trace = args.show_tree or args.trace is not None
    result = treespec.generate(
        model,
        args.prompt,
        drafter,
        tokenizer,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        streamer=streamer,
        trace=want_trace,
        options=treespec.DecodeOptions(numerics=args.numerics, kv_dtype=args.kv_dtype),
    )
    if args.suffix_cache:
        for suffix in parts.suffix_drafters:
            suffix.finish()  # this answer into the cache, then the cache to its file
            suffix.cache.save(args.suffix_cache)
    if streamer is None:
        print(result.text)
    if want_trace:
        trace = Trace.from_result(result, tokenizer, model=args.model or model.config.name_or_path)
        if args.show_tree:
            print_trace_trees(trace)
        if args.trace is not None:
            trace.save(args.trace)
            print(f"trace written to {args.trace}", file=sys.stderr)
    print(result.stats.summary())
    return 0


# ----- treespec chat -----


def _add_chat(commands) -> None:
    p = commands.add_parser(
        "chat",
        help="talk with the model, turn after turn (the conversation's K/V kept between turns)",
        description="An interactive conversation on stdin / stdout: each line is a message, the reply "
        "streams back. The history stays in the cache, so a turn prefills only its new tokens. "
        "/reset starts a new conversation; an empty line or end of input ends.",
    )
    p.add_argument("--model", default=None, help="HF model id or folder (default: embedded SmolLM2-135M)")
    p.add_argument(
        "--drafter",
        default=recipes.AUTO,
        choices=[*recipes.names(), "none"],
        metavar="RECIPE",
        help="a recipe (treespec.recipes): auto (default), none (= plain) or any of: "
        + ", ".join(recipes.names()),
    )
    p.add_argument("--system", default=None, help="a system message (default: the chat template's own)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per reply (default 256)")
    _add_sampling_and_model_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no statistics line after each reply")
    p.set_defaults(run=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from transformers import TextStreamer

    sampling = sampling_config(args)
    model, tokenizer = treespec.load_model(args.model, dtype=args.dtype, device=args.device)
    drafter = None if args.drafter == "none" else args.drafter
    options = treespec.DecodeOptions(numerics=args.numerics, kv_dtype=args.kv_dtype)
    interactive = sys.stdin.isatty()
    with treespec.Chat(
        model, tokenizer, drafter, system=args.system, max_new_tokens=args.max_new_tokens,
        sampling=sampling, options=options,
    ) as chat:  # fmt: skip
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            message = line.strip()
            if not message:
                break
            if message == "/reset":
                chat.reset()
                print("(a new conversation)", file=sys.stderr)
                continue
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            try:
                result = chat.send(message, streamer=streamer)
            except treespec.CacheCapacityError as error:  # the conversation is full: /reset goes on
                print(f"treespec chat: {error}", file=sys.stderr)
                continue
            if not args.quiet:
                print(f"[{result.stats.summary()}]", file=sys.stderr)
    return 0


def print_trace_trees(trace: Trace) -> None:
    """Print each step's candidate tree in the terminal (rich)."""
    from rich.console import Console

    console = Console(highlight=False)
    for k in range(len(trace.steps)):
        console.print(rich_step_tree(trace, k))


def rich_step_tree(trace: Trace, step_index: int):
    """A rich Tree of one step: accepted path bold green, rejected nodes dim, the bonus in yellow."""
    from rich.text import Text
    from rich.tree import Tree as RichTree

    from .viz import visible

    step, tree = trace.steps[step_index], trace.step_tree(step_index)
    accepted = set(step.path)

    def label(node: int) -> Text:
        text = visible(step.token_texts[node], 24)
        if node == 0:
            return Text(f"{text}  (root)", style="bold green")
        prob = "" if step.draft_probs is None else f"  p={step.draft_probs[node]:.2f}"
        where = f"  h{int(tree.head[node])} r{int(tree.rank[node])}"
        return Text(text + prob + where, style="bold green" if node in accepted else "dim")

    def grow(branch: RichTree, node: int) -> None:
        for child in tree.children(node):
            grow(branch.add(label(child)), child)
        if node == step.path[-1]:
            branch.add(Text(f"+ {visible(step.bonus_text, 24)}  (bonus)", style="bold yellow"))

    title = f"step {step_index + 1} / {len(trace.steps)}: accepted length {step.accept_length}"
    root = RichTree(Text(title, style="bold"))
    grow(root.add(label(0)), 0)
    return root


# ----- treespec viz -----


def _add_viz(commands) -> None:
    p = commands.add_parser(
        "viz",
        help="draw a tree (PNG/SVG) or a generation trace (HTML, or one step as PNG/SVG)",
        description="Draw a tree file as PNG/SVG, or a trace from `treespec generate --trace` as an "
        "interactive HTML page or one step's picture. The output format follows the -o extension.",
    )
    p.add_argument("tree", nargs="?", help="tree JSON file, a folder with tree.json, or a default tree size")
    p.add_argument("--num-heads", type=int, default=4, help="heads of a default tree size (default 4)")
    p.add_argument("--trace", default=None, help="trace JSON file written by `treespec generate --trace`")
    p.add_argument("-o", "--output", required=True, help="output: .png or .svg (tree or step), .html (trace)")
    p.add_argument(
        "--acceptance",
        default=None,
        help='JSON table acceptance[head][rank] (or {"acceptance": [...]}) to colour a tree by',
    )
    p.add_argument(
        "--mode",
        choices=["path", "node"],
        default="path",
        help="with --acceptance: colour by path probability (default) or the node's own",
    )
    p.add_argument("--step", type=int, default=None, help="with --trace and -o .png/.svg: step K (1-based)")
    p.set_defaults(run=cmd_viz)


def cmd_viz(args: argparse.Namespace) -> int:
    from . import viz

    out = Path(args.output)
    ext = out.suffix.lower()
    if (args.tree is None) == (args.trace is None):
        raise ValueError("give either a tree file or --trace TRACE.json (not both)")
    if args.tree is not None:
        if args.step is not None:
            raise ValueError("--step needs --trace")
        if ext not in PICTURES:
            raise ValueError(f"{out}: a tree is drawn as .png or .svg, not {ext or 'no extension'!r}")
        tree = options.parse_tree(args.tree)
        if isinstance(tree, int):
            tree = treespec.default_tree(tree, args.num_heads)
        acceptance = load_acceptance(args.acceptance) if args.acceptance else None
        viz.draw_tree(tree, out, acceptance=acceptance, mode=args.mode)
    else:
        if args.acceptance is not None:
            raise ValueError("--acceptance applies to a tree file, not to a trace")
        trace = Trace.load(args.trace)
        if ext == ".html":
            if args.step is not None:
                raise ValueError("--step applies to a .png/.svg picture; the HTML page shows every step")
            viz.write_html(trace, out, title=f"treespec trace: {Path(args.trace).name}")
        elif ext in PICTURES:
            step = 1 if args.step is None else args.step
            if not 1 <= step <= len(trace.steps):
                count = len(trace.steps)
                raise ValueError(f"{args.trace}: --step {step} out of range (the trace has {count} steps)")
            viz.draw_step(trace, step - 1, out)
        else:
            raise ValueError(f"{out}: a trace is drawn as .html, .png or .svg, not {ext or 'no extension'!r}")
    print(f"wrote {out}", file=sys.stderr)
    return 0


def load_acceptance(path: str | Path) -> list[list[float]]:
    """An ``acceptance[head][rank]`` table from JSON: a list of lists, or an object holding one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if isinstance(data, dict):
        data = data.get("acceptance")
    ok = isinstance(data, list) and all(isinstance(row, list) for row in data)
    if not ok or not all(_is_number(p) for row in data for p in row):
        raise ValueError(f"{path}: expected an acceptance table [[p, ...], ...] of numbers, one row per head")
    return [[float(p) for p in row] for row in data]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----- treespec bench / train -----


def run_program(name: str, argv: list[str]) -> int:
    """Run the library program behind ``treespec <name>`` (its ``main(argv, prog=...)``)."""
    module = importlib.import_module(PROGRAMS[name][0])
    result = module.main(argv, prog=f"treespec {name}")
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
