"""What a step costs and what it gains on this machine: the prices the tree planner (`core.planner`) and
the decoder's batch steps decide on.

- `AcceptanceCalibration`: P(node accepted | parent accepted) by the drafter's probability, per
  calibration group (a source at a drafting level), learned from every verified step;
- `DraftCosts`: seconds to draft d levels, measured as drafting runs;
- `StepCosts`: a step's seconds beyond drafting by verified node count: the machine's verification cost
  curve corrected by a line through the steps actually run;
- `StepPricer`: plain or speculative steps for a batch of a static tree, from their measured cost at each
  live-row count (a speculative step verifies A x N rows where a plain step verifies A: once the live
  rows fill the machine's matrix units, more rows per step cost nearly their full price). The decoder's
  `plain_above="auto"` asks it before each step of a batch; a planner that prices its trees decides
  that itself (the root alone is one of the trees it prices).
"""

from __future__ import annotations

import array
import bisect
from collections import deque
from collections.abc import Hashable, Sequence

import torch

from .runtime import TargetRuntime


class AcceptanceCalibration:
    """P(node accepted | parent accepted) as a function of the drafter's probability for the node, in
    probability bins, from counts of verified nodes whose parent was accepted; each bin starts from a
    prior of `prior_weight` pseudo-observations at `prior_scale` x its centre.

    With `groups` > 1 (e.g. one per drafting level: deeper heads and a lookup branch are calibrated
    differently), each group keeps its own counts per bin, starting from `group_weight`
    pseudo-observations at the pooled estimate of the bin (a group with few observations follows the
    pooled table).

    The counts are Python floats: a planner predicts and updates a few dozen nodes a step, where each
    small tensor operation costs more than the arithmetic (`predict_list` / `update_list` are what it
    calls; the tensor forms and attributes give the same numbers)."""

    def __init__(
        self,
        bins: int = 10,
        prior_weight: float = 4.0,
        prior_scale: float = 0.5,
        groups: int = 1,
        group_weight: float = 4.0,
    ):
        # [bins - 1] inner edges, float32 values (a probability on an edge goes to the lower bin)
        self.edges = torch.linspace(0, 1, bins + 1)[1:-1].double().tolist()
        centres = [(b + 0.5) / bins for b in range(bins)]
        self._proposed = [float(prior_weight)] * bins
        self._accepted = [prior_weight * prior_scale * c for c in centres]
        self.group_weight = group_weight
        self._group_proposed = [[0.0] * bins for _ in range(groups)]  # [groups][bins]
        self._group_accepted = [[0.0] * bins for _ in range(groups)]

    # the counts as float64 tensors (copies): proposed / accepted [bins], group_* [groups, bins]
    @property
    def proposed(self) -> torch.Tensor:
        return torch.tensor(self._proposed, dtype=torch.float64)

    @property
    def accepted(self) -> torch.Tensor:
        return torch.tensor(self._accepted, dtype=torch.float64)

    @property
    def group_proposed(self) -> torch.Tensor:
        return torch.tensor(self._group_proposed, dtype=torch.float64)

    @property
    def group_accepted(self) -> torch.Tensor:
        return torch.tensor(self._group_accepted, dtype=torch.float64)

    def reserve(self, groups: int) -> None:
        """At least `groups` groups: new ones start with no observations of their own (the pooled table)."""
        bins = len(self._proposed)
        for _ in range(groups - len(self._group_proposed)):
            self._group_proposed.append([0.0] * bins)
            self._group_accepted.append([0.0] * bins)

    def _bins(self, probs: Sequence[float]) -> list[int]:
        """The bin of each probability, as a float32 value clamped to [0, 1]."""
        return [bisect.bisect_left(self.edges, min(max(p, 0.0), 1.0)) for p in array.array("f", probs)]

    def _groups(self, groups: Sequence[int]) -> list[int]:
        last = len(self._group_proposed) - 1
        return [min(max(int(g), 0), last) for g in groups]

    def predict_list(self, probs: Sequence[float], groups: Sequence[int] | None = None) -> list[float]:
        """probs [n] (and their groups [n]) -> calibrated acceptance probabilities [n]."""
        bins = self._bins(probs)
        pooled = [self._accepted[b] / self._proposed[b] for b in bins]
        if groups is None:
            return pooled
        w = self.group_weight
        return [
            (self._group_accepted[g][b] + w * p) / (self._group_proposed[g][b] + w)
            for g, b, p in zip(self._groups(groups), bins, pooled, strict=True)
        ]

    def update_list(
        self, probs: Sequence[float], accepted: Sequence[bool], groups: Sequence[int] | None = None
    ) -> None:
        """probs [m] of nodes whose parent was accepted; accepted [m]: whether they were; groups [m]."""
        bins = self._bins(probs)
        for b, hit in zip(bins, accepted, strict=True):
            self._proposed[b] += 1.0
            self._accepted[b] += float(hit)
        if groups is not None:
            for g, b, hit in zip(self._groups(groups), bins, accepted, strict=True):
                self._group_proposed[g][b] += 1.0
                self._group_accepted[g][b] += float(hit)

    def predict(
        self, probs: torch.Tensor, groups: torch.Tensor | Sequence[int] | None = None
    ) -> torch.Tensor:
        """probs [n] (and their groups [n]) -> calibrated acceptance probabilities [n] (float64)."""
        groups = groups.tolist() if isinstance(groups, torch.Tensor) else groups
        return torch.tensor(self.predict_list(probs.tolist(), groups), dtype=torch.float64)

    def update(
        self, probs: torch.Tensor, accepted: torch.Tensor, groups: torch.Tensor | Sequence[int] | None = None
    ) -> None:
        """probs [m] of nodes whose parent was accepted; accepted [m] bool: whether they were; groups [m]."""
        groups = groups.tolist() if isinstance(groups, torch.Tensor) else groups
        self.update_list(probs.tolist(), accepted.tolist(), groups)


