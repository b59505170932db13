#!/usr/bin/env python
"""Where a decoding step's time goes: the plain loop (and trees of N nodes) through the native step.

    python scripts/step_profile.py --dtype float32 --nodes 1,4,8,16 --out benchmarks/step-profile.json
    python scripts/step_profile.py --dtype float32 --numerics int8 --nodes 1,4,8,16
    python scripts/step_profile.py --shape qwen2.5-0.5b --weights bf16,float32 --nodes 1,4 --hf-tokens 16

For each node count: wall ms of one `Decoder.step` over a chain of that many nodes (drafted by a drafter
that proposes fixed tokens, so only the verification is timed), of the native call inside it, and the
native step's task time by stage (linears / attention / the rest: norms, rotary, embedding), from the
extension's own counters (`NativeStep.profile`, summed over threads and divided by the thread count, so
the parts add up to the native call's wall time minus what the threads waited). The Python around the
call (drafting, acceptance, the commit) is the step minus the native call.

--shape builds a float32 model of a public model's shape with random weights (a step's speed does not
depend on the weights) instead of loading one; --weights says what values its linears hold: `bf16`, bfloat16
values (a bf16 checkpoint loaded in float32, which the native step reads from bf16 copies) or `float32`
(full float32 values, read as they are); both in one run give the ratio. --hf-tokens N also times HF
`generate` (greedy, N new tokens after the same prompt) on the same model, per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import treespec
from treespec.core.decoder import Decoder
from treespec.core.drafting import BaseDrafter, Proposal
from treespec.core.native import LINEAR_STAGES
from treespec.core.tree import Tree
from treespec.tools.models import MODEL_SHAPES, shape_config


def shaped_model(shape: str) -> torch.nn.Module:
    """A float32 model of `shape` (`MODEL_SHAPES`) with random weights (normal, std 0.02)."""
    model_type, sizes = shape_config(shape)
    return random_model(model_type, **{"max_position_embeddings": 4096, **sizes})


def random_model(model_type: str, **fields) -> torch.nn.Module:
    """A float32 model of a transformers model type and config fields, random weights (normal, std 0.02)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model


def set_weight_values(model, values: str) -> None:
    """Linear weights of bfloat16 values ("bf16": rounded to the nearest) or of full float32 values
    ("float32": each bf16 value moved by a random amount below half a bf16 step, so no weight is one)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                w.copy_(w.bfloat16().float())
                if values == "float32":
                    w.mul_(1.0 + (torch.rand_like(w) - 0.5) / 512)


def hf_ms_per_token(model, prompt: list[int], new_tokens: int) -> float:
    """Wall ms per new token of HF greedy `generate` (after one warm-up call)."""
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        t0 = time.perf_counter()
        model.generate(ids, **kwargs)
    return 1e3 * (time.perf_counter() - t0) / new_tokens


class ChainDrafter(BaseDrafter):
    """Proposes the root followed by fixed tokens: a chain of `n` nodes every step."""

    def __init__(self, n: int, token: int):
        self.tree = Tree.chain(n - 1)
        self.token = token

    def propose(self, hidden, roots, max_depth=None):
        n = self.tree.num_nodes
        tokens = torch.full((roots.shape[0], n), self.token, dtype=torch.long)
        tokens[:, 0] = roots
        return Proposal(tokens)


def profile(
    model, prompt: list[int], n: int, steps: int, numerics: str = "fast", kv_dtype: str = "model"
) -> dict:
    drafter = ChainDrafter(n, token=prompt[-1]) if n > 1 else None
    decoder = Decoder(model, drafter, step="native", numerics=numerics, kv_dtype=kv_dtype)
    decoder.prefill(prompt, max_new_tokens=steps * n + 8)
    native = decoder.native
    calls = []
    inner = decoder.scorer

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        calls.append(time.perf_counter() - t0)
        return out

    decoder.scorer = timed
    with decoder.running():  # the model's mode held over the loop, as `generate` holds it
        for _ in range(3):  # warm
            decoder.step()
        calls.clear()
        native.set_profiling(True)
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            decoder.step()
            walls.append(time.perf_counter() - t0)
        parts = native.profile()
        native.set_profiling(False)
    threads = torch.get_num_threads()
    per_step = {k: 1e3 * v / steps / threads for k, v in parts.items()}
    linears = sum(per_step[k] for k in LINEAR_STAGES)
    return {
        "nodes": n,
        "step_ms": 1e3 * statistics.median(walls),
        "native_call_ms": 1e3 * statistics.median(calls),
        "linears_ms": linears,
        "lm_head_ms": per_step["logits"],
        "attention_ms": per_step["attention"],
        "other_kernels_ms": sum(
            v for k, v in per_step.items() if k not in LINEAR_STAGES and k != "attention"
        ),
        "stages_ms": per_step,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model folder (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--nodes", default="1,4,8,16")
    p.add_argument("--prefix", type=int, default=128, help="committed tokens before the timed steps")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--numerics", default="fast", help="fast, bitwise or int8 (`Decoder(numerics=)`)")
    p.add_argument("--kv-dtype", default="model", help="model or bfloat16 (`Decoder(kv_dtype=)`)")
    p.add_argument("--shape", choices=sorted(MODEL_SHAPES), help="a random float32 model of this shape")
    p.add_argument("--weights", default="bf16", help="with --shape: bf16, float32 or both (bf16,float32)")
    p.add_argument("--hf-tokens", type=int, default=0, help="also time HF generate over this many tokens")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.shape:
        model, label = shaped_model(args.shape), f"{MODEL_SHAPES[args.shape]['label']}, random weights"
    else:
        model, _ = treespec.load_model(args.model, dtype=args.dtype)
        label = args.model or "SmolLM2-135M-Instruct"
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.prefix,), generator=gen).tolist()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    runs = []
    for values in args.weights.split(",") if args.shape else [None]:
        if values is not None:
            set_weight_values(model, values)
        rows = [
            profile(model, prompt, int(n), args.steps, args.numerics, args.kv_dtype)
            for n in args.nodes.split(",")
        ]
        hf = hf_ms_per_token(model, prompt, args.hf_tokens) if args.hf_tokens else None
        runs.append({"weights": values, "rows": rows, "hf_generate_ms_per_token": hf})
        one = rows[0]["step_ms"]
        weights = "" if values is None else f", {values} weight values"
        print(
            f"{label}: native step, {dtype}{weights}, numerics {args.numerics}, K/V {args.kv_dtype}, "
            f"{threads} threads, prefix {args.prefix}"
        )
        print("nodes  step ms  (x 1 node)  native call  linears (lm_head)  attention  other kernels  python")
        for r in rows:
            python = r["step_ms"] - r["native_call_ms"] - r["lm_head_ms"]
            print(
                f"{r['nodes']:5d}  {r['step_ms']:7.2f}  ({r['step_ms'] / one:4.2f}x)"
                f"    {r['native_call_ms']:7.2f}"
                f"   {r['linears_ms']:7.2f} ({r['lm_head_ms']:5.2f})   {r['attention_ms']:7.2f}"
                f"    {r['other_kernels_ms']:7.2f}   {python:6.2f}"
            )
        if hf is not None:
            print(f"HF generate: {hf:.2f} ms per token ({hf / one:.2f}x the native one-token step)")
    result = {
        "model": label,
        "dtype": dtype,
        "numerics": args.numerics,
        "threads": threads,
        "prefix": args.prefix,
        **({"rows": runs[0]["rows"]} if not args.shape else {"runs": runs}),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
