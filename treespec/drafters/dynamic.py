"""Dynamic trees: each step verifies only the nodes worth their cost on this machine.

`DynamicTreeDrafter` wraps any drafter that gives each node a probability (heads, sequential heads,
the EAGLE-style drafter, a draft model with runners-up, a prompt-lookup branch with its own hit rates).
Every step:

1. the inner drafter fills its (largest) tree; each node gets a *calibrated* acceptance probability
   a_i = P(node accepted | parent accepted), read from a table of draft probability -> observed
   acceptance per drafting level (`AcceptanceCalibration`, learned online from every verified step,
   starting from a prior; a level with few observations follows the table pooled over levels);
2. a node's value is the probability that verification reaches it: v_i = a_i x v_parent (v_root = 1),
   so E[accepted length] of a connected set S = 1 + sum of v_i over S (the root always counts);
3. nodes sorted by value (parents never after their children) are taken while they pay: the kept
   prefix of k nodes maximises E[accepted](k) / step seconds(k + 1), a step costing the drafting (timed
   as it runs), the verification of k + 1 nodes at this prefix length (this machine's cost curve,
   `verify_seconds`) and the rest of the step (sampling, commit, Python), both corrected by what the
   steps actually run took (`StepCosts`: a line through each step's time beyond drafting and the curve
   against the curve's extra cost of its nodes, so a curve that misprices more nodes is corrected;
   while few trees were run, their extra cost is priced a little optimistically, so a tree the curve
   puts just above break-even gets tried). The kept set can be the root alone;
4. when the root alone won `patience` steps in a row, drafting itself is skipped for a while (doubling
   up to `max_skip` steps), so a drafter that does not pay costs almost nothing;
5. an inner drafter that drafts level by level (`limits_depth`: sequential heads, the EAGLE drafter)
   drafts only the levels that pay. Each level costs a read of its output rows; the drafting time of
   each level count is measured as it runs (unmeasured counts: on a line through the measured ones).
   Every step also prices the level counts it could have drafted instead: for d up to the levels drafted,
   the best expected tokens per second with levels 1..d only (the lookup branch is drafted whole). What
   level d adds, log(rate_d / rate_d-1), is averaged over the steps that priced it; the next step drafts
   the level count with the largest summed gains, and every level is drafted again every `explore_after`
   steps while the deepest drafted is the best (so each deeper level's gain is priced again). One-time
   costs (the first draft of each level count, a step many times slower than its price) are not learned.

The calibration groups are the drafting levels unless the inner proposal names others
(`Proposal.groups`): a `UnionDrafter` gives each source (and the nodes both sources proposed) groups of
their own, so heads, a suffix tree and a lookup chain are each priced on their own record.

What it learns (the calibration, the drafting costs, the level gains, the rest of the step) describes
the drafter on this machine, not one prompt: it carries over to the next sequence, so a drafter reused
across `generate` calls starts warm. The step's tree and its prediction go into the proposal
(`Proposal.tree`, `expected_accept`); the decoder records predicted against observed accepted length
per step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from ..core.drafting import BaseDrafter, Drafter, DrafterReport, Proposal, Scorer, SequenceStart, step_layout
from ..core.tree import Tree

# distinct kept-node sets whose pruned trees a drafter keeps: the decoder keeps as many layouts of them
MAX_PRUNED_TREES = 512


class AcceptanceCalibration:
    """P(node accepted | parent accepted) as a function of the drafter's probability for the node, in
    probability bins, from counts of verified nodes whose parent was accepted; each bin starts from a
    prior of `prior_weight` pseudo-observations at `prior_scale` x its centre.

    With `groups` > 1 (e.g. one per drafting level: deeper heads and a lookup branch are calibrated
    differently), each group keeps its own counts per bin, starting from `group_weight`
    pseudo-observations at the pooled estimate of the bin (a group with few observations follows the
    pooled table)."""

    def __init__(
        self,
        bins: int = 10,
        prior_weight: float = 4.0,
        prior_scale: float = 0.5,
        groups: int = 1,
        group_weight: float = 4.0,
    ):
        self.edges = torch.linspace(0, 1, bins + 1)[1:-1]  # [bins - 1] inner edges
        centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins  # [bins]
        self.proposed = torch.full((bins,), prior_weight, dtype=torch.float64)
        self.accepted = prior_weight * prior_scale * centres
        self.group_weight = group_weight
        self.group_proposed = torch.zeros(groups, bins, dtype=torch.float64)  # [groups, bins]
        self.group_accepted = torch.zeros(groups, bins, dtype=torch.float64)

    def reserve(self, groups: int) -> None:
        """At least `groups` groups: new ones start with no observations of their own (the pooled table)."""
        more = groups - self.group_proposed.shape[0]
        if more > 0:
            zeros = self.group_proposed.new_zeros(more, self.group_proposed.shape[1])
            self.group_proposed = torch.cat([self.group_proposed, zeros])
            self.group_accepted = torch.cat([self.group_accepted, zeros])

    def bin(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(probs.double().clamp(0, 1), self.edges.double())  # [n]

    def group(self, groups: torch.Tensor | Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(groups, dtype=torch.long).clamp(0, self.group_proposed.shape[0] - 1)  # [n]

    def predict(
        self, probs: torch.Tensor, groups: torch.Tensor | Sequence[int] | None = None
    ) -> torch.Tensor:
        """probs [n] (and their groups [n]) -> calibrated acceptance probabilities [n] (float64)."""
        b = self.bin(probs)
        pooled = self.accepted[b] / self.proposed[b]  # [n]
        if groups is None:
            return pooled
        g, w = self.group(groups), self.group_weight
        return (self.group_accepted[g, b] + w * pooled) / (self.group_proposed[g, b] + w)

    def update(
        self, probs: torch.Tensor, accepted: torch.Tensor, groups: torch.Tensor | Sequence[int] | None = None
    ) -> None:
        """probs [m] of nodes whose parent was accepted; accepted [m] bool: whether they were; groups [m]."""
        b = self.bin(probs)
        self.proposed.index_add_(0, b, torch.ones_like(b, dtype=torch.float64))
        self.accepted.index_add_(0, b, accepted.double())
        if groups is not None:
            g = self.group(groups)
            self.group_proposed.index_put_((g, b), torch.ones_like(b, dtype=torch.float64), accumulate=True)
            self.group_accepted.index_put_((g, b), accepted.double(), accumulate=True)


def choose_nodes(
    values: Sequence[float], parents: Sequence[int], step_seconds: Callable[[int], float]
) -> tuple[list[int], float]:
    """The connected node set with the most expected tokens per second.

    values [N] (v_0 = 1 for the root), parents [N]; step_seconds(n): the cost of a step verifying n nodes.
    Returns (kept node indices sorted, root first; expected accepted length)."""
    n = len(values)
    # non-root nodes by value, ties in node order (a parent's value >= its child's, and its index smaller)
    order = sorted(range(1, n), key=lambda i: (-float(values[i]), i))
    kept, best_k, best_rate, total = {0}, 0, 1.0 / step_seconds(1), 1.0
    gains = [1.0]
    for i in order:
        if int(parents[i]) not in kept:  # only with rounding ties; a child never precedes its parent
            continue
        kept.add(i)
        total += float(values[i])
        gains.append(total)
        rate = total / step_seconds(len(kept))
        if rate > best_rate:
            best_rate, best_k = rate, len(kept) - 1
    chosen = [0] + [i for i in order if i in kept][:best_k]
    return sorted(chosen), gains[best_k]


def level_rates(
    values: Sequence[float],
    levels: Sequence[int],
    drafted: int,
    draft_seconds: Callable[[int], float],
    verify_seconds: Sequence[float],
) -> list[float]:
    """For d = 0..drafted: the best expected tokens per second had only levels 1..d been drafted.

    values [N] (as in `choose_nodes`), levels [N]: the drafting level that makes each node (0: drafted
    whole, whatever the level count: the root, a lookup branch); draft_seconds(d): drafting d levels;
    verify_seconds[n]: verifying n nodes (index 0 unused). A node's level is never below its parent's,
    so the nodes of levels <= d taken by value form a connected set."""
    order = sorted((i for i in range(1, len(values)) if values[i] > 0), key=lambda i: (-values[i], i))
    rates = []
    for d in range(drafted + 1):
        fixed = draft_seconds(d)
        total, count, best = 1.0, 1, 1.0 / (fixed + verify_seconds[1])
        for i in order:
            if levels[i] <= d and count + 1 < len(verify_seconds):
                total, count = total + values[i], count + 1
                best = max(best, total / (fixed + verify_seconds[count]))
        rates.append(best)
    return rates


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
        return [0.0] + [c + rest + slope * (c - curve[1]) for c in curve[1:]]


class DynamicTreeDrafter(BaseDrafter):
    """Prunes the inner drafter's tree every step to the nodes worth verifying (module docstring).

    verify_seconds(nodes, prefix): this machine's verification cost (e.g. from the cost curve,
    `training.costs.verify_cost_model`); the inner drafter's `tree` is the largest tree a step may use.
    An inner drafter that proposes a tree of its own each step (`Proposal.tree`: suffix decoding, a
    `UnionDrafter`) is pruned on that tree, its nodes' levels and calibration groups read from the
    proposal (`Proposal.levels` / `groups`; a union's groups tell its sources apart)."""

    def __init__(
        self,
        inner: Drafter,
        verify_seconds: Callable[[int, int], float],
        calibration: AcceptanceCalibration | None = None,
        patience: int = 4,
        max_skip: int = 8,
        explore_after: int = 16,
        prefix_bucket: int = 16,
        slow_step: float = 4.0,
        max_slow_steps: int = 8,
    ):
        if inner.scorer() is not None:
            raise ValueError(
                "a dynamic tree needs the decoder's own verification (this drafter brings its own)"
            )
        self.inner, self.tree = inner, inner.tree
        self.feature_layers = tuple(inner.feature_layers)
        self.verify_seconds = verify_seconds
        self.patience, self.max_skip = patience, max_skip
        self.explore_after, self.prefix_bucket = explore_after, prefix_bucket
        self.slow_step, self.max_slow_steps = slow_step, max_slow_steps
        self.inner_limits_depth = inner.limits_depth
        self.parents = inner.tree.parents.tolist()  # [N]
        # the drafting level that makes each node (0: always drafted: the root, a lookup branch)
        self.levels_of_nodes = [int(d) for d in inner.node_levels]  # [N]
        self.max_levels = max(self.levels_of_nodes)
        # calibrated per drafting level (the lookup branch: level 0) unless given
        self.calibration = calibration or AcceptanceCalibration(groups=self.max_levels + 1)
        self.choices = [(), *inner.tree.choices]
        self.index = {c: i for i, c in enumerate(self.choices)}  # choice path -> node of the inner tree
        self.root_tree = Tree.from_choices([])
        # kept nodes (with the inner tree of the step when it has its own) -> tree, node order
        self.pruned: dict[tuple, tuple[Tree, list[int]]] = {}
        # learned about this drafter on this machine, kept across sequences (a reused drafter starts warm):
        self.draft_costs = DraftCosts()  # seconds of one inner propose per level count
        # level d -> running mean of log(best rate with levels 1..d / best rate with 1..d-1), both priced
        # on the same steps (the steps that drafted d levels or more)
        self.level_gains: dict[int, float] = {}
        self.gain_age: dict[int, int] = {}  # level d -> steps since its gain was last priced
        self.step_costs = StepCosts()  # a line through each step's time beyond drafting and the curve
        self.levels = self.max_levels  # levels the next step drafts
        self.verify_tables: dict[int, list[float]] = {}  # prefix bucket -> verify seconds by node count
        self._reset()

    def _reset(self) -> None:
        """Per-sequence state; the calibration, drafting costs, level gains and step costs carry over."""
        self.prefix = 0
        self.step_started: float | None = None  # when the last step's propose began (None: no step yet)
        self.predicted_seconds = 0.0  # drafting + the curve's verification of the last step
        self.predicted_extra = 0.0  # the curve's extra cost of the last step over a one-node step
        self.root_only_streak, self.skip, self.skip_left = 0, 1, 0
        # the last step's tree, tokens [n], probs [n], calibration groups [n] (None: no tree)
        self.last: tuple[Tree, torch.Tensor, torch.Tensor, list[int]] | None = None
        self.slow_streak = 0  # steps in a row too slow to learn from (`learn_step`)
        self.counts = {"steps": 0, "skipped": 0, "nodes": 0, "levels": 0, "slow_steps": 0}

    def start(self, sequence: SequenceStart) -> None:
        self._reset()
        self.prefix = len(sequence.tokens)
        self.inner.start(sequence)

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        self.counts["steps"] += 1
        t0 = time.perf_counter()
        if self.step_started is not None:  # the last step took t0 - step_started: learn the rest's cost
            self.learn_step(t0 - self.step_started)
        self.step_started = t0
        curve = self.verify_table()
        if self.skip_left > 0:  # trees have not paid lately: plain step, no drafting
            self.skip_left -= 1
            self.counts["skipped"] += 1
            self.last, self.predicted_extra = None, 0.0
            self.predicted_seconds = curve[1]
            return Proposal(
                roots.reshape(1, 1).to(hidden.device), None, tree=self.root_tree, expected_accept=1.0
            )
        levels = self.levels if self.inner_limits_depth else self.max_levels
        full = self.inner.propose(hidden, roots, levels)
        self.counts["levels"] += levels
        drafting = time.perf_counter() - t0
        self.draft_costs.record(levels, drafting)
        if full.probs is None:
            raise ValueError("a dynamic tree needs the inner drafter's node probabilities (Proposal.probs)")
        step, parents, node_levels, groups = self.inner_layout(full)
        values = self.node_values(full.probs[0].float().cpu(), parents, node_levels, groups, levels)
        draft, hopeful = self.draft_costs(levels), self.step_costs.prices(curve, optimistic=True)
        kept, expected = choose_nodes(values, parents, lambda n: draft + hopeful[n])
        self.predicted_seconds = drafting + curve[len(kept)]
        self.predicted_extra = curve[len(kept)] - curve[1]
        if self.inner_limits_depth:
            rates = level_rates(values, node_levels, levels, self.draft_costs, self.step_costs.prices(curve))
            self.choose_levels(rates, levels)
        tree, order = self.pruned_tree(tuple(kept), step)
        index = torch.tensor(order, device=full.tokens.device)  # [n]
        tokens, node_probs = full.tokens[:, index], full.probs[:, index]
        levels_kept = [node_levels[i] for i in order]  # [n]
        groups_kept = [groups[i] for i in order]  # [n] each node's calibration group
        self.last = (tree, tokens[0].cpu(), node_probs[0].float().cpu(), groups_kept)
        self.counts["nodes"] += tree.num_nodes
        if tree.num_nodes == 1:
            self.root_only_streak += 1
            if self.root_only_streak >= self.patience:
                self.skip_left, self.skip = self.skip, min(2 * self.skip, self.max_skip)
                self.root_only_streak = 0
        else:
            self.root_only_streak, self.skip = 0, 1
        return Proposal(
            tokens,
            node_probs,
            tree=tree,
            expected_accept=expected,
            levels=torch.tensor([levels_kept]),  # [1, n]
            groups=torch.tensor([groups_kept]),  # [1, n]
        )

    def learn_step(self, seconds: float) -> None:
        """Teach `step_costs` what the last step took, unless it took over `slow_step` times its learned
        price: such a step paid a one-time cost (compilation of a new shape, a first use, a pause), not
        the price of its nodes. After `max_slow_steps` such steps in a row the machine has changed, and
        they are learned."""
        rest, slope = self.step_costs.line
        price = max(self.predicted_seconds, self.predicted_seconds + rest + slope * self.predicted_extra)
        if seconds > self.slow_step * price and self.slow_streak < self.max_slow_steps:
            self.slow_streak += 1
            self.counts["slow_steps"] += 1
            return
        self.slow_streak = 0
        self.step_costs.record(self.predicted_extra, seconds - self.predicted_seconds)

    def inner_layout(self, full: Proposal) -> tuple[Tree | None, list[int], list[int], list[int]]:
        """The inner proposal's layout: (its per-step tree, None for the inner `tree`; parents [N],
        drafting levels [N] and calibration groups [N] of its nodes)."""
        if full.tree is None and full.levels is None and full.groups is None:  # the static tree
            return None, self.parents, self.levels_of_nodes, self.levels_of_nodes
        tree, levels, groups = step_layout(self.inner, full)
        step = None if full.tree is None else tree
        return step, tree.parents.tolist(), levels[0].tolist(), groups[0].tolist()

    def node_values(
        self, probs: torch.Tensor, parents: list[int], levels: list[int], groups: list[int], drafted: int
    ) -> list[float]:
        """[N] the probability that verification reaches each node (module docstring, step 2): the
        calibrated acceptance of each node (probs [N], by calibration group) times its parent's value;
        0 for nodes not drafted this step (probability 0, or a level beyond the `drafted` ones)."""
        self.calibration.reserve(max(groups) + 1)
        accept = self.calibration.predict(probs, groups).tolist()  # [N]
        values = [1.0] * len(accept)
        for i, p in enumerate(probs.tolist()):  # parents come first in node order
            if i:
                useful = p > 0 and levels[i] <= drafted
                values[i] = values[parents[i]] * accept[i] if useful else 0.0
        return values

    def verify_table(self) -> list[float]:
        """Verification seconds by node count (index 0 unused) at the current prefix length, rounded down
        to `prefix_bucket` tokens; computed once per bucket. Made non-decreasing (a measured curve can
        price n nodes above n + 1 by noise; verifying fewer nodes never costs more)."""
        bucket = self.prefix // self.prefix_bucket * self.prefix_bucket
        if bucket not in self.verify_tables:
            table = [self.verify_seconds(k, bucket) for k in range(1, self.tree.num_nodes + 1)]
            for k in range(len(table) - 2, -1, -1):
                table[k] = min(table[k], table[k + 1])
            self.verify_tables[bucket] = [0.0, *table]
        return self.verify_tables[bucket]

    def choose_levels(self, rates: Sequence[float], drafted: int) -> None:
        """Learn from this step's `rates` (levels 0..drafted, all priced on this step) what each level
        adds: gain_d = log(rate_d / rate_d-1), a running mean that moves halfway to a gain not priced
        for `explore_after` steps (it was priced under older costs). The next step drafts the level
        count whose summed gains are the largest, or every level when that count was the deepest drafted
        and a deeper level has not been priced for `explore_after` steps: every deeper gain is priced
        again, so a level priced low once (in a warm-up, under load) is not left out for good."""
        for d in self.gain_age:
            self.gain_age[d] += 1
        for d in range(1, len(rates)):
            gain = math.log(rates[d] / rates[d - 1])
            old = self.level_gains.get(d)
            rate = 0.5 if self.gain_age.get(d, 0) >= self.explore_after else 0.2
            self.level_gains[d] = gain if old is None else old + rate * (gain - old)
            self.gain_age[d] = 0
        best, total, best_total = 0, 0.0, 0.0
        for d in range(1, self.max_levels + 1):
            if d not in self.level_gains:
                break
            total += self.level_gains[d]
            if total > best_total:
                best, best_total = d, total
        stale = any(
            self.gain_age.get(d, self.explore_after) >= self.explore_after
            for d in range(best + 1, self.max_levels + 1)
        )
        self.levels = self.max_levels if best == drafted < self.max_levels and stale else best

    def pruned_tree(self, kept: tuple[int, ...], step: Tree | None = None) -> tuple[Tree, list[int]]:
        """The tree of the kept nodes of the inner tree (sorted, root first; `step`: of the inner
        drafter's tree of this step) and, for each of its nodes in canonical order, the inner node it is;
        built once per distinct (step tree,) kept set (at most `MAX_PRUNED_TREES` are kept; all are
        dropped when that many are)."""
        key = kept if step is None else (step, kept)
        if key not in self.pruned:
            if len(self.pruned) >= MAX_PRUNED_TREES:  # bounded, as the decoder's layouts of them are
                self.pruned.clear()
            choices = self.choices if step is None else [(), *step.choices]
            index = self.index if step is None else {c: i for i, c in enumerate(choices)}
            tree = Tree.from_choices([choices[i] for i in kept[1:]])
            # the new tree's node j is choices[j - 1]: its inner node
            self.pruned[key] = (tree, [0] + [index[c] for c in tree.choices])
        return self.pruned[key]

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Calibrate on what was verified: every node whose parent was accepted, accepted or not."""
        tokens_committed = committed[0]
        self.prefix += len(tokens_committed)
        if self.last is not None and self.last[0].num_nodes > 1:
            tree, tokens, probs, levels = self.last
            node, seen, hits = 0, [], []
            for token in tokens_committed[:-1] + [None]:  # walk the accepted path down the tree
                children = tree.children(node)
                seen += children
                nxt = next((c for c in children if token is not None and int(tokens[c]) == token), None)
                hits += [c == nxt for c in children]
                if nxt is None:
                    break
                node = nxt
            if seen:
                self.calibration.update(probs[seen], torch.tensor(hits), [levels[i] for i in seen])
        self.inner.observe(committed, features)

    @property
    def node_levels(self) -> torch.Tensor:
        """[N] the inner drafter's level that makes each node."""
        return torch.tensor(self.levels_of_nodes, dtype=torch.long)

    @property
    def target_topk(self) -> int:
        return self.inner.target_topk

    def verified(self, tokens: torch.Tensor, top_tokens: torch.Tensor) -> None:
        """Every verified node goes to the inner drafter (what the target said after each token)."""
        self.inner.verified(tokens, top_tokens)

    def report(self) -> DrafterReport:
        inner = self.inner.report()
        return DrafterReport(
            {**inner.stats, "dynamic": dict(self.counts), "pricer": self.learned()}, inner.cache_memory
        )

    def learned(self) -> dict:
        """What the pricer has learned so far (carried across sequences), for reports: the step-cost line
        (rest of the step in ms, the slope correcting the curve's extra cost, tree steps behind it), the
        level count the next step drafts and each level's mean gain, and the pooled calibration
        (observed acceptance per draft-probability bin)."""
        rest, slope = self.step_costs.line
        pooled = self.calibration.accepted / self.calibration.proposed  # [bins]
        return {
            "rest_ms": round(rest * 1e3, 3),
            "slope": round(slope, 4),
            "tree_steps": self.step_costs.tree_steps,
            "levels": self.levels,
            "level_gains": {d: round(g, 4) for d, g in sorted(self.level_gains.items())},
            "acceptance_by_bin": [round(float(a), 4) for a in pooled],
        }

    def scorer(self) -> Scorer | None:
        return None
