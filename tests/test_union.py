"""UnionDrafter: two drafters' trees merged by token path and tagged per source; exact through the decoder
(greedy == HF alone and in a batch, standalone, under DynamicTreeDrafter and with LookupDrafter; lossless
sampling), and the wrappers that now honour an inner drafter's tree of each step (`Proposal.tree`)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from conftest import (
    ARCHS,
    hf_greedy,
    random_heads,
    repeating_prompts,
    second_token_marginals,
    tiny_model,
    total_variation,
)

import treespec
from treespec import Proposal, SequenceStart, SuffixCache, SuffixDrafter, Tree, UnionDrafter
from treespec.core.drafting import BaseDrafter, step_layout
from treespec.drafters.union import BOTH, SOURCES

SPECULATE = treespec.DecodeOptions(plain_above=None)  # batches speculate in every step


def cost(nodes: int, prefix: int) -> float:
    """A verification cost curve for the dynamic tree: cheap nodes, so trees pay."""
    return 1e-3 * (1 + 0.05 * nodes)


class Scripted(BaseDrafter):
    """Proposes given trees: per row a dict choice path -> (token, prob); `per_step`: the tree of the
    paths (Proposal.tree), else laid onto `tree` (missing nodes: the root's token, probability 0)."""

    batched = True
    limits_depth = True  # (it drafts everything: its nodes keep their depth as level)

    def __init__(self, tree: Tree, rows: list[dict], per_step: bool = False):
        self.tree, self.rows, self.per_step = tree, rows, per_step

    def propose(self, hidden, roots, max_depth=None) -> Proposal:
        step = (
            Tree.from_choices(sorted({p for row in self.rows for p in row})) if self.per_step else self.tree
        )
        tokens = [
            [int(r)] + [row.get(p, (int(r), 0))[0] for p in step.choices]
            for r, row in zip(roots.tolist(), self.rows, strict=True)
        ]
        probs = [[1.0] + [row.get(p, (0, 0.0))[1] for p in step.choices] for row in self.rows]
        return Proposal(torch.tensor(tokens), torch.tensor(probs), tree=step if self.per_step else None)


def merged_nodes(proposal: Proposal, row: int = 0) -> dict[tuple[int, ...], tuple]:
    """Token path -> (prob, level, group) of one row's nodes (probability > 0)."""
    tree, out = proposal.tree, {}
    for i in range(1, tree.num_nodes):
        if proposal.probs[row, i] > 0:
            path = tuple(int(proposal.tokens[row, j]) for j in tree.path_to(i)[1:])
            p = round(float(proposal.probs[row, i]), 6)
            out[path] = (p, int(proposal.levels[row, i]), int(proposal.groups[row, i]))
    return out


# ----- the merged tree -----


def test_identical_paths_merge_into_one_node_tagged_with_both_sources():
    primary = Scripted(
        Tree.from_choices([[0], [1], [0, 0], [1, 0]]),
        [{(0,): (10, 0.5), (1,): (11, 0.25), (0, 0): (12, 0.5), (1, 0): (99, 0.0)}],  # (1, 0): not drafted
    )
    secondary = Scripted(
        Tree.from_choices([[0], [0, 0], [0, 1], [0, 0, 0]]),
        [{(0,): (10, 0.5), (0, 0): (12, 1.0), (0, 1): (13, 0.75), (0, 0, 0): (14, 0.5)}],
        per_step=True,
    )
    union = UnionDrafter(primary, secondary, limit_secondary=True)  # levels: each drafter's depth
    assert union.tree.num_nodes == 5 + 5 - 1 and union.tree.max_depth == 3  # both declared trees
    proposal = union.propose(torch.zeros(1, 4), torch.tensor([7]))
    assert proposal.tree.num_nodes == 6  # root, 10, 11, 10-12, 10-13, 10-12-14: each path once
    assert proposal.tokens.shape == proposal.probs.shape == proposal.levels.shape == (1, 6)
    assert merged_nodes(proposal) == {
        (10,): (0.75, 1, SOURCES * 1 + BOTH),  # 1 - (1 - 0.5)(1 - 0.5), both sources at level 1
        (11,): (0.25, 1, SOURCES * 1 + 0),  # the primary's alone
        (10, 12): (1.0, 2, SOURCES * 2 + BOTH),
        (10, 13): (0.75, 2, SOURCES * 2 + 1),  # the secondary's alone
        (10, 12, 14): (0.5, 3, SOURCES * 3 + 1),
    }
    # the primary's children come first (its order), then the secondary's new ones
    assert [proposal.tree.choices[i - 1] for i in range(1, 6)] == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert union.report().stats["union"] == {
        "steps": 1, "rows": 1, "nodes": 6, "primary": 1, "secondary": 2, "both": 2,
    }  # fmt: skip
    # by default the secondary drafts whole: its nodes' level is 0 (a shared node: the smaller level)
    whole = UnionDrafter(primary, secondary).propose(torch.zeros(1, 4), torch.tensor([7]))
    levels = {p: level for p, (_, level, _) in merged_nodes(whole).items()}
    assert levels == {(10,): 0, (11,): 1, (10, 12): 0, (10, 13): 0, (10, 12, 14): 0}
    # its own layout as a wrapper reads it: the step's tree, levels and groups
    tree, levels, groups = step_layout(union, proposal)
    assert tree is proposal.tree and torch.equal(groups, proposal.groups)


def test_a_batch_joins_the_rows_trees_and_rows_fill_what_they_lack_with_their_root():
    tree = Tree.from_choices([[0], [0, 0]])
    primary = Scripted(tree, [{(0,): (10, 0.5), (0, 0): (11, 0.5)}, {(0,): (20, 0.5), (0, 0): (21, 0.5)}])
    # row 0: the secondary repeats the primary's chain and goes one deeper; row 1: a branch of its own
    secondary = Scripted(
        Tree.from_choices([[0], [0, 0], [0, 0, 0]]),
        [{(0,): (10, 0.5), (0, 0): (11, 0.5), (0, 0, 0): (12, 0.5)}, {(0,): (30, 0.9)}],
    )
    union = UnionDrafter(primary, secondary, limit_secondary=True)
    proposal = union.propose(torch.zeros(2, 4), torch.tensor([7, 8]))
    assert proposal.tree.choices == ((0,), (1,), (0, 0), (0, 0, 0))
    assert merged_nodes(proposal, 0) == {
        (10,): (0.75, 1, SOURCES + BOTH), (10, 11): (0.75, 2, 2 * SOURCES + BOTH), (10, 11, 12): (0.5, 3, 10),
    }  # fmt: skip
    assert set(merged_nodes(proposal, 1)) == {(20,), (30,), (20, 21)}
    index = {p: i for i, p in enumerate(proposal.tree.choices, start=1)}
    assert int(proposal.tokens[0, index[(1,)]]) == 7 and float(proposal.probs[0, index[(1,)]]) == 0.0
    assert int(proposal.tokens[1, index[(0, 0, 0)]]) == 8
    capped = UnionDrafter(
        primary, secondary, max_nodes=3, limit_secondary=True
    )  # the most valuable paths of any row
    assert capped.propose(torch.zeros(2, 4), torch.tensor([7, 8])).tree.choices == ((0,), (1,))
    with pytest.raises(ValueError, match="max_nodes"):
        UnionDrafter(primary, secondary, max_nodes=99)


def test_the_declared_tree_and_levels_place_both_drafters_and_a_whole_secondary_is_level_0():
    model = tiny_model("llama", dtype=torch.float32)
    heads = treespec.make_drafter(random_heads(model), treespec.default_tree(8, 4), model)
    lookup = treespec.LookupDrafter(None, 3)  # does not limit depth: drafted whole
    union = UnionDrafter(heads, lookup)
    assert union.limits_depth and union.tree.num_nodes == 8 + 4 - 1
    levels = union.node_levels
    assert torch.equal(levels[union.primary_nodes], heads.tree.depth)
    assert levels[union.secondary_nodes].tolist() == [0, 0, 0, 0]
    suffix_whole = UnionDrafter(heads, SuffixDrafter())  # the default: the secondary drafts whole
    assert (suffix_whole.node_levels[suffix_whole.secondary_nodes] == 0).all()
    limited = UnionDrafter(heads, SuffixDrafter(), limit_secondary=True)
    assert torch.equal(limited.node_levels[limited.secondary_nodes][1:], limited.secondary.tree.depth[1:])
    assert UnionDrafter(lookup, treespec.LookupDrafter(None, 2)).limits_depth is False


# ----- through the decoder -----


def heads_and_suffix(model, seed: int = 0, **union) -> UnionDrafter:
    heads = random_heads(model, seed=seed, sequential=bool(seed % 2))
    drafter = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
    return UnionDrafter(drafter, SuffixDrafter(max_nodes=12, max_depth=5), **union)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_output_equals_hf_alone_and_in_a_batch(arch):
    model = tiny_model(arch, dtype=torch.float32)
    prompts = repeating_prompts(hash(arch) % 1000, 3) + [[5] * 9]
    expected = [hf_greedy(model, p, 40) for p in prompts]
    drafter = heads_and_suffix(model, seed=1)
    for prompt, want in zip(prompts, expected, strict=True):
        assert treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[]).token_ids == want
    results = treespec.generate(
        model, prompts, drafter, max_new_tokens=40, eos_token_id=[], options=SPECULATE
    )
    assert [r.token_ids for r in results] == expected
    stats = drafter.report().stats
    assert stats["union"]["secondary"] > 0 and stats["union"]["primary"] > 0  # both drafted
    assert stats["suffix"]["global"] > 0  # the suffix cache of earlier answers was read


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_under_a_dynamic_tree_and_with_a_lookup_chain_it_stays_exact(arch, steady_clock):
    model = tiny_model(arch, dtype=torch.float32)
    prompts = [[5] * 9, *repeating_prompts(hash(arch) % 997, 2), [5] * 9]
    dynamic = treespec.DynamicTreeDrafter(heads_and_suffix(model, seed=2), cost)
    lookup = treespec.LookupDrafter(heads_and_suffix(model, seed=3), 4)  # the chain beside the union
    heads = treespec.make_drafter(random_heads(model, seed=4), treespec.default_tree(8, 4), model)
    # heads + lookup chain, then the suffix tree (a chain the suffix tree repeats merges into it), the
    # suffix tree's levels limited with the heads'
    union = UnionDrafter(treespec.LookupDrafter(heads, 4), SuffixDrafter(), limit_secondary=True)
    inside = treespec.DynamicTreeDrafter(union, cost)
    steps = []
    for prompt in prompts:
        want = hf_greedy(model, prompt, 40)
        for drafter in (dynamic, lookup, inside):
            result = treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[])
            assert result.token_ids == want, type(drafter).__name__
            steps.append(result.stats.steps)
    assert steps[-3] < 25  # the dynamic union on the repeated request: the suffix tree's deep paths pay
    results = treespec.generate(
        model, prompts[1:], lookup, max_new_tokens=40, eos_token_id=[], options=SPECULATE
    )
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 40) for p in prompts[1:]]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_three_sources_by_nesting_unions_stay_exact_under_a_dynamic_tree(arch):
    """bench's dynamic_all: (heads + suffix) + recycling, the recycling table learning from every step;
    the nested union alone in a batch."""
    model = tiny_model(arch, dtype=torch.float32)
    prompts = [*repeating_prompts(hash(arch) % 991, 3), [7] * 5]
    vocab = model.get_output_embeddings().weight.shape[0]
    union = UnionDrafter(heads_and_suffix(model, seed=5), treespec.RecyclingDrafter(vocab))
    drafter = treespec.DynamicTreeDrafter(union, cost)
    expected = [hf_greedy(model, p, 40) for p in prompts]
    for prompt, want in zip(prompts, expected, strict=True):
        assert treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[]).token_ids == want
    assert drafter.report().stats["union"]["secondary"] > 0  # the recycling tree was drafted
    seen = drafter.calibration.group_proposed.sum(dim=1)  # [groups]
    assert seen.numel() > SOURCES * SOURCES  # nested groups: 3 (3 g + s) + s'
    results = treespec.generate(  # the union itself decodes a batch (the dynamic tree takes one row)
        model, prompts, union, max_new_tokens=40, eos_token_id=[], options=SPECULATE
    )
    assert [r.token_ids for r in results] == expected


