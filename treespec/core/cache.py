"""TreeKVCache: the target's preallocated KV cache, B rows, each with its own committed length.

Layout per layer (gpt-fast style, written by position index; B = 1 is a batch of one):

    keys/values: [B, Hkv, max_len, D]
                  row b: [0, c_b)          its committed prefix, shared by every branch of its tree
                         [c_b, c_b + n)    the block its last forward wrote (n tree nodes or prompt tokens)

A forward starts one way: `begin(rows, n)` (the rows still decoding, or one row's prefill); each of them
writes its n new tokens at its own committed end. A forward that was not begun (a plain HF call on the
cache) begins over every row. `commit(paths)` keeps each row's accepted nodes (node path[i] of row b
moves to c_b + i where path[i] != i) and advances that row alone; the rest of the block is rolled back by
pointer. The copies go through the fused op `treespec.ops.commit_kv` (one call per row that moves
anything, all layers at once) when the compiled extension is available (`fused_commit`), else through
the torch reference. Rows never see each other: attention reads row b's keys [0, c_b + n) only
(`AttentionPlan.rows` and `prefix_lens`, which `attention_plan` fills for the forward). It plugs into
transformers as a `Cache`, so any HF decoder model writes its K/V here through `cache.update(...)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.models.llama.modeling_llama import LlamaModel

from .. import ops
from .attention import AttentionPlan
from .pages import huge_page_zeros
from .runtime import TargetRuntime

# The keyword under which transformers' model and decoder-layer forwards take a cache: "cache" in recent
# 5.x releases, "past_key_values" before (there an unknown "cache=" vanishes into **kwargs and every
# forward would run without the cache). One name per installed transformers, read off one model class.
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


class CacheNotWrittenError(RuntimeError):
    """A forward that should have written the cache did not (the model ignored the cache argument)."""


class CacheCapacityError(ValueError):
    """More tokens than the preallocated cache can hold."""


def text_config(model):
    """A transformers causal LM's text-decoder config (its own, or a multimodal model's text part)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def kv_layout(model) -> tuple[int, int, int, torch.dtype, torch.device]:
    """(layers, KV heads, head dim, dtype, device) of a transformers causal LM's KV cache."""
    config = text_config(model)
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    param = next(model.parameters())
    return config.num_hidden_layers, num_kv_heads, head_dim, param.dtype, param.device


