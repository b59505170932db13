"""Trees that change from step to step: the decoder verifies whatever tree a proposal carries (any node
count up to the drafter's declared tree), greedy output stays the base model's; the pricing a planner cuts
them with (`core.pricing`, `TreePlanner`'s cut and level counts)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ARCHS, hf_greedy, random_heads, tiny_model

import treespec
from treespec.core.drafting import BaseDrafter, Proposal
from treespec.core.planner import TreePlanner, best_prefix
from treespec.core.pricing import AcceptanceCalibration, DraftCosts, StepCosts


class RandomSubtrees(BaseDrafter):
    """Drafts the inner drafter's tree, then keeps a random prefix of its nodes (canonical order keeps
    parents first, so a prefix is a tree): 1 node up to all of them, changing every step."""

    def __init__(self, inner, seed: int):
        self.inner, self.tree = inner, inner.tree
        self.gen = torch.Generator().manual_seed(seed)
        self.sizes = []

    def propose(self, hidden, roots, max_depth=None):
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
        result = treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[])
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

        def propose(self, hidden, roots, max_depth=None):
            full = inner.propose(hidden, roots)
            return Proposal(full.tokens, full.probs, tree=inner.tree)

    with pytest.raises(ValueError, match="declared at most 2 nodes"):
        treespec.generate(model, [1, 2, 3], TooBig(), max_new_tokens=4, eos_token_id=[])


# ----- pricing -----


def _connected_subsets(parents: list[int]):
    """Every node set containing the root and closed under parents (brute force, small trees)."""
    n = len(parents)
    for mask in range(1 << (n - 1)):
        kept = {0} | {i + 1 for i in range(n - 1) if mask >> i & 1}
        if all(parents[i] in kept for i in kept if i):
            yield sorted(kept)


@pytest.mark.parametrize("seed", range(5))
def test_the_best_prefix_by_value_is_the_best_connected_set(seed):
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

    # by value, ties in node order: a parent (value >= its child's, index smaller) comes first
    order = sorted(range(1, tree.num_nodes), key=lambda i: (-float(values[i]), i))
    k = best_prefix([float(values[i]) for i in order], 1.0, cost, tree.num_nodes - 1)
    kept = [0, *order[:k]]
    best = max(_connected_subsets(parents), key=lambda s: sum(float(values[i]) for i in s) / cost(len(s)))
    best_rate = sum(float(values[i]) for i in best) / cost(len(best))
    assert sum(float(values[i]) for i in kept) / cost(len(kept)) == pytest.approx(best_rate)
    assert all(parents[i] in kept for i in kept if i)


def test_calibration_learns_the_observed_acceptance():
    cal = AcceptanceCalibration(bins=4, prior_weight=2.0)
    probs = torch.full((400,), 0.9)
    cal.update(probs, torch.arange(400) % 10 == 0)  # a confident drafter right only 10% of the time
    assert float(cal.predict(torch.tensor([0.9]))) == pytest.approx((40 + 2 * 0.5 * 0.875) / 402)
    assert float(cal.predict(torch.tensor([0.1]))) == pytest.approx(0.5 * 0.125)  # untouched bin: its prior


def test_calibration_per_group_starts_from_the_pooled_table_and_learns_its_own():
    cal = AcceptanceCalibration(bins=4, prior_weight=2.0, groups=3, group_weight=4.0)
    probs = torch.full((200,), 0.6)
    groups = torch.tensor([1] * 100 + [2] * 100)
    hits = torch.cat([torch.ones(100, dtype=torch.bool), torch.zeros(100, dtype=torch.bool)])
    cal.update(probs, hits, groups)  # level 1 always right, level 2 never, at the same probability
    pooled = (100 + 2 * 0.5 * 0.625) / 202
    assert float(cal.predict(torch.tensor([0.6]))) == pytest.approx(pooled)
    by_group = cal.predict(torch.tensor([0.6, 0.6, 0.6]), [0, 1, 2]).tolist()
    assert by_group[0] == pytest.approx(pooled)  # no observations of its own: the pooled estimate
    assert by_group[1] == pytest.approx((100 + 4 * pooled) / 104)
    assert by_group[2] == pytest.approx((0 + 4 * pooled) / 104)
    assert float(cal.predict(torch.tensor([0.6]), [7])) == pytest.approx(by_group[2])  # the last group


def test_calibration_equals_a_tensor_reference_on_random_observations():
    gen = torch.Generator().manual_seed(0)
    bins, groups, weight = 10, 5, 4.0
    cal = AcceptanceCalibration(bins=bins, prior_weight=3.0, prior_scale=0.5, groups=2, group_weight=weight)
    cal.reserve(groups)
    edges = torch.linspace(0, 1, bins + 1)[1:-1].double()  # the reference: counts as float64 tensors
    proposed = torch.full((bins,), 3.0, dtype=torch.float64)
    accepted = 3.0 * 0.5 * ((torch.arange(bins, dtype=torch.float64) + 0.5) / bins)
    g_proposed = torch.zeros(groups, bins, dtype=torch.float64)
    g_accepted = torch.zeros(groups, bins, dtype=torch.float64)
    for _ in range(20):
        probs = torch.rand(30, generator=gen)  # float32, as the planner's
        probs[:3] = torch.tensor([0.0, 1.0, 0.5])  # the ends and an inner edge
        hits = torch.rand(30, generator=gen) < probs
        g = torch.randint(0, groups + 2, (30,), generator=gen)  # past the last group: the last one
        b, gc = torch.bucketize(probs.double().clamp(0, 1), edges), g.clamp(0, groups - 1)
        pooled = accepted[b] / proposed[b]
        expected = (g_accepted[gc, b] + weight * pooled) / (g_proposed[gc, b] + weight)
        assert cal.predict_list(probs.tolist(), g.tolist()) == expected.tolist()
        assert torch.equal(cal.predict(probs, g), expected) and torch.equal(cal.predict(probs), pooled)
        cal.update_list(probs.tolist(), hits.tolist(), g.tolist())
        proposed.index_add_(0, b, torch.ones(30, dtype=torch.float64))
        accepted.index_add_(0, b, hits.double())
        g_proposed.index_put_((gc, b), torch.ones(30, dtype=torch.float64), accumulate=True)
        g_accepted.index_put_((gc, b), hits.double(), accumulate=True)
        assert torch.equal(cal.proposed, proposed) and torch.equal(cal.accepted, accepted)
        assert torch.equal(cal.group_proposed, g_proposed) and torch.equal(cal.group_accepted, g_accepted)


@pytest.mark.parametrize("sequential", [False, True])
def test_a_priced_planner_is_exact_and_shrinks_when_nodes_cost_too_much(sequential):
    model = tiny_model("llama")
    heads = random_heads(model, seed=3, sequential=sequential)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    expected = hf_greedy(model, prompt, 40)
    sizes = {}
    for per_node in (0.0, 10.0):  # free nodes: big trees; nodes costing 10 root steps: the root alone
        inner = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
        sources = [inner, treespec.PromptLookup(3)]
        drafter = TreePlanner(sources, lambda n, prefix, c=per_node: 1.0 + c * (n - 1))
        result = treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[])
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
        model, [1, 2, 3], drafter, tokenizer=tokenizer, max_new_tokens=12, eos_token_id=[], trace=True
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
    """Sequential heads, independent heads and the EAGLE drafter with max_depth=D: the nodes down to depth
    D are the full proposal's; deeper ones keep the root's token with probability 0."""
    from conftest import random_eagle

    model = tiny_model("llama", dtype=torch.float32)
    tree = treespec.default_tree(16, 4)
    hidden, roots = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(0)), None
    roots = torch.tensor([3, 9])
    sequential = treespec.make_drafter(random_heads(model, seed=4, sequential=True), tree, model)
    independent = treespec.make_drafter(random_heads(model, seed=4), tree, model)
    assert sequential.limits_depth and independent.limits_depth
    for drafter in (sequential, independent):
        full = drafter.propose(hidden, roots)
        for depth in (0, 1, 2):
            part = drafter.propose(hidden, roots, max_depth=depth)
            shallow = tree.depth <= depth
            assert torch.equal(part.tokens[:, shallow], full.tokens[:, shallow])
            torch.testing.assert_close(part.probs[:, shallow], full.probs[:, shallow])
            assert (part.probs[:, ~shallow] == 0).all() and (part.tokens[:, ~shallow] == roots[:, None]).all()

    eagle_tree = treespec.Tree.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    eagle = treespec.EagleDrafter(random_eagle(model, seed=1, draft_size=40), eagle_tree, model)
    prompt = [4, 8, 15, 16, 23]
    features = torch.randn(1, len(prompt) - 1, 3 * model.config.hidden_size)
    eagle.start(treespec.core.drafting.SequenceStart(prompt, 32, None, "sdpa", features))
    whole = eagle.propose(hidden[:1], roots[:1])
    part = eagle.propose(hidden[:1], roots[:1], max_depth=1)
    shallow = eagle_tree.depth <= 1
    assert torch.equal(part.tokens[:, shallow], whole.tokens[:, shallow])
    assert (part.probs[:, ~shallow] == 0).all()


def test_draft_costs_measure_each_level_count_and_draw_a_line_through_them():
    costs = DraftCosts(smoothing=0.5)
    assert costs(3) == 0.0  # nothing measured yet
    costs.record(4, 800.0)  # the first draft of a level count pays one-time costs: not learned
    assert costs(4) == 0.0
    costs.record(4, 8.0)
    assert costs(4) == 8.0 and costs(2) == 4.0 and costs(0) == 0.0  # one count: proportional
    costs.record(2, 500.0)
    costs.record(2, 5.0)
    assert costs(3) == pytest.approx(6.5) and costs(0) == pytest.approx(2.0)  # the line through both
    costs.record(2, 7.0)
    assert costs(2) == 6.0  # a running mean of the measurements


def test_a_pause_inside_a_draft_is_not_learned_as_its_price():
    """Pauses only add time: a draft far above the mean counts as twice the mean, one below it moves the
    mean halfway (a level count priced out by one pause would not be drafted, so not priced, again)."""
    costs = DraftCosts()  # smoothing 0.2
    costs.record(1, 99.0)  # warm-up: not learned
    costs.record(1, 1.0)
    costs.record(1, 100.0)  # a pause: as 2.0
    assert costs(1) == pytest.approx(1.2)
    costs.record(1, 1.0)
    assert costs(1) == pytest.approx(1.1)
    for _ in range(12):  # a real slowdown (3x) is learned within a dozen drafts
        costs.record(1, 3.0)
    assert costs(1) > 2.5


@pytest.mark.parametrize("seed", range(4))
def test_level_rates_price_every_level_count_against_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    # the inner tree to depth 3 plus a 2-node chain (level 0: drafted whatever the level count)
    tree = treespec.Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2], [2, 0]])
    parents = tree.parents.tolist()
    levels = [0] + [0 if path[0] == 2 else len(path) for path in tree.choices]
    values = [1.0] * tree.num_nodes
    for i in range(1, tree.num_nodes):
        values[i] = values[parents[i]] * float(torch.rand(1, generator=gen))
    per_node, per_level = float(torch.rand(1, generator=gen)) * 0.2, float(torch.rand(1, generator=gen))
    verify = [0.0] + [1.0 + per_node * (n - 1) for n in range(1, tree.num_nodes + 1)]

    def draft(d):
        return 0.1 + per_level * d

    planner = TreePlanner([treespec.PromptLookup(2)], lambda n, prefix: 1.0)
    planner.draft_costs = draft
    paths = {i: tree.choices[i - 1] for i in range(1, tree.num_nodes)}
    order = sorted(paths.values(), key=lambda p: (-values[tree.choices.index(p) + 1], len(p), p))
    by_path = {p: values[i] for i, p in paths.items()}
    level_of = {p: levels[i] for i, p in paths.items()}
    rates = planner.level_rates(order, by_path, level_of, 3, verify, 1)
    assert len(rates) == 4
    for d, rate in enumerate(rates):
        best = max(
            sum(values[i] for i in s) / (draft(d) + verify[len(s)])
            for s in _connected_subsets(parents)
            if all(levels[i] <= d for i in s)
        )
        assert rate == pytest.approx(best)


def test_a_planner_drafts_the_level_count_that_pays_and_tries_every_level_now_and_then():
    model = tiny_model("llama")
    heads = random_heads(model, seed=3, sequential=True)
    inner = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
    drafter = TreePlanner([inner], lambda n, prefix: 1.0 + 0.01 * (n - 1), explore_after=4)
    assert inner.tree.max_depth == 3 and drafter.max_levels == 3
    assert drafter.levels == 3  # nothing seen yet: every level
    drafter.choose_levels([1.0, 2.0, 1.5, 1.2], drafted=3)
    assert drafter.levels == 1
    for _ in range(3):  # the deepest drafted is the best, but 2 levels were priced lately: stay
        drafter.choose_levels([1.0, 3.0], drafted=1)
        assert drafter.levels == 1
    drafter.choose_levels([1.0, 3.0], drafted=1)  # explore_after steps since: every level again
    assert drafter.levels == 3
    stale = dict(drafter.level_gains)
    drafter.choose_levels([1.0, 3.0, 1.0, 1.0], drafted=3)  # levels 2-3 do not pay: back to 1
    assert drafter.levels == 1
    # a gain priced long ago moves halfway to the new price, not a fifth of the way
    assert drafter.level_gains[2] == pytest.approx(stale[2] + 0.5 * (math.log(1 / 3) - stale[2]))
    for _ in range(10):  # the second level pays lately, the third was last priced long ago: try it
        drafter.choose_levels([1.0, 1.0, 9.0], drafted=2)
    assert drafter.level_gains[2] > 0 and drafter.levels == 3
    # through the decoder: exact, and levels are skipped when nodes cost much
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    costly = TreePlanner([inner], lambda n, prefix: 1.0 + 0.5 * (n - 1))
    result = treespec.generate(model, prompt, costly, max_new_tokens=40, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 40)
    counts = costly.counts
    assert counts["levels"] < 3 * (counts["steps"] - counts["skipped"])


def test_explorations_that_find_no_level_worth_drafting_come_less_often():
    model = tiny_model("llama")
    heads = random_heads(model, seed=3, sequential=True)
    inner = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
    planner = TreePlanner([inner], lambda n, prefix: 1.0, explore_after=4, max_explore_after=16)
    nothing_pays = [1.0, 0.5, 0.4, 0.3]  # rates had 0, 1, 2, 3 levels been drafted
    planner.choose_levels(nothing_pays, drafted=3)
    assert planner.levels == 0
    gaps = []
    for _ in range(4):
        steps = 0
        while planner.levels == 0:  # steps without heads until every level is drafted again
            planner.choose_levels([1.0], drafted=0)
            steps += 1
        gaps.append(steps)
        planner.choose_levels(nothing_pays, drafted=3)
        assert planner.levels == 0
    assert gaps == [4, 8, 16, 16]  # the wait doubles, up to max_explore_after
    while planner.levels == 0:
        planner.choose_levels([1.0], drafted=0)
    planner.choose_levels([1.0, 4.0, 4.4, 4.5], drafted=3)  # now the first level pays
    assert planner.levels >= 1 and planner.explore_interval == 4  # back to every explore_after steps


def test_step_trees_are_kept_for_a_bounded_number_of_node_sets():
    from treespec.core.drafting import StepTrees

    trees = StepTrees(limit=2)
    first = trees([(0,), (1,)])
    assert trees([(1,), (0,)]) is first  # built once per set of paths
    for paths in [[], [(0,)], [(0,), (1,)]]:  # a long run does not keep every set it ever drafted
        tree = trees(paths)
        assert tree.num_nodes == len(paths) + 1 and len(trees.trees) <= 2
    assert tree is not first and tree.choices == first.choices  # dropped, then built again the same


def test_the_step_time_beyond_the_cost_curve_is_learned_and_the_curve_made_monotone():
    model = tiny_model("llama")
    heads = random_heads(model, seed=3, sequential=True)
    inner = treespec.make_drafter(heads, treespec.default_tree(8, heads.num_heads), model)
    noisy = {1: 3.0, 2: 2.0, 3: 2.5, 4: 4.0, 5: 3.5}  # ms by node count, above 5: 1 ms more per node

    def curve(n, prefix):
        return 1e-6 * noisy.get(n, n - 1.0)  # far below what a step really takes

    drafter = TreePlanner([inner], curve)
    table = drafter.verify_table(1)
    assert [round(t * 1e6, 6) for t in table[1:6]] == [2.0, 2.0, 2.5, 3.5, 3.5]  # never falls with n
    assert all(a <= b for a, b in zip(table[1:], table[2:], strict=False))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    result = treespec.generate(model, prompt, drafter, max_new_tokens=20, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 20)
    # the steps took far longer than the curve says: the rest (sampling, commit, Python) is learned
    assert drafter.step_costs.line[0] > 10 * table[-1]  # (a step of this tiny model: ~0.7 ms)
    drafter.start(treespec.core.drafting.SequenceStart(prompt, 64, None, "sdpa", None))
    assert drafter.step_started is None  # the time between sequences is not a step


def test_a_step_far_slower_than_its_price_is_not_learned_unless_slow_steps_go_on():
    """A compiled step of a new shape (or a first use) took seconds: learning it as the price of its
    nodes would price every tree out for a long run (the heads + lookup collapse of Dec 4)."""

    model = tiny_model("llama")
    heads = random_heads(model, seed=3, sequential=True)
    inner = treespec.make_drafter(heads, treespec.default_tree(8, heads.num_heads), model)
    drafter = TreePlanner([inner], lambda n, prefix: 0.01 * n, slow_step=4.0, max_slow_steps=8)
    drafter.predicted_seconds, drafter.predicted_extra = 0.01, 0.0
    drafter.learn_step(0.012)
    assert drafter.step_costs.steps == 1 and drafter.step_costs.line[0] == pytest.approx(0.002)
    drafter.learn_step(0.03)  # slower, but within 4x its price: learned
    drafter.learn_step(5.0)  # one-time cost: left out
    assert drafter.step_costs.steps == 2 and drafter.counts["slow_steps"] == 1
    for _ in range(7):
        drafter.learn_step(1.0)
    assert drafter.step_costs.steps == 2 and drafter.counts["slow_steps"] == 8
    drafter.learn_step(1.0)  # slow steps go on: the machine is slower now, and that is learned
    assert drafter.step_costs.steps == 3 and drafter.counts["slow_steps"] == 8
    drafter.learn_step(1.0)
    assert drafter.step_costs.steps == 4


def test_step_costs_learn_the_rest_of_the_step_and_correct_the_curves_extra_cost():
    curve = [0.0, 10.0, 14.0, 18.0, 22.0]  # extra cost 4 s per node; the truth: 2 s per node
    costs = StepCosts(prior_weight=4.0)
    assert costs.prices(curve) == curve  # nothing observed: the curve
    gen = torch.Generator().manual_seed(0)
    for step in range(400):  # every step also takes 3 s beyond verification, +-1 s of noise
        n = 1 + step % 4
        noise = float(torch.rand(1, generator=gen)) * 2 - 1
        costs.record(curve[n] - curve[1], 10.0 + 2.0 * (n - 1) + 3.0 + noise - curve[n])
    rest, slope = costs.line
    assert rest == pytest.approx(3.0, abs=0.3) and slope == pytest.approx(-0.5, abs=0.1)
    assert costs.prices(curve) == pytest.approx([0.0, 13.0, 15.0, 17.0, 19.0], abs=0.5)
    # optimism has faded after 300 tree steps; with none observed it takes half the extra cost off
    assert costs.prices(curve, optimistic=True) == pytest.approx(costs.prices(curve), abs=0.1)
    assert StepCosts(explore=0.5).prices(curve, optimistic=True) == [0.0, 10.0, 12.0, 14.0, 16.0]
    # a curve far off (extra cost 100x too high) is corrected at most to a tenth of what it says
    wild = StepCosts()
    for _ in range(100):
        wild.record(0.0, 1.0)
        wild.record(400.0, 1.0 - 396.0)
    assert wild.line[1] == pytest.approx(-0.9)


@pytest.mark.parametrize("explore", [0.5, 0.0])
def test_a_tree_the_curve_overprices_is_tried_and_then_kept(explore):
    """The curve says the 3-node tree costs 2x a plain step, just above break-even for its 1.8
    expected tokens; it really costs 1.2x. Priced a little optimistically, it is tried, its real price
    learned, and it is kept; without optimism the pricer never learns it and stays on plain steps."""
    values = [0.5, 0.3]  # a chain: E[accepted] = 1.8 with both nodes
    curve, truth = [0.0, 10.0, 19.0, 20.0], [0.0, 10.0, 11.0, 12.0]
    costs, sizes = StepCosts(explore=explore), []
    for _ in range(60):
        hopeful = costs.prices(curve, optimistic=True)
        n = 1 + best_prefix(values, 1.0, lambda n, table=hopeful: table[n], 2)
        costs.record(curve[n] - curve[1], truth[n] - curve[n])
        sizes.append(n)
    if explore:
        assert sizes[-40:] == [3] * 40
    else:
        assert set(sizes) == {1}


def test_a_reused_planner_keeps_what_it_learned_and_stays_exact():
    model = tiny_model("llama")
    heads = random_heads(model, seed=4, sequential=True)
    inner = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
    drafter = TreePlanner([inner], lambda n, prefix: 1e-4 * (1.0 + 0.01 * (n - 1)))  # nodes ~free
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 9, 3, 9, 3, 9]]
    first = treespec.generate(model, prompts[0], drafter, max_new_tokens=30, eos_token_id=[])
    assert first.token_ids == hf_greedy(model, prompts[0], 30)
    proposed = drafter.calibration.proposed.clone()
    gains, costs = dict(drafter.level_gains), dict(drafter.draft_costs.measured)
    assert gains and costs and all(t > 0 for t in costs.values())
    drafter.start(treespec.core.drafting.SequenceStart(prompts[1], 64, None, "sdpa", None))
    # a new sequence: its own counts and prefix, the learned calibration, cost and depths unchanged
    assert drafter.counts["steps"] == 0 and drafter.prefixes == [len(prompts[1])]
    assert torch.equal(drafter.calibration.proposed, proposed)
    assert drafter.level_gains == gains and drafter.draft_costs.measured == costs
    second = treespec.generate(model, prompts[1], drafter, max_new_tokens=30, eos_token_id=[])
    assert second.token_ids == hf_greedy(model, prompts[1], 30)
    assert drafter.calibration.proposed.sum() > proposed.sum()  # and it goes on learning
