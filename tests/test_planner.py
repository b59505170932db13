"""TreePlanner: the sources' trees merged by token path, joined over a batch's rows and (priced) cut to what
pays; exact through the decoder (greedy == HF alone and in a batch, unpriced and priced, with a lookup
chain, three sources; lossless sampling), each source calibrated on its own record."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    ARCHS,
    hf_greedy,
    random_heads,
    repeating_prompts,
    second_token_counts,
    second_token_marginals,
    tiny_model,
    total_variation,
)

import treespec
from treespec import PromptLookup, Proposal, SuffixCache, SuffixDrafter, Tree, TreePlanner
from treespec.core.drafting import BaseDrafter

SPECULATE = treespec.DecodeOptions(plain_above=None)  # batches speculate in every step


def cost(nodes: int, prefix: int) -> float:
    """A verification cost curve for a priced planner: cheap nodes, so trees pay."""
    return 1e-3 * (1 + 0.05 * nodes)


class Scripted(BaseDrafter):
    """Proposes given trees: per row a dict choice path -> (token, prob); `per_step`: the tree of the
    paths (Proposal.tree), else laid onto `tree` (missing nodes: the root's token, probability 0)."""

    batched = True
    limits_depth = True

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


def merged_nodes(proposal: Proposal, row: int = 0) -> dict[tuple[int, ...], float]:
    """Token path -> probability of one row's drafted nodes (probability > 0)."""
    tree, out = proposal.tree, {}
    for i in range(1, tree.num_nodes):
        if proposal.probs[row, i] > 0:
            path = tuple(int(proposal.tokens[row, j]) for j in tree.path_to(i)[1:])
            out[path] = round(float(proposal.probs[row, i]), 6)
    return out


# ----- the merged tree -----


def test_identical_paths_merge_into_one_node_tagged_with_its_sources():
    primary = Scripted(
        Tree.from_choices([[0], [1], [0, 0], [1, 0]]),
        [{(0,): (10, 0.5), (1,): (11, 0.25), (0, 0): (12, 0.5), (1, 0): (99, 0.0)}],  # (1, 0): not drafted
    )
    secondary = Scripted(
        Tree.from_choices([[0], [0, 0], [0, 1], [0, 0, 0]]),
        [{(0,): (10, 0.5), (0, 0): (12, 1.0), (0, 1): (13, 0.75), (0, 0, 0): (14, 0.5)}],
        per_step=True,
    )
    planner = TreePlanner([primary, secondary])
    assert planner.tree.num_nodes == 5 + 5 - 1 and planner.tree.max_depth == 3  # both declared trees
    assert planner.max_levels == 2  # the first source's levels; the second drafts whole
    proposal = planner.propose(torch.zeros(1, 4), torch.tensor([7]))
    assert proposal.tree.num_nodes == 6  # root, 10, 11, 10-12, 10-13, 10-12-14: each path once
    assert proposal.tokens.shape == proposal.probs.shape == (1, 6)
    assert merged_nodes(proposal) == {
        (10,): 0.75,  # 1 - (1 - 0.5)(1 - 0.5)
        (11,): 0.25,  # the primary's alone
        (10, 12): 1.0,
        (10, 13): 0.75,  # the secondary's alone
        (10, 12, 14): 0.5,
    }
    # the primary's children come first (its order), then the secondary's new ones
    assert list(proposal.tree.choices) == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    # calibration groups: (sources bitmask, level); a node the second source drafted whole is level 0
    assert set(planner.group_ids) == {(3, 0), (1, 1), (2, 0)}
    counts = planner.report().stats["planner"]
    assert counts["steps"] == 1 and counts["nodes"] == 6
    assert counts["proposed"] == [3, 4] and counts["shared"] == 2
    with pytest.raises(ValueError, match="max_nodes"):
        TreePlanner([primary, secondary], max_nodes=99)


def test_a_batch_joins_the_rows_trees_and_rows_fill_what_they_lack_with_their_root():
    tree = Tree.from_choices([[0], [0, 0]])
    primary = Scripted(tree, [{(0,): (10, 0.5), (0, 0): (11, 0.5)}, {(0,): (20, 0.5), (0, 0): (21, 0.5)}])
    # row 0: the secondary repeats the primary's chain and goes one deeper; row 1: a branch of its own
    secondary = Scripted(
        Tree.from_choices([[0], [0, 0], [0, 0, 0]]),
        [{(0,): (10, 0.5), (0, 0): (11, 0.5), (0, 0, 0): (12, 0.5)}, {(0,): (30, 0.9)}],
    )
    proposal = TreePlanner([primary, secondary]).propose(torch.zeros(2, 4), torch.tensor([7, 8]))
    assert proposal.tree.choices == ((0,), (1,), (0, 0), (0, 0, 0))
    assert merged_nodes(proposal, 0) == {(10,): 0.75, (10, 11): 0.75, (10, 11, 12): 0.5}
    assert set(merged_nodes(proposal, 1)) == {(20,), (30,), (20, 21)}
    index = {p: i for i, p in enumerate(proposal.tree.choices, start=1)}
    assert int(proposal.tokens[0, index[(1,)]]) == 7 and float(proposal.probs[0, index[(1,)]]) == 0.0
    assert int(proposal.tokens[1, index[(0, 0, 0)]]) == 8
    # at most 3 nodes: the paths worth most summed over the rows ((0,): 0.75 + 0.5, (1,): 0.9)
    capped = TreePlanner([primary, secondary], max_nodes=3)
    assert capped.propose(torch.zeros(2, 4), torch.tensor([7, 8])).tree.choices == ((0,), (1,))


def test_a_priced_planner_verifies_the_root_alone_when_nodes_cost_too_much_and_then_skips_drafting():
    chain = Scripted(Tree.from_choices([[0], [0, 0]]), [{(0,): (10, 0.9), (0, 0): (11, 0.9)}])
    cheap = TreePlanner([chain], lambda n, prefix: 1.0 + 0.01 * n)
    assert cheap.propose(torch.zeros(1, 4), torch.tensor([7])).tree.num_nodes == 3
    costly = TreePlanner([chain], lambda n, prefix: 1.0 * n, patience=2)
    for _ in range(2):
        proposal = costly.propose(torch.zeros(1, 4), torch.tensor([7]))
        assert proposal.tree.num_nodes == 1 and proposal.expected_accept == 1.0
    assert costly.skip_left == 1  # two root-only steps in a row: the next one does not draft
    costly.propose(torch.zeros(1, 4), torch.tensor([7]))
    assert costly.counts["skipped"] == 1


def test_a_first_source_given_no_level_to_draft_is_not_called():
    class Counted(Scripted):
        calls = 0

        def propose(self, hidden, roots, max_depth=None) -> Proposal:
            Counted.calls += 1
            return super().propose(hidden, roots, max_depth)

    heads = Counted(Tree.from_choices([[0], [0, 0]]), [{(0,): (10, 0.9), (0, 0): (11, 0.9)}] * 2)
    lookup = Scripted(Tree.from_choices([[0]]), [{(0,): (20, 0.5)}, {(0,): (30, 0.5)}])
    planner = TreePlanner([heads, lookup], lambda n, prefix: 1.0 + 0.01 * n)
    planner.levels = 0  # the level count the pricer would choose after levels that did not pay
    proposal = planner.propose(torch.zeros(2, 4), torch.tensor([7, 8]))
    assert Counted.calls == 0  # the heads are not asked for a tree of the root alone
    assert merged_nodes(proposal, 0) == {(20,): 0.5} and merged_nodes(proposal, 1) == {(30,): 0.5}
    planner.levels = 2
    planner.propose(torch.zeros(2, 4), torch.tensor([7, 8]))
    assert Counted.calls == 1


def test_every_source_whose_levels_are_network_passes_drafts_the_step_level_count():
    """Two such sources (EAGLE and heads in the `all` recipe): both draft the step's level count, and
    neither is called at level 0; a later source that is not one drafts its whole tree."""

    class Leveled(Scripted):
        costly_levels = True

        def __init__(self, tree, script):
            super().__init__(tree, script)
            self.depths = []

        def propose(self, hidden, roots, max_depth=None) -> Proposal:
            self.depths.append(max_depth)
            return super().propose(hidden, roots, max_depth)

    chain = Tree.from_choices([[0], [0, 0], [0, 0, 0]])
    first = Leveled(chain, [{(0,): (10, 0.9), (0, 0): (11, 0.9), (0, 0, 0): (12, 0.9)}])
    second = Leveled(chain, [{(0,): (20, 0.9), (0, 0): (21, 0.9), (0, 0, 0): (22, 0.9)}])
    lookup = Scripted(Tree.from_choices([[0], [0, 0]]), [{(0,): (30, 0.5), (0, 0): (31, 0.5)}])
    planner = TreePlanner([first, second, lookup], lambda n, prefix: 1.0 + 0.01 * n)
    assert planner.leveled == [True, True, False] and planner.max_levels == 3
    planner.levels = 0
    proposal = planner.propose(torch.zeros(1, 4), torch.tensor([7]))
    assert first.depths == second.depths == []  # neither asked for a tree of the root alone
    assert set(merged_nodes(proposal, 0)) == {(30,), (30, 31)}  # the lookup chain drafted whole
    planner.levels = 2
    planner.propose(torch.zeros(1, 4), torch.tensor([7]))
    assert first.depths == second.depths == [2]


def test_the_declared_tree_places_every_source_side_by_side():
    model = tiny_model("llama", dtype=torch.float32)
    heads = treespec.make_drafter(random_heads(model), treespec.default_tree(8, 4), model)
    planner = TreePlanner([heads, PromptLookup(3)])
    assert planner.tree.num_nodes == 8 + 4 - 1 and planner.max_levels == heads.tree.max_depth
    assert planner.batched and not planner.prices_steps
    # leveled: the first source, and later ones whose levels are network passes (heads, EAGLE)
    assert TreePlanner([PromptLookup(3), heads]).max_levels == heads.tree.max_depth
    suffix = SuffixDrafter(max_nodes=4, max_depth=3)
    assert TreePlanner([PromptLookup(3), suffix]).max_levels == 0  # a later cheap source drafted whole
    assert TreePlanner([suffix, PromptLookup(3)]).max_levels == 3
    assert TreePlanner([heads], cost).prices_steps  # a priced planner chooses a batch's plain steps


# ----- through the decoder -----


def heads_and_suffix(model, seed: int = 0, verify_seconds=None, lookup: int = 0) -> TreePlanner:
    heads = random_heads(model, seed=seed, sequential=bool(seed % 2))
    drafter = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
    sources = [drafter, SuffixDrafter(max_nodes=12, max_depth=5)] + ([PromptLookup(lookup)] if lookup else [])
    return TreePlanner(sources, verify_seconds)


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
    assert all(stats["planner"]["proposed"])  # both drafted
    assert stats["suffix"]["global"] > 0  # the suffix cache of earlier answers was read


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_priced_and_with_a_lookup_chain_it_stays_exact_alone_and_in_batches(arch, steady_clock):
    model = tiny_model(arch, dtype=torch.float32)
    prompts = [[5] * 9, *repeating_prompts(hash(arch) % 997, 2), [5] * 9]
    priced = heads_and_suffix(model, seed=2, verify_seconds=cost)
    lookup = heads_and_suffix(model, seed=3, lookup=4)  # the chain beside heads and suffix tree
    priced_lookup = heads_and_suffix(model, seed=4, verify_seconds=cost, lookup=4)
    steps = []
    for prompt in prompts:
        want = hf_greedy(model, prompt, 40)
        for drafter in (priced, lookup, priced_lookup):
            result = treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[])
            assert result.token_ids == want
            steps.append(result.stats.steps)
    assert steps[-3] < 25  # priced, on the repeated request: the suffix tree's deep paths pay
    expected = [hf_greedy(model, p, 40) for p in prompts[1:]]
    for drafter in (lookup, priced, priced_lookup):  # a batch shares one tree per step
        results = treespec.generate(model, prompts[1:], drafter, max_new_tokens=40, eos_token_id=[])
        assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_three_sources_priced_stay_exact_for_batches_of_1_to_8(arch, rows):
    """dynamic+all: heads + suffix + recycling, the recycling table learning from every step."""
    model = tiny_model(arch, dtype=torch.float32)
    pool = [*repeating_prompts(hash(arch) % 991, 5), [7] * 5, [3, 1, 4, 1, 5], [9, 2, 6]]
    prompts = pool[:rows]
    vocab = model.get_output_embeddings().weight.shape[0]
    heads = random_heads(model, seed=5, sequential=True)
    drafter = TreePlanner(
        [
            treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model),
            SuffixDrafter(max_nodes=12, max_depth=5),
            treespec.RecyclingDrafter(vocab),
        ],
        cost,
    )
    results = treespec.generate(model, prompts, drafter, max_new_tokens=32, eos_token_id=[])
    results = results if isinstance(results, list) else [results]
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 32) for p in prompts]
    assert drafter.report().stats["planner"]["proposed"][2] > 0  # the recycling tree was drafted
    assert drafter.calibration.group_proposed.sum() > 0


