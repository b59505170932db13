"""Repetition penalty over a verified tree, as transformers' `repetition_penalty` applies it.

A one-token step penalizes the logits of every token its sequence holds so far (the prompt and the tokens
generated up to the one being scored): logit / penalty where the logit is >= 0, logit * penalty where it is
< 0 (so a penalty > 1 makes a seen token less likely). A verified tree node stands for such a step at its
own sequence: the row's sequence up to the tree's root, then the tree's tokens from the root's child down to
the node itself. So each node's logits are penalized at the row's seen tokens and at its own branch's
tokens, each token once, and a greedy decode with a penalty equals HF's greedy decode with that penalty (the
same float32 operations on the same logits). The rows' seen tokens are kept here, by cache row.
"""

from __future__ import annotations

import torch


def penalize(scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """scores [...] float32 -> the penalized scores (HF's expression, for the same bits)."""
    return torch.where(scores < 0, scores * penalty, scores / penalty)


class RepetitionPenalty:
    """The seen tokens of each cache row, and the penalty applied to a step's logits."""

    def __init__(self, penalty: float):
        self.penalty = penalty
        self.seen: dict[int, set[int]] = {}  # cache row -> the tokens of its sequence so far
        self._index: dict[int, torch.Tensor] = {}  # cache row -> its seen tokens as a tensor [U]

    def start(self, row: int, tokens: list[int]) -> None:
        """Row `row` begins a sequence holding `tokens` (its prompt)."""
        self.seen[row] = set(tokens)
        self._index.pop(row, None)

    def extend(self, row: int, tokens: list[int]) -> None:
        """Tokens that row `row` generated (committed ones and its next root)."""
        seen = self.seen[row]
        if not seen.issuperset(tokens):
            seen.update(tokens)
            self._index.pop(row, None)

    def _seen_index(self, row: int, device: torch.device) -> torch.Tensor:
        index = self._index.get(row)
        if index is None or index.device != device:
            index = self._index[row] = torch.tensor(sorted(self.seen[row]), dtype=torch.long, device=device)
        return index

    def apply(
        self, logits: torch.Tensor, rows: list[int], tokens: list[list[int]], parents: list[int]
    ) -> torch.Tensor:
        """logits [A, N, V] of a step over cache rows `rows`, tokens [A][N] its trees' tokens (node 0 the
        root, already among the seen tokens), parents [N] (parents[0] = -1) -> the penalized logits [A, N, V]
        in float32 (a new tensor)."""
        out = logits.float().clone()
        vocab = out.shape[-1]
        for a, row in enumerate(rows):
            seen = self.seen[row]
            index = self._seen_index(row, out.device)
            index = index[index < vocab]  # ids past the output layer cannot be generated
            if index.numel():
                out[a, :, index] = penalize(out[a, :, index], self.penalty)  # [N, U]
            nodes, ids = branch_tokens(tokens[a], parents, seen, vocab)
            if nodes:
                n = torch.tensor(nodes, device=out.device)
                t = torch.tensor(ids, device=out.device)
                out[a, n, t] = penalize(out[a, n, t], self.penalty)
        return out


def branch_tokens(
    tokens: list[int], parents: list[int], seen: set[int], vocab: int
) -> tuple[list[int], list[int]]:
    """The (node, token) pairs to penalize beyond the row's seen tokens: every token on a node's branch
    (from the root's child down to the node itself) that is not seen yet, once per node."""
    nodes, ids = [], []
    branch: list[set[int]] = [set()]  # node -> its branch's unseen tokens
    for node in range(1, len(tokens)):
        own = branch[parents[node]]
        token = tokens[node]
        if token not in seen and token < vocab and token not in own:
            own = own | {token}
        branch.append(own)
        for t in own:
            nodes.append(node)
            ids.append(t)
    return nodes, ids
