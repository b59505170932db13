"""Hardware-aware choice of gamma (tokens drafted per step) for a chain drafter, from measurements.

Model of one step with gamma drafted tokens:

    E(gamma)    = 1 + sum_{i=1..gamma} prod_{j<=i} a_j        tokens committed per step (bonus included),
                                                               a_j = P(draft j accepted | drafts < j were)
    T(gamma)    = draft(gamma) + verify(gamma) + commit        seconds per step, measured on this machine
    speedup     = (E(gamma) / T(gamma)) / (1 / T_plain)        against one-token-at-a-time decoding

`choose_gamma` maximises E/T (`training.objective`, the objective tree calibration uses too). The
reference text's formula, Speedup = 1 / (1/gamma + C_verification / C_autoregressive) with
C_verification = T(gamma) and C_autoregressive = gamma * T_plain, is printed beside it: it assumes
every drafted token is accepted, so it is an upper bound, not a forecast.
`tune_drafter` measures everything (acceptance from one generation pass at the largest gamma, step
costs from short runs at every gamma) and then checks the prediction with a real run at the choice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..io import atomic_write_json
from .objective import best_rate, expected_tokens

TUNE_NAME = "tune.json"


def default_gamma(folder: str | os.PathLike, gamma: int | None = None) -> int:
    """`gamma` when given, else the choice in <folder>/tune.json, else 4."""
    if gamma is not None:
        return gamma
    return TuneResult.load(folder).gamma if (Path(folder) / TUNE_NAME).is_file() else 4


def conditional_acceptance(accepted_drafts: Sequence[int], gamma: int) -> list[float]:
    """a_j for j = 1..gamma from the number of drafts each step accepted (each in [0, gamma]).

    a_j = #steps with >= j accepted / #steps with >= j - 1 accepted (0 when no step got that far)."""
    reached = [sum(1 for a in accepted_drafts if a >= j) for j in range(gamma + 1)]  # reached[0] = steps
    return [reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, gamma + 1)]


def reference_speedup(gamma: int, c_verification: float, c_autoregressive: float) -> float:
    """The reference text's formula: 1 / (1/gamma + C_verification / C_autoregressive)."""
    return 1.0 / (1.0 / gamma + c_verification / c_autoregressive)


@dataclass
class GammaRow:
    gamma: int
    expected_tokens: float
    step_seconds: float
    tokens_per_second: float
    predicted_speedup: float
    reference_speedup: float


@dataclass
class TuneResult:
    """The choice, the table it came from, and (after a check run) the measured speedup."""

    gamma: int
    plain_step_seconds: float
    acceptance: list[float]
    table: list[GammaRow]
    measured_speedup: float | None = None
    measured: dict = field(default_factory=dict)

    @property
    def best(self) -> GammaRow:
        return next(r for r in self.table if r.gamma == self.gamma)

    def save(self, folder: str | os.PathLike) -> Path:
        """Write <folder>/tune.json (atomically) beside the drafter's config."""
        return atomic_write_json(Path(folder) / TUNE_NAME, asdict(self), indent=2)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> TuneResult:
        path = Path(folder) / TUNE_NAME
        try:
            data = json.loads(path.read_text())
            data["table"] = [GammaRow(**row) for row in data["table"]]
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError) as error:
            raise ValueError(
                f"{path} is not a treespec tune file ({error}): run `treespec tune` again"
            ) from error

    def format(self) -> str:
        lines = [
            f"plain decoding: {1e3 * self.plain_step_seconds:.1f} ms per token",
            "acceptance a_j: " + " ".join(f"{a:.2f}" for a in self.acceptance),
            "gamma  E[tokens/step]  ms/step  tokens/s  predicted speedup  reference formula",
        ]
        for r in self.table:
            mark = "  <- chosen" if r.gamma == self.gamma else ""
            lines.append(
                f"{r.gamma:5d}  {r.expected_tokens:14.2f}  {1e3 * r.step_seconds:7.1f}"
                f"  {r.tokens_per_second:8.1f}  {r.predicted_speedup:16.2f}x"
                f"  {r.reference_speedup:16.2f}x{mark}"
            )
        if self.measured_speedup is not None:
            lines.append(
                f"measured at gamma={self.gamma}: {self.measured_speedup:.2f}x "
                f"(predicted {self.best.predicted_speedup:.2f}x)"
            )
        return "\n".join(lines)


