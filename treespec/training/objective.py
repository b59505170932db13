"""The one objective that tuning and calibration maximise: expected tokens committed per second.

    rate(option) = E[tokens committed per step](option) / seconds per step(option)

E counts the token the base model adds itself (bonus or root), so plain decoding has E = 1. For a chain
of gamma drafts with conditional acceptances a_j it is `expected_tokens`; for a tree it is
`Tree.expected_accept_length` (the chain is the tree with one node per depth). `tune.choose_gamma`
picks gamma with it, `calibrate.choose_budget` the tree's node budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def expected_tokens(acceptance: Sequence[float], gamma: int) -> float:
    """E(gamma) = 1 + sum_{i<=gamma} prod_{j<=i} a_j: tokens one chain step commits, the bonus included."""
    total, run = 1.0, 1.0
    for a in acceptance[:gamma]:
        run *= a
        total += run
    return total


def tokens_per_second(expected: float, step_seconds: float) -> float:
    """Expected tokens committed per step over the seconds one step costs."""
    if not step_seconds > 0:
        raise ValueError(f"a step must cost a positive time, got {step_seconds!r} s")
    return expected / step_seconds


def best_rate(
    expected: Mapping[int, float], step_seconds: Mapping[int, float]
) -> tuple[int, dict[int, float]]:
    """The option (e.g. gamma or node budget) with the most expected tokens per second, ties to the
    smallest, and every option's rate (ascending options). Both mappings have the same keys."""
    if not step_seconds:
        raise ValueError("no option to choose from: step_seconds is empty")
    if set(expected) != set(step_seconds):
        raise ValueError(f"expected tokens for {sorted(expected)} but step costs for {sorted(step_seconds)}")
    rates = {k: tokens_per_second(expected[k], step_seconds[k]) for k in sorted(step_seconds)}
    return max(rates, key=rates.__getitem__), rates
