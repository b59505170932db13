"""The EAGLE-style drafter: one draft layer (`eagle_model.EagleDraftModel`) with its own small KV cache,
fed with the target's features from the verification forward that already ran.

Per sequence, with T the target's committed length and x_T the next root (the target's own token):

    start / observe   the committed positions the drafter has not seen yet get their entries:
                      (target features f_t, token x_t+1) -> K/V appended and accepted in the drafter's
                      cache, whose committed length then equals T; the output at t = T-1 is kept
    propose           level 0: the kept output's logits give the root's children (top-k);
                      level d: each node at depth d with children runs the layer on (its parent's
                      output, its own token) at position T-1+d, attending to the committed entries and
                      to its own ancestors' entries; its logits give its children
                      the drafted entries stay speculative and are dropped by pointer afterwards

So one step runs the layer once over the newly committed positions and once per deeper tree level, and
never runs the target. `feature_layers` tells the decoder which of the target's hidden states to keep.
"""

from __future__ import annotations

import time

import torch

from ..core.packed import packed_linears
from ..core.spec_cache import SpeculativeKVCache
from ..core.tree import Tree
from .base import BaseDrafter, DrafterReport, Proposal, SequenceStart, single_row
from .eagle_model import EagleDraftModel


class EagleDrafter(BaseDrafter):
    """Drafts `tree` (a chain or a top-k tree, node order of `core.tree.Tree`) with an EAGLE draft layer."""

    def __init__(
        self,
        draft: EagleDraftModel,
        tree: Tree,
        model: torch.nn.Module,
        storage: str = "model",
        linears: str = "auto",
    ):
        """storage: the precision of the drafter's KV cache (`SpeculativeKVCache`); linears: how its linear
        layers run on CPU (`core.packed`): "auto" (treespec's block kernel for weights rounded with
        `EagleDraftModel.round_to_blocks`, else oneDNN prepacked), "onednn" or "torch"."""
        if tree.num_nodes < 1:
            raise ValueError("the tree needs at least its root")
        self.draft, self.tree, self.storage, self.linears = draft, tree, storage, linears
        self.embedding = model.get_input_embeddings().weight  # [V, H]
        self.feature_layers = tuple(draft.feature_layers)
        self.device = self.embedding.device
        # per level d: expanded nodes at depth d [n_d], their parents, the children [c_d], each child's
        # parent's row in `expanded`, each child's rank, and the top-k the level needs
        self.levels = tree.levels(self.device)
        # drafted entries, in level order: the slot of each expanded non-root node, and per level the
        # slots its nodes see (their drafted ancestors and themselves) [n_d, slots written so far]
        drafted = [int(n) for level in self.levels[1:] for n in level[0].tolist()]
        slot = {node: i for i, node in enumerate(drafted)}
        self.num_drafted = len(drafted)
        self.level_masks = [None]
        written = 0
        for expanded, *_ in self.levels[1:]:
            written += len(expanded)
            mask = torch.zeros(len(expanded), written, dtype=torch.bool)
            for row, node in enumerate(expanded.tolist()):
                for ancestor in tree.ancestor_mask[node].nonzero().flatten().tolist():
                    if ancestor in slot:
                        mask[row, slot[ancestor]] = True
            self.level_masks.append(mask.to(self.device))
        self.cache: SpeculativeKVCache | None = None
        self.last_hidden: torch.Tensor | None = None  # [1, 1, H] the output at position T-1
        self.stats = {"catch_up_seconds": 0.0, "draft_seconds": 0.0, "steps": 0}

    # -- the drafter's committed entries ---------------------------------------------------------------
    def start(self, sequence: SequenceStart) -> None:
        if sequence.features is None:
            raise ValueError(
                "the EAGLE drafter needs the target's features at the prompt: run it through treespec's "
                "Decoder (it asks the verification forward for the layers in drafter.feature_layers)"
            )
        d = self.draft
        if self.cache is None or self.cache.max_len < sequence.capacity:
            self.cache = SpeculativeKVCache(
                1,
                1,
                d.num_kv_heads,
                d.head_dim,
                sequence.capacity,
                d.fc.weight.dtype,
                self.device,
                self.storage,
                spec_reserve=self.num_drafted,
            )
        self.cache.rollback(0)
        self.stats = {"catch_up_seconds": 0.0, "draft_seconds": 0.0, "steps": 0}
        tokens = sequence.tokens  # prompt + root: the entry at t reads x_t+1
        self._append(sequence.features, torch.tensor([tokens[1:]], device=self.device))

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """committed: per row, the accepted tokens after the root, then the bonus; features [1, a+1, F]
        at the accepted nodes (root first): exactly the positions whose entries are missing."""
        if features is None:
            raise ValueError("the EAGLE drafter needs the verification forward's features in observe()")
        self._append(features, torch.tensor(committed, device=self.device))

    @torch.inference_mode()
    def _append(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Committed entries from features [1, n, F] at positions c..c+n-1 and next_tokens [1, n] (x_t+1)."""
        t0 = time.perf_counter()
        cache, d = self.cache, self.draft
        cache.rollback(cache.committed)  # drop the last step's drafted entries
        c, n = cache.committed, next_tokens.shape[1]
        positions = torch.arange(c, c + n, device=self.device)[None]  # [1, n]
        with packed_linears(d, mode=self.linears):
            hidden = d.fuse(features)  # [1, n, H]
            emb = self.embedding[next_tokens]  # [1, n, H]
            q, k, v = d.qkv(hidden, emb, positions)
            keys, values = cache.layers[0].update(k, v)  # [1, Hkv, c+n, D]
            mask = torch.ones(n, c + n, dtype=torch.bool, device=self.device).tril(c)  # causal, [0, c+n)
            out = d.finish(hidden, d.attend(q, keys, values, mask))  # [1, n, H]
        cache.advance(n)
        cache.accept(n)
        self.last_hidden = out[:, -1:]  # [1, 1, H]
        self.stats["catch_up_seconds"] += time.perf_counter() - t0

    # -- drafting --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor) -> Proposal:
        _, root = single_row(hidden, roots)  # the target's hidden is not used: the drafter keeps its own
        if self.cache is None or self.last_hidden is None:
            raise RuntimeError("EagleDrafter.propose() before start(): run it through treespec's Decoder")
        t0 = time.perf_counter()
        with packed_linears(self.draft, mode=self.linears):
            proposal = self._draft(root)
        self.stats["draft_seconds"] += time.perf_counter() - t0
        self.stats["steps"] += 1
        return proposal

    def _draft(self, root: int) -> Proposal:
        """The tree's tokens and draft probabilities, level by level (see the module docstring)."""
        d, cache, n = self.draft, self.cache, self.tree.num_nodes
        c = cache.committed
        tokens = torch.empty(n, dtype=torch.long, device=self.device)  # [N]
        tokens[0] = root
        probs = torch.ones(n, device=self.device)  # [N]
        outputs = self.last_hidden.new_empty(n, d.hidden_size)  # [N, H] the output of each node's entry
        outputs[0] = self.last_hidden[0, 0]
        for level, (expanded, parents, children, row, rank, k) in enumerate(self.levels):
            if level == 0:
                h = self.last_hidden[0]  # [1, H]
            else:
                count = len(expanded)
                x = outputs[parents][None]  # [1, n_d, H] each node's parent's output
                emb = self.embedding[tokens[expanded]][None]  # [1, n_d, H]
                positions = torch.full((1, count), c - 1 + level, device=self.device)  # [1, n_d]
                q, key, value = d.qkv(x, emb, positions)
                keys, values = cache.layers[0].update(key, value)  # [1, Hkv, end, D]
                cache.advance(count)
                seen = self.level_masks[level]  # [n_d, drafted so far]
                mask = torch.cat([seen.new_ones(count, c), seen], dim=1)  # [n_d, end]
                h = d.finish(x, d.attend(q, keys, values, mask))[0]  # [n_d, H]
                outputs[expanded] = h
            top = d.logits(h).float().softmax(dim=-1).topk(k, dim=-1)  # values, indices [n_d, k]
            tokens[children] = d.token_ids(top.indices[row, rank])  # [c_d]
            probs[children] = top.values[row, rank]
        return Proposal(tokens[None], probs[None])  # [1, N] each

    def report(self) -> DrafterReport:
        memory = self.cache.memory_bytes() if self.cache is not None else {}
        return DrafterReport(dict(self.stats), memory)
