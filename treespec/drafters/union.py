"""The union of two drafters' trees: e.g. Medusa heads and suffix decoding verified in one tree.

Drafters guess differently: heads read the target's hidden state, suffix decoding and prompt lookup copy
what followed the same words earlier. `UnionDrafter(primary, secondary)` proposes, every step, one tree
holding both drafters' trees of that step (each one's `Proposal.tree`, or its static `tree`):

- identical token paths merge: a node both drafters proposed (the same tokens from the root down) is one
  node, and what either proposed below it merges the same way, so every distinct continuation is verified
  once (duplicates inside one drafter's tree, e.g. a lookup chain that repeats the heads' guess, merge too);
- a node a drafter did not draft this step (probability 0: a level beyond `max_depth`, a lookup filler, a
  suffix row without a match) is left out, with everything below it;
- each node keeps who proposed it: its probability is 1 - (1 - p1)(1 - p2) over the drafters that did,
  its drafting level the smallest of theirs (a drafter that does not limit depth drafts its nodes whole:
  level 0), and its calibration group (`Proposal.groups`) is 3 g + s, s = 0 primary only, 1 secondary
  only, 2 both, g the group the drafter gave it (the primary's for a shared node). `DynamicTreeDrafter`
  calibrates each group on its own record, so it learns how far to trust each source at each level.

Children are ranked the primary's first (in its order), then the secondary's new ones. In a batch each
row merges its own proposals; the rows' rank paths are joined into the step's one tree (the most valuable
first, value: the product of the node probabilities down the path, at most `max_nodes` nodes), and a row
fills nodes it lacks with its root token at probability 0, as `SuffixDrafter` does. The declared `tree`
is both drafters' declared trees side by side under the root (the secondary's at new first-level ranks),
the largest tree a step proposes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..core.drafting import (
    BaseDrafter,
    Drafter,
    DrafterReport,
    Proposal,
    Scorer,
    SequenceStart,
    StepTrees,
    step_layout,
)
from ..core.tree import Tree

SOURCES = 3  # calibration groups per group of a drafter: primary only, secondary only, both
BOTH = 2
MAX_STEP_TREES = 512  # distinct step trees a drafter keeps (the decoder keeps as many layouts)


@dataclass
class _Side:
    """One drafter's proposal of this step as lists: parents [N]; tokens, probs, levels, groups [B][N]."""

    parents: list[int]
    tokens: list[list[int]]
    probs: list[list[float]]
    levels: list[list[int]]
    groups: list[list[int]]


class _MergedRow:
    """One row's merged tree: node 0 is the root; per node its parent, token, rank path and, per source,
    its probability (0: that source did not propose it), drafting level and calibration group."""

    def __init__(self, root: int):
        self.parents, self.tokens, self.paths = [-1], [root], [()]
        self.children: list[dict[int, int]] = [{}]  # token -> node
        self.probs: list[list[float]] = [[1.0, 1.0]]
        self.levels: list[list[int]] = [[0, 0]]
        self.groups: list[list[int]] = [[0, 0]]

    def add(self, parent: int, token: int, source: int, prob: float, level: int, group: int) -> int:
        """The node for `token` under `parent` (made when new), now also proposed by `source`."""
        node = self.children[parent].get(token)
        if node is None:
            node = len(self.tokens)
            self.children[parent][token] = node
            self.parents.append(parent)
            self.tokens.append(token)
            self.paths.append((*self.paths[parent], len(self.children[parent]) - 1))
            self.children.append({})
            self.probs.append([0.0, 0.0])
            self.levels.append([level, level])
            self.groups.append([group, group])
        if self.probs[node][source] == 0.0:
            self.levels[node][source], self.groups[node][source] = level, group
        else:  # the same source proposed it twice (e.g. a lookup chain beside the heads' guess)
            self.levels[node][source] = min(self.levels[node][source], level)
        self.probs[node][source] = max(self.probs[node][source], prob)
        return node

    def merged(self) -> tuple[list[float], list[int], list[int], list[float]]:
        """Per node: (combined probability, drafting level, calibration group, value: the product of
        the combined probabilities from the root down)."""
        probs, levels, groups, values = [1.0], [0], [0], [1.0]
        for node in range(1, len(self.tokens)):
            p = self.probs[node]
            has = [s for s in (0, 1) if p[s] > 0]
            probs.append(min(1.0, 1.0 - (1.0 - p[0]) * (1.0 - p[1])))
            levels.append(min(self.levels[node][s] for s in has))
            groups.append(SOURCES * self.groups[node][has[0]] + (BOTH if len(has) == 2 else has[0]))
            values.append(values[self.parents[node]] * probs[-1])
        return probs, levels, groups, values


