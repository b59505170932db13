#!/usr/bin/env python
"""GPU timings of the device run: attention kernels, random-weight models of real shapes, a projection.

    python scripts/device_timing.py --out $OUT/device_timing.json     # a CUDA machine: under 3 min on an H200
    python scripts/device_timing.py --device cpu --smoke              # this script's CPU smoke test (seconds)
    python scripts/device_timing.py --models smollm2 --shapes 7b --prefixes 8192 --nodes 1,64

1. Kernels (--shapes, --dtypes, --prefixes, --nodes): treespec's `ops.tree_attention` against
   `F.scaled_dot_product_attention` with a dense float mask and with a bool mask (enable_gqa=True), and
   flash-attn without a mask when it imports (a lower bound: it has no tree masks), on inputs laid out
   as transformers hands them over (q a transposed [1, n, H, D] projection, K/V views of longer cache
   buffers; a `default_tree(n)` mask, none at n = 1). Median of CUDA-event timings; the K/V bytes
   treespec's kernel read per second, and a 256 MB device copy's rate for reference.
2. Models (--models): SmolLM2-135M, a Llama-3.2-1B and a Llama-3.1-8B shape, built on the device from
   their configs with random weights (HF's init, normal std 0.02: speed does not depend on the weights),
   bf16 on a GPU. Per model: HF `generate` greedy per-token time, eager (--hf-prompt tokens of prompt;
   ms per token = (time of --hf-new-tokens new tokens - time of 1) / (--hf-new-tokens - 1), medians);
   treespec's one-token step and verification of n nodes (--model-nodes) after --model-prefixes
   committed tokens (`costs.verify_ms`: `Decoder.score`), for the attention kernel "auto" picks on the
   device and the other one of "sdpa" (torch) and "compiled" (treespec's own kernel, where the extension
   runs on the device).
3. Projection: the accepted tokens per step and nodes per step of the shipped drafters, measured on the
   CPU with SmolLM2-135M (--acceptance: a scripts/bench.py JSON; its "accepted / step", `accept_length`),
   divided by each model's measured verification time at that node count (interpolated between the
   measured counts, at the measured prefix nearest the benchmark's mean context), against one-token steps
   and HF `generate`. It is a projection, not a measured GPU run: drafting time is not counted, and the
   135M model's acceptance stands in for the larger shapes.

--smoke: tiny models of the same families, small kernel inputs, few repeats (wall-clock timings): it
checks this script, not the device. Markdown tables go to stdout (the tables BENCHMARKS.md shows:
`treespec.tools.benchmarks_page.device_tables`), progress to stderr, JSON to --out (format
"treespec.device_timing").
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))
    import treespec
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from treespec import ops  # noqa: E402
from treespec.core.attention import auto_kernel  # noqa: E402
from treespec.core.tree import pack_bits  # noqa: E402
from treespec.io import atomic_write_json  # noqa: E402
from treespec.tools.benchmarks_page import device_tables, overall_summary  # noqa: E402
from treespec.tools.models import MODEL_SHAPES, shape_config  # noqa: E402
from treespec.training.costs import interpolate, verify_ms  # noqa: E402

KERNEL_SHAPES = {"smollm2": (9, 3, 64), "7b": (32, 8, 128)}  # query heads, KV heads, head_dim
# the public shapes it builds: the Llama-family ones (LlamaConfig fields, random weights)
LLAMA_SHAPES = {name: shape for name, shape in MODEL_SHAPES.items() if shape["model_type"] == "llama"}
SMOKE_HEAD_DIM, SMOKE_LAYERS, SMOKE_VOCAB = 16, 2, 1024  # --smoke: each family's heads, tiny otherwise
DEFAULT_ACCEPTANCE = "benchmarks/2026-12-04-all-sources-acceptance-at-16-nodes-spec-bench-26-float32.json"
PROJECTION_LABEL = (
    "Projected from CPU acceptance, not a measured GPU run: tokens/s = accepted tokens per step (the "
    "shipped drafters on SmolLM2-135M, {file}) / this device's measured verification ms at the method's "
    "mean nodes per step ({kernel} kernel, prefix {prefix}, the measured prefix nearest the benchmark's "
    "mean context of {context} tokens); drafting time not counted; the 135M model's acceptance stands in "
    "for the larger shapes. x one-token steps: against treespec's measured one-token step; x HF: against "
    "HF `generate`'s measured ms per token."
)


OPTION_DEFAULTS = {  # option: (default on a GPU, default with --smoke)
    "dtypes": ("bfloat16,float16", "bfloat16"),
    "prefixes": ("128,1024,8192,32768", "64"),
    "nodes": ("1,16,32,64", "1,8"),
    "repeats": (30, 3),
    "model_prefixes": ("128,1024", "32"),
    "model_nodes": ("1,16,32,64", "1,4,8"),
    "verify_repeats": (7, 2),
    "hf_prompt": (128, 16),
    "hf_new_tokens": (64, 8),
    "hf_repeats": (3, 2),
}


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def median_ms(fn, device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median ms of `fn()` over `repeats` calls after `warmup` calls: on a GPU the device time between two
    CUDA events around each call, on the CPU wall time (the one place the two devices differ)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends, strict=True))


def flash_attention():
    """flash-attn's `flash_attn_func`, or None where it does not import."""
    try:
        from flash_attn import flash_attn_func
    except Exception:  # not installed, or built for another torch / CUDA
        return None
    return flash_attn_func


