"""Token recycling: draft a tree from what the target itself predicted after each token before.

Token Recycling (Luo et al., 2024) is training-free: every verification already computes the target's
logits at every tree node, and the top-k of those logits are good guesses for what follows the same
token the next time it appears. `RecyclingDrafter` keeps them in an adjacency table

    table [V, k] int32     table[t, r] = the r-th most likely next token the target gave after token t
    width [V] uint8        how many of row t's candidates are known (0: none, 1: seeded, k: the target's)
    from_target [V] bool   whether row t came from the target (else from the text, or nothing yet)

and drafts a static tree by walking it: node (r1, ..., rd) is candidate r_d of the table row of its
parent's token, level by level in torch over the whole batch (one gather per depth).

Where the table learns (`verified`, called by the decoder after each verified step with the step's tree
tokens [A, N] and the target's top-k after every node [A, N, k]): row t is replaced by the top-k after
the last node carrying t, in row-major order (later rows of the batch, then later nodes, which in the
canonical node order are the deeper ones, overwrite earlier ones); a row from the target is always
replaced whole. Rows the target has not filled yet are seeded with rank 0 only from the text itself
(`start`: the prompt's consecutive token pairs; `observe`: the committed tokens), so a prompt's
bigrams draft from the first step; the target's rows overwrite seeded ones, never the reverse.

The table is shared by all rows of a batch and kept across sequences (a reused drafter starts warm);
its memory is fixed at construction: V x k int32 + V bytes.

Node probabilities are running estimates of P(node accepted | parent accepted) per (row source, depth,
rank), learned in `observe` by walking the committed tokens down the last proposal (a node counts as
accepted when its token is the committed one at its depth and its parent's was, whether or not a
planner cut it from the verified tree: under greedy decoding that is exactly when it would have been
accepted). They are conditional probabilities like a head's softmax or the lookup chain's hit rates, so
a priced `TreePlanner` (which multiplies them along paths) prices them as it does every other source.
A node whose parent's token has no known candidate at its rank repeats the parent's token with
probability 0 (it can be accepted only by chance; a dynamic tree prunes it).
"""

from __future__ import annotations

import torch

from ..core.drafting import BaseDrafter, DrafterReport, Proposal, SequenceStart, batch_rows
from ..core.tree import Tree

TARGET, SEEDED = 0, 1  # where a table row came from (the node statistics are kept per source)
# prior of the acceptance estimates: P(accepted | parent accepted) = PRIOR_ACCEPT * PRIOR_DECAY**rank
# (seeded rows: PRIOR_SEEDED), worth PRIOR_WEIGHT observations
PRIOR_ACCEPT, PRIOR_DECAY, PRIOR_SEEDED, PRIOR_WEIGHT = 0.5, 0.4, 0.3, 2.0


def recycling_tree(num_nodes: int = 16, depth: int = 6, k: int = 8) -> Tree:
    """The default static tree: the `num_nodes` nodes (root included) of largest prior path value when
    every depth accepts alike (the table's rows come from the target itself at any depth, unlike heads
    that get worse further ahead), candidate r accepted with PRIOR_ACCEPT * PRIOR_DECAY**r."""
    acceptance = [[PRIOR_ACCEPT * PRIOR_DECAY**r for r in range(k)]] * depth  # [depth][k]
    return Tree.from_acceptance(acceptance, num_nodes)


def last_occurrences(ids: torch.Tensor) -> torch.Tensor:
    """ids [M] -> [M] bool: True where no later entry has the same id (M is a tree's nodes, small: an
    [M, M] comparison, no [V] scratch per call)."""
    if ids.numel() > 4096:  # a large batch of large trees: sort instead of the quadratic comparison
        order = torch.arange(ids.numel(), device=ids.device)
        _, perm = torch.sort(ids * ids.numel() + order)  # by id, then position
        sorted_ids = ids[perm]
        last = torch.ones_like(ids, dtype=torch.bool)
        last[:-1] = sorted_ids[:-1] != sorted_ids[1:]
        keep = torch.zeros_like(last)
        keep[perm] = last
        return keep
    same = ids[:, None] == ids[None, :]  # [M, M]
    return ~same.triu(1).any(dim=1)


