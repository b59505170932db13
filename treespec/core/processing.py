"""Logits processing over a verified tree: HF's repetition penalty and any HF `LogitsProcessor`.

A one-token step processes the logits of its sequence so far (the prompt and the tokens generated up to
the one being scored). A verified tree node stands for such a step at its own sequence: the row's
sequence up to the tree's root, then the tree's tokens from the root's child down to the node itself. So
each node's logits are processed at that sequence, and a greedy decode equals HF's greedy decode with the
same processing (the same float32 operations on the same logits).

- repetition penalty (`SamplingConfig.repetition_penalty`, HF's rule): logit / penalty where >= 0, logit *
  penalty where < 0, at every token the node's sequence holds (each token once). Applied directly: the
  row's seen tokens, then each node's own branch tokens.
- logits processors (`SamplingConfig.logits_processor`: HF `LogitsProcessor`s or any callable
  `(input_ids [n, L], scores [n, V]) -> scores`): called once per tree depth per row, on the nodes of that
  depth, whose sequences have one length (input_ids: the row's tokens, then the node's branch). Each row's
  sequence is its own, not padded: a processor that reads positions sees the row's own.

The rows' tokens are kept here, by cache row. HF's order: the penalty, then the processors, then
temperature / top-k / top-p (`SamplingConfig.probs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def penalize(scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """scores [...] float32 -> the penalized scores (HF's expression, for the same bits)."""
    return torch.where(scores < 0, scores * penalty, scores / penalty)


class TreeLogitsProcessing:
    """Each cache row's tokens so far, and the processing of a step's logits at every node's sequence."""

    def __init__(self, penalty: float = 1.0, processors: Sequence[Callable] = ()):
        self.penalty, self.processors = penalty, list(processors)
        self.tokens: dict[int, list[int]] = {}  # cache row -> the tokens of its sequence so far
        self.seen: dict[int, set[int]] = {}  # cache row -> those tokens as a set
        self._index: dict[int, torch.Tensor] = {}  # cache row -> its seen tokens below the vocabulary [U]

    @classmethod
    def of(cls, sampling) -> TreeLogitsProcessing | None:
        """The processing a `SamplingConfig` asks for (None: nothing to do)."""
        processors = list(sampling.logits_processor or ())
        if sampling.repetition_penalty == 1.0 and not processors:
            return None
        return cls(sampling.repetition_penalty, processors)

    def start(self, row: int, tokens: list[int]) -> None:
        """Row `row` begins a sequence holding `tokens` (its prompt)."""
        self.tokens[row] = list(tokens)
        self.seen[row] = set(tokens)
        self._index.pop(row, None)

    def extend(self, row: int, tokens: list[int]) -> None:
        """Tokens that row `row` generated (committed ones and its next root)."""
        self.tokens[row].extend(tokens)
        seen = self.seen[row]
        if not seen.issuperset(tokens):
            seen.update(tokens)
            self._index.pop(row, None)

    def apply(
        self, logits: torch.Tensor, rows: list[int], tokens: list[list[int]], parents: list[int]
    ) -> torch.Tensor:
        """logits [A, N, V] of a step over cache rows `rows`, tokens [A][N] its trees' tokens (node 0 the
        root, already the last of the row's tokens), parents [N] (parents[0] = -1) -> the processed logits
        [A, N, V] in float32 (a new tensor)."""
        out = logits.float().clone()
        for a, row in enumerate(rows):
            if self.penalty != 1.0:
                self._penalize(out[a], row, tokens[a], parents)
            if self.processors:
                self._process(out[a], row, tokens[a], parents)
        return out

    def _penalize(self, scores: torch.Tensor, row: int, tokens: list[int], parents: list[int]) -> None:
        """The repetition penalty on one row's scores [N, V], in place."""
        vocab = scores.shape[-1]
        index = self._index.get(row)
        if index is None or index.device != scores.device:  # ids past the output layer cannot be generated
            seen = sorted(t for t in self.seen[row] if t < vocab)
            index = self._index[row] = torch.tensor(seen, dtype=torch.long, device=scores.device)
        if index.numel():
            scores[:, index] = penalize(scores[:, index], self.penalty)  # [N, U]
        nodes, ids = branch_tokens(tokens, parents, self.seen[row], vocab)
        if nodes:
            n, t = torch.tensor(nodes, device=scores.device), torch.tensor(ids, device=scores.device)
            scores[n, t] = penalize(scores[n, t], self.penalty)

    def _process(self, scores: torch.Tensor, row: int, tokens: list[int], parents: list[int]) -> None:
        """The logits processors on one row's scores [N, V], in place, one call per tree depth."""
        history = torch.tensor(self.tokens[row], device=scores.device)  # [L], the root last
        for nodes, branches in depth_groups(tokens, parents):
            ids = history.expand(len(nodes), -1)  # [n, L]
            if branches[0]:
                extra = torch.tensor(branches, device=scores.device)  # [n, d]
                ids = torch.cat([ids, extra], dim=1)  # [n, L + d]
            index = torch.tensor(nodes, device=scores.device)
            processed = scores[index]  # [n, V]
            for processor in self.processors:
                out = processor(ids, processed)
                if not isinstance(out, torch.Tensor) or out.shape != processed.shape:
                    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise TypeError(
                        f"logits processor {type(processor).__name__} returned {got} for scores of shape "
                        f"{tuple(processed.shape)}: a processor returns the scores, processed, in their shape"
                    )
                processed = out
            scores[index] = processed.to(scores.dtype)


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


def depth_groups(tokens: list[int], parents: list[int]) -> list[tuple[list[int], list[list[int]]]]:
    """The nodes of each depth with their branches' tokens (the root's child down to the node; the root's
    branch is empty): [(nodes, branches [n][d])] by depth."""
    branch: list[list[int]] = [[]]
    groups: dict[int, tuple[list[int], list[list[int]]]] = {0: ([0], [[]])}
    for node in range(1, len(tokens)):
        own = [*branch[parents[node]], tokens[node]]
        branch.append(own)
        nodes, branches = groups.setdefault(len(own), ([], []))
        nodes.append(node)
        branches.append(own)
    return [groups[d] for d in sorted(groups)]
