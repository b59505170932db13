#!/usr/bin/env python
"""Train Medusa heads for a base model on its self-distillation data: `treespec train` from a checkout.

    python scripts/train_heads.py --data data/distill/smollm2-135m-instruct --out runs/heads-smollm2
    accelerate launch --multi_gpu --num_processes 2 scripts/train_heads.py ...   # DDP, same script

(On a CPU-only machine `--multi_gpu` starts torchrun processes that talk over gloo; accelerate's
`--cpu` flag alone starts a single process unless MPI is configured.) Options and outputs: see
treespec.tools.train_heads (`python scripts/train_heads.py --help`).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import treespec  # noqa: F401
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from treespec.tools.train_heads import main as train_main


def main(argv: list[str] | None = None) -> int:
    return train_main(argv, prog="train_heads.py")


if __name__ == "__main__":
    sys.exit(main())
