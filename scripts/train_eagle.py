#!/usr/bin/env python
"""Train an EAGLE-style draft layer for a base model on its self-distillation data.

    python scripts/train_eagle.py --data data/distill/smollm2-135m-instruct --out runs/eagle-smollm2
    accelerate launch --multi_gpu --num_processes 2 scripts/train_eagle.py ...   # DDP, same script

The run folder gets `drafter/` (config.json + model.safetensors + training.json: load it with
treespec.EagleDraftModel.from_pretrained), `training.json` (settings, loss curve, held-out per-position
acceptance), `checkpoint/` (atomic; `--resume` continues from it) and `cache/` (the target's features,
computed once). See treespec.training.eagle_train for what is trained and how.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    import treespec  # noqa: F401
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from treespec.tools.models import load_model
from treespec.training.eagle_train import EagleTrainConfig, train_eagle


def parse_args(argv: list[str] | None = None) -> tuple[EagleTrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="train_eagle.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        required=True,
        help="self-distillation data folder (make_distill_data.py), or several joined by commas, e.g. "
        "a greedy and a sampled set (train: all of them; eval: the first)",
    )
    p.add_argument("--out", required=True, help="run folder (drafter/, training.json, checkpoint/, cache/)")
    p.add_argument("--model", default=None, help="base model id or folder (default: embedded SmolLM2)")
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per step, all processes")
    p.add_argument("--max-length", type=int, default=512, help="sequences are cut to this many tokens")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--ttt-steps", type=int, default=5, help="unrolled training-time-test steps (1: none)")
    p.add_argument("--step-decay", type=float, default=0.8, help="loss weight decay per unrolled step")
    p.add_argument(
        "--hard-labels", action="store_true", help="CE on the target's greedy token, not soft labels"
    )
    p.add_argument(
        "--feature-layers",
        default=None,
        help="comma list of the target's hidden_states indices to fuse (default: low, middle, high)",
    )
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--max-sequences", type=int, default=None, help="use only the first N training sequences")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="folder of the target's features (default <out>/cache)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument(
        "--init-from",
        default=None,
        help="a drafter folder (e.g. the committed one) to start from: a new training round, fresh optimizer",
    )
    p.add_argument("--no-bf16", action="store_true", help="target and training in float32 (default: bf16)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    args = p.parse_args(argv)
    layers = [int(x) for x in args.feature_layers.split(",")] if args.feature_layers else None
    cfg = EagleTrainConfig(
        data=args.data,
        out=args.out,
        max_steps=args.max_steps,
        batch_tokens=args.batch_tokens,
        max_length=args.max_length,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        ttt_steps=args.ttt_steps,
        step_decay=args.step_decay,
        soft_labels=not args.hard_labels,
        feature_layers=layers,
        draft_vocab_size=args.draft_vocab_size,
        max_sequences=args.max_sequences,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        cache=args.cache,
        bf16=not args.no_bf16,
        init_from=args.init_from,
        extra={"model": args.model} if args.model else {},
    )
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(cfg.extra.get("model"), dtype="bfloat16" if cfg.bf16 else "float32")
    record = train_eagle(cfg, model, resume=args.resume)
    if record:
        e = record["eval"]
        print(
            f"held-out acceptance per position {' '.join(f'{a:.3f}' for a in e['acceptance'])}; "
            f"expected accepted length {e['expected_accept_length']:.2f} ({e['anchors']} anchors)"
        )
        print(f"drafter written to {Path(cfg.out) / 'drafter'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