# ---- 1. kernels ------------------------------------------------------------------------------------


def kernel_row(shape: str, dtype, prefix: int, n: int, device, repeats: int, flash) -> dict:
    """One kernel configuration timed: treespec's kernel, SDPA with a float and with a bool mask, flash-attn
    without a mask (when given), in ms; treespec's K/V read rate."""
    heads, kv_heads, head_dim = KERNEL_SHAPES[shape]
    total = prefix + n  # keys: the committed prefix, then the tree's n nodes
    gen = torch.Generator(device).manual_seed(prefix * 131 + n)

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    q = randn(1, n, heads, head_dim).transpose(1, 2)  # [1, H, n, D]: a transposed projection
    k = randn(1, kv_heads, total + 64, head_dim)[:, :, :total]  # [1, Hkv, L, D]: views of a longer cache
    v = randn(1, kv_heads, total + 64, head_dim)[:, :, :total]
    tree_mask = treespec.default_tree(n, 4).ancestor_mask if n > 1 else None  # [n, n] bool
    bits = pack_bits(tree_mask).to(device) if n > 1 else None  # [n, words]: packed once per step
    bool_mask = torch.ones(n, total, dtype=torch.bool, device=device)  # [n, L]
    if tree_mask is not None:
        bool_mask[:, prefix:] = tree_mask.to(device)
    float_mask = torch.zeros(n, total, dtype=dtype, device=device).masked_fill(~bool_mask, float("-inf"))
    scale = head_dim**-0.5

    def sdpa(mask):  # -> [1, n, H, D], the layout transformers wants back
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous()

    ms = lambda fn: median_ms(fn, device, repeats)  # noqa: E731
    row = {"shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    row |= {"dtype": str(dtype).removeprefix("torch."), "prefix": prefix, "n": n}
    row["treespec"] = ms(lambda: ops.tree_attention(q, k, v, bits, scale))
    row["sdpa_float"] = ms(lambda: sdpa(float_mask))
    row["sdpa_bool"] = ms(lambda: sdpa(bool_mask))
    if flash is not None:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, n|L, H|Hkv, D]
        try:
            row["flash_nomask"] = ms(lambda: flash(qt, kt, vt, softmax_scale=scale))
        except Exception as error:  # a flash-attn build that does not take these inputs
            row["flash_error"] = error_text(error)
    row["kv_gbps"] = 2 * kv_heads * total * head_dim * k.element_size() / (row["treespec"] * 1e-3) / 1e9
    return row