def test_each_source_is_calibrated_on_its_own_record():
    model = tiny_model("qwen2", dtype=torch.float32)
    drafter = heads_and_suffix(model, seed=0, verify_seconds=cost)
    prompt = [3, 8] * 6  # the model falls into a loop the suffix tree copies
    result = treespec.generate(model, prompt, drafter, max_new_tokens=60, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 60)
    seen = drafter.calibration.group_proposed.sum(dim=1)  # [groups] nodes verified per group
    accepted = drafter.calibration.group_accepted.sum(dim=1)
    heads_only = [g for (mask, _), g in drafter.group_ids.items() if mask == 1]
    suffix_only = [g for (mask, _), g in drafter.group_ids.items() if mask == 2]
    assert seen[heads_only].sum() > 0 and seen[suffix_only].sum() > 0
    # the random heads are rarely right, the suffix tree on a loop often: their records differ
    suffix_rate = accepted[suffix_only].sum() / seen[suffix_only].sum()
    assert suffix_rate > 0.5 > accepted[heads_only].sum() / seen[heads_only].sum()


@pytest.mark.parametrize("priced", [False, True])
def test_sampling_keeps_the_base_models_distribution(priced, steady_clock):
    """temperature 1: each row's 2nd token follows the base model's exact marginal (heads and suffix
    trees over a 10-token vocabulary, merged where they agree; priced: one cut tree for the batch)."""
    model = tiny_model("llama", dtype=torch.float32, vocab_size=10, initializer_range=0.5)
    rng = random.Random(0)
    cache = SuffixCache()
    for _ in range(40):
        cache.add([rng.randrange(10) for _ in range(12)])
    heads = treespec.make_drafter(random_heads(model, seed=1), treespec.default_tree(8, 4), model)
    prompts = [[1, 4, 2], [7, 7, 3, 0]]
    exact = second_token_marginals(model, prompts)  # [V] per prompt
    drafters = []

    def new_planner(seed):
        suffix = SuffixDrafter(cache, min_prob=0.05, spec_factor=4.0, remember=False)
        drafters.append(TreePlanner([heads, suffix], cost if priced else None))
        return drafters[-1]

    counts = second_token_counts(model, prompts, new_planner, seeds=50, copies=32, options=SPECULATE)
    assert sum(d.report().stats["planner"]["shared"] for d in drafters) > 0  # merged nodes
    for count, p in zip(counts, exact, strict=True):
        assert sum(count.values()) == 1600
        assert total_variation(count, p) < 0.06  # noise at n=1600 over 10 tokens is ~0.025


