"""SpeculativeKVCache: a draft model's own preallocated KV cache: pointer rollback, storage precision.

Layout per layer (allocated once, for the whole generation):

    storage: [B, Hkv, max_len, D]
              [0, c)        committed: tokens the target model has verified
              [c, length)   speculative: tokens written while drafting, not verified yet

A forward over n tokens writes them at [length, length + n) and advances `length` (append), so each
drafted token sees the ones drafted before it. After verification `accept(m)` keeps the first m
speculative tokens (c += m) and drops the rest by pointer (length = c): nothing is copied or cleared.

Storage precision (`storage=`): "model" (the draft model's dtype, K/V returned as views, no copy),
"float32", "bfloat16", "float16", or "int8" (symmetric, one float32 scale per token and KV head:
scale = max|x| / 127 over the head dimension, so |x - dequant(quant(x))| <= scale / 2). Lower precision
saves memory; attention then reads a dequantized copy kept in one shared per-cache scratch buffer (one
layer's worth, reused layer after layer because layers run one after another). Precision may cost the
drafter acceptance; the target verifies every token, so the output never changes.
"""

from __future__ import annotations

import torch

from .cache import KVCacheBase, PreallocatedLayer, kv_layout

STORAGES = ("model", "float32", "bfloat16", "float16", "int8")
INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (int8 [..., D], float32 scales [..., 1]); symmetric, one scale per row."""
    scale = x.float().abs().amax(dim=-1, keepdim=True) / INT8_MAX  # [..., 1]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows: any scale works
    q = torch.round(x.float() / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # [..., D]
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D] and scales [..., 1] -> [..., D] in `dtype`."""
    return (q.float() * scale).to(dtype)


class SpeculativeKVLayer(PreallocatedLayer):
    """One layer's preallocated K/V in the storage precision; pointers live in the parent cache."""

    def __init__(self, owner: SpeculativeKVCache, shape: tuple[int, int, int, int], device):
        store = torch.int8 if owner.storage == "int8" else owner.storage_dtype
        keys = torch.zeros(shape, dtype=store, device=device)  # [B, Hkv, max_len, D]
        values = torch.zeros(shape, dtype=store, device=device)  # [B, Hkv, max_len, D]
        super().__init__(owner, keys, values)
        self.key_scales = self.value_scales = None
        if owner.storage == "int8":
            self.key_scales = torch.ones(shape[:3] + (1,), device=device)  # [B, Hkv, max_len, 1]
            self.value_scales = torch.ones(shape[:3] + (1,), device=device)  # [B, Hkv, max_len, 1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, Hkv, n, D] for the n new tokens, in the model's dtype
        start = self.owner.length
        end = self.owner._reserve(key_states.shape[2])
        if self.key_scales is None:
            self.keys[:, :, start:end] = key_states
            self.values[:, :, start:end] = value_states
        else:
            q, s = quantize_int8(key_states)
            self.keys[:, :, start:end], self.key_scales[:, :, start:end] = q, s
            q, s = quantize_int8(value_states)
            self.values[:, :, start:end], self.value_scales[:, :, start:end] = q, s
        return self.owner._readable(self, end)  # [B, Hkv, end, D] each


class SpeculativeKVCache(KVCacheBase):
    """A drafter's own K/V for one generation: committed history + speculative tokens, one storage dtype."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        model_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        storage: str = "model",
        spec_reserve: int = 0,
    ):
        if storage not in STORAGES:
            raise ValueError(f"unknown speculative cache storage {storage!r}; choose one of {STORAGES}")
        self.storage = storage
        self.model_dtype = model_dtype
        self.storage_dtype = model_dtype if storage in ("model", "int8") else getattr(torch, storage)
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        super().__init__(
            [SpeculativeKVLayer(self, shape, device) for _ in range(num_layers)], max_len, spec_reserve
        )
        # dequantized K/V of the layer being run, when the storage is not the model's dtype
        self.scratch = None
        if self.storage_dtype != model_dtype or storage == "int8":
            self.scratch = (
                torch.empty(shape, dtype=model_dtype, device=device),  # [B, Hkv, max_len, D]
                torch.empty(shape, dtype=model_dtype, device=device),
            )

    @classmethod
    def for_model(
        cls, model, max_len: int, storage: str = "model", spec_reserve: int = 0
    ) -> SpeculativeKVCache:
        """A cache shaped for `model` (a transformers causal LM) holding up to `max_len` tokens."""
        num_layers, num_kv_heads, head_dim, dtype, device = kv_layout(model)
        return cls(num_layers, 1, num_kv_heads, head_dim, max_len, dtype, device, storage, spec_reserve)

    # -- pointers ---------------------------------------------------------------------------------
    def _write_start(self) -> int:
        return self.length  # append after the speculative tokens: each drafted token sees those before it

    def advance(self, n: int) -> None:
        """After a forward over n tokens (all layers have written them): they join the speculative part."""
        self.length += n

    def accept(self, m: int) -> None:
        """Keep the first m speculative tokens as committed; drop the rest by pointer."""
        if not 0 <= m <= self.length - self.committed:
            raise ValueError(f"cannot accept {m} tokens: {self.length - self.committed} are speculative")
        self.committed += m
        self.length = self.committed

    # -- reading ----------------------------------------------------------------------------------
    def _readable(self, layer: SpeculativeKVLayer, end: int):
        """K/V [B, Hkv, end, D] in the model's dtype: views of the storage, or its dequantized copy."""
        if self.scratch is None:
            return layer.keys[:, :, :end], layer.values[:, :, :end]
        k_out, v_out = self.scratch[0][:, :, :end], self.scratch[1][:, :, :end]
        if layer.key_scales is None:
            k_out.copy_(layer.keys[:, :, :end])
            v_out.copy_(layer.values[:, :, :end])
        else:
            torch.mul(layer.keys[:, :, :end], layer.key_scales[:, :, :end], out=k_out)
            torch.mul(layer.values[:, :, :end], layer.value_scales[:, :, :end], out=v_out)
        return k_out, v_out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def kv(self, layer_idx: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized copies of one layer's K/V [B, Hkv, end, D] (default: everything held)."""
        layer = self.layers[layer_idx]
        end = self.length if end is None else end
        if layer.key_scales is None:
            return layer.keys[:, :, :end].to(self.model_dtype), layer.values[:, :, :end].to(self.model_dtype)
        return (
            dequantize_int8(layer.keys[:, :, :end], layer.key_scales[:, :, :end], self.model_dtype),
            dequantize_int8(layer.values[:, :, :end], layer.value_scales[:, :, :end], self.model_dtype),
        )

    def bytes_per_token(self) -> int:
        """K + V (+ int8 scales) bytes of one token across all layers."""
        layer = self.layers[0]
        per_layer = 2 * layer.keys[:, :, 0].numel() * layer.keys.element_size()
        if layer.key_scales is not None:
            per_layer += 2 * layer.key_scales[:, :, 0].numel() * layer.key_scales.element_size()
        return per_layer * len(self.layers)

    def memory_bytes(self) -> dict[str, int]:
        """The base report plus the dequantization scratch."""
        scratch = 0 if self.scratch is None else sum(t.numel() * t.element_size() for t in self.scratch)
        return {**super().memory_bytes(), "scratch": scratch}
