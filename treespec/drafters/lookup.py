"""Prompt lookup as an extra tree branch: copy what followed the last earlier occurrence of the suffix.

Answers often repeat spans of the prompt or of themselves (names, code, quoted text, and the loops small
models fall into). `NgramIndex` remembers, for every n-gram (n <= max_ngram) of the text so far, where
it last started with at least one token after it; `propose(length)` looks up the text's own suffix
(longest n first) and returns the tokens that followed it.

`LookupDrafter` wraps another drafter: its tree is the inner tree plus one chain of `length` nodes under
the root, filled with the proposal (or, when nothing matches, with a copy of the inner tree's top branch).
The verifier treats the chain like any other branch, so the output stays the base model's own. An inner
drafter that proposes a tree of its own each step (`Proposal.tree`: suffix decoding, a `UnionDrafter`)
gets the chain added to that step's tree.
"""

from __future__ import annotations

import torch

from ..core.drafting import (
    BaseDrafter,
    Drafter,
    DrafterReport,
    Proposal,
    RootOnlyDrafter,
    Scorer,
    SequenceStart,
    step_layout,
)
from ..core.tree import Tree


class NgramIndex:
    """Latest start position of every n-gram (1 <= n <= max_ngram) that has a token after it."""

    def __init__(self, max_ngram: int = 3):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; every n-gram that now has a follower points at its latest start."""
        for token in tokens:
            i = len(self.tokens)  # position of the new token: n-grams ending at i - 1 gain a follower
            for n in range(1, min(self.max_ngram, i) + 1):
                self._starts[tuple(self.tokens[i - n : i])] = i - n
            self.tokens.append(int(token))

    def propose(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the longest matching
        suffix of the text (none: [])."""
        return self.match(length)[0]

    def match(self, length: int) -> tuple[list[int], int]:
        """(the tokens `propose` gives, the length of the suffix they matched; 0: no match)."""
        for n in range(min(self.max_ngram, len(self.tokens)), 0, -1):
            start = self._starts.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start + n : start + n + length], n
        return [], 0


MAX_STEP_LAYOUTS = 512  # inner trees of one step whose layout a drafter keeps


def chain_layout(inner: Tree, length: int) -> tuple[Tree, torch.Tensor, torch.Tensor, list[int]]:
    """The inner tree plus a chain of `length` nodes under the root at a new first-level rank: (the tree,
    the inner nodes' places in it [N_inner], the chain's [length], the inner node indices of the inner
    tree's top branch, rank 0 at every depth from depth 1)."""
    rank = 1 + max((p[0] for p in inner.choices), default=-1)  # a new first-level rank
    chain = [(rank,) + (0,) * d for d in range(length)]
    tree = Tree.from_choices([*inner.choices, *chain])
    index = {(): 0} | {p: i + 1 for i, p in enumerate(tree.choices)}
    inner_paths = [(), *inner.choices]
    top, inner_choices = [()], set(inner.choices)
    while top[-1] + (0,) in inner_choices:
        top.append(top[-1] + (0,))
    inner_index = {p: i for i, p in enumerate(inner_paths)}
    return (
        tree,
        torch.tensor([index[p] for p in inner_paths]),
        torch.tensor([index[p] for p in chain]),
        [inner_index[p] for p in top[1:]],
    )


