"""Log g (session 37): an int8 prefill's time (the fastest of five, and the median) and its attention tasks'
time at 300 and 768 random tokens; run it in the old and the new tree alternately:

    PYTHONPATH=OLD_TREE python benchmarks/log/2026-12-07-g-prefill-tiles.py old
    python benchmarks/log/2026-12-07-g-prefill-tiles.py new
"""
import time, torch, treespec, sys
from treespec.core.decoder import Decoder
model,tok = treespec.load_model(dtype="float32")
g=torch.Generator().manual_seed(0)
out=[]
for L in (300, 768):
    prompt=torch.randint(0,49152,(L,),generator=g).tolist()
    d=Decoder(model,None,step="native",numerics="int8")
    d.prefill(prompt,max_new_tokens=8)
    ts=[]
    for r in range(5):
        t0=time.perf_counter(); d.prefill(prompt,max_new_tokens=8); ts.append(time.perf_counter()-t0)
    nat=d.native; nat.set_profiling(True); d.prefill(prompt,max_new_tokens=8); parts=nat.profile(); nat.set_profiling(False)
    d.release()
    out.append(f"L {L}: prefill {1e3*min(ts):.0f} ms (median {1e3*sorted(ts)[2]:.0f}), attention busy {parts['attention']*1e3/2:.0f} ms")
print(sys.argv[1], " | ".join(out))
