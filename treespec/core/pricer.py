"""StepPricer: plain or speculative steps for a batch, from their measured cost at each live-row count.

A speculative step verifies A x N rows where a plain step verifies A: once the live rows fill the
machine's matrix units, more rows per step cost nearly their full price and speculation stops paying.
The decoder's `plain_above="auto"` asks a pricer before each step of a batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from .runtime import TargetRuntime


class StepPricer:
    """Chooses plain or speculative steps from their measured cost at each live-row count.

    Per row count A it keeps a moving average of the seconds of a speculative and of a plain step (the
    first step of each kind is a warm-up and is not kept: a drafter's first call pays for its
    allocations), and the mean accepted length E per row over the rows of the last `window`
    speculative steps (at least `min_accepted` rows before choosing: one step of a batch of 4). A
    speculative step commits E tokens per row where a plain one commits 1, so it pays while
    E x t_plain(A) > t_spec(A).

    A row count not measured yet is inferred where it can be: speculation pays less as more rows share a
    step, so a loss measured at fewer rows (or a win at more) decides it; otherwise the nearest count
    measured within a factor of two decides it when it won there by at least `margin` (a batch whose rows
    finish one by one explores about log2(B) counts, not B). A count with nothing to infer from, or
    only a close call nearby, tries both kinds.

    The kind not chosen runs once after `recheck` steps and its estimate is replaced by what it costs
    now, so the estimates follow the machine and the text. A recheck that confirms the choice by a
    clear margin (`margin`) doubles the wait (up to `max_recheck`); otherwise the wait starts again.

    `StepPricer.shared(model, key)` keeps one pricer per model and drafter setting in the model's
    `TargetRuntime`, so a batch starts from what earlier batches measured instead of exploring again."""

    @classmethod
    def shared(cls, model, key: Hashable) -> StepPricer:
        """The model's pricer for `key` (the drafter's kind and tree, kernel, compile ...)."""
        return TargetRuntime.of(model).pricer(key, cls)

    def __init__(
        self,
        recheck: int = 32,
        smoothing: float = 0.3,
        max_recheck: int = 256,
        window: int = 64,
        min_accepted: int = 4,
        margin: float = 1.1,
    ):
        self.recheck, self.smoothing, self.max_recheck = recheck, smoothing, max_recheck
        self.min_accepted, self.margin = min_accepted, margin
        self.seconds: dict[tuple[int, bool], float] = {}  # (rows, speculative) -> seconds per step
        self.samples: dict[tuple[int, bool], int] = {}  # steps kept per key
        self.warmed: set[bool] = set()  # the kinds whose warm-up step ran
        # per speculative step: (tokens accepted over its rows, its rows)
        self.accepted: deque[tuple[float, int]] = deque(maxlen=window)
        self.steps = 0
        self.interval = recheck  # steps until the next recheck
        self.next_recheck = recheck
        self.rechecking: tuple[int, bool] | None = None  # (rows, the choice a recheck step questions)

    @property
    def accept(self) -> float:
        """Mean accepted length per row over the rows of the recent speculative steps."""
        rows = self.accepted_rows
        return sum(total for total, _ in self.accepted) / rows if rows else 1.0

    @property
    def accepted_rows(self) -> int:
        return sum(rows for _, rows in self.accepted)

    def speculate(self, rows: int) -> bool:
        """Whether the next step over `rows` live rows should be speculative."""
        self.steps += 1
        best = self.best(rows)
        if best is None:  # measure what is missing: speculative steps first, then plain ones
            return not self.measured(rows, True) or self.accepted_rows < self.min_accepted
        if self.steps >= self.next_recheck:
            self.rechecking = (rows, best)
            return not best
        return best

    def best(self, rows: int) -> bool | None:
        """Whether speculation pays at `rows` rows: measured there, inferred from other row counts, or
        None (unknown)."""
        if self.accepted_rows < self.min_accepted:
            return None
        if self.measured(rows, True) and self.measured(rows, False):
            return self.pays(rows)
        measured = [
            r for (r, spec) in self.seconds if spec and self.measured(r, True) and self.measured(r, False)
        ]
        if any(r <= rows and not self.pays(r) for r in measured):
            return False
        if any(r >= rows and self.pays(r) for r in measured):
            return True
        near = [r for r in measured if r <= 2 * rows and rows <= 2 * r]
        if near:  # the nearest count decides only a clear case; a close call is measured here
            nearest = min(near, key=lambda r: (abs(r - rows), r))
            if self.ratio(nearest) >= self.margin:
                return self.pays(nearest)
        return None

    def measured(self, rows: int, speculative: bool) -> bool:
        """Whether the kind has a kept measurement at this row count (a step after its warm-up)."""
        return self.samples.get((rows, speculative), 0) >= 1

    def pays(self, rows: int) -> bool:
        return self.accept * self.seconds[(rows, False)] > self.seconds[(rows, True)]

    def ratio(self, rows: int) -> float:
        """Tokens per second of the better kind over the other's, at a measured row count (>= 1)."""
        gain = self.accept * self.seconds[(rows, False)] / self.seconds[(rows, True)]
        return max(gain, 1 / gain)

    def record(self, rows: int, speculative: bool, seconds: float, accepted: float) -> None:
        """One step over `rows` rows took `seconds`; a speculative one accepted `accepted` tokens per row."""
        key, a = (rows, speculative), self.smoothing
        if speculative:
            self.accepted.append((accepted * rows, rows))
        if speculative not in self.warmed:  # the warm-up: its time is not kept
            self.warmed.add(speculative)
            return
        self.samples[key] = self.samples.get(key, 0) + 1
        rechecked = self.rechecking is not None and self.rechecking == (rows, not speculative)
        if self.samples[key] == 1 or rechecked:  # the first kept step, a fresh recheck
            self.seconds[key] = seconds
        else:
            self.seconds[key] = (1 - a) * self.seconds[key] + a * seconds
        if self.rechecking is not None:
            checked_rows, choice = self.rechecking
            clear = (
                checked_rows == rows
                and self.best(rows) == choice
                and self.measured(rows, True)
                and self.measured(rows, False)
                and self.ratio(rows) >= self.margin
            )
            self.interval = min(2 * self.interval, self.max_recheck) if clear else self.recheck
            self.next_recheck = self.steps + self.interval
            self.rechecking = None
