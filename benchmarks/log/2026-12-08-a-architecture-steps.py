"""Step cost on models of two public shapes with sliding-window layers (random weights: a step's speed
does not depend on them), committed prefix within and past the window: treespec's plain step and a 4-node
chain, against HF greedy `generate` per token on the same model and prompt length.

    python benchmarks/log/2026-12-08-a-architecture-steps.py --out /tmp/arch-steps.json

Shapes: Gemma-3-270M (18 layers, 5 of 6 sliding, window 512, vocab 262144) and Mistral-7B-v0.1's layer
shape cut to 4 layers (its window of 4096 set to 512 here, so a short run passes it). Past the window a
sliding layer attends through `attention_with_terms` (SDPA, the window in its mask); within it, through
the plan's kernel (the compiled tree attention on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from step_profile import ChainDrafter, random_model  # noqa: E402

from treespec.core.decoder import Decoder  # noqa: E402

SHAPES = {
    "gemma3-270m": dict(
        model_type="gemma3_text",
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        sliding_window=512,
        query_pre_attn_scalar=256,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "mistral-7b-4-layers": dict(
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        sliding_window=512,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
}


def shaped(name: str):
    fields = dict(SHAPES[name])
    return random_model(fields.pop("model_type"), **fields)


def step_ms(model, prompt: list[int], n: int, steps: int) -> tuple[float, str]:
    drafter = ChainDrafter(n, token=prompt[-1]) if n > 1 else None
    decoder = Decoder(model, drafter)
    decoder.prefill(prompt, max_new_tokens=steps * n + 8)
    walls = []
    with decoder.running():
        for i in range(steps + 3):
            t0 = time.perf_counter()
            decoder.step()
            if i >= 3:
                walls.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(walls), decoder.step_kind


def hf_ms(model, prompt: list[int], new: int) -> float:
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
    return 1e3 * (time.perf_counter() - t0) / new


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--prefixes", default="256,1024")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for name in args.shapes.split(","):
        model = shaped(name)
        for prefix in map(int, args.prefixes.split(",")):
            prompt = [(7 * i) % 1000 + 3 for i in range(prefix)]
            plain, kind = step_ms(model, prompt, 1, args.steps)
            chain, _ = step_ms(model, prompt, 4, args.steps)
            hf = hf_ms(model, prompt, args.steps)
            row = dict(
                shape=name,
                prefix=prefix,
                window=SHAPES[name]["sliding_window"],
                step=kind,
                hf_ms_per_token=hf,
                plain_ms=plain,
                chain4_ms=chain,
            )
            rows.append(row)
            print(
                f"{name:20s} prefix {prefix:5d} ({kind}): HF {hf:7.1f} ms/token, plain {plain:7.1f} ms "
                f"({hf / plain:.2f}x HF), 4-node chain {chain:7.1f} ms ({chain / plain:.2f}x plain)",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"cpu": open("/proc/cpuinfo").read().count("processor"), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
