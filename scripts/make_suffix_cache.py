#!/usr/bin/env python
"""Write a suffix cache warmed with a model's own earlier answers: the answers of its distillation data's
train split (prompts no evaluation uses), for `SuffixDrafter` to draft from before it has seen a request.

    python scripts/make_suffix_cache.py --data data/distill/smollm2-135m-instruct \
        --out heads/smollm2-135m-instruct-suffix/suffix-cache.json

(the file the default model's `--drafter suffix` starts from). Load it with `treespec.SuffixCache.load`,
or pass it to `treespec generate --suffix-cache` or `treespec bench --suffix-warm`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import treespec
from treespec.training.distill import read_answers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="distillation data folder(s), comma-separated")
    p.add_argument("--out", required=True, help="the cache file to write (JSON)")
    p.add_argument(
        "--room", type=int, default=131072, help="tokens of room for later requests (default %(default)s)"
    )
    args = p.parse_args(argv)
    answers = read_answers(args.data)
    cache = treespec.SuffixCache.from_sequences(answers, room=args.room)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cache.save(out)
    memory, size = cache.memory_bytes() / 2**20, out.stat().st_size / 2**20
    print(
        f"{out}: {cache.num_requests} answers, {cache.num_tokens} tokens, {memory:.1f} MiB in memory, "
        f"{size:.1f} MiB on disk"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
