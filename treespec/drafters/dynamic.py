"""Dynamic trees: each step verifies only the nodes worth their cost on this machine.

`DynamicTreeDrafter` wraps any drafter that gives each node a probability (heads, sequential heads,
the EAGLE-style drafter, a draft model with runners-up, a prompt-lookup branch with its own hit rates).
Every step:

1. the inner drafter fills its (largest) tree; each node gets a *calibrated* acceptance probability
   a_i = P(node accepted | parent accepted), read from a table of draft probability -> observed
   acceptance (`AcceptanceCalibration`, learned online from every verified step, starting from a prior);
2. a node's value is the probability that verification reaches it: v_i = a_i x v_parent (v_root = 1),
   so E[accepted length] of a connected set S = 1 + sum of v_i over S (the root always counts);
3. nodes sorted by value (parents never after their children) are taken while they pay: the kept
   prefix of k nodes maximises E[accepted](k) / (draft seconds + verify seconds(k + 1, prefix)), with
   the verification cost from this machine's cost curve (`verify_seconds`) and the drafting cost timed
   as it runs. The kept set can be the root alone;
4. when the root alone won `patience` steps in a row, drafting itself is skipped for a while (doubling
   up to `max_skip` steps), so a drafter that does not pay costs almost nothing;
5. an inner drafter that drafts level by level (`limits_depth`: sequential heads, the EAGLE drafter)
   drafts only as deep as the deepest tree kept over the last `depth_window` steps: each level costs a
   read of its output rows, and levels no kept tree reaches are not drafted. A step that keeps a node
   at the deepest level it drafted lets the next one draft a level further.

What it learns (the calibration, the drafting cost, the depths kept) describes the drafter on this
machine, not one prompt: it carries over to the next sequence, so a drafter reused across `generate`
calls starts warm. The step's tree and its prediction go into the proposal (`Proposal.tree`,
`expected_accept`); the decoder records predicted against observed accepted length per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..core.tree import Tree
from .base import BaseDrafter, Drafter, DrafterReport, Proposal, Scorer, SequenceStart


class AcceptanceCalibration:
    """P(node accepted | parent accepted) as a function of the drafter's probability for the node, in
    probability bins, from counts of verified nodes whose parent was accepted; each bin starts from a
    prior of `prior_weight` pseudo-observations at `prior_scale` x its centre."""

    def __init__(self, bins: int = 10, prior_weight: float = 4.0, prior_scale: float = 0.5):
        self.edges = torch.linspace(0, 1, bins + 1)[1:-1]  # [bins - 1] inner edges
        centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins  # [bins]
        self.proposed = torch.full((bins,), prior_weight, dtype=torch.float64)
        self.accepted = prior_weight * prior_scale * centres

    def bin(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(probs.double().clamp(0, 1), self.edges.double())  # [n]

    def predict(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [n] -> calibrated acceptance probabilities [n] (float64)."""
        b = self.bin(probs)
        return self.accepted[b] / self.proposed[b]

    def update(self, probs: torch.Tensor, accepted: torch.Tensor) -> None:
        """probs [m] of nodes whose parent was accepted; accepted [m] bool: whether they were."""
        b = self.bin(probs)
        self.proposed.index_add_(0, b, torch.ones_like(b, dtype=torch.float64))
        self.accepted.index_add_(0, b, accepted.double())


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


