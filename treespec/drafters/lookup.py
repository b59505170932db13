"""Prompt lookup: copy what followed the last earlier occurrence of the text's own suffix.

Answers often repeat spans of the prompt or of themselves (names, code, quoted text, and the loops small
models fall into). A `suffix.SuffixIndex` of the text so far remembers, for every n-gram (n <=
max_ngram), the latest position that followed it; the text's own suffix is looked up there (longest n
first) and the tokens that followed its latest earlier occurrence are the copy.

`PromptLookup` drafts that copy as a chain of `length` nodes under the root, each node's probability its
record of being accepted when its parent was (per matched suffix length and depth); a row without a
match drafts nothing (probability 0). It is one source among others in a `TreePlanner`, which merges
the chain with the other drafters' trees and leaves undrafted nodes out.
"""

from __future__ import annotations

import torch

from ..core.drafting import BaseDrafter, Proposal, SequenceStart, batch_rows
from ..core.tree import Tree
from .suffix import SuffixIndex


class PromptLookup(BaseDrafter):
    """A prompt-lookup chain of `length` nodes under the root, for a batch of rows (module docstring)."""

    batched = True

    def __init__(self, length: int = 8, max_ngram: int = 3):
        if length < 1:
            raise ValueError(f"the lookup chain needs length >= 1, got {length}")
        self.length, self.max_ngram = length, max_ngram
        self.tree = Tree.chain(length)
        self.indexes = [SuffixIndex(max_ngram)]  # per row of the batch: the text so far
        # per matched suffix length n and chain depth d: how often node d was accepted when its parent was
        # (prior: 1 of 2), pooled over the rows of a batch
        self.hits = torch.ones(max_ngram + 1, length, dtype=torch.float64)
        self.tries = torch.full((max_ngram + 1, length), 2.0, dtype=torch.float64)
        # per row: the chain the last step drafted and the suffix length it matched (None: no match)
        self.last_chains: list[tuple[list[int], int] | None] = [None]

    def start(self, sequence: SequenceStart) -> None:
        """Row `sequence.row` starts: index its prompt and first token."""
        if sequence.row == 0:
            self.indexes = [SuffixIndex(self.max_ngram) for _ in range(sequence.rows)]
            self.last_chains = [None] * sequence.rows
        self.indexes[sequence.row].extend(sequence.tokens)

    def keep_rows(self, rows: list[int]) -> None:
        self.indexes = [self.indexes[r] for r in rows]
        self.last_chains = [self.last_chains[r] for r in rows]

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Tokens committed by the last step in each row (the accepted ones, then the bonus token)."""
        for row, tokens in enumerate(committed):
            self.indexes[row].extend(tokens)
            if self.last_chains[row] is not None:
                self._record(*self.last_chains[row], tokens)
                self.last_chains[row] = None

    def _record(self, chain: list[int], n: int, committed: list[int]) -> None:
        """The chain's history: which of its nodes were accepted, given that their parent was."""
        for d, token in enumerate(chain):  # node d's parent was accepted: node d - 1 was
            if d > 0 and (d > len(committed) - 1 or committed[d - 1] != chain[d - 1]):
                break
            self.tries[n, d] += 1
            self.hits[n, d] += float(d < len(committed) - 1 and committed[d] == token)

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        """tokens, probs [B, length + 1]: each row's copied chain (padded with its last token at
        probability 0; a row without a match: its root, probability 0)."""
        hidden, roots = batch_rows(hidden, roots)
        roots = roots.tolist()
        tokens, probs = [], torch.zeros(len(roots), self.tree.num_nodes)  # [B, N]
        for row, root in enumerate(roots):
            index = self.indexes[row]  # the latest occurrence of the longest suffix (<= max_ngram tokens)
            matched, found = index.match(list(index.tokens[-self.max_ngram :]), self.max_ngram, max_scan=1)
            chain = index.continuation(found[0], self.length) if found else []
            self.last_chains[row] = (chain, matched) if chain else None
            tokens.append([root, *chain] + [chain[-1] if chain else root] * (self.length - len(chain)))
            history = self.hits[matched] / self.tries[matched]  # [length]
            probs[row, 1 : len(chain) + 1] = history[: len(chain)].float()
        probs[:, 0] = 1.0
        return Proposal(torch.tensor(tokens, device=hidden.device), probs)