def test_the_dynamic_tree_calibrates_each_source_on_its_own():
    model = tiny_model("qwen2", dtype=torch.float32)
    union = heads_and_suffix(model, seed=0)
    drafter = treespec.DynamicTreeDrafter(union, cost)
    prompt = [3, 8] * 6  # the model falls into a loop the suffix tree copies
    result = treespec.generate(model, prompt, drafter, max_new_tokens=60, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 60)
    seen = drafter.calibration.group_proposed.sum(dim=1)  # [groups] nodes verified per group
    accepted = drafter.calibration.group_accepted.sum(dim=1)
    suffix_only = [SOURCES * d + 1 for d in range(1, 6)]
    heads_only = [SOURCES * d for d in range(1, 5)]
    assert seen[heads_only].sum() > 0 and seen[suffix_only].sum() > 0
    # the random heads are rarely right, the suffix tree on a loop often: their records differ
    suffix_rate = accepted[suffix_only].sum() / seen[suffix_only].sum()
    assert suffix_rate > 0.5 > accepted[heads_only].sum() / seen[heads_only].sum()


def test_sampling_keeps_the_base_models_distribution():
    """temperature 1: each row's 2nd token follows the base model's exact marginal (heads and suffix
    trees over a 10-token vocabulary, merged where they agree)."""
    model = tiny_model("llama", dtype=torch.float32, vocab_size=10, initializer_range=0.5)
    rng = random.Random(0)
    cache = SuffixCache()
    for _ in range(40):
        cache.add([rng.randrange(10) for _ in range(12)])
    heads = treespec.make_drafter(random_heads(model, seed=1), treespec.default_tree(8, 4), model)
    prompts = [[1, 4, 2], [7, 7, 3, 0]]
    exact = second_token_marginals(model, prompts)  # [V] per prompt
    counts = [Counter(), Counter()]
    copies = 32
    for seed in range(50):
        suffix = SuffixDrafter(cache, min_prob=0.05, spec_factor=4.0, remember=False)
        drafter = UnionDrafter(heads, suffix)
        results = treespec.generate(
            model,
            [prompts[i % 2] for i in range(2 * copies)],
            drafter,
            max_new_tokens=2,
            sampling=treespec.SamplingConfig(temperature=1.0, seed=seed),
            eos_token_id=[],
            options=SPECULATE,
        )
        for i, result in enumerate(results):
            counts[i % 2][result.token_ids[1]] += 1
    stats = drafter.report().stats["union"]
    assert stats["both"] > 0 and stats["secondary"] > 0  # merged nodes and suffix nodes of its own
    for count, p in zip(counts, exact, strict=True):
        assert sum(count.values()) == 1600
        assert total_variation(count, p) < 0.06  # noise at n=1600 over 10 tokens is ~0.025


