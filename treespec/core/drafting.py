"""The drafter interface: everything the decoder calls on a drafter, with one signature each.

It lives in core beside the decoder that calls it; every drafter (`treespec.drafters`) implements it.

One decoding step, seen from a drafter:

    start(SequenceStart)            once per sequence, after the prefill (prompt + the first token)
    propose(hidden [B, H], roots [B], max_depth=None) -> Proposal(tokens [B, N], probs [B, N] | None)
                                    (max_depth: a planner's level count, honoured where `limits_depth`;
                                    a per-step tree in `Proposal.tree`)
    observe(committed, features)    the tokens the step committed per row (accepted nodes, then the bonus),
                                    and the target's features there when the drafter asked for them
    feature_layers                  which of the target's hidden states the drafter reads (default none)
    batched                         True when it drafts for B > 1 rows (a batch of sequences)
    limits_depth                    True when propose(hidden, roots, max_depth=D) drafts depths 1..D only
                                    (deeper nodes: probability 0), so a priced planner can skip levels
    costly_levels                   True when each level it drafts is a pass of a network (heads, EAGLE):
                                    a planner drafts it to the step's level count wherever it stands
    target_topk                     k > 0: after each verification the decoder calls
    verified(tokens, top_tokens)    with the step's tree tokens [A, N] and the target's k most likely next
                                    tokens after every node [A, N, k] (read from logits it computed anyway)
    prices_steps                    True when it chooses a batch's plain steps itself (a priced planner)
    keep_rows(rows)                 batches: only these rows (indices into the last batch) go on decoding
    report() -> DrafterReport       what the drafter measured and the memory of its own cache, if any
    scorer() -> Scorer | None       its own verification forward (partial-layer verification), or None

`Drafter` is the protocol; `BaseDrafter` gives the do-nothing defaults, so a stateless drafter writes
only `tree` and `propose`. Shapes are batch-shaped: heads, prompt lookup and plain decoding draft for a
batch of rows (`batched`); the drafters with a cache or scorer of their own take one row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from .tree import Tree

if TYPE_CHECKING:
    from .attention import AttentionPlan
    from .cache import TreeKVCache


@dataclass
class SequenceStart:
    """What a drafter learns when a sequence starts (after the target's prefill)."""

    tokens: list[int]  # the prompt followed by the target's first token
    capacity: int  # positions the sequence may reach: prompt + max_new_tokens + one tree block
    cache: TreeKVCache  # the target's cache (only a drafter that runs the target's own layers writes it)
    kernel: str  # the tree-attention kernel the decoder uses
    # [1, P, F] the target's hidden states at the prompt, from the layers in the drafter's
    # `feature_layers` concatenated (None when it asks for none)
    features: torch.Tensor | None = None
    row: int = 0  # in a batch: which row starts (rows start in order 0, 1, ...)
    rows: int = 1  # in a batch: how many rows the batch has


@dataclass
class Proposal:
    """A candidate tree for each row: node 0 is the root (the target's own token)."""

    tokens: torch.Tensor  # [B, N] long, in the node order of `tree` (default: the drafter's `tree`)
    probs: torch.Tensor | None = None  # [B, N] the drafter's probability of each node's token
    # this step's tree when it differs from the drafter's static `tree` (a planner's): any tree of at
    # most `drafter.tree.num_nodes` nodes, which sizes the cache's speculative block
    tree: Tree | None = None
    expected_accept: float | None = None  # the drafter's prediction of this step's accepted length


@dataclass
class DrafterReport:
    """What a drafter measured over one sequence."""

    stats: dict = field(default_factory=dict)  # e.g. drafted / accepted counts, seconds drafting
    cache_memory: dict[str, int] = field(default_factory=dict)  # its own KV cache (SpeculativeKVCache)


class Scorer(Protocol):
    """A verification forward: the target's final hidden states at the proposed nodes.

    ids, positions: [B, N]; K/V of the nodes are written into `cache` at its committed end.
    Returns [B, N, H] (after the final norm)."""

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: TreeKVCache, plan: AttentionPlan
    ) -> torch.Tensor: ...


