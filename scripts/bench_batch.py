#!/usr/bin/env python
"""Batched decoding benchmark: treespec at batch sizes 1-16 against HF generate and vLLM on the same groups.

    python scripts/bench_batch.py --batch-sizes 1,4,8,16 --num-prompts 16 --dtype float32

The benchmark lives in treespec.tools.bench_batch (methods, options, output: `--help`).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import treespec  # noqa: F401
except ModuleNotFoundError:  # a checkout without `pip install -e .`: import it from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from treespec.tools.bench_batch import main as bench_batch_main


def main(argv: list[str] | None = None) -> dict:
    return bench_batch_main(argv, prog="python scripts/bench_batch.py")


if __name__ == "__main__":
    main()