class UnionDrafter(BaseDrafter):
    """Each step the union of two drafters' trees, identical token paths merged and every node tagged
    with the drafter(s) that proposed it (module docstring). Standalone, as the inner drafter of
    `DynamicTreeDrafter` (which prunes the union per source) or of `LookupDrafter`; either drafter may
    itself be a `LookupDrafter` (e.g. heads + lookup chain, then the suffix tree).

    max_nodes: the most nodes (root included) of a step's tree (default and most: the declared tree's,
    the sum of both drafters' trees less one root). limit_secondary: whether `max_depth` (a dynamic tree's
    level count) limits the secondary too. Default False: the secondary drafts its whole tree every step
    (its nodes: level 0, priced node by node), as suits a cheap secondary (suffix decoding, prompt lookup)
    beside heads whose levels cost; True for a secondary whose levels cost too (an EAGLE drafter)."""

    def __init__(
        self,
        primary: Drafter,
        secondary: Drafter,
        max_nodes: int | None = None,
        limit_secondary: bool = False,
    ):
        for drafter in (primary, secondary):
            if drafter.scorer() is not None:
                raise ValueError(
                    "a union of trees needs the decoder's own verification (a self-speculative drafter "
                    "verifies only its own chain)"
                )
        layers = [tuple(primary.feature_layers), tuple(secondary.feature_layers)]
        if all(layers) and layers[0] != layers[1]:
            raise ValueError(
                f"both drafters read the target's features, from different layers ({layers[0]} and "
                f"{layers[1]}); a union passes one set of features to the drafters that read them"
            )
        self.primary, self.secondary = primary, secondary
        # per drafter: whether max_depth goes to it (else it drafts whole: its nodes' level is 0)
        self.limits = [primary.limits_depth, secondary.limits_depth and limit_secondary]
        self.feature_layers = layers[0] or layers[1]
        self.reads_features = [bool(layers[0]), bool(layers[1])]
        rank = 1 + max((p[0] for p in primary.tree.choices), default=-1)  # the secondary's first rank
        moved = [(p[0] + rank, *p[1:]) for p in secondary.tree.choices]
        self.tree = Tree.from_choices([*primary.tree.choices, *moved])
        cap = self.tree.num_nodes if max_nodes is None else max_nodes
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= self.tree.num_nodes:
            raise ValueError(f"max_nodes must be an int in [1, {self.tree.num_nodes}], got {max_nodes!r}")
        self.max_nodes = cap
        index = {(): 0} | {p: i + 1 for i, p in enumerate(self.tree.choices)}
        self.primary_nodes = torch.tensor([index[p] for p in [(), *primary.tree.choices]])  # [N1]
        self.secondary_nodes = torch.tensor([0] + [index[p] for p in moved])  # [N2]
        self._tree_for = StepTrees(MAX_STEP_TREES)  # choice paths -> the step's tree (bounded)
        self.counts = dict.fromkeys(("steps", "rows", "nodes", "primary", "secondary", "both"), 0)

    @property
    def batched(self) -> bool:
        return self.primary.batched and self.secondary.batched

    @property
    def limits_depth(self) -> bool:
        """propose(..., max_depth=D) limits the drafters that limit depth (the others draft whole)."""
        return any(self.limits)

    @property
    def target_topk(self) -> int:
        return max(self.primary.target_topk, self.secondary.target_topk)

    @property
    def node_levels(self) -> torch.Tensor:
        """[N] on the declared tree: each drafter's levels at its nodes (0 for one that drafts whole)."""
        levels = torch.zeros(self.tree.num_nodes, dtype=torch.long)
        for source, nodes in ((1, self.secondary_nodes), (0, self.primary_nodes)):  # the root: primary's
            if self.limits[source]:
                levels[nodes] = self._drafters()[source][0].node_levels
        return levels

    def _drafters(self) -> list[tuple[Drafter, bool]]:
        return [(self.primary, self.reads_features[0]), (self.secondary, self.reads_features[1])]

    def start(self, sequence: SequenceStart) -> None:
        """Both drafters start (the target's features go to those that read them)."""
        for drafter, reads in self._drafters():
            drafter.start(sequence if reads else dataclasses.replace(sequence, features=None))

    def keep_rows(self, rows: list[int]) -> None:
        self.primary.keep_rows(rows)
        self.secondary.keep_rows(rows)

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        for drafter, reads in self._drafters():
            drafter.observe(committed, features if reads else None)

    def verified(self, tokens: torch.Tensor, top_tokens: torch.Tensor) -> None:
        """The whole verified tree goes to each drafter that asks, with the top-k it asked for."""
        for drafter in (self.primary, self.secondary):
            if drafter.target_topk > 0:
                drafter.verified(tokens, top_tokens[..., : drafter.target_topk])

    def report(self) -> DrafterReport:
        """Both drafters' statistics and caches, and the union's counts (rows drafted, nodes in the step
        trees, nodes proposed by the primary only, the secondary only, both); memory of a kind both hold
        (e.g. "allocated": a draft model's cache and the recycling table) adds up."""
        first, second = self.primary.report(), self.secondary.report()
        stats = {**second.stats, **first.stats, "union": dict(self.counts)}
        memory = dict(first.cache_memory)
        for kind, size in second.cache_memory.items():
            memory[kind] = memory.get(kind, 0) + size
        return DrafterReport(stats, memory)

    def scorer(self) -> Scorer | None:
        return None  # refused at construction for drafters with their own

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        """tokens, probs, levels, groups: [B, N] over the step's merged tree (`Proposal.tree`)."""
        sides = [self._side(source, hidden, roots, max_depth) for source in (0, 1)]
        rows = [self._merge_row(r, int(root), sides) for r, root in enumerate(roots.reshape(-1).tolist())]
        merged = [row.merged() for row in rows]
        tree = self._tree_for(self._join(rows, merged))
        tokens, probs, levels, groups = self._fill(tree, rows, merged)
        self.counts["steps"] += 1
        self.counts["nodes"] += tree.num_nodes
        return Proposal(
            torch.tensor(tokens, dtype=torch.long, device=hidden.device),
            torch.tensor(probs, dtype=torch.float32),
            tree=tree,
            levels=torch.tensor(levels, dtype=torch.long),
            groups=torch.tensor(groups, dtype=torch.long),
        )

    def _side(self, source: int, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None) -> _Side:
        """One drafter's proposal of this step (its own tree, levels and groups) as lists."""
        drafter = self._drafters()[source][0]
        proposal = drafter.propose(hidden, roots, max_depth if self.limits[source] else None)
        tree, levels, groups = step_layout(drafter, proposal)
        probs = proposal.probs
        probs = torch.ones(proposal.tokens.shape) if probs is None else probs.float().cpu()  # [B, N]
        if not self.limits[source]:
            levels = torch.zeros_like(levels)  # drafted whole, whatever max_depth
        return _Side(
            tree.parents.tolist(), proposal.tokens.tolist(), probs.tolist(), levels.tolist(), groups.tolist()
        )

    def _merge_row(self, row: int, root: int, sides: list[_Side]) -> _MergedRow:
        """Row `row`'s two trees merged by token path (nodes with probability 0 and below them: left out)."""
        merged = _MergedRow(root)
        for source, side in enumerate(sides):
            where = [0] + [-1] * (len(side.parents) - 1)  # the side's node -> merged node (-1: left out)
            tokens, probs = side.tokens[row], side.probs[row]
            levels, groups = side.levels[row], side.groups[row]
            for i in range(1, len(side.parents)):
                parent = where[side.parents[i]]
                if parent >= 0 and probs[i] > 0:
                    where[i] = merged.add(parent, tokens[i], source, probs[i], levels[i], groups[i])
        self.counts["rows"] += 1
        for p in merged.probs[1:]:
            key = "both" if p[0] > 0 and p[1] > 0 else ("primary" if p[0] > 0 else "secondary")
            self.counts[key] += 1
        return merged

    def _join(self, rows: list[_MergedRow], merged: list[tuple]) -> list[tuple[int, ...]]:
        """The rows' rank paths, the most valuable first (in any row), at most max_nodes - 1. A parent is
        worth at least its child in every row and sorts first on ties, so the set stays a tree."""
        best: dict[tuple[int, ...], float] = {}
        for row, (_, _, _, values) in zip(rows, merged, strict=True):
            for path, value in zip(row.paths[1:], values[1:], strict=True):
                best[path] = max(best.get(path, -1.0), value)
        return sorted(best, key=lambda c: (-best[c], len(c), c))[: self.max_nodes - 1]

    def _fill(self, tree: Tree, rows: list[_MergedRow], merged: list[tuple]) -> tuple[list, ...]:
        """tokens, probs, levels, groups [B][N] on the step's tree; a row's nodes it lacks: its root token,
        probability 0, level the node's depth, group 0."""
        n = tree.num_nodes
        index = {path: i for i, path in enumerate(tree.choices, start=1)}
        depth = tree.depth.tolist()
        tokens, probs, levels, groups = [], [], [], []
        for row, (row_probs, row_levels, row_groups, _) in zip(rows, merged, strict=True):
            t, p, lv, g = [row.tokens[0]] * n, [1.0] + [0.0] * (n - 1), list(depth), [0] * n
            for node in range(1, len(row.tokens)):
                i = index.get(row.paths[node])
                if i is not None:
                    t[i], p[i], lv[i], g[i] = (
                        row.tokens[node],
                        row_probs[node],
                        row_levels[node],
                        row_groups[node],
                    )
            tokens.append(t)
            probs.append(p)
            levels.append(lv)
            groups.append(g)
        return tokens, probs, levels, groups