class LookupDrafter(BaseDrafter):
    """Another drafter's tree plus a prompt-lookup chain of `length` nodes under the root (inner=None:
    the root and the chain alone, plain prompt-lookup decoding)."""

    def __init__(self, inner: Drafter | None, length: int = 8, max_ngram: int = 3):
        inner = RootOnlyDrafter() if inner is None else inner
        if length < 1:
            raise ValueError(f"the lookup chain needs length >= 1, got {length}")
        if inner.scorer() is not None:
            raise ValueError(
                "a prompt-lookup branch does not combine with self-speculative drafting (its verification "
                "runs only the upper layers of the drafted chain); use lookup=0"
            )
        self.inner = inner
        self.feature_layers = tuple(inner.feature_layers)
        self.length = length
        self.max_ngram = max_ngram
        # the inner tree's nodes [N_inner] and the chain's [length] in the tree, the inner nodes of its
        # top branch (rank 0 at every depth): filler when nothing matches
        self.tree, self.inner_nodes, self.chain_nodes, self._top_branch = chain_layout(inner.tree, length)
        self._step_layouts: dict[Tree, tuple] = {}  # an inner tree of one step -> its layout (bounded)
        self.indexes = [NgramIndex(max_ngram)]  # per row of the batch: the text so far
        # the chain's own history, per matched suffix length n and chain depth d: how often node d was
        # accepted when its parent was (prior: 1 of 2), giving each chain node a probability; pooled
        # over the rows of a batch
        self.hits = torch.ones(max_ngram + 1, length, dtype=torch.float64)
        self.tries = torch.full((max_ngram + 1, length), 2.0, dtype=torch.float64)
        # per row: the chain the last step verified (chain tokens, matched length), None when it was a filler
        self.last_chains: list[tuple[list[int], int] | None] = [None]

    @property
    def batched(self) -> bool:
        return self.inner.batched

    @property
    def limits_depth(self) -> bool:
        """propose(..., max_depth=D) limits the inner drafter's levels (the chain is drafted whole)."""
        return self.inner.limits_depth

    @property
    def node_levels(self) -> torch.Tensor:
        """[N] the inner drafter's level that drafts each node; 0 for the chain (always drafted whole)."""
        levels = torch.zeros(self.tree.num_nodes, dtype=torch.long)
        levels[self.inner_nodes] = self.inner.node_levels
        return levels

    def start(self, sequence: SequenceStart) -> None:
        """A new sequence (or row `sequence.row` of a batch): index its prompt and first token; the inner
        drafter starts too."""
        if sequence.row == 0:
            self.indexes = [NgramIndex(self.max_ngram) for _ in range(sequence.rows)]
            self.last_chains = [None] * sequence.rows
        self.indexes[sequence.row].extend(sequence.tokens)
        self.inner.start(sequence)

    def keep_rows(self, rows: list[int]) -> None:
        self.indexes = [self.indexes[r] for r in rows]
        self.last_chains = [self.last_chains[r] for r in rows]
        self.inner.keep_rows(rows)

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Tokens committed by the last step in each row (the accepted ones, then the bonus token)."""
        for row, tokens in enumerate(committed):
            self.indexes[row].extend(tokens)
            if self.last_chains[row] is not None:
                self._record(*self.last_chains[row], tokens)
                self.last_chains[row] = None
        self.inner.observe(committed, features)

    def _record(self, chain: list[int], n: int, committed: list[int]) -> None:
        """The chain's history: which of its nodes were accepted, given that their parent was."""
        for d, token in enumerate(chain):  # node d's parent was accepted: node d - 1 was
            if d > 0 and (d > len(committed) - 1 or committed[d - 1] != chain[d - 1]):
                break
            self.tries[n, d] += 1
            self.hits[n, d] += float(d < len(committed) - 1 and committed[d] == token)

    @property
    def target_topk(self) -> int:
        return self.inner.target_topk

    def verified(self, tokens: torch.Tensor, top_tokens: torch.Tensor) -> None:
        """Every verified node goes to the inner drafter (what the target said after each token)."""
        self.inner.verified(tokens, top_tokens)

    def report(self) -> DrafterReport:
        return self.inner.report()

    def scorer(self) -> Scorer | None:
        return None  # refused at construction for inner drafters with their own

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        """tokens, probs [B, N]: the inner proposal's nodes and the chain. An inner tree of its own this
        step (`Proposal.tree`) gets the chain too: the proposal carries the combined tree, with the
        inner nodes' levels and groups and level / group 0 for the chain."""
        inner = self.inner.propose(hidden, roots, max_depth)
        tree, inner_nodes, chain_nodes, top_branch = self.layout(inner.tree)
        B = inner.tokens.shape[0]
        device = inner.tokens.device
        tokens = torch.empty(B, tree.num_nodes, dtype=torch.long, device=device)  # [B, N]
        tokens[:, inner_nodes.to(device)] = inner.tokens
        probs = torch.ones(B, tree.num_nodes)  # [B, N]
        if inner.probs is not None:
            probs[:, inner_nodes] = inner.probs.float().cpu()
        roots = roots.reshape(-1).tolist()
        chains = []
        for row in range(B):
            proposal, matched = self.indexes[row].match(self.length)
            # filler when nothing matches: a copy of the inner tree's top branch
            chain = (proposal or inner.tokens[row, top_branch].tolist())[: self.length]
            chain = chain + [chain[-1] if chain else roots[row]] * (self.length - len(chain))
            self.last_chains[row] = (chain, matched) if proposal else None
            chains.append(chain)
            # chain nodes: their history's acceptance given the parent (0 for a filler)
            history = (
                (self.hits[matched] / self.tries[matched]).float() if proposal else torch.zeros(self.length)
            )
            probs[row, chain_nodes] = history
        tokens[:, chain_nodes.to(device)] = torch.tensor(chains, device=device)  # [B, length]
        if inner.tree is None and inner.levels is None and inner.groups is None:
            return Proposal(tokens, probs)  # [B, N] each, on the static tree (levels: `node_levels`)
        _, inner_levels, inner_groups = step_layout(self.inner, inner)  # [B, N_inner] each
        levels = torch.zeros(B, tree.num_nodes, dtype=torch.long)  # [B, N] the chain: 0
        groups = torch.zeros(B, tree.num_nodes, dtype=torch.long)
        levels[:, inner_nodes], groups[:, inner_nodes] = inner_levels, inner_groups
        step_tree = None if inner.tree is None else tree
        return Proposal(tokens, probs, tree=step_tree, levels=levels, groups=groups)

    def layout(self, inner_tree: Tree | None) -> tuple[Tree, torch.Tensor, torch.Tensor, list[int]]:
        """`chain_layout` of the inner drafter's tree (None) or of its tree of one step (built once per
        distinct tree, at most MAX_STEP_LAYOUTS kept; all are dropped when that many are)."""
        if inner_tree is None:
            return self.tree, self.inner_nodes, self.chain_nodes, self._top_branch
        layout = self._step_layouts.get(inner_tree)
        if layout is None:
            if len(self._step_layouts) >= MAX_STEP_LAYOUTS:
                self._step_layouts.clear()
            layout = self._step_layouts[inner_tree] = chain_layout(inner_tree, self.length)
        return layout