# ----- wrappers over a tree of each step -----


def test_wrappers_take_an_inner_tree_of_each_step(steady_clock):
    """DynamicTreeDrafter and LookupDrafter over SuffixDrafter's own trees (no fixed_tree): exact, and
    the dynamic tree keeps the deep suffix paths on a repeated request."""
    model = tiny_model("llama", dtype=torch.float32)
    dynamic = treespec.DynamicTreeDrafter(SuffixDrafter(), cost)
    lookup = treespec.LookupDrafter(SuffixDrafter(), 4)
    for prompt in [[5] * 9, *repeating_prompts(3, 2), [5] * 9]:
        want = hf_greedy(model, prompt, 40)
        for drafter in (dynamic, lookup):
            assert (
                treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[]).token_ids
                == want
            )
    last = treespec.generate(model, [5] * 9, dynamic, max_new_tokens=40, eos_token_id=[])
    assert last.stats.steps < 25
    lookup.start(SequenceStart([5, 6, 7, 5, 6], 64, None, "sdpa"))
    proposal = lookup.propose(torch.zeros(1, 4), torch.tensor([6]))
    tree, levels, groups = step_layout(lookup, proposal)
    rank = max(p[0] for p in tree.choices)  # the chain's: after the suffix tree's first-level ranks
    chain = [i for i, p in enumerate(tree.choices, start=1) if p[0] == rank]
    assert proposal.tree is tree and proposal.tokens[0, chain].tolist()[:3] == [7, 5, 6]
    assert levels[0, chain].tolist() == groups[0, chain].tolist() == [0] * 4


