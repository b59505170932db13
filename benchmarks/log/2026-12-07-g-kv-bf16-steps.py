"""Log g (session 37): float32 K/V against bf16 K/V (`kv_dtype="bfloat16"`) in one process, native steps of a
chain of N nodes after a random prompt of P tokens, the two decoders alternated in blocks of 15 steps (12 blocks
each, medians).

    python benchmarks/log/2026-12-07-g-kv-bf16-steps.py int8 700,2000,4000 1,2,4
"""
import sys, time, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "scripts"))
import step_profile as sp
import treespec
from treespec.core.decoder import Decoder
torch.set_num_threads(2)
model, _ = treespec.load_model(dtype="float32")
numerics = sys.argv[1]; prefixes = [int(x) for x in sys.argv[2].split(",")]; nodes = [int(x) for x in sys.argv[3].split(",")]
g = torch.Generator().manual_seed(0)
for P in prefixes:
    prompt = torch.randint(0, model.config.vocab_size, (P,), generator=g).tolist()
    for n in nodes:
        decs = {}
        for kv in ("model", "bfloat16"):
            drafter = sp.ChainDrafter(n, token=prompt[-1]) if n > 1 else None
            d = Decoder(model, drafter, step="native", numerics=numerics, kv_dtype=kv)
            d.prefill(prompt, max_new_tokens=12 * 15 * n + 64)
            decs[kv] = d
        times = {k: [] for k in decs}
        for r in range(12):
            for k in (list(decs) if r % 2 == 0 else list(decs)[::-1]):
                d = decs[k]
                with d.running():
                    d.step()
                    t0 = time.perf_counter()
                    for _ in range(15): d.step()
                    times[k].append((time.perf_counter() - t0) / 15 * 1e3)
        for d in decs.values(): d.release()
        m = {k: statistics.median(t) for k, t in times.items()}
        print(f"{numerics} prefix {P} nodes {n}: float32 K/V {m['model']:.2f} ms  bf16 K/V {m['bfloat16']:.2f} ms  ({m['model']/m['bfloat16']:.2f}x)", flush=True)
