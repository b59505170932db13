"""Drafters turn the base model's last hidden state into a candidate tree of tokens.

A drafter has a `tree` (the static topology) and `draft(hidden, root) -> tokens`: the token at
every tree node for one decoding step. Node 0 is always `root`, the base model's own next token.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .heads import MedusaHeads
from .tree import Tree


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
    """Medusa heads: head k's top-r tokens fill the tree nodes at depth k+1 with rank r."""

    def __init__(self, heads: MedusaHeads, tree: Tree, lm_head: torch.nn.Module):
        if tree.max_depth > heads.num_heads:
            raise ValueError(
                f"the tree is {tree.max_depth} levels deep but the heads predict only {heads.num_heads} "
                "tokens ahead; use a shallower tree or more heads"
            )
        self.heads = heads
        self.tree = tree
        self.lm_head = lm_head
        self.topk = max(tree.max_rank, 1)
        device = next(heads.parameters()).device
        self.token_index = tree.token_index(self.topk).to(device)  # [N] into [root, head0 top-k, ...]
        self.last_probs: torch.Tensor | None = None  # [N] head probability of each node's token

    def draft(self, hidden: torch.Tensor, root: int) -> torch.Tensor:
        depth = self.tree.max_depth
        logits = self.heads(hidden.view(1, 1, -1), self.lm_head, num_heads=depth)  # [K, 1, 1, V]
        top = logits[:, 0, 0].float().softmax(dim=-1).topk(self.topk, dim=-1)  # values, indices: [K, topk]
        root_t = torch.tensor([root], device=top.indices.device)
        candidates = torch.cat([root_t, top.indices.flatten()])  # [1 + K*topk]
        probs = torch.cat([top.values.new_ones(1), top.values.flatten()])  # [1 + K*topk]
        self.last_probs = probs[self.token_index]  # [N] each node's probability under its head
        return candidates[self.token_index]  # [N]
