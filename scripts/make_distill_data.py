#!/usr/bin/env python
"""Generate self-distillation data for Medusa heads: the base model's own (greedy) answers to prompts.

    nice -n 10 python scripts/make_distill_data.py --threads 1                 # all prompts, resumable
    python scripts/make_distill_data.py --limit 32 --max-new-tokens 64 --out /tmp/distill-smoke
    python scripts/make_distill_data.py --engine vllm --dtype float32 --out data/distill/v   # vLLM answers
    python scripts/make_distill_data.py --engine vllm --temperature 0.8 --seed 1 --out ...  # a sampled set

Prompts: ShareGPT first turns in data/sharegpt_prompts.json (the TRAINING set; Spec-Bench is
for evaluation only). Output: token-id shards + meta.json in --out (see treespec/distill.py). Rerun the
same command after an interruption: finished shards are kept. Read with
`treespec.training.distill.load_distill_data(folder, split="train" | "eval")`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`: import it from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import treespec
from treespec.tools.models import default_model_folder
from treespec.tools.peers import VllmPeer
from treespec.training.distill import DistillDataError, make_distill_data

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO_ROOT / "data" / "sharegpt_prompts.json"
DEFAULT_OUT = REPO_ROOT / "data" / "distill" / "smollm2-135m-instruct"
DEFAULT_SOURCE = (
    "ShareGPT first-turn English prompts (ml-energy/leaderboard-v2, "
    "sharegpt/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json); research use"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=None, help="HF model id or folder (default: embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--prompts", default=None, help=f"prompts JSON (default {DEFAULT_PROMPTS})")
    p.add_argument(
        "--out", default=None, help=f"output folder (default {DEFAULT_OUT.relative_to(REPO_ROOT)})"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-chars", type=int, default=1500, help="cut prompts to this many characters")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (only with --temperature > 0)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=64, help="prompts per shard file")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of prompts held out (by id hash)")
    p.add_argument(
        "--splits", default="train,eval", help="which splits to generate (eval shards always come first)"
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts of the fixed hash order")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave)")
    p.add_argument(
        "--engine",
        default="hf",
        choices=["hf", "vllm"],
        help="hf: HF generate in padded batches (--batch-size); vllm: vLLM's CPU build (`make vllm-env`) "
        "answers each shard in one call, batching it itself",
    )
    p.add_argument("--vllm-python", default=None, help="python of vLLM's environment (default .venv-vllm)")
    p.add_argument("--kv-cache-gb", type=int, default=4, help="vLLM's CPU KV cache size (--engine vllm)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = Path(args.prompts) if args.prompts else DEFAULT_PROMPTS
    out = Path(args.out) if args.out else DEFAULT_OUT
    model, tokenizer = treespec.load_model(args.model, dtype=args.dtype, device=args.device)
    print(f"model {model.config.name_or_path} ({args.dtype}), prompts {prompts}, out {out}", flush=True)
    peer = None
    if args.engine == "vllm":
        folder = args.model or default_model_folder()
        print(f"starting vLLM on {folder} (a few minutes the first time) ...", flush=True)
        peer = VllmPeer(folder, args.dtype, python=args.vllm_python, kv_cache_gb=args.kv_cache_gb)
    start = time.perf_counter()
    try:
        meta = make_distill_data(
            out,
            model,
            tokenizer,
            prompts,
            max_new_tokens=args.max_new_tokens,
            max_prompt_chars=args.max_prompt_chars,
            batch_size=args.batch_size,
            shard_size=args.shard_size,
            eval_fraction=args.eval_fraction,
            temperature=args.temperature,
            seed=args.seed,
            limit=args.limit,
            splits=tuple(s.strip() for s in args.splits.split(",")),
            data_source=DEFAULT_SOURCE if prompts.resolve() == DEFAULT_PROMPTS.resolve() else None,
            answer=peer.run_batch if peer else None,
            engine=peer.engine_name(args.temperature) if peer else "hf",
        )
    except DistillDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if peer:
            peer.close()
    run = meta["last_run"]
    print(
        f"done in {time.perf_counter() - start:.0f} s: {run['new_tokens']} new tokens this run "
        f"({run['tokens_per_s']} tok/s); complete={meta['complete']}",
        flush=True,
    )
    for split, t in meta["totals"].items():
        print(
            f"  {split}: {t['shards']} shards, {t['prompts']} prompts, {t['response_tokens']} response tokens"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
