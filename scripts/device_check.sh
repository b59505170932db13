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
#    128..32768, trees of 16 / 32 / 64 nodes and decode (n = 1), bf16 and fp16; prints markdown tables.
#
# Everything it prints also goes to $OUT/device_check.log (and the timings to $OUT/device_check.json)
# when $OUT is set. Exit status: 0 when every correctness check passed.
# treespec/ops.py is loaded by file path, so neither transformers nor a pip install is needed.
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

spec = importlib.util.spec_from_file_location("treespec_ops", "treespec/ops.py")
ops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ops)

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
echo "== device check exit status $status"
exit $status
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
