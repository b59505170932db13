#!/usr/bin/env python
"""Wall ms of int8 native verification steps (Decoder.step over a chain of n nodes, as
scripts/step_profile.py runs it), summarised by low percentiles: on a shared machine the minimum and the
10th percentile of many steps are what the code costs when it has the cores, the median is what it cost
beside the other processes.
    python benchmarks/2026-12-06-int8-step-times.py --nodes 1,16 --steps 150 --prefix 128
    python benchmarks/2026-12-06-int8-step-times.py --threads 1 --cpu-time   # the work, whatever the load
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root / "scripts"))
import step_profile  # noqa: E402  (its ChainDrafter)
import treespec  # noqa: E402
from treespec.core.decoder import Decoder  # noqa: E402


def times(model, prompt: list[int], n: int, steps: int, cpu: bool = False) -> list[float]:
    drafter = step_profile.ChainDrafter(n, token=prompt[-1]) if n > 1 else None
    decoder = Decoder(model, drafter, step="native", numerics="int8")
    decoder.prefill(prompt, max_new_tokens=steps * n + 8)
    walls = []
    clock = time.process_time if cpu else time.perf_counter
    with decoder.running():
        for _ in range(5):
            decoder.step()
        for _ in range(steps):
            t0 = clock()
            decoder.step()
            walls.append(1e3 * (clock() - t0))
    return sorted(walls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1,16")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall time (1 thread)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = treespec.load_model(None, dtype="float32")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.prefix,), generator=gen).tolist()
    rows = {}
    for n in [int(x) for x in args.nodes.split(",")]:
        w = times(model, prompt, n, args.steps, args.cpu_time)
        rows[n] = {"min": w[0], "p10": w[len(w) // 10], "median": w[len(w) // 2]}
        print(f"nodes {n:3d}: min {w[0]:6.2f}  p10 {w[len(w) // 10]:6.2f}  median {w[len(w) // 2]:6.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"prefix": args.prefix, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