class PreallocatedLayer(CacheLayerMixin):
    """One layer's preallocated K/V, written by position index; the pointers live in the owning cache."""

    is_sliding = False

    def __init__(self, owner: KVCacheBase, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys = keys  # [B, Hkv, max_len, D]
        self.values = values  # [B, Hkv, max_len, D]
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner._write_start() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return self.owner.max_len


def zeroed_layers(
    owner, layer_cls, num_layers: int, shape: tuple, dtype, device, spare: torch.Tensor | None = None
) -> tuple[list, torch.Tensor | None]:
    """`num_layers` layers of `layer_cls` over zeroed K/V of `shape` ([B, Hkv, max_len, D]), owned by
    `owner` (the cache that keeps their pointers), and the buffer they live in: on the CPU all of them in
    one buffer on 2 MB pages (`spare`: one to reuse, see `huge_page_zeros`); elsewhere None."""
    if torch.device(device).type == "cpu":
        kv, buffer = huge_page_zeros(2 * num_layers, tuple(shape), dtype, spare)
        return [layer_cls(owner, kv[2 * i], kv[2 * i + 1]) for i in range(num_layers)], buffer
    layers = [
        layer_cls(
            owner,
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]
    return layers, None


class KVCacheBase(Cache):
    """The pointer scheme every treespec KV cache shares (one per decoding run, allocated once):

        [0, committed)        final tokens
        [committed, length)   written by forwards but not accepted yet (speculative)
        [length, max_len)     free

    A forward over n tokens writes [start, start + n) with start = `_write_start()` (subclasses say
    where), after `_reserve(n)` checked the capacity. Rollback moves pointers only; nothing is cleared.
    """

    def __init__(self, layers: list[CacheLayerMixin], max_len: int, spec_reserve: int = 0):
        super().__init__(layers=layers)
        self.max_len = max_len
        self.committed = 0
        self.length = 0
        self.spec_reserve = spec_reserve  # tokens kept free for speculation (for the memory report)

    def _write_start(self) -> int:
        raise NotImplementedError

    def _reserve(self, n: int) -> int:
        """Capacity check for a forward over n tokens; returns the end of its block."""
        end = self._write_start() + n
        if end > self.max_len:
            raise CacheCapacityError(
                f"the {type(self).__name__} holds {self.max_len} tokens; {self.committed} are committed and "
                f"the forward needs positions up to {end}: create the cache with a larger max_len "
                "(prompt + max_new_tokens + speculation size)"
            )
        return end

    def rollback(self, length: int) -> None:
        """Forget everything from position `length` on (pointer only, nothing is cleared)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: {self.length} tokens are held")
        self.length = length
        self.committed = min(self.committed, length)

    def crop(self, max_length: int) -> None:
        """transformers-style crop: a negative value removes that many tokens."""
        self.rollback(self.length + max_length if max_length < 0 else min(max_length, self.length))

    def reset(self) -> None:
        self.committed = self.length = 0

    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (K + V, plus any scales)."""
        raise NotImplementedError

    def memory_bytes(self) -> dict[str, int]:
        """Cache memory: per token, committed prefix, speculative reserve, everything allocated."""
        per_token = self.bytes_per_token()
        return {
            "per_token": per_token,
            "committed": self.committed * per_token,
            "speculative": self.spec_reserve * per_token,
            "allocated": self.max_len * per_token,
        }


class TreeKVLayer(PreallocatedLayer):
    """One layer's K/V for all rows; a forward writes the new tokens of its rows at their own offsets."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [A, Hkv, n, D] for the A rows of this forward
        owner = self.owner
        (_, heads, _, dims), (_, want_heads, _, want_dims) = key_states.shape, self.keys.shape
        if heads != want_heads or dims != want_dims:
            raise ValueError(
                f"the model's layers give {heads} K/V heads of {dims} dims, but its config describes "
                f"{want_heads} of {want_dims} (num_key_value_heads, head_dim), which sized treespec's cache: "
                "fix those config fields to match the model"
            )
        if not owner.rows:  # a forward nobody began (a plain HF call): every row
            owner.begin(range(owner.num_rows), key_states.shape[2])
        owner.writes += 1
        rows, dst = owner._write_index  # [A, 1] and [A, n], or (start, end) slices for one row
        if owner._one_block:
            self.keys[:, :, rows:dst] = key_states
            self.values[:, :, rows:dst] = value_states
        else:  # index_put with the head dim between the advanced indices: values go as [A, n, Hkv, D]
            dtype = self.keys.dtype  # (a bf16 cache under a float32 model: rounded to nearest even)
            self.keys[rows, :, dst] = key_states.transpose(1, 2).to(dtype)
            self.values[rows, :, dst] = value_states.transpose(1, 2).to(dtype)
        end = owner._write_end
        # [B, Hkv, end, D] views of every row (no copy); attention takes the rows it needs
        return self.keys[:, :, :end], self.values[:, :, :end]


class TreeKVCache(KVCacheBase):
    """Preallocated per-layer K/V for B sequences (B = 1: one); per-row committed lengths."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fused_commit: bool | None = None,
        spare: torch.Tensor | None = None,
    ):
        """fused_commit: None (default) uses the fused commit op when the extension is available,
        True requires it, False always uses the torch reference. spare: a CPU buffer to carve the K/V
        from when it is large enough (`huge_page_zeros`; `for_model` passes the model's)."""
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        layers, self.buffer = zeroed_layers(self, TreeKVLayer, num_layers, shape, dtype, device, spare)
        super().__init__(layers, max_len)
        self.runtime = None  # the model's TargetRuntime that `release` gives the buffer to (`for_model`)
        self.released = False
        self.num_rows = batch_size
        self.device = torch.device(device)
        self.fused_commit = fused_commit
        self.lengths = [0] * batch_size  # committed tokens per row
        self.rows: list[int] = []  # the rows of the current forward
        self.block = 0  # n: tokens the current forward writes per row
        self._write_index: tuple | None = None
        self._write_end = 0
        self.writes = 0  # layers that wrote the current forward's block (`check_written`)
        self._one_block = False  # the forward covers every row from one start: a slice write
        self._rows_host = self._starts_host = torch.zeros(0, dtype=torch.long)

    @classmethod
    def for_model(
        cls,
        model,
        max_len: int,
        batch_size: int = 1,
        spec_reserve: int = 0,
        dtype: torch.dtype | None = None,
    ) -> TreeKVCache:
        """A cache shaped for `model` (a transformers causal LM): `batch_size` rows of `max_len` tokens, K/V
        in `dtype` (default: the model's). On the CPU its K/V reuse the buffer that the model's last
        released cache gave back (`release`), when that is large enough."""
        num_layers, num_kv_heads, head_dim, model_dtype, device = kv_layout(model)
        dtype = dtype or model_dtype
        runtime = TargetRuntime.of(model)
        spare = runtime.take_kv_buffer() if torch.device(device).type == "cpu" else None
        cache = cls(num_layers, batch_size, num_kv_heads, head_dim, max_len, dtype, device, spare=spare)
        cache.spec_reserve = spec_reserve
        cache.runtime = runtime
        return cache

    def copy_prefix(self, other: TreeKVCache, length: int) -> None:
        """Row 0 takes the first `length` committed tokens of `other`'s row 0 (a cache of the same model:
        one sequence moving to a larger cache), committed here."""
        if not 0 <= length <= min(other.lengths[0], self.max_len) or len(other.layers) != len(self.layers):
            raise ValueError(f"cannot take {length} tokens from a cache of {other.lengths[0]} committed")
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.keys[0, :, :length] = theirs.keys[0, :, :length]  # [Hkv, length, D]
            mine.values[0, :, :length] = theirs.values[0, :, :length]
        self.lengths[0] = length
        self._end_forward()

    def release(self) -> None:
        """Done with this cache: its CPU buffer goes to the model's runtime, for the next cache of the model
        to reuse (`for_model`), and the cache holds no K/V after this (a forward on it raises)."""
        if self.released:
            return
        if self.runtime is not None and self.buffer is not None:
            self.runtime.keep_kv_buffer(self.buffer)
        self.buffer, self.released = None, True
        empty = torch.empty(0, dtype=self.layers[0].keys.dtype, device=self.device)
        for layer in self.layers:
            layer.keys = layer.values = empty

    # -- one forward -----------------------------------------------------------------------------
    def begin(self, rows: Sequence[int], n: int) -> None:
        """Prepare a forward over `rows` (indices into the batch) writing n tokens each at their
        committed ends; checks every row's capacity first."""
        if self.released:
            raise RuntimeError(
                "this TreeKVCache was released (its memory went to the next cache): make a new one"
            )
        rows = [int(r) for r in rows]
        if not rows or any(not 0 <= r < self.num_rows for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"rows {rows} are not distinct rows of a batch of {self.num_rows}")
        starts = [self.lengths[r] for r in rows]
        end = max(starts) + n
        if end > self.max_len:
            row = rows[starts.index(max(starts))]
            raise CacheCapacityError(
                f"row {row} has {self.lengths[row]} committed tokens and the forward needs positions up to "
                f"{end}, but the TreeKVCache holds {self.max_len}: create it with a larger max_len "
                "(longest prompt + max_new_tokens + speculation size)"
            )
        self.rows, self.block, self._write_end = rows, n, end
        self.writes = 0
        # [A] each, on the CPU (the kernels read them on the host): the rows and their committed lengths
        self._rows_host = torch.tensor(rows, dtype=torch.long)
        self._starts_host = torch.tensor(starts, dtype=torch.long)
        self._one_block = rows == list(range(self.num_rows)) and len(set(starts)) == 1
        if self._one_block:  # every row from the same start (one sequence): a slice [start, end)
            self._write_index = (starts[0], end)
        else:
            dst = self._starts_host.to(self.device)[:, None] + torch.arange(n, device=self.device)  # [A, n]
            self._write_index = (self._rows_host.to(self.device)[:, None], dst)  # [A, 1], [A, n]
        self.length = end

    def positions(self, depth: torch.Tensor) -> torch.Tensor:
        """Positions of the current forward's tokens: c_row + depth, [A, n] (depth [n])."""
        return self._starts_host.to(depth.device)[:, None] + depth[None]

    def attention_plan(self, plan: AttentionPlan) -> AttentionPlan:
        """`plan` (the tree's visibility) with this forward's rows and their committed lengths; unchanged
        for a forward over every row from one start (one sequence): its prefix is every key before the
        block."""
        if self._one_block:
            return plan
        return replace(plan, rows=self._rows_host, prefix_lens=self._starts_host)

    def forward_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current forward's rows and their committed lengths (int64 [A] CPU tensors each), for a
        kernel that writes the block itself (`core.native`)."""
        if not self.rows:
            raise RuntimeError("TreeKVCache.begin(rows, n) must prepare the forward first")
        return self._rows_host, self._starts_host

    def mark_written(self, layers: int) -> None:
        """A kernel wrote the current forward's block in `layers` layers itself (no `update` calls)."""
        self.writes += layers

    def _write_start(self) -> int:
        return max(self.lengths[r] for r in self.rows) if self.rows else max(self.lengths)

    def _reserve(self, n: int) -> int:
        """The end of the current forward's block (begun here over every row when nobody began it)."""
        if not self.rows:
            self.begin(range(self.num_rows), n)
        if n != self.block:
            raise RuntimeError(f"TreeKVCache.begin() prepared a block of {self.block} tokens, got {n}")
        return self._write_end

    @property
    def pending(self) -> int:
        """n: tokens each row of the current forward wrote past its committed end (0 between forwards)."""
        return self.block

    # -- after a forward -------------------------------------------------------------------------
    def commit(self, paths: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor) -> None:
        """Keep, for each row of the forward, the pending nodes `paths[a]` (indices into its block, in
        order) as its next committed tokens; the rest of each block is rolled back by pointer. A forward
        over one row also takes its path alone (a list of ints or a [m] tensor)."""
        if isinstance(paths, torch.Tensor):
            paths = paths.tolist()
        if len(self.rows) == 1 and len(paths) and isinstance(paths[0], int):
            paths = [paths]
        if len(paths) != len(self.rows):
            raise ValueError(f"commit got {len(paths)} paths for a forward over {len(self.rows)} rows")
        moves: dict[int, tuple[list[int], list[int]]] = {}  # row -> (src, dst) slots
        for row, path in zip(self.rows, paths, strict=True):
            path = [int(p) for p in path]
            if not path or any(p < 0 or p >= self.block for p in path):
                raise ValueError(
                    f"commit path {path} indexes outside the pending block of {self.block} tokens"
                )
            c = self.lengths[row]
            for i, p in enumerate(path):
                if p != i:  # a prefix of a chain is already in place
                    src, dst = moves.setdefault(row, ([], []))
                    src.append(c + p)
                    dst.append(c + i)
            self.lengths[row] = c + len(path)
        for row, (src, dst) in moves.items():
            self._copy_slots(row, src, dst)
        self._end_forward()

    def check_written(self) -> None:
        """Refuse a forward after which no layer wrote its block: the model ran without this cache."""
        if self.rows and self.writes == 0:
            raise CacheNotWrittenError(
                "the model's forward did not write treespec's KV cache: it ignored the cache argument "
                f"{CACHE_KWARG!r} (this model class or transformers version names it otherwise); "
                "upgrade transformers (pip install -U transformers) or report the model class"
            )

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

    def rollback(self, length: int) -> None:
        """Forget everything from position `length` on in every row (pointer only, nothing is cleared)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: {self.length} tokens are held")
        self.lengths = [min(n, length) for n in self.lengths]
        self._end_forward()

    def _copy_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Slot src[i] -> dst[i] of one row in every layer. In-order moves equal gather-then-scatter
        here: dst increases and src[i] >= dst[i] (a path only moves nodes towards the prefix)."""
        s = torch.tensor(src, dtype=torch.long)  # host indices: the fused op checks them there, then uploads
        d = torch.tensor(dst, dtype=torch.long)
        keys = [layer.keys[row : row + 1] for layer in self.layers]  # [1, Hkv, max_len, D] views
        values = [layer.values[row : row + 1] for layer in self.layers]
        if self._use_fused(self.device):
            ops.commit_kv(keys, values, s, d)  # one call for all layers
            return
        for k, v in zip(keys, values, strict=True):  # the torch reference: gather first, then scatter
            k[:, :, d] = k[:, :, s]
            v[:, :, d] = v[:, :, s]

    def _use_fused(self, device: torch.device) -> bool:
        if self.fused_commit is False:
            return False
        if self.fused_commit is None:
            return ops.available(device)
        if not ops.available(device):
            raise ops.ExtensionUnavailable(
                f"fused_commit=True but treespec's compiled ops are not available on {device}: "
                f"{ops.build_info()['error']}"
            )
        return True

    def _end_forward(self) -> None:
        self.rows, self.block, self._write_index = [], 0, None
        self.length = self.committed = max(self.lengths)

    def reset(self) -> None:
        super().reset()
        self.lengths = [0] * self.num_rows
        self._end_forward()

    # -- reading ---------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._write_start()

    def row_kv(self, row: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one row's committed K/V in one layer: [Hkv, c_row, D] each."""
        layer, n = self.layers[layer_idx], self.lengths[row]
        return layer.keys[row, :, :n], layer.values[row, :, :n]

    def committed_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the committed K/V of one layer over every row: [B, Hkv, c, D] each (c = the longest
        row's length)."""
        layer = self.layers[layer_idx]
        return layer.keys[:, :, : self.committed], layer.values[:, :, : self.committed]

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
