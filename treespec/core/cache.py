"""TreeKVCache: a preallocated KV cache with a committed prefix and one speculative tree block.

Layout per layer (gpt-fast style, written by position index):

    keys/values: [B, Hkv, max_len, D]
                  [0, c)       committed prefix, shared by every branch of the tree
                  [c, c + n)   the block written by the last forward (n tree nodes, or n prompt tokens)

`commit(path)` keeps the accepted nodes of the block: node path[i] moves to slot c + i (copied only
where path[i] != i) and c advances by len(path). Everything past c is dropped by pointer (rollback):
the next forward simply overwrites it. The copies of all layers go through one call of the fused op
`treespec.ops.commit_kv` when the compiled extension is available (`fused_commit`), else through
the torch reference (`_commit_reference`, two index copies per layer). It plugs into transformers as
a `Cache`, so any HF decoder model writes its K/V here through `cache.update(...)` without
modification.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import ops


class CacheCapacityError(ValueError):
    """More tokens than the preallocated cache can hold."""


def kv_layout(model) -> tuple[int, int, int, torch.dtype, torch.device]:
    """(layers, KV heads, head dim, dtype, device) of a transformers causal LM's KV cache."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
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


def zeroed_layers(owner, layer_cls, num_layers: int, shape: tuple, dtype, device) -> list:
    """`num_layers` layers of `layer_cls` over zeroed K/V of `shape` ([B, Hkv, max_len, D]), owned by
    `owner` (the cache that keeps their pointers)."""
    return [
        layer_cls(
            owner,
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


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
    """The target's layer: each forward (over a tree block or prompt tokens) writes at the committed end."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, Hkv, n, D] for the n new tokens
        start, n = self.owner.committed, key_states.shape[2]
        end = self.owner._reserve(n)
        self.owner.length = end
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]  # [B, Hkv, c + n, D] views, no copy


class TreeKVCache(KVCacheBase):
    """Preallocated per-layer K/V for one decoding run: committed prefix + speculative block."""

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
    ):
        """fused_commit: None (default) uses the fused commit op when the extension is available,
        True requires it, False always uses the torch reference."""
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        super().__init__(zeroed_layers(self, TreeKVLayer, num_layers, shape, dtype, device), max_len)
        self.fused_commit = fused_commit

    @classmethod
    def for_model(cls, model, max_len: int, batch_size: int = 1, spec_reserve: int = 0) -> TreeKVCache:
        """A cache shaped for `model` (a transformers causal LM) holding up to `max_len` tokens."""
        num_layers, num_kv_heads, head_dim, dtype, device = kv_layout(model)
        cache = cls(num_layers, batch_size, num_kv_heads, head_dim, max_len, dtype, device)
        cache.spec_reserve = spec_reserve
        return cache

    def _write_start(self) -> int:
        return self.committed

    @property
    def pending(self) -> int:
        """n: tokens [c, c + n) written by the last forward, not committed yet."""
        return self.length - self.committed

    # -- writing ---------------------------------------------------------------------------------
    def commit(self, path: Sequence[int] | torch.Tensor) -> None:
        """Keep pending nodes `path` (indices into the block, in order) as the next committed tokens.

        Node path[i] is copied to slot c + i only where path[i] != i (a prefix of a chain is already in
        place); everything else in the block is rolled back by pointer.
        """
        path = [int(p) for p in (path.tolist() if isinstance(path, torch.Tensor) else path)]
        if any(p < 0 or p >= self.pending for p in path):
            raise ValueError(f"commit path {path} indexes outside the pending block of {self.pending} tokens")
        c = self.committed
        moves = [(i, p) for i, p in enumerate(path) if p != i]
        if moves:
            device = self.layers[0].keys.device
            dst = torch.tensor([c + i for i, _ in moves], device=device)
            src = torch.tensor([c + p for _, p in moves], device=device)
            if self._use_fused(device):
                # one call for all layers; in-order moves equal gather-then-scatter here because
                # dst increases and src[i] >= dst[i] (a path only moves nodes towards the prefix)
                keys = [layer.keys for layer in self.layers]
                ops.commit_kv(keys, [layer.values for layer in self.layers], src, dst)
            else:
                self._commit_reference(src, dst)
        self.committed = self.length = c + len(path)

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

    def _commit_reference(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The torch reference of the commit copies: slot src[i] -> dst[i] in every layer."""
        for layer in self.layers:
            # gather first (src and dst may overlap), then scatter: [B, Hkv, m, D]
            layer.keys[:, :, dst] = layer.keys[:, :, src]
            layer.values[:, :, dst] = layer.values[:, :, src]

    def commit_all(self) -> None:
        """Accept the whole pending block as written (prefill, plain decoding)."""
        self.committed = self.length

    # -- reading ---------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.committed

    def committed_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the committed K/V of one layer: [B, Hkv, c, D] each."""
        layer = self.layers[layer_idx]
        return layer.keys[:, :, : self.committed], layer.values[:, :, : self.committed]

    def bytes_per_token(self) -> int:
        """K + V bytes that one token occupies across all layers."""
        keys = self.layers[0].keys
        per_layer = 2 * keys.shape[0] * keys.shape[1] * keys.shape[3] * keys.element_size()
        return per_layer * len(self.layers)
