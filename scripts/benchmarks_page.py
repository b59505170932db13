#!/usr/bin/env python
"""Regenerate BENCHMARKS.md (the current-results page) from benchmarks/*.json and benchmarks/current.json.

    python scripts/benchmarks_page.py            rewrite BENCHMARKS.md
    python scripts/benchmarks_page.py --check    exit 1 when BENCHMARKS.md is out of date

The page is built by treespec/tools/benchmarks_page.py (which runs are current, what each table shows).
That module uses the standard library only, so it is loaded from its file: no torch import, and the
checkout's copy is used whatever treespec is installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _page_module():
    spec = importlib.util.spec_from_file_location(
        "treespec_benchmarks_page", ROOT / "treespec" / "tools" / "benchmarks_page.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    """Build the page of this checkout (from any working directory)."""
    os.chdir(ROOT)
    return _page_module().main(argv, prog="python scripts/benchmarks_page.py")


if __name__ == "__main__":
    sys.exit(main())
