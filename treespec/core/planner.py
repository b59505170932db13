"""The tree planner: every step, the trees of a recipe's drafters merged into one, and (when priced) cut
to the nodes worth verifying on this machine.

Drafters guess differently: heads and an EAGLE layer read the target's hidden state, suffix trees and
prompt lookup copy what followed the same words earlier. `TreePlanner(sources, verify_seconds)` drafts
with every source each step and verifies one tree:

1. merge: in each row the sources' trees (each one's `Proposal.tree`, or its static `tree`) merge by
   token path: a node two sources proposed is one node, and what either proposed below it merges the
   same way; a node a source did not draft (probability 0) is left out with everything below it. A
   node's probability is 1 - prod(1 - p_s) over the sources that proposed it; its drafting level is the
   smallest of theirs (levels count for the leveled sources: the first one and every one whose levels are
   network passes, `costly_levels`; the others draft their whole tree every step, level 0); its
   calibration group is the set of sources that proposed it and that level.
2. value: unpriced, the product of the probabilities from the root down; priced, the probability that
   verification reaches the node: its calibrated acceptance (`AcceptanceCalibration`, per group,
   learned from every verified step) times its parent's value, so E[accepted length] of a connected set
   is 1 + the sum of its values.
3. join: a node is named by its rank path (the k-th child of the k'-th child ...); the step's one tree
   holds the most valuable paths over the rows (values summed over the rows), so a batch verifies one
   tree and a row fills the nodes it lacks with its root token at probability 0.
4. cut (priced): the kept prefix of k paths maximises the expected tokens committed over the rows per
   step second, a step costing the drafting (timed as it runs) and the verification of B x (k + 1)
   nodes (this machine's cost curve, corrected by `StepCosts` from the steps actually run; while few
   trees ran, extra nodes are priced a little optimistically, so a tree just above break-even is
   tried). The root alone is a candidate: it is a batch's plain step. When the root alone won `patience`
   steps in a row, drafting is skipped for a while (doubling up to `max_skip` steps).
5. levels (priced, the leveled sources, drafted level by level: heads, EAGLE): every step also prices the
   level counts they could have drafted instead (what level d adds: log(rate_d / rate_d-1), a running
   mean); the next step drafts the count with the largest summed gains in every leveled source (none:
   they are not called at all), and every level again every `explore_after` steps while the deepest
   drafted is the best (each such exploration that finds no deeper count worth drafting doubles that
   wait, up to `max_explore_after`: where the heads do not pay, drafting all their levels costs most of
   a plain step).

What it learns (calibration, drafting and step costs, level gains) describes the drafters on this
machine, not one prompt: it carries over to the next sequence.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch

from .drafting import BaseDrafter, Drafter, DrafterReport, Proposal, SequenceStart, StepTrees
from .pricing import AcceptanceCalibration, DraftCosts, StepCosts
from .tree import Tree

MAX_TREES = 512  # distinct step trees kept (the decoder keeps as many layouts)


class _MergedRow:
    """One row's merged tree: per node its parent, token, rank path, probability per source (0: not
    proposed by it) and drafting level."""

    def __init__(self, root: int, sources: int):
        self.parents, self.tokens, self.paths = [-1], [root], [()]
        self.children: list[dict[int, int]] = [{}]  # token -> node
        self.probs, self.levels = [[1.0] * sources], [0]
        # per node, once every source is merged (`TreePlanner._merge`): the sources' combined
        # probability and the calibration group
        self.node_probs: list[float] = []
        self.groups: list[int] = []

    def add(self, parent: int, token: int, source: int, prob: float, level: int) -> int:
        """The node for `token` under `parent` (made when new), now also proposed by `source`."""
        node = self.children[parent].get(token)
        if node is None:
            node = self.children[parent][token] = len(self.tokens)
            self.parents.append(parent)
            self.tokens.append(token)
            self.paths.append((*self.paths[parent], len(self.children[parent]) - 1))
            self.children.append({})
            self.probs.append([0.0] * len(self.probs[0]))
            self.levels.append(level)
        self.levels[node] = min(self.levels[node], level)
        self.probs[node][source] = max(self.probs[node][source], prob)
        return node


def best_prefix(values: Sequence[float], base: float, seconds: Callable[[int], float], most: int) -> int:
    """k (0..most): how many of `values` (sorted, a parent before its children) to keep so that
    (base + their sum) / seconds(k + 1) is the largest; seconds(n): a step verifying n nodes a row."""
    total, best, best_rate = base, 0, base / seconds(1)
    for k, value in enumerate(values[:most], start=1):
        total += value
        rate = total / seconds(k + 1)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class TreePlanner(BaseDrafter):
    """Drafts with every source each step and verifies one merged tree, cut to what pays on this machine
    when `verify_seconds` is given (module docstring).

    sources: drafters (none with a scorer of its own; those that read the target's features read the
    same layers). verify_seconds(nodes, prefix): this machine's verification cost (the cost curve,
    `training.costs.verify_cost_model`); None: no pricing, every merged node up to `max_nodes` is verified.
    max_nodes: the most nodes of a step's tree, root included (default and most: the sources' trees
    side by side, `tree`)."""

    def __init__(
        self,
        sources: Sequence[Drafter],
        verify_seconds: Callable[[int, int], float] | None = None,
        *,
        max_nodes: int | None = None,
        patience: int = 4,
        max_skip: int = 8,
        explore_after: int = 16,
        max_explore_after: int = 128,
        prefix_bucket: int = 16,
        slow_step: float = 4.0,
        max_slow_steps: int = 8,
    ):
        self.sources = list(sources)
        if not self.sources:
            raise ValueError("a tree planner needs at least one drafter")
        if any(s.scorer() is not None for s in self.sources):
            raise ValueError(
                "a planned tree needs the decoder's own verification (a self-speculative drafter verifies "
                "only its own chain)"
            )
        layers = {tuple(s.feature_layers) for s in self.sources} - {()}
        if len(layers) > 1:
            raise ValueError(
                f"the drafters read the target's features from different layers ({sorted(layers)}); a "
                "planner passes one set of features to the drafters that read them"
            )
        self.feature_layers = layers.pop() if layers else ()
        self.verify_seconds = verify_seconds
        self.patience, self.max_skip, self.explore_after = patience, max_skip, explore_after
        self.max_explore_after = max(explore_after, max_explore_after)
        self.prefix_bucket, self.slow_step, self.max_slow_steps = prefix_bucket, slow_step, max_slow_steps
        choices, rank = [], 0  # the sources' declared trees side by side under the root
        for source in self.sources:
            choices += [(p[0] + rank, *p[1:]) for p in source.tree.choices]
            rank += 1 + max((p[0] for p in source.tree.choices), default=-1)
        self.tree = Tree.from_choices(choices)
        cap = self.tree.num_nodes if max_nodes is None else max_nodes
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= self.tree.num_nodes:
            raise ValueError(f"max_nodes must be an int in [1, {self.tree.num_nodes}], got {max_nodes!r}")
        self.max_nodes = cap
        self.trees = StepTrees(MAX_TREES)  # kept rank paths -> the step's tree
        # the sources drafted level by level (level d drafts depth d), each to the step's level count
        self.leveled = [s.limits_depth and (i == 0 or s.costly_levels) for i, s in enumerate(self.sources)]
        depths = [s.tree.max_depth for s, leveled in zip(self.sources, self.leveled, strict=True) if leveled]
        self.max_levels = max(depths, default=0)
        # learned about these drafters on this machine, kept across sequences:
        self.calibration = AcceptanceCalibration()
        self.group_ids: dict[tuple[int, int], int] = {}  # (sources bitmask, level) -> calibration group
        self.draft_costs = DraftCosts()  # seconds of drafting by level count
        self.step_costs = StepCosts()  # a step's time beyond drafting and the curve
        self.level_gains: dict[int, float] = {}  # level d -> mean log gain of drafting d levels, not d - 1
        self.gain_age: dict[int, int] = {}  # level d -> steps since its gain was last priced
        # steps a deeper level's gain may age before every level is drafted again; doubles after each
        # such exploration that found no deeper count worth drafting (up to max_explore_after)
        self.explore_interval = explore_after
        self.explored_from: int | None = None  # the level count an exploration just replaced
        self.levels = self.max_levels  # levels the next step drafts
        self.verify_tables: dict[tuple[int, int], list[float]] = {}  # (prefix bucket, rows) -> seconds
        self.prefixes: list[int] = [0]  # per row: tokens in the sequence
        self._reset()

    @property
    def priced(self) -> bool:
        return self.verify_seconds is not None

    @property
    def prices_steps(self) -> bool:
        """A priced planner chooses a batch's plain steps itself (the root alone is a tree it prices)."""
        return self.priced

    @property
    def batched(self) -> bool:
        return all(s.batched for s in self.sources)

    @property
    def target_topk(self) -> int:
        return max(s.target_topk for s in self.sources)

    def _reset(self) -> None:
        """Per-sequence state (what the planner learned carries over)."""
        self.step_started: float | None = None  # when the last step's propose began
        self.predicted_seconds = 0.0  # drafting + the curve's verification of the last step
        self.predicted_extra = 0.0  # the curve's extra cost of the last step over a plain step
        self.root_only_streak, self.skip, self.skip_left = 0, 1, 0
        self.slow_streak = 0  # steps in a row too slow to learn from (`learn_step`)
        # the last step's tree and, per row: tokens, probabilities, calibration groups [B][n]
        self.last: tuple[Tree, list[list[int]], list[list[float]], list[list[int]]] | None = None
        self.counts = dict.fromkeys(("steps", "skipped", "nodes", "shared", "levels", "slow_steps"), 0)
        self.counts["proposed"] = [0] * len(self.sources)  # merged nodes each source proposed

    def start(self, sequence: SequenceStart) -> None:
        """Every source starts (the target's features go to those that read them)."""
        if sequence.row == 0:
            self._reset()
            self.prefixes = [0] * sequence.rows
        self.prefixes[sequence.row] = len(sequence.tokens)
        for source in self.sources:
            source.start(sequence if source.feature_layers else dataclasses.replace(sequence, features=None))

    def keep_rows(self, rows: list[int]) -> None:
        self.prefixes = [self.prefixes[r] for r in rows]
        for source in self.sources:
            source.keep_rows(rows)

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Calibrate on what was verified (every drafted node whose parent was accepted), then every
        source observes."""
        for row, tokens in enumerate(committed):
            self.prefixes[row] += len(tokens)
        if self.priced and self.last is not None and self.last[0].num_nodes > 1:
            self._calibrate(committed)
        self.last = None
        for source in self.sources:
            source.observe(committed, features if source.feature_layers else None)

    def _calibrate(self, committed: list[list[int]]) -> None:
        tree, tokens, probs, groups = self.last
        seen_probs, seen_groups, hits = [], [], []
        for row, accepted in enumerate(committed):
            node = 0
            for token in accepted[:-1] + [None]:  # walk the accepted path down the tree
                nxt = None
                for child in tree.children(node):
                    if probs[row][child] > 0:  # drafted in this row (not a filler)
                        hit = token is not None and tokens[row][child] == token
                        seen_probs.append(probs[row][child])
                        seen_groups.append(groups[row][child])
                        hits.append(hit)
                        nxt = child if hit else nxt
                if nxt is None:
                    break
                node = nxt
        if hits:
            self.calibration.update_list(seen_probs, hits, seen_groups)

    def verified(self, tokens: torch.Tensor, top_tokens: torch.Tensor) -> None:
        """The whole verified tree goes to each source that asks, with the top-k it asked for."""
        for source in self.sources:
            if source.target_topk > 0:
                source.verified(tokens, top_tokens[..., : source.target_topk])

    def report(self) -> DrafterReport:
        """The sources' statistics and caches (memory of a kind several hold adds up), the planner's
        counts and, priced, what it learned."""
        stats, memory = {}, {}
        for source in reversed(self.sources):
            report = source.report()
            stats.update(report.stats)
            for kind, size in report.cache_memory.items():
                memory[kind] = memory.get(kind, 0) + size
        stats["planner"] = {k: (list(v) if isinstance(v, list) else v) for k, v in self.counts.items()}
        if self.priced:
            stats["pricer"] = self.learned()
        return DrafterReport(stats, memory)

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        """tokens, probs [B, N] over the step's merged (and, priced, cut) tree, `Proposal.tree`."""
        roots_list = roots.reshape(-1).tolist()
        B = len(roots_list)
        self.counts["steps"] += 1
        t0 = time.perf_counter()
        if self.priced and self.step_started is not None:  # learn what the last step cost
            self.learn_step(t0 - self.step_started)
        self.step_started = t0
        table = self.verify_table(B) if self.priced else None
        if self.skip_left > 0:  # trees have not paid lately: a plain step, no drafting
            self.skip_left -= 1
            self.counts["skipped"] += 1
            self.predicted_seconds, self.predicted_extra = table[1], 0.0
            root_only = roots.reshape(-1, 1).to(hidden.device)  # [B, 1]
            return Proposal(root_only, None, tree=self.trees([]), expected_accept=1.0)
        levels = self.levels if self.priced else self.max_levels
        drafts = [self._draft(i, s, hidden, roots, levels) for i, s in enumerate(self.sources)]
        drafting = time.perf_counter() - t0
        self.counts["levels"] += levels
        if self.priced:
            self.draft_costs.record(levels, drafting)
        rows = [self._merge(root, r, drafts) for r, root in enumerate(roots_list)]
        values, path_levels = self._join(rows)
        order = sorted(values, key=lambda p: (-values[p], len(p), p))
        expected = None
        if self.priced:
            prices = self.step_costs.prices(table, optimistic=True)
            draft = self.draft_costs(levels)
            ranked = [values[p] for p in order]
            k = best_prefix(ranked, B, lambda n: draft + prices[n], min(self.max_nodes, len(table) - 1) - 1)
            expected = (B + sum(ranked[:k])) / B
            self.predicted_seconds = drafting + table[k + 1]
            self.predicted_extra = table[k + 1] - table[1]
            if self.max_levels:
                rates = self.level_rates(order, values, path_levels, levels, table, B)
                self.choose_levels(rates, levels)
            self._count_root_only(k == 0)
            order = order[:k]
        tree = self.trees(order[: self.max_nodes - 1])
        tokens, probs, groups = self._fill(tree, rows)
        self.last = (tree, tokens, probs, groups)
        self.counts["nodes"] += tree.num_nodes
        return Proposal(
            torch.tensor(tokens, dtype=torch.long, device=hidden.device),
            torch.tensor(probs, dtype=torch.float32),
            tree=tree,
            expected_accept=expected,
        )

    def _draft(self, index: int, source: Drafter, hidden, roots, levels: int) -> tuple:
        """One source's proposal as lists: (parents [N], tokens [B][N], probs [B][N], levels [N])."""
        limits = self.leveled[index]
        if limits and levels == 0:  # no level to draft: the root alone, without calling the source
            return [-1], [[r] for r in roots.reshape(-1).tolist()], [[1.0]] * roots.numel(), [0]
        proposal = source.propose(hidden, roots, levels if limits else None)
        tree = source.tree if proposal.tree is None else proposal.tree
        # level d drafts depth d; a source that is not leveled drafts whole, whatever the count
        node_levels = tree.depth.tolist() if limits else [0] * tree.num_nodes
        probs = proposal.probs
        probs = torch.ones(proposal.tokens.shape) if probs is None else probs.float().cpu()  # [B, N]
        return tree.parents.tolist(), proposal.tokens.tolist(), probs.tolist(), node_levels

    def _merge(self, root: int, row: int, drafts: list[tuple]) -> tuple[_MergedRow, list[float]]:
        """Row `row`'s trees merged by token path: (the merged tree with each node's combined probability
        and calibration group, each node's value)."""
        merged = _MergedRow(root, len(drafts))
        for source, (parents, tokens, probs, levels) in enumerate(drafts):
            where = [0] + [-1] * (len(parents) - 1)  # the source's node -> merged node (-1: left out)
            for i in range(1, len(parents)):
                parent, p = where[parents[i]], probs[row][i]
                if parent >= 0 and p > 0:
                    where[i] = merged.add(parent, tokens[row][i], source, p, levels[i])
        probs, groups = [1.0], [0]
        for node in range(1, len(merged.tokens)):
            by_source = merged.probs[node]
            mask = sum(1 << s for s, p in enumerate(by_source) if p > 0)
            groups.append(self.group_ids.setdefault((mask, merged.levels[node]), len(self.group_ids)))
            probs.append(1.0 - math.prod(1.0 - p for p in by_source))
            self.counts["shared"] += mask & (mask - 1) != 0
            for s, p in enumerate(by_source):
                self.counts["proposed"][s] += p > 0
        merged.node_probs, merged.groups = probs, groups
        if self.priced:  # calibrated acceptance of each node given its parent
            self.calibration.reserve(len(self.group_ids))
            accept = self.calibration.predict_list(probs, groups)
        else:
            accept = probs
        values = [1.0] * len(probs)
        for node in range(1, len(probs)):  # parents come first
            values[node] = values[merged.parents[node]] * accept[node]
        return merged, values

    def _join(self, rows: list[tuple]) -> tuple[dict[tuple, float], dict[tuple, int]]:
        """Every row's rank paths: (path -> value summed over the rows, path -> smallest drafting level)."""
        values: dict[tuple, float] = {}
        levels: dict[tuple, int] = {}
        for merged, row_values in rows:
            for node in range(1, len(merged.tokens)):
                path = merged.paths[node]
                values[path] = values.get(path, 0.0) + row_values[node]
                levels[path] = min(levels.get(path, merged.levels[node]), merged.levels[node])
        return values, levels

    def _fill(self, tree: Tree, rows: list[tuple]) -> tuple[list[list], list[list], list[list]]:
        """tokens, probs, groups [B][N] on the step's tree; a row's nodes it lacks: its root token,
        probability 0."""
        n = tree.num_nodes
        index = {path: i for i, path in enumerate(tree.choices, start=1)}
        tokens, probs, groups = [], [], []
        for merged, _ in rows:
            t, p, g = [merged.tokens[0]] * n, [1.0] + [0.0] * (n - 1), [0] * n
            for node in range(1, len(merged.tokens)):
                i = index.get(merged.paths[node])
                if i is not None:
                    t[i], p[i], g[i] = merged.tokens[node], merged.node_probs[node], merged.groups[node]
            tokens.append(t)
            probs.append(p)
            groups.append(g)
        return tokens, probs, groups

    # ----- pricing -----

    def verify_table(self, rows: int) -> list[float]:
        """Seconds of verifying k nodes in each of `rows` rows, by k (index 0 unused), at the rows' mean
        prefix rounded down to `prefix_bucket` tokens; made non-decreasing (a measured curve can price k
        nodes above k + 1 by noise)."""
        prefix = sum(self.prefixes[:rows]) // max(1, rows)
        key = (prefix // self.prefix_bucket * self.prefix_bucket, rows)
        if key not in self.verify_tables:
            table = [self.verify_seconds(rows * k, key[0]) for k in range(1, self.tree.num_nodes + 1)]
            for k in range(len(table) - 2, -1, -1):
                table[k] = min(table[k], table[k + 1])
            self.verify_tables[key] = [0.0, *table]
        return self.verify_tables[key]

    def learn_step(self, seconds: float) -> None:
        """Teach `step_costs` what the last step took, unless it took over `slow_step` times its price:
        such a step paid a one-time cost (a first use, a compilation, a pause). After `max_slow_steps`
        of them in a row the machine has changed, and they are learned."""
        rest, slope = self.step_costs.line
        price = max(self.predicted_seconds, self.predicted_seconds + rest + slope * self.predicted_extra)
        if seconds > self.slow_step * price and self.slow_streak < self.max_slow_steps:
            self.slow_streak += 1
            self.counts["slow_steps"] += 1
            return
        self.slow_streak = 0
        self.step_costs.record(self.predicted_extra, seconds - self.predicted_seconds)

    def _count_root_only(self, root_only: bool) -> None:
        """After `patience` steps in a row where the root alone paid best, skip drafting for a while."""
        if not root_only:
            self.root_only_streak, self.skip = 0, 1
            return
        self.root_only_streak += 1
        if self.root_only_streak >= self.patience:
            self.skip_left, self.skip = self.skip, min(2 * self.skip, self.max_skip)
            self.root_only_streak = 0

    def level_rates(
        self, order, values, path_levels, drafted: int, table: list[float], B: int
    ) -> list[float]:
        """For d = 0..drafted: the best expected tokens per second had only levels 1..d been drafted
        (nodes of level 0, drafted whole, always count)."""
        prices, rates = self.step_costs.prices(table), []
        for d in range(drafted + 1):
            fixed = self.draft_costs(d)
            ranked = [values[p] for p in order if path_levels[p] <= d]
            k = best_prefix(ranked, B, lambda n, fixed=fixed: fixed + prices[n], len(table) - 2)
            rates.append((B + sum(ranked[:k])) / (fixed + prices[k + 1]))
        return rates

    def choose_levels(self, rates: Sequence[float], drafted: int) -> None:
        """Learn what each level adds from this step's `rates` (gain_d = log(rate_d / rate_d-1), a
        running mean that moves halfway to a gain not priced for `explore_after` steps) and set the level
        count of the next step: the one with the largest summed gains, or every level when that is the
        deepest drafted and a deeper level's gain is stale (not priced for `explore_interval` steps:
        `explore_after`, doubled after each exploration that found no deeper count worth drafting)."""
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
        if self.explored_from is not None and drafted == self.max_levels:  # an exploration was priced
            found = best > self.explored_from
            self.explore_interval = (
                self.explore_after if found else min(2 * self.explore_interval, self.max_explore_after)
            )
            self.explored_from = None
        stale = any(
            self.gain_age.get(d, self.explore_interval) >= self.explore_interval
            for d in range(best + 1, self.max_levels + 1)
        )
        self.levels = best
        if best == drafted < self.max_levels and stale:
            self.levels, self.explored_from = self.max_levels, best

    def learned(self) -> dict:
        """What the pricer has learned so far, for reports: the step-cost line (rest of the step in ms,
        the slope correcting the curve, tree steps behind it), the next level count and each level's
        mean gain, and the pooled calibration (observed acceptance per draft-probability bin)."""
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
