"""SuffixDrafter / SuffixCache: the trees they draft, the global cache (bounded, saved, reloaded), and
exactness through the decoder (greedy == HF, lossless sampling, under a dynamic tree)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import (
    ARCHS,
    hf_greedy,
    repeating_prompts,
    second_token_counts,
    second_token_marginals,
    tiny_model,
    total_variation,
)

import treespec
from treespec import SequenceStart, SuffixCache, SuffixDrafter
from treespec.drafters.suffix import SuffixIndex

SPECULATE = treespec.DecodeOptions(plain_above=None)  # batches speculate in every step


def started(drafter: SuffixDrafter, sequences: list[list[int]]) -> SuffixDrafter:
    """Start the drafter on a batch of sequences (prompt + first token each) without a model."""
    for row, tokens in enumerate(sequences):
        drafter.start(SequenceStart(list(tokens), 1024, None, "sdpa", None, row, len(sequences)))
    return drafter


def propose(drafter: SuffixDrafter, roots: list[int], max_depth: int | None = None):
    return drafter.propose(torch.zeros(len(roots), 4), torch.tensor(roots), max_depth)


def nodes_of(proposal, row: int = 0) -> dict[tuple[int, ...], tuple[int, float]]:
    """Choice path -> (token, prob) of one row's drafted nodes (probability > 0)."""
    out = {}
    for i, path in enumerate(proposal.tree.choices, start=1):
        if proposal.probs[row, i] > 0:
            out[path] = (int(proposal.tokens[row, i]), round(float(proposal.probs[row, i]), 6))
    return out


# ----- the index and the trees -----


def test_the_index_finds_the_longest_earlier_suffix():
    index = SuffixIndex(ngram=2)
    text = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    index.extend(text)
    # "9 1 2" occurred twice before (followed at 6 and 10); "4 9 1 2" never did
    assert index.match(text, max_context=8, max_scan=16) == (3, [10, 6])
    assert index.match(text, max_context=2, max_scan=16) == (2, [10, 6, 2])
    assert index.continuation(10, 3) == [4, 9, 1]
    assert index.match([7, 7], 8, 16) == (0, [])


def test_continuation_counts_make_a_tree_scored_by_frequency():
    drafter = started(SuffixDrafter(max_nodes=16, max_depth=6), [[1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]])
    proposal = propose(drafter, [2])
    # matched "9 1 2" (3 tokens: at most 3 deep); followed once by "3 9 1", once by "4 9 1"
    assert nodes_of(proposal) == {
        (0,): (3, 0.5),
        (1,): (4, 0.5),
        (0, 0): (9, 0.5),
        (1, 0): (9, 0.5),
        (0, 0, 0): (1, 0.5),
        (1, 0, 0): (1, 0.5),
    }
    assert proposal.tree.num_nodes == 7 and proposal.tokens[0, 0] == 2 and proposal.probs[0, 0] == 1
    shallow = propose(drafter, [2], max_depth=1)  # limits_depth: depths 1..max_depth only
    assert shallow.tree.max_depth == 1 and nodes_of(shallow) == {(0,): (3, 0.5), (1,): (4, 0.5)}


def test_the_node_budget_keeps_the_most_probable_paths():
    text = [5, 6, 7, 8, 9, 10, 11] * 4 + [5, 6, 7, 8, 20, 21, 22] * 4 + [5, 6, 7, 8, 30, 31] * 2
    drafter = started(SuffixDrafter(max_nodes=6, max_depth=6, max_context=4), [text + [5, 6, 7, 8]])
    proposal = propose(drafter, [8])
    assert proposal.tree.num_nodes == 6  # 5 drafted nodes: the budget
    probs = sorted(p for _, p in nodes_of(proposal).values())
    rest = [0.4, 0.4, 0.4, 0.4]  # "9 10 11 5" and "20 21 22 5" followed 4 of 10 times
    assert probs == sorted(rest + [0.4])


