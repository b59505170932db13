#!/usr/bin/env python
"""Make a draft model: the base model's first layers, distilled on its self-distillation data.

    python scripts/make_draft_model.py --data data/distill/smollm2-135m-instruct --out runs/draft-6l \\
        --num-layers 6 --max-steps 300 --batch-tokens 4096

The run folder gets `model/` (the draft: config, safetensors weights and the tokenizer, loadable offline
with AutoModelForCausalLM / AutoTokenizer.from_pretrained), `training.json` (settings, loss curve, held-out
top-1 agreement with the base model's greedy tokens) and `checkpoint/` (atomic; `--resume` continues).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import treespec  # noqa: F401
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from treespec.training.draft_train import MODEL_DIR, DraftTrainConfig, train_draft_model


def parse_args(argv: list[str] | None = None) -> tuple[DraftTrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="make_draft_model.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        required=True,
        help="self-distillation data folder (make_distill_data.py), or several joined by commas, e.g. "
        "a greedy and a sampled set (train: all of them; eval: the first)",
    )
    p.add_argument("--out", required=True, help="run folder (model/, training.json, checkpoint/)")
    p.add_argument("--model", default=None, help="base model id or folder (default: embedded SmolLM2)")
    p.add_argument(
        "--dtype", default="float32", help="dtype the base model is loaded in and the draft saved in"
    )
    p.add_argument("--num-layers", type=int, default=6, help="decoder layers the draft keeps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-tokens", type=int, default=4096, help="rows x padded width per step")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-sequences", type=int, default=None, help="evaluate on the first N eval sequences")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-bf16", action="store_true", help="train in float32 (default: bf16 autocast)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    args = p.parse_args(argv)
    cfg = DraftTrainConfig(
        data=args.data,
        out=args.out,
        num_layers=args.num_layers,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        max_steps=args.max_steps,
        batch_tokens=args.batch_tokens,
        grad_clip=args.grad_clip,
        eval_every=args.eval_every,
        eval_sequences=args.eval_sequences,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        bf16=not args.no_bf16,
        extra={"model": args.model},
    )
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    import torch

    from treespec import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.model, dtype=args.dtype)
    record = train_draft_model(cfg, target_model=target, resume=args.resume)
    folder = Path(cfg.out) / MODEL_DIR
    tokenizer.save_pretrained(folder)
    history = " ".join(f"{e['step']}:{e['top1']:.3f}" for e in record["eval_history"])
    print(f"draft model ({cfg.num_layers} layers) written to {folder}")
    print(f"held-out top-1 agreement with the base model by step: {history}")
    print(f"{record['seconds_per_step']:.2f} s/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