class DraftCosts:
    """Seconds to draft d levels: a running mean per measured d; other d on the least-squares line
    through the measured ones (one measured d: proportional to d).

    The first draft of each level count is not learned: it pays one-time costs (weights packed on first
    use, compilation) that can be 100x a draft, and a level count priced that high is never drafted
    again, so never priced again. For the same reason (a pause of the machine inside a draft) a later
    draft counts as twice the mean at most and a faster one moves the mean halfway; a real slowdown
    still raises the mean 1.2x per draft."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.measured: dict[int, float] = {}
        self.warmed: set[int] = set()  # level counts drafted at least once

    def record(self, levels: int, seconds: float) -> None:
        if levels not in self.warmed:
            self.warmed.add(levels)
            return
        old = self.measured.get(levels)
        if old is None:
            self.measured[levels] = seconds
            return
        # pauses only add time: a draft above the mean counts as twice the mean at most, one below it
        # moves the mean halfway (a count priced high by a pause comes back within a few drafts)
        rate = self.smoothing if seconds > old else max(self.smoothing, 0.5)
        self.measured[levels] = old + rate * (min(seconds, 2.0 * old) - old)

    def __call__(self, levels: int) -> float:
        if levels in self.measured:
            return self.measured[levels]
        if not self.measured:
            return 0.0
        if len(self.measured) == 1:
            ((d, t),) = self.measured.items()
            return t * levels / d if d else t
        ds, ts = list(self.measured), list(self.measured.values())
        mean_d, mean_t = sum(ds) / len(ds), sum(ts) / len(ts)
        slope = sum((d - mean_d) * (t - mean_t) for d, t in zip(ds, ts, strict=True)) / sum(
            (d - mean_d) ** 2 for d in ds
        )
        return max(0.0, mean_t + slope * (levels - mean_d))


class StepCosts:
    """Seconds of a step beyond drafting by verified node count n, learned from the steps actually run.

    The cost curve prices n nodes at curve[n]; a curve measured under other load can misprice the extra
    cost of more nodes by 20-40% on a shared CPU, and a step also pays for sampling, commit and Python.
    So a step of n nodes is priced at curve[n] + a + b x extra[n], with extra[n] = curve[n] - curve[1]:
    `a` is the rest of the step, `b` corrects the curve's extra cost (-0.5: more nodes cost half what it
    says). Both come from a least-squares line through every step's time beyond the curve (running
    means), b shrunk towards 0 while few steps verified more than one node (`prior_weight` of them
    count as one at b = 0) and kept in [-0.9, 3], so prices never fall with n.

    `optimistic` prices take off a share (`explore`, shrinking the same way) of the extra cost: a tree
    the curve prices just above break-even gets tried a few times rather than never, and those steps
    teach b."""

    def __init__(self, smoothing: float = 0.05, prior_weight: float = 4.0, explore: float = 0.5):
        self.smoothing, self.prior_weight, self.explore = smoothing, prior_weight, explore
        self.steps, self.tree_steps = 0, 0  # recorded steps; those that verified more than one node
        # running means of x = extra[n], y = time beyond the curve, x^2, x y
        self.mean_x = self.mean_y = self.mean_xx = self.mean_xy = 0.0

    def record(self, extra: float, beyond_curve: float) -> None:
        """A step whose nodes the curve prices `extra` seconds above one node took `beyond_curve` seconds
        more than drafting + the curve."""
        self.steps += 1
        self.tree_steps += extra > 0
        rate = max(1.0 / self.steps, self.smoothing)
        self.mean_x += rate * (extra - self.mean_x)
        self.mean_y += rate * (beyond_curve - self.mean_y)
        self.mean_xx += rate * (extra * extra - self.mean_xx)
        self.mean_xy += rate * (extra * beyond_curve - self.mean_xy)

    @property
    def line(self) -> tuple[float, float]:
        """(a, b): a step's time beyond the curve is a + b x extra."""
        var_x = self.mean_xx - self.mean_x**2
        slope = (self.mean_xy - self.mean_x * self.mean_y) / var_x if var_x > 1e-12 else 0.0
        slope *= self.tree_steps / (self.tree_steps + self.prior_weight)
        slope = min(max(slope, -0.9), 3.0)
        return self.mean_y - slope * self.mean_x, slope

    def prices(self, curve: Sequence[float], optimistic: bool = False) -> list[float]:
        """curve[n]: verification seconds of n nodes (index 0 unused, non-decreasing) -> step seconds
        beyond drafting by node count."""
        rest, slope = self.line
        if optimistic:
            slope -= self.explore * self.prior_weight / (self.tree_steps + self.prior_weight) * (1 + slope)
        # never below a tenth of the curve: a curve that overprices the step would otherwise give
        # prices <= 0 (and no rate to compare)
        return [0.0] + [max(c + rest + slope * (c - curve[1]), 0.1 * c) for c in curve[1:]]


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