def choose_gamma(
    acceptance: Sequence[float], step_seconds: dict[int, float], plain_step_seconds: float
) -> TuneResult:
    """The gamma among `step_seconds`' keys with the most expected tokens per second.

    acceptance: a_1..a_max (conditional, see `conditional_acceptance`); step_seconds[gamma]: measured
    seconds of one speculative step (draft + verify + commit); plain_step_seconds: one plain token."""
    if not step_seconds:
        raise ValueError("choose_gamma needs the step cost of at least one gamma")
    if max(step_seconds) > len(acceptance):
        raise ValueError(
            f"acceptance covers {len(acceptance)} positions but gamma goes to {max(step_seconds)}"
        )
    expected = {gamma: expected_tokens(acceptance, gamma) for gamma in step_seconds}
    best, rates = best_rate(expected, step_seconds)
    table = [
        GammaRow(
            gamma=gamma,
            expected_tokens=expected[gamma],
            step_seconds=step_seconds[gamma],
            tokens_per_second=rate,
            predicted_speedup=expected[gamma] * plain_step_seconds / step_seconds[gamma],
            reference_speedup=reference_speedup(gamma, step_seconds[gamma], gamma * plain_step_seconds),
        )
        for gamma, rate in rates.items()
    ]
    return TuneResult(best, plain_step_seconds, list(acceptance), table)


def tune_drafter(
    make_drafter: Callable[[int], object],
    run: Callable[[object | None, list[int], int], object],
    prompts: list[list[int]],
    max_gamma: int = 8,
    max_new_tokens: int = 64,
    cost_prompts: int = 2,
    progress: Callable[[str], None] | None = None,
    verify_seconds: Callable[[int, int], float] | None = None,
) -> TuneResult:
    """Measure, choose, check.

    make_drafter(gamma) -> a chain drafter; run(drafter or None, prompt ids, max_new_tokens) -> a
    GenerationResult (None: plain decoding). Acceptance comes from all `prompts` at max_gamma; the step
    cost of every gamma from `cost_prompts` of them; then the chosen gamma and plain decoding run on all
    prompts and their tokens/s ratio is the measured speedup.
    verify_seconds(nodes, prefix): this machine's verification cost curve (`training.costs.
    verify_cost_model`); when given, a step costs its timed drafting and commit plus the curve's
    verification of gamma + 1 nodes at the run's mean prefix, instead of the timed verification.
    """
    say = progress or (lambda _: None)
    say(f"acceptance: {len(prompts)} prompts at gamma={max_gamma}")
    accepted: list[int] = []
    for ids in prompts:
        result = run(make_drafter(max_gamma), ids, max_new_tokens)
        accepted += [n - 1 for n in result.stats.accept_lengths]
    acceptance = conditional_acceptance(accepted, max_gamma)

    def step_cost(drafter) -> float:
        seconds = steps = 0
        for ids in prompts[:cost_prompts]:
            stats = run(drafter, ids, max_new_tokens).stats
            # a drafter with its own scorer (partial-layer verification) is not priced by the full curve
            if verify_seconds is None or (drafter is not None and drafter.scorer() is not None):
                seconds += stats.time_draft + stats.time_verify + stats.time_commit
            else:
                nodes = drafter.tree.num_nodes if drafter is not None else 1
                prefix = len(ids) + max_new_tokens // 2
                seconds += stats.time_draft + stats.time_commit + stats.steps * verify_seconds(nodes, prefix)
            steps += stats.steps
        return seconds / max(steps, 1)

    say("step costs: plain decoding")
    run(None, prompts[0], 8)  # warm-up
    plain = step_cost(None)
    costs = {}
    for gamma in range(1, max_gamma + 1):
        say(f"step costs: gamma={gamma}")
        costs[gamma] = step_cost(make_drafter(gamma))
    result = choose_gamma(acceptance, costs, plain)

    say(f"check: gamma={result.gamma} against plain decoding on {len(prompts)} prompts")
    fast_tokens = fast_time = plain_tokens = plain_time = 0.0
    for ids in prompts:
        plain_stats = run(None, ids, max_new_tokens).stats
        fast_stats = run(make_drafter(result.gamma), ids, max_new_tokens).stats
        plain_tokens += plain_stats.new_tokens
        plain_time += plain_stats.time_total
        fast_tokens += fast_stats.new_tokens
        fast_time += fast_stats.time_total
    result.measured = {
        "plain_tokens_per_second": plain_tokens / plain_time,
        "tokens_per_second": fast_tokens / fast_time,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
    }
    result.measured_speedup = (fast_tokens / fast_time) / (plain_tokens / plain_time)
    return result
