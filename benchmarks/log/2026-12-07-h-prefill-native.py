"""Log h (session 38): a short prompt's prefill through the HF forward against the native step (fast or
bitwise numerics), one process, the two alternated five times: the fastest (median), their ratio, whether
the first token agrees and the largest difference of the last hidden state:

    python benchmarks/log/2026-12-07-h-prefill-native.py fast 10,25,50,100,200,400,768
"""
import sys, time, torch, treespec, statistics
import treespec.core.decoder as D
from treespec.core.decoder import Decoder
model, tok = treespec.load_model(dtype="float32")
g = torch.Generator().manual_seed(0)
num = sys.argv[1]; sizes = [int(x) for x in sys.argv[2].split(",")]
d = Decoder(model, None, numerics=num)
for L in sizes:
    prompt = torch.randint(0, 49152, (L,), generator=g).tolist()
    res = {"hf": [], "native": []}
    def run(name):
        D.NATIVE_PREFILL_MAX = 0 if name == "hf" else 100000
        t0 = time.perf_counter(); first = d.prefill(prompt, max_new_tokens=8); return time.perf_counter() - t0, first, d.hidden.clone()
    run("hf"); run("native")
    for r in range(5):
        for name in res: res[name].append(run(name)[0])
    _, a, ha = run("hf"); _, b, hb = run("native")
    print(num, L, "  ".join(f"{k}: {1e3*min(v):.1f} ({1e3*statistics.median(v):.1f})" for k, v in res.items()), f"ratio {min(res['hf'])/min(res['native']):.2f}", "same first", a == b, f"hidden diff {(ha-hb).abs().max().item():.1e}", flush=True)
