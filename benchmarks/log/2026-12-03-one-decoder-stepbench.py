"""Per-step time of batched decoding at B = 4 (plain steps and the heads' tree every step), old or new code."""
import sys, time, statistics, torch, treespec
from treespec.tools.models import default_heads_folder
new = hasattr(treespec, "TargetRuntime")
model, tok = treespec.load_model(dtype="float32")
heads = treespec.MedusaHeads.from_pretrained(default_heads_folder(), model=model)
texts = ["Why is the sky blue?", "Name three rivers in Europe.", "Write a haiku about autumn leaves.", "What is 17 times 23?"]
prompts = [treespec.encode_prompt(t, tok) for t in texts]
out = {}
for kind in ("plain", "tree"):
    drafter = treespec.make_drafter(heads, heads.tree, model)
    plain_above = 0 if kind == "plain" else None
    if new:
        dec = treespec.Decoder(model, drafter, plain_above=plain_above)
    else:
        from treespec.core.batch import BatchDecoder
        dec = BatchDecoder(model, drafter, plain_above=plain_above)
    dec.prefill(prompts, max_new_tokens=200)
    times = []
    with dec.running():
        for i in range(45):
            t0 = time.perf_counter(); dec.step(); times.append(time.perf_counter() - t0)
    out[kind] = statistics.median(times[5:]) * 1e3
print(("after " if new else "before"), " ".join(f"{k} {v:.1f} ms" for k, v in out.items()), flush=True)
