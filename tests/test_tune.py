"""Tuning gamma: the acceptance statistics, the expectation, and the choice on synthetic cost models
whose optimum is known in closed form."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from treespec.training.calibrate import choose_budget
from treespec.training.objective import best_rate, tokens_per_second
from treespec.training.tune import (
    TuneResult,
    choose_gamma,
    conditional_acceptance,
    expected_tokens,
    reference_speedup,
    tune_drafter,
)


def test_conditional_acceptance_counts_steps_that_got_that_far():
    # 4 steps accepted 0, 1, 3 and 3 drafts of 3
    assert conditional_acceptance([0, 1, 3, 3], 3) == [3 / 4, 2 / 3, 2 / 2]
    assert conditional_acceptance([0, 0], 2) == [0.0, 0.0]


def test_expected_tokens_is_the_geometric_sum_for_a_constant_rate():
    for p in (0.0, 0.3, 0.8, 1.0):
        for gamma in range(1, 9):
            closed = gamma + 1 if p == 1 else (1 - p ** (gamma + 1)) / (1 - p)
            assert expected_tokens([p] * 9, gamma) == pytest.approx(closed)


@pytest.mark.parametrize(
    "p, draft, verify0, verify1",
    [(0.8, 0.10, 1.0, 0.05), (0.5, 0.30, 1.0, 0.02), (0.95, 0.02, 1.0, 0.01), (0.2, 0.5, 1.0, 0.1)],
)
def test_choose_gamma_finds_the_known_optimum(p, draft, verify0, verify1):
    """Cost draft*gamma + verify0 + verify1*(gamma+1), constant acceptance p: brute force in closed form."""
    costs = {g: draft * g + verify0 + verify1 * (g + 1) for g in range(1, 13)}

    def rate(g):
        return (1 - p ** (g + 1)) / (1 - p) / costs[g]

    want = max(costs, key=rate)
    result = choose_gamma([p] * 12, costs, plain_step_seconds=verify0 + verify1)
    assert result.gamma == want
    assert result.best.tokens_per_second == pytest.approx(rate(want))
    assert result.best.predicted_speedup == pytest.approx(rate(want) * (verify0 + verify1))


def test_choose_gamma_follows_a_drop_in_acceptance():
    """Free drafting but nothing accepted after position 3: more than 3 only costs verification."""
    costs = {g: 1.0 + 0.01 * g for g in range(1, 9)}
    result = choose_gamma([0.9, 0.9, 0.9, 0, 0, 0, 0, 0], costs, 1.0)
    assert result.gamma == 3


def test_one_objective_for_gamma_and_tree_budget():
    """Tuning and calibration rank options by the same expected tokens per second (ties: smallest)."""
    assert best_rate({1: 2.0, 2: 3.0, 3: 3.0}, {1: 1.0, 2: 1.0, 3: 1.0}) == (2, {1: 2.0, 2: 3.0, 3: 3.0})
    assert tokens_per_second(3.0, 1.5) == 2.0
    with pytest.raises(ValueError, match="positive"):
        tokens_per_second(1.0, 0.0)
    with pytest.raises(ValueError, match="step costs"):
        best_rate({1: 1.0}, {2: 1.0})
    # a chain is a one-node-per-depth tree: both choices give the same rates for the same numbers
    acceptance = [0.9, 0.6, 0.3]
    costs = {1: 1.0, 2: 1.3, 3: 1.8}
    chain = choose_gamma(acceptance, costs, 1.0)
    # one rank per head: a tree of n nodes is the root and a chain of n - 1 drafts
    best, report = choose_budget([[a] for a in acceptance], {g + 1: t for g, t in costs.items()})
    assert best == chain.gamma + 1
    for row in chain.table:
        assert report[row.gamma + 1]["tokens_per_s"] == pytest.approx(row.tokens_per_second)


def test_reference_formula():
    assert reference_speedup(4, 1.0, 4.0) == pytest.approx(1 / (0.25 + 0.25))
    assert math.isclose(reference_speedup(1, 0.0, 1.0), 1.0)


def test_tune_drafter_measures_chooses_and_checks(tmp_path):
    """A fake generation whose steps cost 1 + 0.2*gamma and accept min(gamma, 2): gamma 2 is best."""

    def run(drafter, ids, max_new_tokens):
        gamma = 0 if drafter is None else drafter
        accepted = min(gamma, 2)
        steps = math.ceil(max_new_tokens / (accepted + 1))
        step = 1.0 + 0.2 * gamma
        stats = SimpleNamespace(
            accept_lengths=[accepted + 1] * steps,
            time_draft=0.2 * gamma * steps,
            time_verify=1.0 * steps,
            time_commit=0.0,
            steps=steps,
            new_tokens=max_new_tokens,
            time_total=step * steps,
        )
        return SimpleNamespace(stats=stats)

    result = tune_drafter(lambda g: g, run, [[1, 2, 3]] * 3, max_gamma=5, max_new_tokens=30)
    assert result.acceptance == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert result.gamma == 2
    assert result.best.predicted_speedup == pytest.approx(3 / 1.4)
    assert result.measured_speedup == pytest.approx((30 / (10 * 1.4)) / (30 / 30))
    result.save(tmp_path)
    loaded = TuneResult.load(tmp_path)
    assert loaded.gamma == 2 and loaded.table[1].gamma == 2
    assert "chosen" in loaded.format()
    (tmp_path / "tune.json").write_text("{")
    with pytest.raises(ValueError, match="treespec tune"):
        TuneResult.load(tmp_path)


def test_tune_drafter_prices_verification_with_the_cost_curve():
    """Timed verification is flat (1.0 s) but the machine's curve says each node costs 1.0 s more: with
    the curve, gamma 1 wins where the timed costs would pick 2."""

    class Chain:
        def __init__(self, gamma):
            self.tree = SimpleNamespace(num_nodes=gamma + 1)
            self.gamma = gamma

        def scorer(self):
            return None

    def run(drafter, ids, max_new_tokens):
        gamma = 0 if drafter is None else drafter.gamma
        accepted = min(gamma, 2)
        steps = math.ceil(max_new_tokens / (accepted + 1))
        stats = SimpleNamespace(
            accept_lengths=[accepted + 1] * steps,
            time_draft=0.01 * gamma * steps,
            time_verify=1.0 * steps,
            time_commit=0.0,
            steps=steps,
            new_tokens=max_new_tokens,
            time_total=(1.0 + 0.01 * gamma) * steps,
        )
        return SimpleNamespace(stats=stats)

    timed = tune_drafter(Chain, run, [[1, 2, 3]] * 2, max_gamma=3, max_new_tokens=30)
    assert timed.gamma == 2
    seen = []

    def curve(nodes, prefix):
        seen.append((nodes, prefix))
        return 1.0 + 1.0 * (nodes - 1)

    priced = tune_drafter(Chain, run, [[1, 2, 3]] * 2, max_gamma=3, max_new_tokens=30, verify_seconds=curve)
    assert priced.gamma == 1  # by the curve: 2 tokens per 2.01 s beats 3 per 3.02 s
    assert (3, 3 + 15) in seen  # gamma 2: 3 nodes at the prompt + half the new tokens
