"""Prompt lookup: the chain it copies against a brute-force search, the chain it drafts, greedy exactness."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ARCHS, hf_greedy, random_heads, tiny_model

import treespec
from treespec.core.acceptance import accept_greedy
from treespec.drafters.lookup import PromptLookup


def _oracle(tokens: list[int], max_ngram: int, length: int) -> list[int]:
    """Longest suffix first; its latest earlier occurrence that has a token after it."""
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + length]
    return []


def test_the_lookup_chain_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(200):
        vocab = rng.choice([2, 3, 5, 20])
        max_ngram, length = rng.choice([1, 2, 3, 4]), rng.randint(1, 6)
        lookup = PromptLookup(length, max_ngram)
        seen = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        lookup.start(treespec.SequenceStart(seen, 64, None, "sdpa"))
        for _ in range(rng.randint(1, 6)):  # then committed in chunks, as decoding steps do
            proposal = lookup.propose(torch.zeros(1, 4), torch.tensor([seen[-1]]))
            drafted = proposal.tokens[0, 1:][proposal.probs[0, 1:] > 0].tolist()
            assert drafted == _oracle(seen, max_ngram, length), (seen, max_ngram)
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            lookup.observe([chunk])
            seen += chunk


def test_the_lookup_chain_copies_what_followed_and_records_its_hits():
    lookup = PromptLookup(length=5)
    assert lookup.tree.num_nodes == 6 and lookup.tree.max_depth == 5 and lookup.batched
    # row 0: suffix "5 6" occurred before, followed by "7 8 5 6"; row 1: nothing repeats
    lookup.start(treespec.SequenceStart([5, 6, 7, 8, 5, 6], 64, None, "sdpa", rows=2))
    lookup.start(treespec.SequenceStart([1, 2, 3], 64, None, "sdpa", row=1, rows=2))
    proposal = lookup.propose(torch.zeros(2, 4), torch.tensor([6, 3]))
    assert proposal.tokens.tolist() == [[6, 7, 8, 5, 6, 6], [3, 3, 3, 3, 3, 3]]  # padded with the last
    # prior: half of the nodes accepted; the padding and a row without a match: not drafted
    assert proposal.probs.tolist() == [[1.0, 0.5, 0.5, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    lookup.observe([[7, 8, 1], [4]])  # the chain's first two tokens accepted, then a bonus token
    matched = 2  # "5 6" matched two tokens
    assert lookup.hits[matched, :3].tolist() == [2.0, 2.0, 1.0] and lookup.tries[matched, :3].tolist() == [
        3.0, 3.0, 3.0,
    ]  # fmt: skip
    lookup.keep_rows([1])
    assert len(lookup.indexes) == 1 and list(lookup.indexes[0].tokens) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="length"):
        PromptLookup(length=0)


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
            treespec.TreePlanner([treespec.as_drafter(model, heads, tree), PromptLookup(6)]),
            max_new_tokens=40,
            eos_token_id=[],
        )
        assert with_heads.token_ids == expected
        alone = treespec.generate(
            model, prompt, treespec.TreePlanner([PromptLookup(6)]), max_new_tokens=40, eos_token_id=[]
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
        model, prompt, treespec.TreePlanner([PromptLookup(8)]), max_new_tokens=60, eos_token_id=[]
    )
    assert res.token_ids == expected
    assert res.stats.steps < 25
