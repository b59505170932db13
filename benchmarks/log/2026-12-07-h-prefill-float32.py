"""Log h (session 38): a float32 (fast numerics) prefill's time at 300, 768 and 2000 random tokens, the
fastest of five (and the median); run it in the old and the new tree alternately:

    PYTHONPATH=OLD_TREE python benchmarks/log/2026-12-07-h-prefill-float32.py old
    python benchmarks/log/2026-12-07-h-prefill-float32.py new
"""
import time, torch, treespec, sys
from treespec.core.decoder import Decoder
model,tok = treespec.load_model(dtype="float32")
g=torch.Generator().manual_seed(0)
out=[]
for L in (300, 768, 2000):
    prompt=torch.randint(0,49152,(L,),generator=g).tolist()
    d=Decoder(model,None,numerics="fast")
    d.prefill(prompt,max_new_tokens=8)
    ts=[]
    for r in range(5):
        t0=time.perf_counter(); d.prefill(prompt,max_new_tokens=8); ts.append(time.perf_counter()-t0)
    d.release()
    out.append(f"{L}: {1e3*min(ts):.0f} ({1e3*sorted(ts)[2]:.0f})")
print(sys.argv[1], " | ".join(out), flush=True)