def test_the_union_reports_both_drafters_memory_and_the_step_counts_the_suffix_cache():
    """Memory of a kind both sides hold adds up (the recycling table beside another "allocated" cache),
    and a decode's speculative memory counts the suffix drafter's cache of earlier answers."""
    model = tiny_model("llama", dtype=torch.float32)
    vocab = model.get_output_embeddings().weight.shape[0]
    recycling = [treespec.RecyclingDrafter(vocab) for _ in range(2)]
    table = recycling[0].report().cache_memory["allocated"]
    assert table > 0
    both = UnionDrafter(*recycling).report().cache_memory
    assert both["allocated"] == 2 * table
    cache = SuffixCache.from_sequences([[5, 6, 7, 8] * 10])
    union = UnionDrafter(SuffixDrafter(cache), treespec.RecyclingDrafter(vocab))
    assert union.report().cache_memory == {"suffix_cache": cache.memory_bytes(), "allocated": table}
    result = treespec.generate(model, [5, 6, 7], union, max_new_tokens=8, eos_token_id=[])
    stats = result.stats
    expected = stats.cache_memory["speculative"] + table + stats.draft_cache_memory["suffix_cache"]
    assert stats.speculative_memory == expected
    assert stats.draft_cache_memory["suffix_cache"] >= cache.memory_bytes() > 0
