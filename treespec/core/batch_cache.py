"""BatchKVCache: one preallocated KV cache for B sequences, each row with its own committed length.

Layout per layer (the same as `TreeKVCache`, one row per sequence):

    keys/values: [B, Hkv, max_len, D]
                  row b: [0, c_b)          its committed prefix
                         [c_b, c_b + n)    the block its last forward wrote (n tree nodes or prompt tokens)

A forward runs over some of the rows (`begin(rows)`: the rows still decoding, or one row's prefill);
each writes its n new tokens at its own committed end. `commit(paths)` keeps each row's accepted nodes
(node path[i] of row b moves to c_b + i where path[i] != i) and advances that row alone; the rest of the
block is rolled back by pointer. Rows never see each other: attention reads row b's keys [0, c_b + n)
only (`AttentionPlan.rows` and `prefix_lens`, which `attention_plan` fills for the forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from .attention import AttentionPlan
from .cache import CacheCapacityError, KVCacheBase, PreallocatedLayer, kv_layout, zeroed_layers


class BatchKVLayer(PreallocatedLayer):
    """One layer's K/V for all rows; a forward writes the new tokens of its rows at their own offsets."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [A, Hkv, n, D] for the A rows of this forward
        rows, dst = self.owner._write_index  # [A, 1], [A, n]
        # index_put with the head dim between the advanced indices: the values go as [A, n, Hkv, D]
        self.keys[rows, :, dst] = key_states.transpose(1, 2)
        self.values[rows, :, dst] = value_states.transpose(1, 2)
        end = self.owner._write_end
        # [B, Hkv, end, D] views of every row (no copy); attention takes the rows it needs
        return self.keys[:, :, :end], self.values[:, :, :end]


