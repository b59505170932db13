"""Token recycling: the table learns what the target said, the tree walks it, the output stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ARCHS,
    hf_greedy,
    second_token_counts,
    second_token_marginals,
    tiny_model,
    total_variation,
)

import treespec
from treespec.core.drafting import SequenceStart
from treespec.drafters.recycling import RecyclingDrafter, last_occurrences

TREE = treespec.Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


def _propose(drafter: RecyclingDrafter, roots: list[int], max_depth: int | None = None):
    """(tokens [B, N], probs [B, N]) drafted from `roots`."""
    hidden = torch.zeros(len(roots), 4)
    proposal = drafter.propose(hidden, torch.tensor(roots), max_depth)
    return proposal.tokens, proposal.probs


def _repeating_prompts(model, count: int, seed: int = 5) -> list[list[int]]:
    """Prompts that repeat a random phrase (text the table can learn from)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        phrase = torch.randint(0, model.config.vocab_size, (5 + i,), generator=gen).tolist()
        prompts.append(phrase * 3 + phrase[:2])
    return prompts


def test_verified_then_propose_walks_a_hand_built_table():
    drafter = RecyclingDrafter(10, TREE, k=2)
    # after token 1 the target said (2, 3); after token 2 it said (4, 5)
    drafter.verified(torch.tensor([[1, 2]]), torch.tensor([[[2, 3], [4, 5]]]))
    tokens, probs = _propose(drafter, [1])
    # nodes: root, (0), (1), (0,0), (0,1), (1,0), (0,0,0)
    assert tokens[0].tolist() == [1, 2, 3, 4, 5, 3, 4]  # rows of 3 and 4 unknown: repeat the parent
    assert (probs[0, :5] > 0).all() and probs[0, 5:].tolist() == [0.0, 0.0]
    assert probs[0, 1] > probs[0, 2]  # rank 0 before rank 1 (prior)
    # a token verified twice: the later node (row-major) wins; later rows over earlier rows
    drafter.verified(torch.tensor([[1, 1]]), torch.tensor([[[6, 7], [8, 9]]]))
    assert drafter.table[1].tolist() == [8, 9]
    drafter.verified(torch.tensor([[1], [1]]), torch.tensor([[[2, 3]], [[4, 5]]]))
    assert drafter.table[1].tolist() == [4, 5]
    with pytest.raises(ValueError, match="vocab_size"):
        drafter.verified(torch.tensor([[1]]), torch.tensor([[[2, 10]]]))
    with pytest.raises(ValueError, match="k=2"):
        drafter.verified(torch.tensor([[1]]), torch.tensor([[[2, 3, 4]]]))
    with pytest.raises(ValueError, match="rank"):
        RecyclingDrafter(10, TREE, k=1)


def test_prompt_bigrams_seed_rank_zero_and_never_overwrite_the_target():
    drafter = RecyclingDrafter(10, TREE, k=2)
    drafter.verified(torch.tensor([[8]]), torch.tensor([[[1, 2]]]))
    drafter.start(SequenceStart([7, 8, 9, 7, 6], 64, None, "sdpa"))
    assert drafter.table[7, 0] == 6 and drafter.width[7] == 1  # the latest pair of 7 wins
    assert drafter.table[8].tolist() == [1, 2] and drafter.width[8] == 2  # the target's row stays
    tokens, probs = _propose(drafter, [7])
    assert tokens[0, :3].tolist() == [7, 6, 7]  # rank 1 of a seeded row is unknown
    assert probs[0, 1] > 0 and probs[0, 2] == 0
    # the committed text seeds too: 6 (the last token) -> 3, 3 -> 4
    drafter.observe([[3, 4]])
    assert drafter.table[6, 0] == 3 and drafter.table[3, 0] == 4
    drafter.verified(torch.tensor([[7]]), torch.tensor([[[5, 4]]]))  # the target replaces a seeded row
    assert drafter.table[7].tolist() == [5, 4] and drafter.width[7] == 2


def test_observe_learns_which_ranks_are_accepted():
    drafter = RecyclingDrafter(10, TREE, k=2)
    drafter.verified(torch.tensor([[1, 2, 3]]), torch.tensor([[[2, 3], [4, 5], [6, 7]]]))
    _, before = _propose(drafter, [1])
    drafter.observe([[3, 6, 0]])  # rank 1 (token 3) then its rank 0 (6) accepted, bonus 0
    _, after = _propose(drafter, [1])
    assert after[0, 2] > before[0, 2]  # (1): tried and accepted
    assert after[0, 1] < before[0, 1]  # (0): tried, not accepted
    assert after[0, 5] > before[0, 5]  # (1, 0): tried and accepted
    assert after[0, 3] == after[0, 5]  # (0, 0) shares the (depth 2, rank 0) estimate
    assert after[0, 4] == before[0, 4]  # (depth 2, rank 1): no such child of an accepted node, not tried
    report = drafter.report()
    assert report.stats["recycling"]["accepted"] == 2
    assert report.cache_memory["allocated"] == 10 * 2 * 4 + 10 + 10