def kernel_rows(args, device) -> list[dict]:
    """Every kernel configuration of the flags, timed (none where treespec's kernel does not run here)."""
    if not ops.available(device):
        progress(f"kernels: skipped, treespec's extension does not run on {device}: {ops.build_info()}")
        return []
    flash = flash_attention() if device.type == "cuda" else None
    rows = []
    for shape in args.shapes:
        for dtype_name in args.dtypes:
            progress(f"kernels: {shape} {dtype_name}, prefixes {args.prefixes}, n {args.nodes}")
            for prefix in args.prefixes:
                for n in args.nodes:
                    dtype = getattr(torch, dtype_name)
                    rows.append(kernel_row(shape, dtype, prefix, n, device, args.repeats, flash))
    return rows


def copy_gbps(device: torch.device, megabytes: int) -> float:
    """Bytes copied per second by one device copy of `megabytes` MB (median of 10)."""
    src = torch.ones(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return src.numel() / (median_ms(lambda: dst.copy_(src), device, repeats=10) * 1e-3) / 1e9


# ---- 2. models -------------------------------------------------------------------------------------


def model_config(name: str, smoke: bool) -> tuple[str, dict]:
    """(label, LlamaConfig fields) of a model shape; --smoke: the family's head counts, tiny otherwise."""
    label = LLAMA_SHAPES[name]["label"]
    _, sizes = shape_config(name)  # a fresh dict: changed below for --smoke
    if smoke:
        hidden = sizes["num_attention_heads"] * SMOKE_HEAD_DIM
        sizes |= {"hidden_size": hidden, "intermediate_size": 2 * hidden}
        sizes |= {"num_hidden_layers": SMOKE_LAYERS, "vocab_size": SMOKE_VOCAB}
        label = f"{label} (tiny: {SMOKE_LAYERS} layers, hidden {hidden})"
    return label, sizes


def build_model(config: LlamaConfig, device: torch.device, dtype) -> LlamaForCausalLM:
    """A random-weight model built directly on the device in `dtype` (HF's init there: no download, no
    files, no float32 copy on the host)."""
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_generate_ms(model, prompt_tokens: int, new_tokens: int, repeats: int) -> dict:
    """HF `generate` (greedy, eager, no early stop): ms per token from the difference of two lengths."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=gen).to(device)  # [1, P]

    def run(count: int):
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=count,
            min_new_tokens=count,
            do_sample=False,
            pad_token_id=0,
        )

    ms_one = median_ms(lambda: run(1), device, repeats, warmup=1)
    ms_all = median_ms(lambda: run(new_tokens), device, repeats, warmup=1)
    return {
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "ms_one": ms_one,
        "ms_all": ms_all,
        "ms_per_token": (ms_all - ms_one) / (new_tokens - 1),
        "how": f"ms per token = (ms of {new_tokens} new tokens - ms of 1) / {new_tokens - 1} after a "
        f"{prompt_tokens}-token prompt, medians of {repeats}.",
    }


def model_kernels(device: torch.device, dtype) -> list[str]:
    """The attention kernels to time: torch's SDPA, and treespec's own where it runs on this device."""
    own = ops.dtype_supported(device, dtype) and ops.available(device)
    return ["sdpa", "compiled"] if own else ["sdpa"]


def model_timings(name: str, args, device: torch.device, dtype) -> dict:
    """One model shape: built, HF generate timed, verification timed per kernel, prefix and node count."""
    label, sizes = model_config(name, args.smoke)
    config = LlamaConfig(max_position_embeddings=8192, initializer_range=0.02, **sizes)
    start = time.perf_counter()
    model = build_model(config, device, dtype)
    built = time.perf_counter() - start
    parameters = sum(p.numel() for p in model.parameters())
    progress(f"{label}: {parameters / 1e6:.0f} M parameters built in {built:.1f} s; HF generate")
    entry = {
        "name": name,
        "label": label,
        "parameters": parameters,
        "dtype": str(dtype).removeprefix("torch."),
    }
    entry["config"], entry["build_seconds"] = sizes, built
    entry["hf_generate"] = hf_generate_ms(model, args.hf_prompt, args.hf_new_tokens, args.hf_repeats)
    entry["auto_kernel"] = auto_kernel(device, dtype)
    entry["verify_ms"], entry["verify_ratio"], entry["errors"] = {}, {}, {}
    for kernel in model_kernels(device, dtype):
        progress(f"{label}: verification, kernel {kernel}, prefixes {args.model_prefixes}")
        try:
            rows = {
                str(prefix): {
                    str(n): verify_ms(model, n, prefix, kernel=kernel, repeats=args.verify_repeats)
                    for n in args.model_nodes
                }
                for prefix in args.model_prefixes
            }
        except Exception as error:  # one kernel failing on the device must not lose the others' timings
            entry["errors"][kernel] = error_text(error)
            progress(f"{label}: kernel {kernel} failed: {entry['errors'][kernel]}")
            continue
        entry["verify_ms"][kernel] = rows
        entry["verify_ratio"][kernel] = {
            prefix: {n: ms / row["1"] for n, ms in row.items()} for prefix, row in rows.items() if "1" in row
        }
    return entry


def free_device_memory(device: torch.device) -> None:
    """Give the memory of a model dropped (or of one that failed half-way) back before the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


# ---- 3. projection ---------------------------------------------------------------------------------


def read_acceptance(path: Path) -> dict:
    """The drafters' accepted tokens and nodes per step over all prompts of a scripts/bench.py run, and the
    run's mean context (prompt tokens + half the new tokens)."""
    data = json.loads(path.read_text())
    methods = [
        {"method": name, "accept_length": entry["accept_length"], "nodes_per_step": entry["nodes_per_step"]}
        for name, entry in overall_summary(data)["methods"].items()
        if (entry.get("nodes_per_step") or 1) > 1 and entry.get("accept_length")
    ]
    prompts = [p["prompt_tokens"] for p in data["prompts"] if "prompt_tokens" in p]
    context = statistics.mean(prompts) + data["config"]["max_new_tokens"] / 2 if prompts else 0
    shown = path.resolve().relative_to(REPO_ROOT) if path.resolve().is_relative_to(REPO_ROOT) else path
    return {
        "file": str(shown),
        "model": data["config"].get("model"),
        "context": round(context),
        "methods": methods,
    }


def projection(models: list[dict], acceptance: dict) -> dict:
    """Projected tokens/s of each drafter on each model: accepted tokens per step / verification ms at its
    nodes per step (the model's "auto" kernel), against one-token steps and HF generate."""
    rows, kernels, prefixes = [], set(), set()
    for model in models:
        curve = model["verify_ms"].get(model["auto_kernel"])
        if not curve:
            continue
        kernels.add(model["auto_kernel"])
        context = acceptance["context"]
        prefixes.add(min(curve, key=lambda p: (abs(int(p) - context), int(p))))  # what `interpolate` reads
        one_token_ms = interpolate(curve, context, 1)
        hf_ms = model.get("hf_generate", {}).get("ms_per_token")
        for method in acceptance["methods"]:
            step_ms = interpolate(curve, context, method["nodes_per_step"])
            tokens_per_second = method["accept_length"] / step_ms * 1e3
            rows.append(
                {
                    "model": model["label"],
                    **method,
                    "verify_ms": step_ms,
                    "one_token_ms": one_token_ms,
                    "projected_tokens_per_second": tokens_per_second,
                    "vs_one_token_steps": tokens_per_second * one_token_ms / 1e3,
                    "vs_hf_generate": tokens_per_second * hf_ms / 1e3 if hf_ms and hf_ms > 0 else None,
                }
            )
    label = PROJECTION_LABEL.format(
        file=acceptance["file"],
        kernel="/".join(sorted(kernels)) or "auto",
        prefix="/".join(sorted(prefixes, key=int)) or "-",
        context=acceptance["context"],
    )
    return {"label": label, "acceptance": acceptance, "rows": rows}


# ---- the run ---------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats: a test of this script")
    p.add_argument("--out", default=None, help="write the JSON here (default: print the tables only)")
    p.add_argument("--shapes", default="smollm2,7b", help=f"kernel shapes, of {','.join(KERNEL_SHAPES)}")
    p.add_argument("--dtypes", default=None, help="kernel dtypes (default bfloat16,float16; smoke bfloat16)")
    p.add_argument("--prefixes", default=None, help="kernel prefixes (default 128,1024,8192,32768)")
    p.add_argument("--nodes", default=None, help="kernel node counts (default 1,16,32,64)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per kernel (default 30)")
    p.add_argument("--models", default="smollm2,llama-1b,llama-8b", help=f"of {','.join(LLAMA_SHAPES)}")
    p.add_argument("--dtype", default=None, help="model dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--model-prefixes", default=None, help="verification prefixes (default 128,1024)")
    p.add_argument("--model-nodes", default=None, help="verification node counts (default 1,16,32,64)")
    p.add_argument("--verify-repeats", type=int, default=None, help="timed verifications (default 7)")
    p.add_argument("--hf-prompt", type=int, default=None, help="HF generate prompt tokens (default 128)")
    p.add_argument("--hf-new-tokens", type=int, default=None, help="HF generate new tokens (default 64)")
    p.add_argument("--hf-repeats", type=int, default=None, help="HF generate timings per length (default 3)")
    p.add_argument("--acceptance", default=str(REPO_ROOT / DEFAULT_ACCEPTANCE), help="bench.py JSON")
    args = p.parse_args(argv)
    for key, (full, smoke) in OPTION_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    args.shapes, args.dtypes, args.models = names(args.shapes), names(args.dtypes), names(args.models)
    args.prefixes, args.nodes = ints(args.prefixes), ints(args.nodes)
    args.model_prefixes, args.model_nodes = ints(args.model_prefixes), ints(args.model_nodes)
    unknown = sorted(set(args.models) - set(LLAMA_SHAPES)) + sorted(set(args.shapes) - set(KERNEL_SHAPES))
    if unknown:
        p.error(f"unknown model or kernel shapes {unknown}")
    if not Path(args.acceptance).is_file():
        p.error(f"--acceptance {args.acceptance}: no such file (a scripts/bench.py JSON)")
    if args.hf_new_tokens < 2:
        p.error("--hf-new-tokens must be at least 2 (per-token time is a difference of two lengths)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch: run with --device cpu --smoke to test the script")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    transformers.logging.set_verbosity_error()  # generate's notes on random configs
    started, start = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
    ops.available(device)  # builds or loads the extension before anything is timed
    result = {
        "format": "treespec.device_timing",
        "version": 1,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "build": ops.build_info(),
        "command": "python scripts/device_timing.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "started": started,
        "smoke": args.smoke,
        "timer": "median of CUDA-event timings" if device.type == "cuda" else "median of wall-clock timings",
    }
    result["kernel_rows"] = kernel_rows(args, device)
    result["copy_megabytes"] = 16 if args.smoke else 256
    result["copy_gbps"] = copy_gbps(device, result["copy_megabytes"])
    result["models"], result["model_errors"] = [], {}
    for name in args.models:
        try:
            result["models"].append(model_timings(name, args, device, dtype))
        except Exception as error:  # one model failing (out of memory, say) must not lose the others
            result["model_errors"][name] = error_text(error)
            progress(f"{name}: failed: {result['model_errors'][name]}")
        finally:
            free_device_memory(device)
    result["projection"] = projection(result["models"], read_acceptance(Path(args.acceptance)))
    result["wall_seconds"] = time.perf_counter() - start
    print("\n".join(device_tables(result)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, result)  # a run cut by its `timeout` leaves no half-written file
        progress(f"wrote {args.out} ({result['wall_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