class BatchKVCache(KVCacheBase):
    """Preallocated per-layer K/V for B sequences decoded together; per-row committed lengths."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        super().__init__(zeroed_layers(self, BatchKVLayer, num_layers, shape, dtype, device), max_len)
        self.num_rows = batch_size
        self.device = torch.device(device)
        self.lengths = [0] * batch_size  # committed tokens per row
        self.rows: list[int] = []  # the rows of the current forward
        self.block = 0  # n: tokens the current forward writes per row
        self._write_index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._write_end = 0
        self._rows_host = self._starts_host = torch.zeros(0, dtype=torch.long)

    @classmethod
    def for_model(cls, model, max_len: int, batch_size: int, spec_reserve: int = 0) -> BatchKVCache:
        """A cache shaped for `model` (a transformers causal LM): `batch_size` rows of `max_len` tokens."""
        num_layers, num_kv_heads, head_dim, dtype, device = kv_layout(model)
        cache = cls(num_layers, batch_size, num_kv_heads, head_dim, max_len, dtype, device)
        cache.spec_reserve = spec_reserve
        return cache

    # -- one forward -----------------------------------------------------------------------------
    def begin(self, rows: Sequence[int], n: int) -> None:
        """Prepare a forward over `rows` (indices into the batch) writing n tokens each at their
        committed ends; checks every row's capacity first."""
        rows = [int(r) for r in rows]
        if not rows or any(not 0 <= r < self.num_rows for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"rows {rows} are not distinct rows of a batch of {self.num_rows}")
        starts = [self.lengths[r] for r in rows]
        end = max(starts) + n
        if end > self.max_len:
            row = rows[starts.index(max(starts))]
            raise CacheCapacityError(
                f"row {row} has {self.lengths[row]} committed tokens and the forward needs positions up to "
                f"{end}, but the BatchKVCache holds {self.max_len}: create it with a larger max_len "
                "(longest prompt + max_new_tokens + speculation size)"
            )
        self.rows, self.block, self._write_end = rows, n, end
        # [A] each, on the CPU (the kernels read them on the host): the rows and their committed lengths
        self._rows_host = torch.tensor(rows, dtype=torch.long)
        self._starts_host = torch.tensor(starts, dtype=torch.long)
        offsets = torch.arange(n, device=self.device)  # [n]
        dst = self._starts_host.to(self.device)[:, None] + offsets  # [A, n]
        self._write_index = (self._rows_host.to(self.device)[:, None], dst)  # [A, 1], [A, n]
        self.length = end

    def positions(self, depth: torch.Tensor) -> torch.Tensor:
        """Positions of the current forward's tokens: c_row + depth, [A, n] (depth [n])."""
        return self._starts_host.to(depth.device)[:, None] + depth[None]

    def attention_plan(self, plan: AttentionPlan) -> AttentionPlan:
        """`plan` (the tree's visibility) with this forward's rows and their committed lengths."""
        return replace(plan, rows=self._rows_host, prefix_lens=self._starts_host)

    def _write_start(self) -> int:
        return max(self.lengths[r] for r in self.rows) if self.rows else 0

    def _reserve(self, n: int) -> int:
        if n != self.block:
            raise RuntimeError(f"BatchKVCache.begin() prepared a block of {self.block} tokens, got {n}")
        return self._write_end

    # -- after a forward -------------------------------------------------------------------------
    def commit(self, paths: Sequence[Sequence[int]]) -> None:
        """Keep, for each row of the forward, the pending nodes `paths[a]` (indices into its block, in
        order) as its next committed tokens; the rest of each block is rolled back by pointer."""
        if len(paths) != len(self.rows):
            raise ValueError(f"commit got {len(paths)} paths for a forward over {len(self.rows)} rows")
        rows, dst, src = [], [], []
        for row, path in zip(self.rows, paths, strict=True):
            path = [int(p) for p in path]
            if not path or any(p < 0 or p >= self.block for p in path):
                raise ValueError(
                    f"commit path {path} indexes outside the pending block of {self.block} tokens"
                )
            c = self.lengths[row]
            for i, p in enumerate(path):
                if p != i:  # a prefix of a chain is already in place
                    rows.append(row)
                    dst.append(c + i)
                    src.append(c + p)
            self.lengths[row] = c + len(path)
        if rows:
            self._copy_slots(rows, src, dst)
        self._end_forward()

    def commit_all(self) -> None:
        """Accept every row's whole block as written (a prefill, plain decoding)."""
        for row in self.rows:
            self.lengths[row] += self.block
        self._end_forward()

    def rollback_rows(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Roll `rows` back to committed `lengths` (no longer than they are): the entries after them are
        dropped by pointer, nothing is copied or cleared."""
        for row, length in zip(rows, lengths, strict=True):
            if not 0 <= length <= self.lengths[row]:
                raise ValueError(
                    f"row {row} has {self.lengths[row]} committed tokens: cannot roll back to {length}"
                )
            self.lengths[row] = int(length)
        self._end_forward()

    def _copy_slots(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """Slot (row, src[i]) -> (row, dst[i]) in every layer: one gather, then one scatter per tensor."""
        r = torch.tensor(rows, device=self.device)
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for layer in self.layers:
            layer.keys[r, :, d] = layer.keys[r, :, s]  # [m, Hkv, D] gathered, then written
            layer.values[r, :, d] = layer.values[r, :, s]

    def _end_forward(self) -> None:
        self.rows, self.block, self._write_index = [], 0, None
        self.length = self.committed = max(self.lengths)

    def reset(self) -> None:
        super().reset()
        self.lengths = [0] * self.num_rows
        self._end_forward()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._write_start() if self.rows else max(self.lengths)

    def row_kv(self, row: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one row's committed K/V in one layer: [Hkv, c_row, D] each."""
        layer, n = self.layers[layer_idx], self.lengths[row]
        return layer.keys[row, :, :n], layer.values[row, :, :n]

    def bytes_per_token(self) -> int:
        """K + V bytes that one token of one row occupies across all layers."""
        keys = self.layers[0].keys
        return 2 * keys.shape[1] * keys.shape[3] * keys.element_size() * len(self.layers)

    def memory_bytes(self) -> dict[str, int]:
        per_token = self.bytes_per_token()
        return {
            "per_token": per_token,
            "committed": sum(self.lengths) * per_token,
            "speculative": self.spec_reserve * self.num_rows * per_token,
            "allocated": self.max_len * self.num_rows * per_token,
        }
