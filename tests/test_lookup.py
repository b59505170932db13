"""Prompt lookup: the n-gram index against a brute-force search, the augmented tree, greedy exactness."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ARCHS, hf_greedy, random_heads, tiny_model

import treespec
from treespec.core.acceptance import accept_greedy
from treespec.drafters.lookup import LookupDrafter, NgramIndex


def _oracle(tokens: list[int], max_ngram: int, length: int) -> list[int]:
    """Longest suffix first; its latest earlier occurrence that has a token after it."""
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + length]
    return []


def test_ngram_index_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(200):
        vocab = rng.choice([2, 3, 5, 20])
        max_ngram = rng.choice([1, 2, 3, 4])
        index = NgramIndex(max_ngram)
        seen: list[int] = []
        for _ in range(rng.randint(1, 6)):  # appended in chunks, as decoding steps do
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            index.extend(chunk)
            seen += chunk
            length = rng.randint(1, 6)
            assert index.propose(length) == _oracle(seen, max_ngram, length), (seen, max_ngram)


def test_lookup_drafter_places_the_inner_tree_and_the_chain():
    model = tiny_model("llama")
    heads = random_heads(model, sequential=True)
    inner = treespec.make_drafter(heads, treespec.default_tree(16, 4), model)
    drafter = LookupDrafter(inner, length=5)
    tree = drafter.tree
    assert tree.num_nodes == inner.tree.num_nodes + 5
    assert [len(tree.path_to(int(i))) - 1 for i in drafter.chain_nodes] == [1, 2, 3, 4, 5]  # one chain
    drafter.start(
        treespec.SequenceStart([5, 6, 7, 8, 5, 6], 64, None, "sdpa")
    )  # suffix "5 6" occurred before, followed by "7 8 5 6"
    hidden = torch.randn(model.config.hidden_size, dtype=torch.float64)
    tokens = drafter.propose(hidden[None], torch.tensor([6])).tokens[0]
    assert tokens[drafter.chain_nodes].tolist() == [7, 8, 5, 6, 6]  # padded with its last token
    assert torch.equal(tokens[drafter.inner_nodes], inner.propose(hidden[None], torch.tensor([6])).tokens[0])
    drafter.start(
        treespec.SequenceStart([1, 2, 3], 64, None, "sdpa")
    )  # nothing repeats: the chain copies the inner tree's top branch
    tokens = drafter.propose(hidden[None], torch.tensor([3])).tokens[0]
    choices = inner.tree.choices
    depth = max(d for d in range(1, 6) if all((0,) * e in choices for e in range(1, d + 1)))
    top = tokens[drafter.inner_nodes][[choices.index((0,) * d) + 1 for d in range(1, depth + 1)]].tolist()
    assert tokens[drafter.chain_nodes].tolist() == (top + [top[-1]] * 5)[:5]
    short = LookupDrafter(inner, length=2)  # shorter than the inner top branch: the filler is cut
    short.start(treespec.SequenceStart([1, 2, 3], 64, None, "sdpa"))
    assert short.propose(hidden[None], torch.tensor([3])).tokens[0][short.chain_nodes].tolist() == top[:2]
    with pytest.raises(ValueError, match="length"):
        LookupDrafter(inner, length=0)


def test_greedy_follows_the_deepest_of_duplicate_branches():
    # root's children 1 and 2 carry the same token; only the branch under 2 goes on matching
    tokens = [0, 5, 5, 9, 6]
    children = [[1, 2], [3], [4], [], []]
    logits = torch.zeros(5, 10)
    logits[0, 5] = logits[2, 6] = logits[1, 7] = logits[4, 1] = 1.0
    assert accept_greedy(tokens, children, logits) == ([0, 2, 4], 1)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_with_lookup_equals_hf_greedy(arch):
    model = tiny_model(arch, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    for trial in range(2):
        phrase = torch.randint(0, model.config.vocab_size, (6,), generator=gen).tolist()
        prompt = phrase * 3 + phrase[:2]  # repeated text gives the lookup something to copy
        expected = hf_greedy(model, prompt, 40)
        heads = random_heads(model, seed=trial, sequential=trial == 0)
        tree = treespec.default_tree(16, 4)
        with_heads = treespec.generate(
            model,
            prompt,
            treespec.LookupDrafter(treespec.as_drafter(model, heads, tree), 6),
            max_new_tokens=40,
            eos_token_id=[],
        )
        assert with_heads.token_ids == expected
        alone = treespec.generate(
            model, prompt, treespec.LookupDrafter(None, 6), max_new_tokens=40, eos_token_id=[]
        )
        assert alone.token_ids == expected
        assert alone.tree.num_nodes == 7


def test_lookup_alone_accepts_deep_on_a_model_that_repeats():
    """With attention and MLP outputs zeroed the next token is a function of the current one, so greedy
    text falls into a cycle, which the lookup copies once it has been seen."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    prompt = [5, 17, 33]
    expected = hf_greedy(model, prompt, 60)
    res = treespec.generate(
        model, prompt, treespec.LookupDrafter(None, 8), max_new_tokens=60, eos_token_id=[]
    )
    assert res.token_ids == expected
    assert res.stats.steps < 25
