"""Qwen3 through the native step: one decoding step of a Qwen3-0.6B-shaped model (random weights of bfloat16
values held in float32, as a bf16 checkpoint loads on a CPU without fast bf16; a step's speed does not depend
on the weights), 256 committed tokens, against the same step through transformers' forward and HF `generate`.

    python benchmarks/log/2026-12-08-b-qwen3-steps.py --out /tmp/qwen3-steps.json

Rows: HF greedy `generate` per token; treespec with step="hf" (transformers' forward on treespec's cache and
attention), step="native" (float32 numerics; each weight read from a bf16 copy, the same bits) and
numerics="int8"; each a plain step and a 4-node chain, median of 24 steps after 3 warm ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from step_profile import ChainDrafter, hf_ms_per_token, set_weight_values, shaped_model  # noqa: E402

from treespec.core.decoder import Decoder  # noqa: E402


def step_ms(model, prompt: list[int], n: int, steps: int, **settings) -> float:
    drafter = ChainDrafter(n, token=prompt[-1]) if n > 1 else None
    decoder = Decoder(model, drafter, **settings)
    decoder.prefill(prompt, max_new_tokens=(steps + 3) * n + 8)
    walls = []
    with decoder.running():
        for i in range(steps + 3):
            t0 = time.perf_counter()
            decoder.step()
            if i >= 3:
                walls.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(walls)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = shaped_model(args.shape)
    set_weight_values(model, "bf16")
    prompt = [(7 * i) % 5000 + 3 for i in range(args.prefix)]
    rows = {"hf generate": {"1": hf_ms_per_token(model, prompt, 16)}}
    print(f"HF generate: {rows['hf generate']['1']:.1f} ms/token", flush=True)
    for label, settings in (
        ("treespec step=hf", dict(step="hf")),
        ("treespec native", dict(step="native")),
        ("treespec native int8", dict(numerics="int8")),
    ):
        rows[label] = {str(n): step_ms(model, prompt, n, args.steps, **settings) for n in (1, 4)}
        print(f"{label}: plain {rows[label]['1']:.1f} ms, 4-node chain {rows[label]['4']:.1f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps({"shape": args.shape, "prefix": args.prefix, "ms": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
