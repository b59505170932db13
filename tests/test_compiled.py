"""The compiled verification forward (core.compiled) against the eager forward it replaces."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import hf_greedy, random_heads, tiny_model

import treespec
from treespec.core import compiled
from treespec.core.compiled import CompiledForward


@pytest.fixture(autouse=True)
def inductor_cache_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path_factory.getbasetemp() / "treespec-cache"))


def decode(model, heads, tree_size: int, prompt: list[int], new: int, compile: bool, linears="auto"):
    drafter = treespec.make_drafter(heads, treespec.default_tree(tree_size, heads.num_heads), model)
    decoder = treespec.Decoder(model, drafter, acceptance="greedy", linears=linears, compile=compile)
    if compile:
        decoder.scorer.progress = None
    out = decoder.prefill(prompt, max_new_tokens=new)
    while len(out) < new:
        out += decoder.step().committed[0]
    return out[:new], decoder


def test_compiled_scores_equal_the_eager_scores_on_fresh_random_trees():
    model = tiny_model("llama", dtype=torch.float32, seed=5)
    gen = torch.Generator().manual_seed(11)
    for n, prefix, capacity in [(1, 7, 40), (6, 13, 40), (6, 21, 90), (1, 30, 90)]:
        drafter = treespec.make_drafter(random_heads(model, seed=n), treespec.default_tree(n, 4), model)
        eager = treespec.Decoder(model, drafter, acceptance="greedy")
        fast = treespec.Decoder(model, drafter, acceptance="greedy", compile=True)
        fast.scorer.progress = None
        prompt = torch.randint(0, model.config.vocab_size, (prefix,), generator=gen).tolist()
        for decoder in (eager, fast):
            decoder.prefill(prompt, max_new_tokens=capacity - prefix - n)
        for _ in range(2):  # the second call of a key skips dynamo's guards: still the same numbers
            tokens = torch.randint(0, model.config.vocab_size, (1, eager.tree.num_nodes), generator=gen)
            torch.testing.assert_close(fast.score(tokens), eager.score(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_compiled_equals_hf_for_several_tree_sizes(arch):
    model = tiny_model(arch, dtype=torch.float32, seed=3)
    heads = random_heads(model, seed=4)
    prompt = [3, 17, 5, 9, 22, 4]
    reference = hf_greedy(model, prompt, 40)
    for size in (4, 16):
        out, _ = decode(model, heads, size, prompt, 40, compile=True)
        assert out == reference
    # a longer sequence afterwards: a new cache capacity, the same graphs
    long_prompt = prompt * 5
    out, _ = decode(model, heads, 4, long_prompt, 30, compile=True)
    assert out == hf_greedy(model, long_prompt, 30)


def eager_and_compiled(model, n: int, prompt: list[int], new: int):
    """Two decoders of one random n-node drafter, eager and compiled, each prefilled with `prompt`."""
    drafter = treespec.make_drafter(random_heads(model, seed=n), treespec.default_tree(n, 4), model)
    eager = treespec.Decoder(model, drafter, acceptance="greedy")
    fast = treespec.Decoder(model, drafter, acceptance="greedy", compile=True)
    fast.scorer.progress = None
    for decoder in (eager, fast):
        decoder.prefill(prompt, max_new_tokens=new)
    return eager, fast


def test_one_graph_serves_every_node_count_of_a_size_class():
    from torch._dynamo.utils import counters

    model = tiny_model("llama", dtype=torch.float32, seed=6)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (12,), generator=gen).tolist()
    graphs = []
    for n in (3, 5, 9, 14):  # all in the size class 2-16
        eager, fast = eager_and_compiled(model, n, prompt, 8)
        for _ in range(2):
            tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=gen)
            torch.testing.assert_close(fast.score(tokens), eager.score(tokens), rtol=1e-4, atol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == graphs[:1] * 3, graphs  # no graph compiled after the first node count


def test_a_graph_split_the_size_classes_did_not_foresee_is_compiled_not_refused(monkeypatch):
    monkeypatch.setattr(compiled, "size_class", lambda n: "every n")  # n = 1 and n = 4 then share a key
    model = tiny_model("llama", dtype=torch.float32, seed=9)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, model.config.vocab_size, (10,), generator=gen).tolist()
    for n in (4, 1):  # dynamo splits n = 1 off (its 0/1 rule) under a key already seen
        eager, fast = eager_and_compiled(model, n, prompt, 8)
        tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=gen)
        torch.testing.assert_close(fast.score(tokens), eager.score(tokens), rtol=1e-4, atol=1e-4)


def test_the_first_call_of_a_node_count_says_it_compiles_and_later_ones_are_quiet():
    model = tiny_model("llama", dtype=torch.float32, seed=8)
    stream = io.StringIO()
    scorer = CompiledForward(model, progress=stream)
    decoder = treespec.Decoder(model, acceptance="greedy", compile=True)
    decoder.scorer = scorer
    decoder.prefill([1, 2, 3, 4], max_new_tokens=6)
    for _ in range(4):
        decoder.step()
    assert stream.getvalue().count("compiling the verification step for trees of 1 node") == 1
    assert "compiled in" in stream.getvalue()


def test_inductor_cache_goes_under_treespec_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    assert compiled.cache_dir() == tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled.cache_dir() == tmp_path / "mine"