def test_suffix_trees_alone_priced_keep_deep_paths_on_a_repeated_request(steady_clock):
    model = tiny_model("llama", dtype=torch.float32)
    priced = TreePlanner([SuffixDrafter()], cost)
    for prompt in [[5] * 9, *repeating_prompts(3, 2), [5] * 9]:
        result = treespec.generate(model, prompt, priced, max_new_tokens=40, eos_token_id=[])
        assert result.token_ids == hf_greedy(model, prompt, 40)
    assert result.stats.steps < 25


def test_the_planner_reports_every_sources_memory_and_the_step_counts_the_suffix_cache():
    """Memory of a kind several sources hold adds up (two recycling tables), and a decode's speculative
    memory counts the suffix drafter's cache of earlier answers."""
    model = tiny_model("llama", dtype=torch.float32)
    vocab = model.get_output_embeddings().weight.shape[0]
    recycling = [treespec.RecyclingDrafter(vocab) for _ in range(2)]
    table = recycling[0].report().cache_memory["allocated"]
    assert table > 0
    assert TreePlanner(recycling).report().cache_memory["allocated"] == 2 * table
    cache = SuffixCache.from_sequences([[5, 6, 7, 8] * 10])
    planner = TreePlanner([SuffixDrafter(cache), treespec.RecyclingDrafter(vocab)])
    assert planner.report().cache_memory == {"suffix_cache": cache.memory_bytes(), "allocated": table}
    result = treespec.generate(model, [5, 6, 7], planner, max_new_tokens=8, eos_token_id=[])
    stats = result.stats
    expected = stats.cache_memory["speculative"] + table + stats.draft_cache_memory["suffix_cache"]
    assert stats.speculative_memory == expected
    assert stats.draft_cache_memory["suffix_cache"] >= cache.memory_bytes() > 0
