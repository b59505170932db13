"""Log h (session 38): the row-invariant attention op over 30 layers' K/V (one query token, SmolLM2's 9 / 3
heads, D 64, float32, from DRAM): the fastest and median of 25 passes, on THREADS threads, after L keys; run
it in two trees alternately:

    PYTHONPATH=TREE python benchmarks/log/2026-12-07-h-exact-attention-threads.py NAME THREADS L
"""
import torch, time, treespec, sys
from treespec import ops
ops.available("cpu")
torch.manual_seed(0); torch.set_num_threads(int(sys.argv[2]))
L=int(sys.argv[3]); n=1
ks=[torch.randn(1,3,L+n,64) for _ in range(30)]; vs=[torch.randn(1,3,L+n,64) for _ in range(30)]
q=torch.randn(1,9,n,64)
f=torch.ops.treespec.tree_attention_exact
for k,v in zip(ks,vs): f(q,k,v,None,0.125)
ts=[]
for r in range(25):
    t0=time.perf_counter()
    for k,v in zip(ks,vs): f(q,k,v,None,0.125)
    ts.append(time.perf_counter()-t0)
ts.sort(); print(sys.argv[1], sys.argv[2], L, f"{ts[0]*1e3:.2f} {ts[12]*1e3:.2f}  {L*3*64*4*2*30/ts[0]/1e9:.1f} GB/s")
