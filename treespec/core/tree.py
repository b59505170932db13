"""Static candidate trees for Medusa-style tree speculation.

A tree is a list of "choice paths". Node 0 is the root: the next token picked by the
base model itself. A path ``[r1, ..., rd]`` is the node reached by taking drafting head
0's rank-r1 candidate, then head 1's rank-r2 candidate below it, and so on; so a node at
depth d comes from head d-1 and its rank is the last element of its path.

Nodes are numbered in canonical order, sorted by (path length, path), so a parent always
has a smaller index than its children and node ``i + 1`` is ``tree.choices[i]``.
Everything the decoding loop needs (parents, the attention mask, the paths to verify)
is computed once here as small CPU tensors; move them to the device once per run.
"""

from __future__ import annotations

import heapq
import json
import math
import numbers
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import networkx as nx
import torch

from ..io import atomic_write_text

FORMAT = "treespec.tree"
VERSION = 1

Choice = tuple[int, ...]  # one choice path, e.g. (0, 1)


class Tree:
    """A static speculation tree. Immutable by convention: don't edit its tensors in place.

    Attributes (N = num_nodes, root included):
        choices: canonical choice paths; node i + 1 is choices[i].
        num_nodes: N.
        max_depth: length of the longest path = number of drafting heads used (0 for a root-only tree).
        max_rank: 1 + the largest rank used = the top-k each head must provide (0 for a root-only tree).
        num_leaves: number of nodes without children.
        parents: [N] int64, parent node index; parents[0] = -1.
        depth: [N] int64, path length; depth[0] = 0.
        head: [N] int64, drafting head = depth - 1; head[0] = -1.
        rank: [N] int64, rank within the head's top-k; rank[0] = 0.
        ancestor_mask: [N, N] bool, [i, j] True iff j is i or an ancestor of i (the tree attention mask).
        ancestor_bits: [N, ceil(N / 64)] int64, ancestor_mask packed: bit j % 64 of word j // 64.
        leaf_paths: [num_leaves, max_depth + 1] int64, node indices root..leaf padded with -1,
            one row per leaf in increasing leaf index (Medusa's "retrieve indices").
    """

    def __init__(self, choices: Sequence[Sequence[int]]):
        """Validate and canonicalise ``choices``; see :meth:`from_choices`."""
        self.choices: tuple[Choice, ...] = _canonical_choices(choices)
        index = {(): 0} | {p: i + 1 for i, p in enumerate(self.choices)}
        paths: list[Choice] = [(), *self.choices]
        n = len(paths)

        self.num_nodes = n
        self.max_depth = max((len(p) for p in paths), default=0)
        self.max_rank = 1 + max((p[-1] for p in self.choices), default=-1)

        parent_list = [-1] + [index[p[:-1]] for p in self.choices]
        self._parent_list = parent_list
        self._children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            self._children[parent_list[i]].append(i)  # ascending, i.e. by rank
        leaves = [i for i in range(n) if not self._children[i]]
        self.num_leaves = len(leaves)

        self.parents = torch.tensor(parent_list, dtype=torch.long)  # [N]
        self.depth = torch.tensor([len(p) for p in paths], dtype=torch.long)  # [N]
        self.head = self.depth - 1  # [N]
        self.rank = torch.tensor([p[-1] if p else 0 for p in paths], dtype=torch.long)  # [N]

        # node i's ancestors (itself included) as the bits of one Python int; parents come first, so
        # theirs are complete. Then the bits as int64 words and the mask, each in one tensor call (a
        # planner makes a new tree in many steps, and N small tensor operations cost more than a step's
        # drafting arithmetic)
        ancestors = [1]
        for i in range(1, n):
            ancestors.append(ancestors[parent_list[i]] | (1 << i))
        words = (n + 63) // 64
        bits = [[_signed64((a >> (64 * w)) & _WORD) for w in range(words)] for a in ancestors]
        self.ancestor_bits = torch.tensor(bits, dtype=torch.long)  # [N, W]
        self.ancestor_mask = unpack_bits(self.ancestor_bits, n)  # [N, N]

        width = self.max_depth + 1  # [L, D + 1] leaf paths, padded with -1
        rows = [path + [-1] * (width - len(path)) for path in map(self.path_to, leaves)]
        self.leaf_paths = torch.tensor(rows, dtype=torch.long).reshape(len(leaves), width)

    # ----- construction -----

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]], max_depth: int | None = None) -> Tree:
        """Build a tree from Medusa-style choice paths, in any order.

        Raises ValueError naming the offending path for an empty path, a negative or
        non-integer rank, a duplicate, a path whose parent path is missing, or (when
        ``max_depth`` is given) a path needing more drafting heads than ``max_depth``.
        Missing earlier siblings are fine: ``[[1]]`` alone is a valid tree.
        """
        tree = cls(choices)
        if max_depth is not None:
            if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
                raise ValueError(f"max_depth must be a non-negative int, got {max_depth!r}")
            for path in tree.choices:
                if len(path) > max_depth:
                    raise ValueError(
                        f"choice path {list(path)} needs {len(path)} drafting heads "
                        f"but the drafter has max_depth={max_depth}"
                    )
        return tree

    @classmethod
    def chain(cls, depth: int) -> Tree:
        """The root followed by a chain of `depth` rank-0 nodes (depth + 1 nodes)."""
        return cls.from_choices([(0,) * d for d in range(1, depth + 1)])

    @classmethod
    def from_acceptance(cls, acceptance: Sequence[Sequence[float]], num_nodes: int) -> Tree:
        """The ``num_nodes``-node tree (root included) with the largest expected accepted length.

        ``acceptance[h][r]`` is the probability that head h's rank-r candidate is accepted given
        that its parent was. A node's value is the product of acceptances along its path, which
        never grows going down a path, so taking the best frontier node greedily is optimal.
        Ties go to the shorter, then lexicographically smaller, path.
        """
        table = _acceptance_table(acceptance)
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1 (the root counts), got {num_nodes!r}")
        capacity, width = 1, 1
        for row in table:
            width *= len(row)
            capacity += width
        if num_nodes > capacity:
            raise ValueError(f"num_nodes={num_nodes} but the acceptance table only allows {capacity} nodes")

        def push_children(path: Choice, value: float) -> None:
            if len(path) < len(table):
                for r, p in enumerate(table[len(path)]):
                    child = (*path, r)
                    heapq.heappush(frontier, (-value * p, len(child), child))

        frontier: list[tuple[float, int, Choice]] = []
        push_children((), 1.0)
        chosen: list[Choice] = []
        while len(chosen) < num_nodes - 1:
            neg_value, _, path = heapq.heappop(frontier)
            chosen.append(path)
            push_children(path, -neg_value)
        return cls(chosen)

    # ----- queries -----

    def __len__(self) -> int:
        return self.num_nodes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and self.choices == other.choices

    def __hash__(self) -> int:
        return hash(self.choices)

    def __repr__(self) -> str:
        return (
            f"Tree(num_nodes={self.num_nodes}, max_depth={self.max_depth}, "
            f"max_rank={self.max_rank}, num_leaves={self.num_leaves})"
        )

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``, both included."""
        self._check_node(node)
        path = []
        while node >= 0:
            path.append(node)
            node = self._parent_list[node]
        return path[::-1]

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in increasing index (= increasing rank) order."""
        self._check_node(node)
        return list(self._children[node])

    def token_index(self, topk: int) -> torch.Tensor:
        """[N] int64 index of each node's token in ``cat([root_token[1], topk_tokens.flatten()])``.

        ``topk_tokens`` is the drafter's [num_heads, topk] candidate grid: the root maps to 0,
        any other node to ``1 + head * topk + rank``. Needs ``topk >= max_rank``.
        """
        if topk < self.max_rank:
            raise ValueError(f"topk={topk} is smaller than the tree's max_rank={self.max_rank}")
        return torch.where(self.head < 0, 0, 1 + self.head * topk + self.rank)  # [N]

    def levels(self, device=None) -> list[tuple]:
        """Per depth d, what drafting level by level needs, on `device`: (expanded [n_d] nodes at depth d
        with children, their parents [n_d] (the root's entry is 0, unused), children [c_d] at depth d+1,
        each child's parent's row in `expanded` [c_d], each child's rank [c_d], the top-k the level needs)."""
        levels = []
        for d in range(self.max_depth):
            children = (self.depth == d + 1).nonzero().flatten()  # [c_d]
            expanded = torch.unique(self.parents[children])  # [n_d]
            row = torch.searchsorted(expanded, self.parents[children])  # [c_d]
            rank = self.rank[children]  # [c_d]
            parents = self.parents[expanded].clamp(min=0)  # [n_d]
            tensors = (expanded, parents, children, row, rank)
            levels.append(tuple(t.to(device) for t in tensors) + (int(rank.max()) + 1,))
        return levels

    def expected_accept_length(self, acceptance: Sequence[Sequence[float]]) -> float:
        """1 (the root) + the sum over other nodes of the product of acceptances along their path."""
        table = _acceptance_table(acceptance)
        prob = [1.0]
        for i, path in enumerate(self.choices):
            h, r = len(path) - 1, path[-1]
            if h >= len(table) or r >= len(table[h]):
                raise ValueError(f"choice path {list(path)}: no acceptance for head {h} rank {r}")
            prob.append(prob[self._parent_list[i + 1]] * table[h][r])
        return math.fsum(prob)

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} out of range for a tree of {self.num_nodes} nodes")

    # ----- serialisation -----

    def to_json(self) -> str:
        """``{"format": "treespec.tree", "version": 1, "choices": [...]}``."""
        return json.dumps({"format": FORMAT, "version": VERSION, "choices": [list(p) for p in self.choices]})

    @classmethod
    def from_calibration(cls, acceptance: str | Path | Sequence[Sequence[float]], num_nodes: int) -> Tree:
        """`from_acceptance` on a measured table, or on the acceptance.json that calibrate_tree.py writes."""
        if isinstance(acceptance, (str, Path)):
            path = Path(acceptance)
            try:
                acceptance = json.loads(path.read_text())["acceptance"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise ValueError(
                    f"{path} is not an acceptance file from scripts/calibrate_tree.py: {error}"
                ) from error
        return cls.from_acceptance(acceptance, num_nodes)

    @classmethod
    def from_json(cls, text: str, max_depth: int | None = None, source: str = "<string>") -> Tree:
        """Parse :meth:`to_json` output; errors are ValueErrors starting with ``source``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: not valid JSON: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f'{source}: not a tree file (expected a JSON object with "format": "{FORMAT}")')
        version = data.get("version")
        if isinstance(version, bool) or version != VERSION:
            raise ValueError(f"{source}: unsupported tree file version {version!r} (expected {VERSION})")
        if "choices" not in data:
            raise ValueError(f'{source}: missing "choices"')
        try:
            return cls.from_choices(data["choices"], max_depth=max_depth)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` (atomically: a crash leaves the old file or the new one)."""
        atomic_write_text(Path(path), self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path, max_depth: int | None = None) -> Tree:
        """Read a tree file; a malformed file raises ValueError naming the file and the problem."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text: {e}") from None
        return cls.from_json(text, max_depth=max_depth, source=str(path))

    def to_networkx(self) -> nx.DiGraph:
        """Nodes 0..N-1 with attributes depth, head, rank and choice (a tuple); edges parent -> child."""
        graph = nx.DiGraph()
        for i, path in enumerate([(), *self.choices]):
            graph.add_node(i, depth=len(path), head=len(path) - 1, rank=path[-1] if path else 0, choice=path)
        graph.add_edges_from((int(self.parents[i]), i) for i in range(1, self.num_nodes))
        return graph

    @classmethod
    def from_networkx(cls, graph: nx.DiGraph) -> Tree:
        """Inverse of :meth:`to_networkx`.

        Uses the ``choice`` node attribute when every node has one; otherwise rebuilds the
        paths from the edges (which must form a tree) and each non-root node's ``rank``.
        """
        if not graph.is_directed() or graph.number_of_nodes() == 0:
            raise ValueError("expected a non-empty networkx.DiGraph")
        attrs = dict(graph.nodes(data=True))
        if all("choice" in a for a in attrs.values()):
            paths = [tuple(a["choice"]) for a in attrs.values()]
            if paths.count(()) != 1:
                raise ValueError(f"graph must have exactly one root (choice ()), found {paths.count(())}")
            return cls([p for p in paths if p])

        if not nx.is_arborescence(graph):
            raise ValueError("graph edges do not form a tree rooted at a single node")
        root = next(node for node, deg in graph.in_degree() if deg == 0)
        choice = {root: ()}
        for parent, child in nx.bfs_edges(graph, root):
            if "rank" not in attrs[child]:
                raise ValueError(f"graph node {child!r} has neither a 'choice' nor a 'rank' attribute")
            choice[child] = (*choice[parent], attrs[child]["rank"])
        return cls([p for p in choice.values() if p])


# ----- helpers -----


def _canonical_choices(choices: Sequence[Sequence[int]]) -> tuple[Choice, ...]:
    """Validate choice paths and sort them by (length, path)."""
    if not isinstance(choices, (list, tuple)):
        raise ValueError(f"choices must be a list of choice paths, got {type(choices).__name__}")
    seen: set[Choice] = set()
    for raw in choices:
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"choice path {raw!r} is not a list of ranks")
        if len(raw) == 0:
            raise ValueError("empty choice path [] (the root is implicit; leave it out)")
        for r in raw:
            if isinstance(r, bool) or not isinstance(r, numbers.Integral):
                raise ValueError(f"choice path {list(raw)!r} has a non-integer rank {r!r}")
            if r < 0:
                raise ValueError(f"choice path {list(raw)!r} has a negative rank {r}")
        path = tuple(int(r) for r in raw)
        if path in seen:
            raise ValueError(f"duplicate choice path {list(path)}")
        seen.add(path)
    for path in seen:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"choice path {list(path)} has no parent: {list(path[:-1])} is missing")
    return tuple(sorted(seen, key=lambda p: (len(p), p)))


def _acceptance_table(acceptance: Sequence[Sequence[float]]) -> list[list[float]]:
    """``acceptance`` as a list of lists of floats in [0, 1]."""
    try:
        table = [[float(p) for p in row] for row in acceptance]
    except (TypeError, ValueError) as e:
        raise ValueError(f"acceptance must be a table of floats [num_heads][num_ranks]: {e}") from None
    for h, row in enumerate(table):
        for r, p in enumerate(row):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"acceptance[{h}][{r}] = {p} is not a probability in [0, 1]")
    return table


_WORD = (1 << 64) - 1


def _signed64(word: int) -> int:
    """A 64-bit word (0 <= word < 2**64) as the int64 with the same bits."""
    return word - (1 << 64) if word >= 1 << 63 else word


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """[N, M] bool -> [N, ceil(M / 64)] int64 words; bit j % 64 of word j // 64 holds mask[:, j]."""
    n, m = mask.shape
    words = (m + 63) // 64
    padded = torch.zeros(n, words * 64, dtype=torch.long)  # [N, W * 64]
    padded[:, :m] = mask
    shifts = torch.arange(64)  # [64]
    # bits are disjoint so the sum is an OR; bit 63 wraps to the sign bit, as a C++ uint64 view expects
    return (padded.view(n, words, 64) << shifts).sum(-1)  # [N, W]


def unpack_bits(bits: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: [N, W] int64 -> [N, m] bool."""
    n, words = bits.shape
    shifts = torch.arange(64)  # [64]
    flat = ((bits.unsqueeze(-1) >> shifts) & 1).view(n, words * 64)  # [N, W * 64]
    return flat[:, :m].bool()


# ----- default trees -----

DEFAULT_TREE_SIZES = (8, 16, 32, 64)
PRIOR_HEAD_ACCEPT = (0.60, 0.45, 0.35, 0.30, 0.25)  # a_h: top-1 acceptance of head h (last value repeats)
PRIOR_RANK_DECAY = 0.5  # b: each lower rank is half as likely
PRIOR_NUM_RANKS = 10


def prior_acceptance(num_heads: int) -> list[list[float]]:
    """The fixed prior behind :func:`default_tree`: ``acceptance[h][r] = a_h * b**r`` for 10 ranks.

    A rough shape of trained Medusa heads (later heads and lower ranks are less reliable), not a
    calibrated distribution: only the order of path products matters for the tree it yields.
    """
    a = [PRIOR_HEAD_ACCEPT[min(h, len(PRIOR_HEAD_ACCEPT) - 1)] for h in range(num_heads)]
    return [[a_h * PRIOR_RANK_DECAY**r for r in range(PRIOR_NUM_RANKS)] for a_h in a]


@lru_cache(maxsize=64)
def default_tree(num_nodes: int = 32, num_heads: int = 4) -> Tree:
    """A generic tree of ``num_nodes`` nodes (root included) for a drafter with ``num_heads`` heads.

    Built by :meth:`Tree.from_acceptance` from :func:`prior_acceptance`; cached, so the same
    object comes back for the same arguments (don't modify it). Sizes 8, 16, 32 and 64
    (``DEFAULT_TREE_SIZES``) are the usual choices.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    return Tree.from_acceptance(prior_acceptance(num_heads), num_nodes)
