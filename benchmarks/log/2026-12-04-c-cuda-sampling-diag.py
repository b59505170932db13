"""CUDA sampling diagnosis: treespec's 2nd-token distribution vs the base model's, per variant."""
import os, sys, time, warnings
from collections import Counter
import torch
sys.path.insert(0, os.getcwd())
import treespec
from transformers import LlamaConfig, LlamaForCausalLM
warnings.simplefilter("ignore")
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 400

# 1. the generator alone: a multinomial draw then a uniform, same CUDA generator, per seed
p = torch.tensor([0.15, 0.05, 0.1, 0.1, 0.6], device=dev)
firsts, us = [], []
for s in range(2000):
    g = torch.Generator(dev).manual_seed(s)
    firsts.append(int(torch.multinomial(p, 1, generator=g)))
    us.append(float(torch.rand((), generator=g, device=dev)))
f = torch.tensor(firsts); u = torch.tensor(us)
print("generator: multinomial freq", [round(float((f == i).float().mean()), 3) for i in range(5)], "vs", p.tolist())
print("generator: uniform mean", round(float(u.mean()), 3), "P(u<0.5)", round(float((u < 0.5).float().mean()), 3),
      "mean u per first", [round(float(u[f == i].mean()), 3) if (f == i).any() else None for i in range(5)])

def tiny(vocab=10, init=0.5):
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                    num_key_value_heads=2, max_position_embeddings=512, initializer_range=init, tie_word_embeddings=False)
    return LlamaForCausalLM(c).to(dev).eval()

def heads_for(model):
    heads = treespec.MedusaHeads.for_model(model, num_heads=4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for q in heads.parameters():
            q.copy_((torch.randn(q.shape, generator=gen, dtype=torch.float64) * 0.5).to(q.dtype))
    return heads

with torch.inference_mode():
    model = tiny(); heads = heads_for(model)
    prompt = [1, 4, 2]
    p1 = model(torch.tensor([prompt], device=dev)).logits[0, -1].softmax(-1).cpu()
    nxt = torch.tensor([prompt + [x] for x in range(10)], device=dev)
    cond = model(nxt).logits[:, -1].softmax(-1).cpu()  # [10, V]
    p2 = p1 @ cond
    cpu_model = tiny().cpu() if dev != "cpu" else model
    cond_cpu = cpu_model(nxt.cpu()).logits[:, -1].softmax(-1)
    print("reference: max |cond(cuda) - cond(cpu)|", float((cond - cond_cpu).abs().max()))
    tree16 = treespec.default_tree(16, 4)
    real_generator = torch.Generator

    def run(label, kernel, cpu_generator=False, tree=tree16, model=model, heads=heads):
        if cpu_generator:
            treespec.core.decoder.torch.Generator = lambda device=None: real_generator("cpu")
        first, second, pairs, acc = Counter(), Counter(), Counter(), 0.0
        t = time.perf_counter()
        try:
            for seed in range(N):
                drafter = treespec.as_drafter(model, heads, tree) if tree is not None else None
                res = treespec.generate(model, prompt, drafter, max_new_tokens=2, eos_token_id=[],
                                        sampling=treespec.SamplingConfig(temperature=1.0, seed=seed), kernel=kernel)
                first[res.token_ids[0]] += 1; second[res.token_ids[1]] += 1
                pairs[tuple(res.token_ids)] += 1
                acc += res.stats.mean_accept_length if res.stats else 1
        finally:
            treespec.core.decoder.torch.Generator = real_generator
        tv1 = 0.5 * sum(abs(first.get(x, 0) / N - float(p1[x])) for x in range(10))
        tv2 = 0.5 * sum(abs(second.get(x, 0) / N - float(p2[x])) for x in range(10))
        # the 2nd token given the 1st: the most frequent 1st token's conditional
        top = first.most_common(1)[0][0]
        cnt = [pairs.get((top, x), 0) for x in range(10)]
        tvc = 0.5 * sum(abs(c / max(1, sum(cnt)) - float(cond[top, x])) for x, c in enumerate(cnt))
        print(f"{label}: TV 1st {tv1:.3f} 2nd {tv2:.3f}; 2nd | 1st={top}: TV {tvc:.3f} over {sum(cnt)}; "
              f"mean accepted {acc / N:.2f}; {time.perf_counter() - t:.1f} s", flush=True)
        print("   2nd counts", [second.get(x, 0) for x in range(10)], "expected", [round(N * float(v)) for v in p2])

    run(f"{dev} plain (no drafter)", "sdpa", tree=None)
    run(f"{dev} heads kernel=sdpa", "sdpa")
    if dev != "cpu":
        run(f"{dev} heads kernel=sdpa, CPU generator", "sdpa", cpu_generator=True)
        run(f"{dev} heads kernel=compiled", "compiled")
        run(f"{dev} heads kernel=reference", "reference")