def test_a_batch_shares_one_tree_and_rows_fill_what_they_lack_with_their_root():
    drafter = started(SuffixDrafter(), [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 6, 4, 7, 4], [8, 9]])
    proposal = propose(drafter, [2, 4, 9])
    tree = proposal.tree
    # row 0 matched "1 2 3 1 2" (5 tokens): "3 1 2" followed it, then the period again ("3 1")
    assert nodes_of(proposal, 0) == {
        (0,) * d: (t, 1.0) for d, t in zip(range(1, 6), [3, 1, 2, 3, 1], strict=True)
    }
    third = round(1 / 3, 6)
    assert nodes_of(proposal, 1) == {(0,): (5, third), (1,): (6, third), (2,): (7, third)}
    assert set(tree.choices) == {(1,), (2,)} | {(0,) * d for d in range(1, 6)}
    assert nodes_of(proposal, 2) == {}  # nothing matched: the root everywhere, probability 0
    assert proposal.tokens[2].tolist() == [9] * tree.num_nodes
    assert proposal.tokens[0, tree.choices.index((1,)) + 1] == 2  # row 0 has no (1,): its root


def test_the_declared_tree_covers_every_step_tree():
    for max_nodes, max_depth in [(16, 6), (8, 12), (32, 4), (1, 3)]:
        drafter = SuffixDrafter(max_nodes=max_nodes, max_depth=max_depth)
        assert drafter.tree.num_nodes == max_nodes
        assert drafter.tree.max_depth == min(max_depth, max_nodes - 1)
    drafter = started(SuffixDrafter(max_nodes=16, max_depth=6), [[1, 2, 3, 1, 2, 3, 1, 2]])
    proposal = propose(drafter, [2])
    assert proposal.tree.num_nodes <= 16 and set(proposal.tree.choices) <= set(drafter.tree.choices)
    assert (proposal.probs > 0).sum() == 6  # the root, then "3 1 2", then the period again: "3 1"


# ----- the global cache -----


def test_finished_answers_go_into_the_global_cache():
    cache = SuffixCache()
    drafter = started(SuffixDrafter(cache), [[1, 2, 3, 4], [7, 8]])
    drafter.observe([[5, 6], [9]])
    drafter.keep_rows([1])  # row 0 finished: its answer (first token 4, then 5 6) is stored
    assert cache.requests() == [[4, 5, 6]]
    started(drafter, [[10, 11]])  # a new batch: the last one's rows are stored first
    assert cache.requests() == [[4, 5, 6], [8, 9]]
    drafter.finish()
    assert cache.requests() == [[4, 5, 6], [8, 9], [11]]
    # another drafter on the same cache drafts from those answers
    other = started(SuffixDrafter(cache), [[0, 8]])
    assert nodes_of(propose(other, [8])) == {(0,): (9, 1.0)}
    other.finish()
    assert cache.num_requests == 4
    reader = started(SuffixDrafter(cache, remember=False), [[0, 8]])  # only reads the cache
    reader.finish()
    assert cache.num_requests == 4


def test_eviction_keeps_the_cache_bounded():
    rng = random.Random(0)
    cache = SuffixCache(max_tokens=600)
    memory = []
    for _ in range(200):
        cache.add([rng.randrange(5000) for _ in range(rng.randrange(1, 60))])
        assert cache.num_tokens + cache.num_requests <= 600
        memory.append(cache.memory_bytes())
    assert max(memory[100:]) < 1.3 * max(memory[:50])  # flat once full
    index = cache.index
    assert all(p >= index.base for table in index.last for p in table.values())  # evicted: no entries
    assert 20 < sum(len(table) for table in index.last) <= 3 * 600
    # the oldest requests are gone, the newest are there
    cache.add([1, 2, 3])
    assert cache.requests()[-1] == [1, 2, 3] and index.match([1, 2], 8, 8)[0] == 2
    assert cache.add([9] * 10_000) is None and cache.requests() == [[9] * 599]  # a huge one: its end


