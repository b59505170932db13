"""The EAGLE-style drafter: one draft layer (`eagle_model.EagleDraftModel`) with its own small KV cache,
fed with the target's features from the verification forward that already ran.

Per sequence (each row of a batch on its own), with T the target's committed length and x_T the next
root (the target's own token):

    start / observe   the committed positions the drafter has not seen yet get their entries:
                      (target features f_t, token x_t+1) -> K/V appended and accepted in the drafter's
                      cache, whose committed length then equals T; the output at t = T-1 is kept
    propose           level 0: the kept output's logits give the root's children (top-k);
                      level d: each node at depth d with children runs the layer on (its parent's
                      output, its own token) at position T-1+d, attending to the committed entries and
                      to its own ancestors' entries; its logits give its children
                      the drafted entries stay speculative and are dropped by pointer afterwards

So one step runs the layer once over the newly committed positions and once per deeper tree level, and
never runs the target. The drafter's cache is a `TreeKVCache` of one layer: a batch of sequences drafts
in the same calls, each row at its own committed length (rows that accept fewer tokens than others are
padded in the catch-up pass, and the padding is dropped by pointer). `feature_layers` tells the decoder
which of the target's hidden states to keep.
"""

from __future__ import annotations

import time

import torch

from ..core.cache import TreeKVCache
from ..core.drafting import BaseDrafter, DrafterReport, Proposal, SequenceStart, batch_rows
from ..core.packed import packed_linears
from ..core.tree import Tree, pack_bits
from .eagle_model import EagleDraftModel
from .eagle_native import NativeEagleLayer, native_eagle_reason


