#!/usr/bin/env python
"""Benchmark treespec against Hugging Face generate on Spec-Bench prompts: `treespec bench` from a checkout.

    python scripts/bench.py --num-prompts 16 --max-new-tokens 128 --dtype bfloat16

The benchmark lives in treespec.tools.bench (methods, options, output: `python scripts/bench.py --help`).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import treespec  # noqa: F401
except ModuleNotFoundError:  # a checkout without `pip install -e .`: import it from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from treespec.tools.bench import main as bench_main


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see treespec.tools.bench.main); returns the results written."""
    return bench_main(argv, prog="python scripts/bench.py")


if __name__ == "__main__":
    main()