def test_a_saved_cache_reloads_and_drafts_the_same_trees(tmp_path):
    rng = random.Random(1)
    cache = SuffixCache(max_tokens=2000)
    phrases = [[rng.randrange(50) for _ in range(8)] for _ in range(6)]
    for _ in range(80):
        cache.add([t for _ in range(5) for t in rng.choice(phrases)])
    cache.save(tmp_path / "suffix.json")
    loaded = SuffixCache.load(tmp_path / "suffix.json")
    assert loaded.requests() == cache.requests() and loaded.max_tokens == 2000
    for phrase in phrases:
        sequences = [[3, 4, *phrase[:3]], [*phrase[:5]]]
        a = started(SuffixDrafter(cache, remember=False), sequences)
        b = started(SuffixDrafter(loaded, remember=False), sequences)
        roots = [s[-1] for s in sequences]
        pa, pb = propose(a, roots), propose(b, roots)
        assert pa.tree == pb.tree and pa.tree.num_nodes > 3
        assert torch.equal(pa.tokens, pb.tokens) and torch.equal(pa.probs, pb.probs)


@pytest.mark.parametrize(
    "content",
    [
        b"\x89PNG\r\n\x1a\n\x00\x00",
        b'{"format": "treespec.suffix_cache", "version": 1, "max_tokens": 100, "ngram": 3',
        json.dumps({"format": "other"}).encode(),
        json.dumps({"format": "treespec.suffix_cache", "version": 2}).encode(),
        json.dumps(
            {
                "format": "treespec.suffix_cache",
                "version": 1,
                "max_tokens": 100,
                "ngram": 3,
                "requests": [[1, "x"]],
            }
        ).encode(),
        json.dumps(
            {"format": "treespec.suffix_cache", "version": 1, "max_tokens": 0, "ngram": 3, "requests": []}
        ).encode(),
    ],
)
def test_a_corrupt_cache_file_is_refused(tmp_path, content):
    path = tmp_path / "suffix.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a treespec suffix cache"):
        SuffixCache.load(path)


# ----- through the decoder -----


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_output_equals_hf_alone_and_in_a_batch(arch):
    model = tiny_model(arch, dtype=torch.float32)
    drafter = SuffixDrafter(max_nodes=12, max_depth=5)
    prompts = repeating_prompts(hash(arch) % 1000, 3) + [[5] * 9]
    expected = [hf_greedy(model, p, 40) for p in prompts]
    for prompt, want in zip(prompts, expected, strict=True):
        assert treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[]).token_ids == want
    results = treespec.generate(
        model, prompts[:3], drafter, max_new_tokens=40, eos_token_id=[], options=SPECULATE
    )
    assert [r.token_ids for r in results] == expected[:3]
    results = treespec.generate(
        model, prompts[1:], drafter, max_new_tokens=40, eos_token_id=[], options=SPECULATE
    )
    assert [r.token_ids for r in results] == expected[1:]
    stats = drafter.report().stats["suffix"]
    assert stats["nodes"] > 2 * stats["steps"] and stats["global"] > 0  # it drafted, also from the cache


def test_a_model_that_repeats_itself_accepts_several_tokens_per_step():
    model = tiny_model("qwen2", dtype=torch.float32)  # after [3, 8] * 6 it says 40 3 47 62 62 62 ...
    prompt = [3, 8] * 6
    result = treespec.generate(model, prompt, SuffixDrafter(), max_new_tokens=60, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 60)
    # 7 tokens a step (6 drafted + the bonus) once the loop is there
    assert result.stats.steps < 20 and result.stats.accept_lengths.count(7) >= 5


def test_a_second_request_like_the_first_accepts_more():
    model = tiny_model("qwen2", dtype=torch.float32)
    prompt = repeating_prompts(7, 1)[0]
    drafter = SuffixDrafter()
    first = treespec.generate(model, prompt, drafter, max_new_tokens=48, eos_token_id=[])
    second = treespec.generate(model, prompt, drafter, max_new_tokens=48, eos_token_id=[])
    assert first.token_ids == second.token_ids == hf_greedy(model, prompt, 48)
    assert second.stats.mean_accept_length > max(2.5, first.stats.mean_accept_length + 1)
    assert drafter.cache.num_requests == 1


