"""Drafters turn the base model's last hidden state into a candidate tree of tokens.

A drafter has a `tree` (the static topology) and `draft(hidden, root) -> tokens`: the token at
every tree node for one decoding step. Node 0 is always `root`, the base model's own next token.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..core.tree import Tree
from .heads import MedusaHeads


class Drafter(Protocol):
    tree: Tree

    def draft(self, hidden: torch.Tensor, root: int) -> torch.Tensor:
        """hidden: [H] last accepted hidden state; root: token id -> tree tokens [N] (long)."""
        ...


class RootOnlyDrafter:
    """No speculation: the tree is the root alone (plain one-token-at-a-time decoding)."""

    def __init__(self):
        self.tree = Tree.from_choices([])

    def draft(self, hidden: torch.Tensor, root: int) -> torch.Tensor:
        return torch.tensor([root], device=hidden.device)  # [1]


class MedusaDrafter:
    """Independent Medusa heads: head k's top-r tokens fill the tree nodes at depth k+1 with rank r."""

    def __init__(self, heads: MedusaHeads, tree: Tree, lm_head: torch.nn.Module):
        _check_depth(heads, tree)
        if heads.sequential:
            raise ValueError("these heads are sequential: use SequentialDrafter (make_drafter picks it)")
        self.heads = heads
        self.tree = tree
        self.weight = heads.output_weight(lm_head)  # [V', H] shared output rows, gathered once
        self.topk = max(tree.max_rank, 1)
        device = next(heads.parameters()).device
        self.token_index = tree.token_index(self.topk).to(device)  # [N] into [root, head0 top-k, ...]
        self.last_probs: torch.Tensor | None = None  # [N] head probability of each node's token

    def draft(self, hidden: torch.Tensor, root: int) -> torch.Tensor:
        depth = self.tree.max_depth
        states = self.heads.head_hidden(hidden.view(1, 1, -1), num_heads=depth)  # [K, 1, 1, H]
        logits = self.heads.logits(states, self.weight)  # [K, 1, 1, V']
        top = logits[:, 0, 0].float().softmax(dim=-1).topk(self.topk, dim=-1)  # values, indices: [K, topk]
        root_t = torch.tensor([root], device=top.indices.device)
        candidates = torch.cat([root_t, self.heads.token_ids(top.indices.flatten())])  # [1 + K*topk]
        probs = torch.cat([top.values.new_ones(1), top.values.flatten()])  # [1 + K*topk]
        self.last_probs = probs[self.token_index]  # [N] each node's probability under its head
        return candidates[self.token_index]  # [N]


class SequentialDrafter:
    """Sequential (Hydra-style) heads: the tree is drafted depth by depth.

    The children of a node at depth d are head d's top-ranked guesses given the tokens on the path to
    that node: head d runs once per depth, batched over the nodes of depth d that have children.
    """

    def __init__(self, heads: MedusaHeads, tree: Tree, lm_head: torch.nn.Module, embedding: torch.nn.Module):
        _check_depth(heads, tree)
        if not heads.sequential:
            raise ValueError("these heads are independent: draft with MedusaDrafter (make_drafter picks it)")
        self.heads = heads
        self.tree = tree
        self.weight = heads.output_weight(lm_head)  # [V', H]
        self.embedding = embedding.weight if hasattr(embedding, "weight") else embedding  # [V, H]
        device = next(heads.parameters()).device
        # per depth d: expanded nodes [n_d], their parents, children [c_d], child's parent row, child rank, k
        self.levels = []
        for d in range(tree.max_depth):
            children = (tree.depth == d + 1).nonzero().flatten()  # [c_d] nodes at depth d+1
            expanded = torch.unique(tree.parents[children])  # [n_d] nodes at depth d with children
            row = torch.searchsorted(expanded, tree.parents[children])  # [c_d] parent's row in `expanded`
            rank = tree.rank[children]  # [c_d]
            k = int(rank.max()) + 1
            parents = tree.parents[expanded].clamp(min=0)  # [n_d] (the root's entry is unused)
            self.levels.append(tuple(t.to(device) for t in (expanded, parents, children, row, rank)) + (k,))
        self.hidden_size = heads.hidden_size
        self.dtype = next(heads.parameters()).dtype
        self.last_probs: torch.Tensor | None = None  # [N]

    def draft(self, hidden: torch.Tensor, root: int) -> torch.Tensor:
        n = self.tree.num_nodes
        tokens = torch.empty(n, dtype=torch.long, device=hidden.device)  # [N]
        tokens[0] = root
        probs = torch.ones(n, device=hidden.device)  # [N]
        states = hidden.new_empty(n, self.hidden_size, dtype=self.dtype)  # [N, H] u at each expanded node
        for d, (expanded, parents, children, row, rank, k) in enumerate(self.levels):
            before = hidden[None] if d == 0 else states[parents]  # [n_d, H] state of each node's parent
            emb = self.heads.embed_tokens(self.embedding, tokens[expanded])  # [n_d, H]
            u = self.heads.advance(d, before, emb)  # [n_d, H]
            states[expanded] = u.to(states.dtype)
            logits = self.heads.logits(u, self.weight, head=d)  # [n_d, V']
            top = logits.float().softmax(dim=-1).topk(k, dim=-1)  # values, indices: [n_d, k]
            tokens[children] = self.heads.token_ids(top.indices[row, rank])  # [c_d]
            probs[children] = top.values[row, rank]
        self.last_probs = probs
        return tokens


def make_drafter(heads: MedusaHeads, tree: Tree, model: torch.nn.Module) -> MedusaDrafter | SequentialDrafter:
    """The drafter that fits the heads: SequentialDrafter for sequential heads, MedusaDrafter otherwise."""
    if heads.sequential:
        return SequentialDrafter(heads, tree, model.get_output_embeddings(), model.get_input_embeddings())
    return MedusaDrafter(heads, tree, model.get_output_embeddings())


def _check_depth(heads: MedusaHeads, tree: Tree) -> None:
    if heads.exit_layer:
        raise ValueError(
            f"these are exit heads (exit_layer={heads.exit_layer}) for self-speculative drafting: "
            "use treespec.SelfSpeculativeDrafter(model, heads, gamma)"
        )
    if tree.max_depth > heads.num_heads:
        raise ValueError(
            f"the tree is {tree.max_depth} levels deep but the heads predict only {heads.num_heads} "
            "tokens ahead; use a shallower tree or more heads"
        )