def test_max_depth_is_honoured():
    drafter = RecyclingDrafter(10, TREE, k=2)
    drafter.verified(torch.tensor([[1, 2, 4]]), torch.tensor([[[2, 3], [4, 5], [6, 7]]]))
    tokens, probs = _propose(drafter, [1, 2], max_depth=1)
    depth = TREE.depth
    assert (probs[:, depth > 1] == 0).all() and (probs[:, depth == 1] > 0).all()
    assert (tokens[:, depth > 1] == torch.tensor([[1], [2]])).all()  # deeper nodes: the root token
    tokens, probs = _propose(drafter, [1, 2])
    assert tokens[0].tolist() == [1, 2, 3, 4, 5, 3, 6]
    assert tokens[1].tolist() == [2, 4, 5, 6, 7, 5, 6]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_with_recycling_equals_hf_greedy(arch):
    model = tiny_model(arch, dtype=torch.float32)
    drafter = RecyclingDrafter(model.config.vocab_size)  # reused: the table carries over
    prompts = _repeating_prompts(model, 3)
    for prompt in prompts:
        result = treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[])
        assert result.token_ids == hf_greedy(model, prompt, 40)
    stats = drafter.report().stats["recycling"]
    assert stats["rows_from_target"] > 10 and stats["verified_nodes"] > 0  # the decoder fed verified()
    results = treespec.generate(model, prompts, drafter, max_new_tokens=40, eos_token_id=[])
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 40) for p in prompts]


def test_recycling_accepts_deep_on_a_model_whose_next_token_depends_on_the_current_one():
    """Attention and MLP outputs zeroed: the next token is a function of the current one, exactly what
    the table stores, so once the text has been seen whole chains are accepted."""
    model = tiny_model("llama", dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    drafter = RecyclingDrafter(model.config.vocab_size)
    prompt = [5, 17, 33]
    expected = hf_greedy(model, prompt, 60)
    first = treespec.generate(model, prompt, drafter, max_new_tokens=60, eos_token_id=[])
    again = treespec.generate(model, prompt, drafter, max_new_tokens=60, eos_token_id=[])
    assert first.token_ids == again.token_ids == expected
    assert again.stats.steps < 20 and again.stats.mean_accept_length > 3


def test_combined_with_dynamic_trees_and_lookup_stays_exact():
    model = tiny_model("llama", dtype=torch.float32)
    prompts = _repeating_prompts(model, 3, seed=7)
    expected = [hf_greedy(model, p, 40) for p in prompts]
    recycling = RecyclingDrafter(model.config.vocab_size)
    dynamic = treespec.TreePlanner(
        [recycling], verify_seconds=lambda nodes, prefix: 1e-3 * (1 + 0.05 * nodes)
    )
    for prompt, want in zip(prompts, expected, strict=True):
        assert treespec.generate(model, prompt, dynamic, max_new_tokens=40, eos_token_id=[]).token_ids == want
    assert recycling.report().stats["recycling"]["verified_nodes"] > 0
    lookup = treespec.TreePlanner([RecyclingDrafter(model.config.vocab_size), treespec.PromptLookup(4)])
    for prompt, want in zip(prompts, expected, strict=True):
        assert treespec.generate(model, prompt, lookup, max_new_tokens=40, eos_token_id=[]).token_ids == want
    results = treespec.generate(model, prompts, lookup, max_new_tokens=40, eos_token_id=[])
    assert [r.token_ids for r in results] == expected
    assert lookup.sources[0].report().stats["recycling"]["rows_from_target"] > 10


def test_sampling_with_recycling_matches_the_base_model():
    """temperature 1: each row's 2nd token follows the base model's exact marginal (a warm table)."""
    model = tiny_model("llama", dtype=torch.float32, vocab_size=10, initializer_range=0.5)
    prompts = [[1, 4, 2], [7, 7, 3, 0]]
    exact = second_token_marginals(model, prompts)  # [V] per prompt
    drafter = RecyclingDrafter(10, k=8)
    # each sample needs its own prefill: kept short
    counts = second_token_counts(model, prompts, lambda seed: drafter, seeds=100, copies=8)
    assert drafter.report().stats["recycling"]["rows_from_target"] >= 5
    for count, p in zip(counts, exact, strict=True):
        assert sum(count.values()) == 800
        assert total_variation(count, p) < 0.085  # noise at n=800 over 10 tokens is ~0.035


@pytest.mark.parametrize("size", [1, 7, 60, 5000])
def test_last_occurrences_matches_a_dictionary(size):
    ids = torch.randint(0, size // 3 + 2, (size,), generator=torch.Generator().manual_seed(size))
    latest = {token: i for i, token in enumerate(ids.tolist())}
    expected = torch.zeros(size, dtype=torch.bool)
    expected[list(latest.values())] = True
    assert torch.equal(last_occurrences(ids), expected)