class Drafter(Protocol):
    """Everything the decoder calls on a drafter."""

    tree: Tree
    # indices into transformers' `hidden_states` (0 = the embeddings, i = after layer i) whose values the
    # decoder hands to `start` and `observe` as features; () = none
    feature_layers: tuple[int, ...]
    batched: bool  # drafts for several rows at once (hidden [B, H], roots [B])
    limits_depth: bool  # propose takes max_depth= (drafts depths 1..max_depth only)
    costly_levels: bool  # each drafted level is a network pass: a planner prices its levels
    target_topk: int  # > 0: `verified` receives the target's top-k next tokens after every verified node
    prices_steps: bool  # chooses a batch's plain steps itself (a priced planner): no decoder StepPricer

    def start(self, sequence: SequenceStart) -> None: ...

    def keep_rows(self, rows: list[int]) -> None: ...

    def propose(
        self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None
    ) -> Proposal: ...

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None: ...

    def verified(self, tokens: torch.Tensor, top_tokens: torch.Tensor) -> None: ...

    def report(self) -> DrafterReport: ...

    def scorer(self) -> Scorer | None: ...


class BaseDrafter:
    """Defaults for the optional parts of `Drafter`: no per-sequence state, no statistics, no cache,
    the decoder's own full forward as scorer."""

    tree: Tree
    feature_layers: tuple[int, ...] = ()
    batched: bool = False
    limits_depth: bool = False
    costly_levels: bool = False
    target_topk: int = 0
    prices_steps: bool = False

    def start(self, sequence: SequenceStart) -> None:
        pass

    def keep_rows(self, rows: list[int]) -> None:
        """A batch lost rows (they finished): later calls see only `rows` of the last batch, in order."""

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        raise NotImplementedError

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        pass

    def verified(self, tokens: torch.Tensor, top_tokens: torch.Tensor) -> None:
        """tokens [A, N]: the step's verified tree (a planner's whole tree, all sources); top_tokens
        [A, N, k]: the target's top-k next tokens after each node. Called only when `target_topk` > 0."""

    def report(self) -> DrafterReport:
        return DrafterReport()

    def scorer(self) -> Scorer | None:
        return None


def single_row(hidden: torch.Tensor, roots: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(hidden [H], root) of a batch of one; a clear error for larger batches."""
    if hidden.dim() != 2 or hidden.shape[0] != 1 or roots.numel() != 1:
        raise ValueError(
            f"this drafter proposes for one sequence at a time; got hidden {tuple(hidden.shape)} "
            f"and {roots.numel()} roots (batches take heads, EAGLE, suffix trees, recycling, prompt lookup "
            "or plain decoding)"
        )
    return hidden[0], int(roots.reshape(-1)[0])


def batch_rows(hidden: torch.Tensor, roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [B, H], roots [B]) of a batch; a clear error when the two disagree."""
    roots = roots.reshape(-1)
    if hidden.dim() != 2 or hidden.shape[0] != roots.numel():
        raise ValueError(
            f"propose takes hidden [B, H] and roots [B]; got hidden {tuple(hidden.shape)} and "
            f"{roots.numel()} roots"
        )
    return hidden, roots


class RootOnlyDrafter(BaseDrafter):
    """No speculation: the tree is the root alone (plain one-token-at-a-time decoding)."""

    batched = True

    def __init__(self):
        self.tree = Tree.from_choices([])

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        return Proposal(roots.reshape(-1, 1).to(hidden.device))  # [B, 1]


class StepTrees:
    """Trees of per-step choice paths, each built once (`Tree.from_choices`) and kept, at most `limit` of
    them (the decoder keeps as many layouts); for drafters whose tree changes from step to step."""

    def __init__(self, limit: int = 512):
        self.limit = limit
        self.trees: dict[tuple, Tree] = {}  # sorted choice paths -> tree

    def __call__(self, choices: list[tuple[int, ...]]) -> Tree:
        key = tuple(sorted(choices))
        tree = self.trees.get(key)
        if tree is None:
            if len(self.trees) >= self.limit:
                self.trees.clear()
            tree = self.trees[key] = Tree.from_choices(key)
        return tree