class EagleDrafter(BaseDrafter):
    """Drafts `tree` (a chain or a top-k tree, node order of `core.tree.Tree`) with an EAGLE draft layer,
    for one sequence or a batch of them."""

    batched = True
    limits_depth = True  # propose(..., max_depth=D): levels 1..D only (see `SequentialDrafter`)
    costly_levels = True  # each level is a pass of the draft layer

    def __init__(
        self,
        draft: EagleDraftModel,
        tree: Tree,
        model: torch.nn.Module,
        linears: str = "auto",
        native: bool | None = None,
    ):
        """linears: how the draft layer's linear layers run on CPU (`core.packed`): "auto" (treespec's
        block kernel for weights rounded with `EagleDraftModel.round_to_blocks`, else oneDNN prepacked),
        "onednn" or "torch". native: run the layer through the native step (`eagle_native`; one C++ call
        per level): None (default) where it can run and linears is "auto", True (required), False (the
        torch layer)."""
        if tree.num_nodes < 1:
            raise ValueError("the tree needs at least its root")
        self.draft, self.tree, self.linears = draft, tree, linears
        self.embedding = model.get_input_embeddings().weight  # [V, H]
        self.native = self._native_layer(native)
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
        # the same visibility as ancestor bits for the native layer: row i (drafted slot i) sees slot j
        visible = torch.zeros(max(self.num_drafted, 1), max(self.num_drafted, 1), dtype=torch.bool)
        first = 0
        for mask in self.level_masks[1:]:
            visible[first : first + mask.shape[0], : mask.shape[1]] = mask.cpu()
            first += mask.shape[0]
        self.slot_bits = pack_bits(visible)  # [slots, W]
        self.cache: TreeKVCache | None = None
        self.live: list[int] = []  # the cache rows still decoding, in the decoder's row order
        self.last_hidden: torch.Tensor | None = None  # [B, H] per cache row: the output at position T-1
        self.last_logits: torch.Tensor | None = None  # [B, V'] native layer: the logits of last_hidden
        self.stats = {"catch_up_seconds": 0.0, "draft_seconds": 0.0, "steps": 0}

    def _native_layer(self, native: bool | None):
        """The native layer `native` asks for, or None (the torch layer)."""
        if native is False or (native is None and self.linears != "auto"):
            return None
        reason = native_eagle_reason(self.draft, self.embedding)
        if reason is None:
            return NativeEagleLayer.of(self.draft, self.embedding)
        if native:
            raise ValueError(f"native=True, but the native EAGLE layer cannot run here: {reason}")
        return None

    # -- the drafter's committed entries ---------------------------------------------------------------
    def start(self, sequence: SequenceStart) -> None:
        """A new sequence, or row `sequence.row` of a batch (row 0 starts the batch)."""
        if sequence.features is None:
            raise ValueError(
                "the EAGLE drafter needs the target's features at the prompt: run it through treespec's "
                "Decoder (it asks the verification forward for drafter.feature_layers)"
            )
        if sequence.row == 0:
            d, rows = self.draft, sequence.rows
            if self.native is not None:  # over the current weights (rebuilt if they changed since)
                self.native = NativeEagleLayer.of(d, self.embedding)
            if self.cache is None or self.cache.max_len < sequence.capacity or self.cache.num_rows != rows:
                dtype = d.fc.weight.dtype
                self.cache = TreeKVCache(
                    1, rows, d.num_kv_heads, d.head_dim, sequence.capacity, dtype, self.device
                )
                self.cache.spec_reserve = self.num_drafted
            self.cache.reset()
            self.live = list(range(rows))
            self.last_hidden = d.fc.weight.new_zeros(rows, d.hidden_size)  # [B, H]
            self.last_logits = d.fc.weight.new_zeros(rows, d.draft_vocab_size)  # [B, V']
            self.stats = {"catch_up_seconds": 0.0, "draft_seconds": 0.0, "steps": 0}
        tokens = sequence.tokens  # prompt + root: the entry at t reads x_t+1
        next_tokens = torch.tensor([tokens[1:]], device=self.device)  # [1, P]
        self._append([sequence.row], sequence.features, next_tokens, [len(tokens) - 1])

    def keep_rows(self, rows: list[int]) -> None:
        self.live = [self.live[r] for r in rows]

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """committed: per live row, the accepted tokens after the root, then the bonus. features [A, m, F]
        at each row's accepted nodes (root first): exactly the positions whose entries are missing; row a's
        first len(committed[a]) are its own (m: the longest), the rest padding."""
        if features is None:
            raise ValueError("the EAGLE drafter needs the verification forward's features in observe()")
        if len(committed) != len(self.live) or features.shape[0] != len(committed):
            raise ValueError(
                f"observe got {len(committed)} rows of tokens and {features.shape[0]} of features for "
                f"{len(self.live)} live rows"
            )
        m = features.shape[1]
        padded = [list(tokens) + [0] * (m - len(tokens)) for tokens in committed]
        next_tokens = torch.tensor(padded, device=self.device)  # [A, m]
        self._append(self.live, features, next_tokens, [len(tokens) for tokens in committed])

    @torch.inference_mode()
    def _append(self, rows: list[int], features: torch.Tensor, next_tokens: torch.Tensor, counts: list[int]):
        """Committed entries for cache `rows` from features [A, m, F] at positions c_a .. c_a+m-1 and
        next_tokens [A, m] (x_t+1); row a keeps its first counts[a] entries, the rest is padding."""
        t0 = time.perf_counter()
        cache, d = self.cache, self.draft
        A, m = next_tokens.shape
        cache.begin(rows, m)
        positions = cache.positions(torch.arange(m, device=self.device))  # [A, m]: c_a + i
        last = torch.tensor(counts, device=self.device) - 1  # [A]
        with packed_linears(d, mode=self.linears):
            hidden = d.fuse(features)  # [A, m, H]
            if self.native is not None:  # one call, causal over the block; logits of the kept outputs only
                rows_at, starts = cache.forward_rows()
                out, logits = self.native(
                    hidden, next_tokens, positions, cache, rows_at, starts, logit_rows=last
                )  # [A, m, H], [A, V']
                cache.mark_written(1)
                self.last_logits[rows] = logits
            else:
                emb = self.embedding[next_tokens]  # [A, m, H]
                q, k, v = d.qkv(hidden, emb, positions)
                keys, values = self._rows_kv(cache.layers[0].update(k, v), rows)  # [A, Hkv, end, D]
                keys_at = torch.arange(keys.shape[2], device=self.device)  # [end]
                mask = keys_at[None, None, :] <= positions[:, :, None]  # [A, m, end]: committed, then causal
                out = d.finish(hidden, d.attend(q, keys, values, mask[:, None]))  # [A, m, H]
        cache.commit([range(n) for n in counts])  # each row's own entries; its padding rolled back
        self.last_hidden[rows] = out[torch.arange(A, device=self.device), last]
        self.stats["catch_up_seconds"] += time.perf_counter() - t0

    def _rows_kv(self, kv: tuple[torch.Tensor, torch.Tensor], rows: list[int]):
        """The cache's [B, Hkv, end, D] views narrowed to `rows` (the views themselves when all rows)."""
        keys, values = kv
        if rows == list(range(self.cache.num_rows)):
            return keys, values
        index = torch.tensor(rows, device=self.device)
        return keys[index], values[index]  # [A, Hkv, end, D]

    # -- drafting --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        _, roots = batch_rows(hidden, roots)  # the target's hidden is not used: the drafter keeps its own
        if self.cache is None or self.last_hidden is None:
            raise RuntimeError("EagleDrafter.propose() before start(): run it through treespec's Decoder")
        if roots.numel() != len(self.live):
            raise ValueError(f"propose got {roots.numel()} roots for {len(self.live)} live rows")
        t0 = time.perf_counter()
        with packed_linears(self.draft, enabled=self.native is None, mode=self.linears):
            proposal = self._draft(roots.to(self.device), max_depth)
        self.stats["draft_seconds"] += time.perf_counter() - t0
        self.stats["steps"] += 1
        return proposal

    def _draft(self, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        """Each live row's tree tokens and draft probabilities, level by level (see the module docstring);
        roots [A]. With max_depth, nodes deeper than it keep the root's token and probability 0."""
        d, cache, n, live = self.draft, self.cache, self.tree.num_nodes, self.live
        A = len(live)
        rows = torch.tensor(live, device=self.device)  # [A]
        committed = [cache.lengths[r] for r in live]
        c = torch.tensor(committed, device=self.device)  # [A]
        tokens = roots[:, None].repeat(1, n)  # [A, N] undrafted nodes: the root's token
        probs = torch.zeros(A, n, device=self.device)  # [A, N] undrafted nodes: 0
        probs[:, 0] = 1.0
        levels = self.levels if max_depth is None else self.levels[: max(max_depth, 0)]
        outputs = self.last_hidden.new_empty(A, n, d.hidden_size)  # [A, N, H] the output of each node's entry
        outputs[:, 0] = self.last_hidden[rows]
        written = 0  # drafted entries per row so far
        native = self.native is not None
        level_layer = self._native_level if native else self._torch_level
        for level, (expanded, parents, children, row, rank, k) in enumerate(levels):
            if level == 0:  # [A, 1, V'] the kept output's logits
                logits = self.last_logits[rows][:, None] if native else d.logits(outputs[:, :1])
            else:
                positions = (c - 1 + level)[:, None].expand(A, len(expanded))  # [A, n_d]
                x, ids = outputs[:, parents], tokens[:, expanded]  # [A, n_d, H] parents' outputs, [A, n_d]
                h, logits = level_layer(level, x, ids, positions, rows, c, written)  # [A, n_d, H], [.., V']
                written += len(expanded)
                outputs[:, expanded] = h
            top = logits.float().softmax(dim=-1).topk(k, dim=-1)  # values, indices [A, n_d, k]
            tokens[:, children] = d.token_ids(top.indices[:, row, rank])  # [A, c_d]
            probs[:, children] = top.values[:, row, rank]
        if not native:
            cache.rollback_rows(live, committed)  # the drafted entries were speculative: dropped by pointer
        return Proposal(tokens, probs)  # [A, N] each

    def _torch_level(self, level, x, ids, positions, rows, c, written):
        """One level through the torch layer: its entries appended at each row's end (after the levels
        before it, committed for the deeper levels to see; `_draft` rolls them back) -> h, logits."""
        d, cache, count = self.draft, self.cache, ids.shape[1]
        q, key, value = d.qkv(x, self.embedding[ids], positions)
        cache.begin(self.live, count)  # at each row's end: after the levels drafted before
        keys, values = self._rows_kv(cache.layers[0].update(key, value), self.live)  # [A, Hkv, end, D]
        written += count
        # key slot j of row a: committed when j < c_a, drafted slot j - c_a when below c_a + written
        rel = torch.arange(keys.shape[2], device=self.device)[None] - c[:, None]  # [A, end]
        seen = self.level_masks[level][:, rel.clamp(0, written - 1)]  # [n_d, A, end]
        mask = (rel < 0)[None] | (seen & ((rel >= 0) & (rel < written))[None])  # [n_d, A, end]
        h = d.finish(x, d.attend(q, keys, values, mask.transpose(0, 1)[:, None]))  # [A, n_d, H]
        cache.commit_all()  # the deeper levels see this level's entries
        return h, d.logits(h)

    def _native_level(self, level, x, ids, positions, rows, c, written):
        """One level through the native layer: one call that writes the level's entries at block positions
        `written`.. after each row's committed end (the committed lengths never move: nothing to roll back)
        and returns h and the logits."""
        return self.native(x, ids, positions, self.cache, rows, c, self.slot_bits, written)

    def report(self) -> DrafterReport:
        memory = self.cache.memory_bytes() if self.cache is not None else {}
        return DrafterReport(dict(self.stats), memory)
