"""Trees that change from step to step: the decoder verifies whatever tree a proposal carries (any node
count up to the drafter's declared tree), greedy output stays the base model's."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, hf_greedy, random_heads, tiny_model

import treespec
from treespec.drafters.base import BaseDrafter, Proposal


class RandomSubtrees(BaseDrafter):
    """Drafts the inner drafter's tree, then keeps a random prefix of its nodes (canonical order keeps
    parents first, so a prefix is a tree): 1 node up to all of them, changing every step."""

    def __init__(self, inner, seed: int):
        self.inner, self.tree = inner, inner.tree
        self.gen = torch.Generator().manual_seed(seed)
        self.sizes = []

    def propose(self, hidden, roots):
        full = self.inner.propose(hidden, roots)
        k = int(torch.randint(1, self.tree.num_nodes + 1, (1,), generator=self.gen))
        self.sizes.append(k)
        tree = treespec.Tree.from_choices(self.tree.choices[: k - 1])
        return Proposal(full.tokens[:, :k], full.probs[:, :k], tree=tree, expected_accept=1.0 + 0.1 * k)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_output_equals_the_base_models_with_a_new_tree_every_step(arch):
    model = tiny_model(arch)
    for seed in range(2):
        heads = random_heads(model, seed=seed, sequential=bool(seed))
        inner = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
        drafter = RandomSubtrees(inner, seed)
        prompt = torch.randint(96, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        result = treespec.generate(model, None, prompt, drafter=drafter, max_new_tokens=40, eos_token_id=[])
        assert result.token_ids == hf_greedy(model, prompt, 40)
        assert len(set(drafter.sizes)) > 3  # the node count really changed
        assert result.stats.nodes_verified == drafter.sizes[: result.stats.steps]
        predicted = [1.0 + 0.1 * k for k in drafter.sizes[: result.stats.steps]]
        assert result.stats.mean_predicted_accept_length == pytest.approx(sum(predicted) / len(predicted))


def test_a_tree_larger_than_declared_is_refused():
    model = tiny_model("llama")
    heads = random_heads(model)
    inner = treespec.make_drafter(heads, treespec.default_tree(8, heads.num_heads), model)

    class TooBig(BaseDrafter):
        tree = treespec.Tree.from_choices([[0]])

        def propose(self, hidden, roots):
            full = inner.propose(hidden, roots)
            return Proposal(full.tokens, full.probs, tree=inner.tree)

    with pytest.raises(ValueError, match="declared at most 2 nodes"):
        treespec.generate(model, None, [1, 2, 3], drafter=TooBig(), max_new_tokens=4, eos_token_id=[])


# ----- DynamicTreeDrafter -----


def _connected_subsets(parents: list[int]):
    """Every node set containing the root and closed under parents (brute force, small trees)."""
    n = len(parents)
    for mask in range(1 << (n - 1)):
        kept = {0} | {i + 1 for i in range(n - 1) if mask >> i & 1}
        if all(parents[i] in kept for i in kept if i):
            yield sorted(kept)


@pytest.mark.parametrize("seed", range(5))
def test_choose_nodes_finds_the_best_connected_set(seed):
    from treespec.drafters.dynamic import choose_nodes

    gen = torch.Generator().manual_seed(seed)
    tree = treespec.Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
    parents = tree.parents.tolist()
    accept = torch.rand(tree.num_nodes, generator=gen, dtype=torch.float64)
    values = torch.ones(tree.num_nodes, dtype=torch.float64)
    for i in range(1, tree.num_nodes):
        values[i] = values[parents[i]] * accept[i]
    per_node = float(torch.rand(1, generator=gen)) * 0.3

    def cost(n):
        return 1.0 + per_node * (n - 1)

    kept, expected = choose_nodes(values, tree.parents, cost)
    best = max(_connected_subsets(parents), key=lambda s: sum(float(values[i]) for i in s) / cost(len(s)))
    best_rate = sum(float(values[i]) for i in best) / cost(len(best))
    assert expected / cost(len(kept)) == pytest.approx(best_rate)
    assert expected == pytest.approx(sum(float(values[i]) for i in kept))
    assert all(parents[i] in kept for i in kept if i)


def test_calibration_learns_the_observed_acceptance():
    from treespec.drafters.dynamic import AcceptanceCalibration

    cal = AcceptanceCalibration(bins=4, prior_weight=2.0)
    probs = torch.full((400,), 0.9)
    cal.update(probs, torch.arange(400) % 10 == 0)  # a confident drafter right only 10% of the time
    assert float(cal.predict(torch.tensor([0.9]))) == pytest.approx((40 + 2 * 0.5 * 0.875) / 402)
    assert float(cal.predict(torch.tensor([0.1]))) == pytest.approx(0.5 * 0.125)  # untouched bin: its prior


@pytest.mark.parametrize("sequential", [False, True])
def test_dynamic_drafter_is_exact_and_shrinks_when_nodes_cost_too_much(sequential):
    from treespec.drafters.dynamic import DynamicTreeDrafter

    model = tiny_model("llama")
    heads = random_heads(model, seed=3, sequential=sequential)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    expected = hf_greedy(model, prompt, 40)
    sizes = {}
    for per_node in (0.0, 10.0):  # free nodes: big trees; nodes costing 10 root steps: the root alone
        inner = treespec.LookupDrafter(
            treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model), length=3
        )
        drafter = DynamicTreeDrafter(inner, lambda n, prefix, c=per_node: 1.0 + c * (n - 1))
        result = treespec.generate(model, None, prompt, drafter=drafter, max_new_tokens=40, eos_token_id=[])
        assert result.token_ids == expected
        sizes[per_node] = result.stats.mean_nodes_verified
        assert all(p is not None for p in result.stats.predicted_accept)
    assert sizes[0.0] > 4 and sizes[10.0] == 1.0


def test_trace_and_page_show_each_steps_tree_and_prediction(tmp_path):
    """A trace of dynamic trees keeps every step's own tree and prediction through save / load, and the
    HTML page shows nodes verified and predicted against accepted length."""
    from transformers import AutoTokenizer

    from treespec.tools import viz
    from treespec.tools.models import default_model_folder
    from treespec.tools.trace import Trace

    tokenizer = AutoTokenizer.from_pretrained(default_model_folder())
    from conftest import tiny_llama_over

    model = tiny_llama_over(tokenizer)
    heads = random_heads(model, seed=1)
    inner = treespec.make_drafter(heads, treespec.default_tree(8, heads.num_heads), model)
    drafter = RandomSubtrees(inner, 2)
    result = treespec.generate(
        model,
        None,
        [1, 2, 3],
        tokenizer=tokenizer,
        drafter=drafter,
        max_new_tokens=12,
        eos_token_id=[],
        trace=True,
    )
    trace = Trace.from_result(result, tokenizer)
    trace.save(tmp_path / "t.json")
    loaded = Trace.load(tmp_path / "t.json")
    for k, step in enumerate(loaded.steps):
        assert loaded.step_tree(k).num_nodes == len(step.token_ids) == drafter.sizes[k]
        assert step.expected_accept == pytest.approx(1.0 + 0.1 * drafter.sizes[k])
    data = viz.html_data(loaded)
    assert [s["nodes_verified"] for s in data["steps"]] == drafter.sizes[: len(loaded.steps)]
    viz.write_html(loaded, tmp_path / "t.html")
    assert "predicted" in (tmp_path / "t.html").read_text()


def test_level_by_level_drafters_stop_at_max_depth():
    """Sequential heads and the EAGLE drafter with max_depth=D: the nodes down to depth D are the full
    proposal's; deeper ones keep the root's token with probability 0. Independent heads draft everything."""
    from conftest import random_eagle

    model = tiny_model("llama", dtype=torch.float32)
    tree = treespec.default_tree(16, 4)
    hidden, roots = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(0)), None
    roots = torch.tensor([3, 9])
    sequential = treespec.make_drafter(random_heads(model, seed=4, sequential=True), tree, model)
    independent = treespec.make_drafter(random_heads(model, seed=4), tree, model)
    assert sequential.limits_depth and independent.limits_depth
    full = sequential.propose(hidden, roots)
    for depth in (0, 1, 2):
        part = sequential.propose(hidden, roots, max_depth=depth)
        shallow = tree.depth <= depth
        assert torch.equal(part.tokens[:, shallow], full.tokens[:, shallow])
        torch.testing.assert_close(part.probs[:, shallow], full.probs[:, shallow])
        assert (part.probs[:, ~shallow] == 0).all() and (part.tokens[:, ~shallow] == roots[:, None]).all()
    assert torch.equal(
        independent.propose(hidden, roots, max_depth=1).tokens, independent.propose(hidden, roots).tokens
    )

    eagle_tree = treespec.Tree.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    eagle = treespec.EagleDrafter(random_eagle(model, seed=1, draft_size=40), eagle_tree, model)
    prompt = [4, 8, 15, 16, 23]
    features = torch.randn(1, len(prompt) - 1, 3 * model.config.hidden_size)
    eagle.start(treespec.drafters.base.SequenceStart(prompt, 32, None, "sdpa", features))
    whole = eagle.propose(hidden[:1], roots[:1])
    part = eagle.propose(hidden[:1], roots[:1], max_depth=1)
    shallow = eagle_tree.depth <= 1
    assert torch.equal(part.tokens[:, shallow], whole.tokens[:, shallow])
    assert (part.probs[:, ~shallow] == 0).all()


def test_dynamic_drafter_drafts_as_deep_as_the_deepest_kept_tree():
    from treespec.drafters.dynamic import DynamicTreeDrafter

    model = tiny_model("llama")
    heads = random_heads(model, seed=3, sequential=True)
    inner = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
    drafter = DynamicTreeDrafter(inner, lambda n, prefix: 1.0 + 0.01 * (n - 1), depth_window=4)
    assert inner.tree.max_depth == 3
    assert drafter.inner_limits_depth and drafter.draft_depth() == 3  # nothing seen yet: every level
    drafter.kept_depths = [1, 0, 0]
    assert drafter.draft_depth() == 3  # fewer steps than the window
    drafter.kept_depths = [1, 0, 0, 1]
    assert drafter.draft_depth() == 1
    drafter.reached_limit = True  # the last step kept a node at the deepest level drafted: one further
    assert drafter.draft_depth() == 2
    drafter.reached_limit = False
    drafter.kept_depths = [0, 0, 0, 0]
    assert drafter.draft_depth() == 1  # at least one level (root-only streaks pause drafting instead)
    drafter.kept_depths = [2, 0, 0, 0]
    assert drafter.draft_depth() == 2
    drafter.kept_depths, drafter.reached_limit = [3, 0, 0, 3], True
    assert drafter.draft_depth() == 3  # never deeper than the tree
    # through the decoder: exact, and levels are skipped once the kept trees stay shallow
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    costly = DynamicTreeDrafter(inner, lambda n, prefix: 1.0 + 0.5 * (n - 1), depth_window=4)
    result = treespec.generate(model, None, prompt, drafter=costly, max_new_tokens=40, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 40)
    counts = costly.counts
    assert counts["levels"] < 3 * (counts["steps"] - counts["skipped"])
    # a pruned tree is built once per kept set; its node j is the inner tree's node order[j]
    tree, order = costly.pruned_tree((0, 1, 3))
    assert costly.pruned_tree((0, 1, 3))[0] is tree
    assert tree.choices == (inner.tree.choices[0], inner.tree.choices[2]) and order == [0, 1, 3]


def test_a_reused_dynamic_drafter_keeps_what_it_learned_and_stays_exact():
    from treespec.drafters.dynamic import DynamicTreeDrafter

    model = tiny_model("llama")
    heads = random_heads(model, seed=4, sequential=True)
    inner = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
    drafter = DynamicTreeDrafter(inner, lambda n, prefix: 1.0 + 0.01 * (n - 1), depth_window=4)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 9, 3, 9, 3, 9]]
    first = treespec.generate(model, None, prompts[0], drafter=drafter, max_new_tokens=30, eos_token_id=[])
    assert first.token_ids == hf_greedy(model, prompts[0], 30)
    proposed = drafter.calibration.proposed.clone()
    depths, seconds = list(drafter.kept_depths), drafter.draft_seconds
    assert len(depths) == 4 and seconds > 0
    drafter.start(treespec.drafters.base.SequenceStart(prompts[1], 64, None, "sdpa", None))
    # a new sequence: its own counts and prefix, the learned calibration, cost and depths unchanged
    assert drafter.counts["steps"] == 0 and drafter.prefix == len(prompts[1])
    assert torch.equal(drafter.calibration.proposed, proposed)
    assert drafter.kept_depths == depths and drafter.draft_seconds == seconds
    second = treespec.generate(model, None, prompts[1], drafter=drafter, max_new_tokens=30, eos_token_id=[])
    assert second.token_ids == hf_greedy(model, prompts[1], 30)
    assert drafter.calibration.proposed.sum() > proposed.sum()  # and it goes on learning
