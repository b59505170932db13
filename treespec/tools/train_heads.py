"""`treespec train`: train Medusa heads (or an exit head) on a base model's self-distillation data
(scripts/make_distill_data.py makes it); the options map onto `training.heads_train.TrainConfig`.

    treespec train --data data/distill/smollm2-135m-instruct --out runs/heads-smollm2
    python scripts/train_heads.py ...                                            # the same, from a checkout
    accelerate launch --multi_gpu --num_processes 2 scripts/train_heads.py ...   # DDP

(On a CPU-only machine `--multi_gpu` starts torchrun processes that talk over gloo; accelerate's
`--cpu` flag alone starts a single process unless MPI is configured.)

The run folder gets `heads/` (the trained heads: config.json + model.safetensors), `training.json`
(settings, loss curve, held-out top-1/top-5 accuracy per head), `checkpoint/` (atomic; `--resume`
continues from it) and `cache/` (the base model's hidden states, computed once).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from ..training.heads_train import TrainConfig, train_heads
from .models import load_model


def parse_args(
    argv: list[str] | None = None, prog: str | None = None
) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog=prog or "treespec train", description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        required=True,
        help="self-distillation data folder (make_distill_data.py), or several joined by commas, e.g. "
        "a greedy and a sampled set (train: all of them; eval: the first)",
    )
    p.add_argument("--out", required=True, help="run folder (heads/, training.json, checkpoint/, cache/)")
    p.add_argument("--model", default=None, help="base model id or folder (default: embedded SmolLM2)")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="Hydra-style heads: head k also sees the token before its guess",
    )
    p.add_argument(
        "--own-lm-head", action="store_true", help="each head gets its own output layer (default: shared)"
    )
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=0,
        help="limit the heads' output to the N most frequent answer tokens (0: whole vocabulary)",
    )
    p.add_argument(
        "--exit-layer",
        type=int,
        default=0,
        help="train one exit head on the first K layers for self-speculative drafting (with --num-heads 1)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=256, help="positions per step, all processes together")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-bf16", action="store_true", help="train in float32 (default: bf16 autocast)")
    p.add_argument("--max-positions", type=int, default=None, help="use at most this many training positions")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    args = p.parse_args(argv)
    # every option named like a TrainConfig field sets that field
    same = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    cfg = TrainConfig(**same, bf16=not args.no_bf16, extra={"model": args.model})
    return cfg, args


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse the options, train, print where the heads went and their held-out accuracy."""
    cfg, args = parse_args(argv, prog)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, _ = load_model(cfg.extra.get("model"), dtype="bfloat16" if cfg.bf16 else "float32")
    record = train_heads(cfg, model, resume=args.resume)
    if record.get("eval"):
        acc = record["eval"]
        print(f"heads written to {Path(cfg.out) / 'heads'}")
        print("held-out top-1 per head:", " ".join(f"{a:.3f}" for a in acc["top1"]))
        print("held-out top-5 per head:", " ".join(f"{a:.3f}" for a in acc["top5"]))
    return 0