class DynamicTreeDrafter(BaseDrafter):
    """Prunes the inner drafter's tree every step to the nodes worth verifying (module docstring).

    verify_seconds(nodes, prefix): this machine's verification cost (e.g. from the cost curve,
    `training.costs.verify_cost_model`); the inner drafter's `tree` is the largest tree a step may use."""

    def __init__(
        self,
        inner: Drafter,
        verify_seconds: Callable[[int, int], float],
        calibration: AcceptanceCalibration | None = None,
        patience: int = 4,
        max_skip: int = 8,
        depth_window: int = 8,
    ):
        if inner.scorer() is not None:
            raise ValueError(
                "a dynamic tree needs the decoder's own verification (this drafter brings its own)"
            )
        self.inner, self.tree = inner, inner.tree
        self.feature_layers = tuple(getattr(inner, "feature_layers", ()))
        self.verify_seconds = verify_seconds
        self.calibration = calibration or AcceptanceCalibration()
        self.patience, self.max_skip = patience, max_skip
        self.depth_window = depth_window
        self.inner_limits_depth = bool(getattr(inner, "limits_depth", False))
        self.parents = inner.tree.parents.tolist()  # [N]
        self.choices = [(), *inner.tree.choices]
        self.index = {c: i for i, c in enumerate(self.choices)}  # choice path -> node of the inner tree
        self.root_tree = Tree.from_choices([])
        self.pruned: dict[tuple[int, ...], tuple[Tree, list[int]]] = {}  # kept nodes -> tree, node order
        # learned about this drafter on this machine, kept across sequences (a reused drafter starts warm):
        self.draft_seconds = 0.0  # running estimate of one inner propose
        self.kept_depths: list[int] = []  # depth of the tree kept by each of the last steps (drafted ones)
        self.reached_limit = False  # the last drafted step kept a node at the deepest level it drafted
        self._reset()

    def _reset(self) -> None:
        """Per-sequence state; the calibration, drafting cost and kept depths carry over."""
        self.prefix = 0
        self.root_only_streak, self.skip, self.skip_left = 0, 1, 0
        self.last: tuple[Tree, torch.Tensor, torch.Tensor] | None = None  # tree, tokens [n], probs [n]
        self.counts = {"steps": 0, "skipped": 0, "nodes": 0, "levels": 0}

    def start(self, sequence: SequenceStart) -> None:
        self._reset()
        self.prefix = len(sequence.tokens)
        self.inner.start(sequence)

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        self.counts["steps"] += 1
        if self.skip_left > 0:  # trees have not paid lately: plain step, no drafting
            self.skip_left -= 1
            self.counts["skipped"] += 1
            self.last = None
            return Proposal(
                roots.reshape(1, 1).to(hidden.device), None, tree=self.root_tree, expected_accept=1.0
            )
        t0 = time.perf_counter()
        depth = self.draft_depth()
        if depth < self.tree.max_depth:
            full = self.inner.propose(hidden, roots, max_depth=depth)
        else:
            full = self.inner.propose(hidden, roots)
        self.counts["levels"] += depth
        elapsed = time.perf_counter() - t0
        self.draft_seconds = elapsed if not self.draft_seconds else 0.8 * self.draft_seconds + 0.2 * elapsed
        if full.probs is None:
            raise ValueError("a dynamic tree needs the inner drafter's node probabilities (Proposal.probs)")
        probs = full.probs[0].float().cpu()  # [N]
        accept = self.calibration.predict(probs).tolist()  # [N]
        values = [1.0] * len(accept)
        for i in range(1, len(accept)):  # parents come first in node order
            values[i] = values[self.parents[i]] * accept[i]
        kept, expected = choose_nodes(
            values, self.parents, lambda n: self.draft_seconds + self.verify_seconds(n, self.prefix)
        )
        tree, order = self.pruned_tree(tuple(kept))
        index = torch.tensor(order, device=full.tokens.device)  # [n]
        tokens, node_probs = full.tokens[:, index], full.probs[:, index]
        self.last = (tree, tokens[0].cpu(), node_probs[0].float().cpu())
        self.counts["nodes"] += tree.num_nodes
        self.kept_depths = (self.kept_depths + [tree.max_depth])[-self.depth_window :]
        self.reached_limit = 0 < depth == tree.max_depth
        if tree.num_nodes == 1:
            self.root_only_streak += 1
            if self.root_only_streak >= self.patience:
                self.skip_left, self.skip = self.skip, min(2 * self.skip, self.max_skip)
                self.root_only_streak = 0
        else:
            self.root_only_streak, self.skip = 0, 1
        return Proposal(tokens, node_probs, tree=tree, expected_accept=expected)

    def pruned_tree(self, kept: tuple[int, ...]) -> tuple[Tree, list[int]]:
        """The tree of the kept nodes of the inner tree (sorted, root first) and, for each of its nodes in
        canonical order, the inner node it is; built once per distinct kept set."""
        if kept not in self.pruned:
            tree = Tree.from_choices([self.choices[i] for i in kept[1:]])
            # the new tree's node j is choices[j - 1]: its inner node
            self.pruned[kept] = (tree, [0] + [self.index[c] for c in tree.choices])
        return self.pruned[kept]

    def draft_depth(self) -> int:
        """Levels the inner drafter drafts this step: as deep as the deepest tree kept lately, one more
        when the last step kept a node at the deepest level it drafted (all levels until a window of
        steps is seen, or when the inner drafter cannot limit its depth)."""
        if not self.inner_limits_depth or len(self.kept_depths) < self.depth_window:
            return self.tree.max_depth
        return min(self.tree.max_depth, max(1, max(self.kept_depths) + self.reached_limit))

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Calibrate on what was verified: every node whose parent was accepted, accepted or not."""
        tokens_committed = committed[0]
        self.prefix += len(tokens_committed)
        if self.last is not None and self.last[0].num_nodes > 1:
            tree, tokens, probs = self.last
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
                self.calibration.update(probs[seen], torch.tensor(hits))
        if self.feature_layers:
            self.inner.observe(committed, features)
        else:
            self.inner.observe(committed)

    def report(self) -> DrafterReport:
        inner = self.inner.report()
        return DrafterReport({**inner.stats, "dynamic": dict(self.counts)}, inner.cache_memory)

    def scorer(self) -> Scorer | None:
        return None