class RecyclingDrafter(BaseDrafter):
    """A tree drafted from the target's own earlier top-k next tokens per token (module docstring).

    vocab_size: the target's output size (`model.config.vocab_size`); tree: the static tree to fill
    (default `recycling_tree(16, 6, k)`; ranks must be < k); k: candidates kept per token (the decoder
    hands the target's top-k); device: where the table lives."""

    batched = True
    limits_depth = True

    def __init__(self, vocab_size: int, tree: Tree | None = None, k: int = 8, device="cpu"):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k (candidates kept per token) must be an int >= 1, got {k!r}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (the target's output size), got {vocab_size}")
        self.tree = recycling_tree(16, 6, k) if tree is None else tree
        if self.tree.max_rank > k:
            raise ValueError(
                f"the tree uses rank {self.tree.max_rank - 1} but the table keeps only k={k} candidates "
                f"per token: use k >= {self.tree.max_rank} or a narrower tree"
            )
        self.vocab_size, self.k, self.target_topk = vocab_size, k, k
        self.device = torch.device(device)
        self.table = torch.zeros(vocab_size, k, dtype=torch.int32, device=self.device)  # [V, k]
        self.width = torch.zeros(vocab_size, dtype=torch.uint8, device=self.device)  # [V] known ranks
        self.from_target = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)  # [V]
        D = max(self.tree.max_depth, 1)
        # the acceptance estimates per (source, depth - 1, rank), pooled over rows and sequences
        prior = torch.tensor([PRIOR_ACCEPT * PRIOR_DECAY**r for r in range(k)], dtype=torch.float64)
        prior = torch.stack([prior, torch.full((k,), PRIOR_SEEDED, dtype=torch.float64)])  # [2, k]
        self.tries = torch.full((2, D, k), PRIOR_WEIGHT, dtype=torch.float64)  # [2, D, k]
        self.hits = PRIOR_WEIGHT * prior[:, None, :].expand(2, D, k).clone()  # [2, D, k]
        # the tree level by level: (nodes at depth d, their parents, their ranks), d = 1..max_depth
        depth, parents, rank = self.tree.depth, self.tree.parents, self.tree.rank
        self.levels = [
            (nodes.to(self.device), parents[nodes].to(self.device), rank[nodes].to(self.device))
            for nodes in (torch.nonzero(depth == d).reshape(-1) for d in range(1, self.tree.max_depth + 1))
        ]
        self.last_tokens: list[int | None] = [None]  # per row: its last committed token (the next root)
        # the last proposal, for observe: tokens [B, N], drafted [B, N] bool, source of each node's row [B, N]
        self.last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.counts = {"steps": 0, "drafted": 0, "accepted": 0, "verified_nodes": 0, "seeded": 0}

    # ----- learning -----

    def verified(self, tokens: torch.Tensor, top_tokens: torch.Tensor) -> None:
        """tokens [A, N]: the verified trees; top_tokens [A, N, k]: the target's top-k after each node.
        table[t] = the top-k after the last node (row-major) that carries t."""
        if top_tokens.shape[-1] != self.k:
            raise ValueError(f"verified() got the top-{top_tokens.shape[-1]} but this table keeps k={self.k}")
        flat = tokens.reshape(-1).to(self.device, torch.long)  # [M]
        top = top_tokens.reshape(-1, self.k).to(self.device)  # [M, k]
        if flat.numel() == 0:
            return
        if bool((flat >= self.vocab_size).any() | (top >= self.vocab_size).any()):
            raise ValueError(
                f"a verified token id is >= vocab_size={self.vocab_size}: build the drafter with the "
                "target's output size (model.config.vocab_size)"
            )
        keep = last_occurrences(flat)  # [M] one writer per token: deterministic
        rows = flat[keep]  # [U] distinct tokens
        self.table[rows] = top[keep].to(torch.int32)
        self.width[rows] = self.k
        self.from_target[rows] = True
        self.counts["verified_nodes"] += int(flat.numel())

    def _seed(self, pairs: list[tuple[int, int]]) -> None:
        """Consecutive text tokens (t, next): rank 0 of rows the target has not filled (the latest pair
        of a token wins among the seeds)."""
        pairs = [(t, n) for t, n in pairs if 0 <= t < self.vocab_size and 0 <= n < self.vocab_size]
        if not pairs:
            return
        pair = torch.tensor(pairs, dtype=torch.long, device=self.device)  # [P, 2]
        free = ~self.from_target[pair[:, 0]]  # [P]
        t, n = pair[free, 0], pair[free, 1]
        keep = last_occurrences(t)  # [P'] the latest pair of each token
        self.table[t[keep], 0] = n[keep].to(torch.int32)
        self.width[t[keep]] = 1
        self.counts["seeded"] += int(keep.sum())

    def start(self, sequence: SequenceStart) -> None:
        """A new sequence (or row `sequence.row` of a batch): seed the table from its prompt's bigrams."""
        if sequence.row == 0:
            self.last_tokens = [None] * sequence.rows
            self.last = None
        tokens = [int(t) for t in sequence.tokens]
        self._seed(list(zip(tokens[:-1], tokens[1:], strict=True)))
        self.last_tokens[sequence.row] = tokens[-1] if tokens else None

    def keep_rows(self, rows: list[int]) -> None:
        self.last_tokens = [self.last_tokens[r] for r in rows]
        if self.last is not None:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            self.last = tuple(t[index] for t in self.last)

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Tokens each row committed (accepted ones, then the bonus): learn which drafted nodes of the
        last proposal were accepted, and seed the table from the text."""
        pairs = []
        for row, tokens in enumerate(committed):
            text = ([] if self.last_tokens[row] is None else [self.last_tokens[row]]) + list(tokens)
            pairs += zip(text[:-1], text[1:], strict=True)
            self.last_tokens[row] = text[-1] if text else None
        self._seed(pairs)
        if self.last is not None:
            self._record(committed, *self.last)
            self.last = None  # a plain step in between proposes nothing: nothing to compare with

    def _record(
        self, committed: list[list[int]], tokens: torch.Tensor, drafted: torch.Tensor, source: torch.Tensor
    ) -> None:
        """Walk the committed tokens down the last proposal (tokens, drafted, source: [B, N]), all rows at
        once; every drafted child of a matched node is one try at (source, depth, rank), a hit when its
        token is the committed one."""
        B = tokens.shape[0]
        longest = max(len(c) for c in committed)
        text = torch.full((B, max(longest, 1)), -1, dtype=torch.long, device=self.device)  # [B, L]
        for row, c in enumerate(committed):
            text[row, : len(c)] = torch.tensor(c, dtype=torch.long, device=self.device)
        matched = torch.zeros(B, dtype=torch.long, device=self.device)  # [B] node reached; -1: none
        for d, (nodes, parents, rank) in enumerate(self.levels):
            if d >= text.shape[1]:
                break
            tried = (parents[None] == matched[:, None]) & drafted[:, nodes]  # [B, n_d]
            hit = tried & (tokens[:, nodes] == text[:, d : d + 1])  # [B, n_d] at most one per row
            src = source[:, nodes]  # [B, n_d]
            index = (src * self.tries.shape[1] + d) * self.k + rank[None]  # [B, n_d] into [2 * D * k]
            self.tries.view(-1).index_add_(0, index[tried], torch.ones(int(tried.sum()), dtype=torch.float64))
            self.hits.view(-1).index_add_(0, index[hit], torch.ones(int(hit.sum()), dtype=torch.float64))
            self.counts["accepted"] += int(hit.sum())
            found = hit.any(dim=1)  # [B]
            matched = torch.where(found, nodes[hit.float().argmax(dim=1)], torch.full_like(matched, -1))

    # ----- drafting -----

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        """tokens [B, N] by walking the table from each row's root; probs [B, N]: the node's estimated
        P(accepted | parent accepted) (root 1; 0 where nothing is known or deeper than max_depth)."""
        hidden, roots = batch_rows(hidden, roots)
        B, N = roots.numel(), self.tree.num_nodes
        tokens = roots.to(self.device, torch.long)[:, None].repeat(1, N)  # [B, N] undrafted: the root
        probs = torch.zeros(B, N, dtype=torch.float32, device=self.device)  # [B, N]
        probs[:, 0] = 1.0
        drafted = torch.zeros(B, N, dtype=torch.bool, device=self.device)  # [B, N]
        source = torch.zeros(B, N, dtype=torch.long, device=self.device)  # [B, N] of the parent's row
        rates = (self.hits / self.tries).float().to(self.device)  # [2, D, k]
        depth_limit = len(self.levels) if max_depth is None else min(max_depth, len(self.levels))
        for d, (nodes, parents, rank) in enumerate(self.levels[:depth_limit]):
            parent_tokens = tokens[:, parents]  # [B, n_d]
            known = (self.width[parent_tokens].long() > rank[None]) & (probs[:, parents] > 0)  # [B, n_d]
            candidates = self.table[parent_tokens, rank[None].expand_as(parent_tokens)].long()  # [B, n_d]
            tokens[:, nodes] = torch.where(known, candidates, parent_tokens)
            src = torch.where(self.from_target[parent_tokens], TARGET, SEEDED)  # [B, n_d]
            probs[:, nodes] = torch.where(known, rates[src, d, rank[None].expand_as(src)], 0.0)
            drafted[:, nodes], source[:, nodes] = known, src
        # deeper than max_depth: still the root token, probability 0 (initialised so)
        self.last = (tokens, drafted, source)
        self.counts["steps"] += 1
        self.counts["drafted"] += int(drafted.sum())
        return Proposal(tokens.to(hidden.device), probs.cpu())  # [B, N] each

    def report(self) -> DrafterReport:
        """Counts (drafted nodes, those a walk of the committed text accepted, table rows known) and the
        table's fixed memory."""
        memory = sum(t.numel() * t.element_size() for t in (self.table, self.width, self.from_target))
        stats = {
            **self.counts,
            "rows_from_target": int(self.from_target.sum()),
            "rows_known": int((self.width > 0).sum()),
        }
        return DrafterReport({"recycling": stats}, {"allocated": memory})