def test_sampling_keeps_the_base_models_distribution():
    """temperature 1: each row's 2nd token follows the base model's exact marginal (branching trees from
    a cache of random sequences over the 10 tokens)."""
    model = tiny_model("llama", dtype=torch.float32, vocab_size=10, initializer_range=0.5)
    rng = random.Random(0)
    cache = SuffixCache()
    for _ in range(40):
        cache.add([rng.randrange(10) for _ in range(12)])
    prompts = [[1, 4, 2], [7, 7, 3, 0]]
    exact = second_token_marginals(model, prompts)  # [V] per prompt
    drafters = []

    def new_suffix(seed):
        drafters.append(SuffixDrafter(cache, min_prob=0.05, spec_factor=4.0, remember=False))
        return drafters[-1]

    counts = second_token_counts(model, prompts, new_suffix, seeds=50, copies=32, options=SPECULATE)
    drafter = drafters[-1]
    assert drafter.report().stats["suffix"]["nodes"] >= 3  # a tree, not the root alone
    for count, p in zip(counts, exact, strict=True):
        assert sum(count.values()) == 1600
        assert total_variation(count, p) < 0.06  # noise at n=1600 over 10 tokens is ~0.025


def test_under_a_priced_planner_it_stays_exact(steady_clock):
    model = tiny_model("llama", dtype=torch.float32)
    drafter = treespec.TreePlanner([SuffixDrafter()], lambda nodes, prefix: 1e-3 * (1 + 0.05 * nodes))
    for prompt in [[5] * 9, *repeating_prompts(3, 2), [5] * 9]:
        result = treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[])
        assert result.token_ids == hf_greedy(model, prompt, 40)
    assert result.stats.steps < 25  # the repeated request: deep trees pay


def test_a_cache_warmed_with_earlier_answers_drafts_them_and_keeps_room():
    """`SuffixCache.from_sequences`: earlier answers (e.g. the model's answers to other prompts) are
    there from the first request on, with `room` tokens left before the oldest are evicted."""
    answers = [[4, 5, 6, 7, 8, 9], [20, 21, 22], [4, 5, 6, 30]]
    cache = SuffixCache.from_sequences(answers, room=10)
    assert cache.requests() == answers and cache.max_tokens == 6 + 1 + 3 + 1 + 4 + 1 + 10
    drafter = started(SuffixDrafter(cache, remember=False), [[1, 4, 5]])  # a request ending in 4 5
    nodes = nodes_of(propose(drafter, [5]))
    assert nodes[(0,)] == (6, 1.0)  # both warm answers with "4 5" go on with 6
    assert {nodes[(0, 0)], nodes[(0, 1)]} == {(7, 0.5), (30, 0.5)}  # then 7 or 30, half each
    cache.add(list(range(100, 109)))  # 9 tokens + a separator fill the room: nothing evicted yet
    assert cache.num_requests == 4
    cache.add([1, 2])  # over the bound: the oldest warm answer goes first
    assert cache.requests()[0] == [20, 21, 22] and cache.num_tokens + cache.num_requests <= cache.max_tokens
    with pytest.raises(ValueError, match="token ids"):
        SuffixCache.from_sequences([[1, -2]])


def test_the_shipped_cache_holds_the_default_models_training_answers_only():
    """heads/smollm2-135m-instruct-suffix/suffix-cache.json is what scripts/make_suffix_cache.py writes
    from the committed distillation data's train split: every answer, in order (the split holds no
    held-out prompt)."""
    from treespec.tools.models import default_suffix_cache_file
    from treespec.training.distill import read_answers

    shipped = SuffixCache.load(default_suffix_cache_file())
    folder = "data/distill/smollm2-135m-instruct"
    assert shipped.requests() == read_answers(folder)  # the train split's answers (not the eval split's)
    assert shipped.max_tokens == shipped.num_tokens + shipped.num_requests + 131072  # room for new requests
