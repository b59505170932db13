"""The EAGLE draft layer through the native step (csrc/native_step.h, `NativeModelDesc::eagle`): one C++
call per drafted level instead of about a hundred small torch operations.

    layer = NativeEagleLayer.of(draft, embedding)
    outputs, logits = layer(inputs, ids, positions, cache, rows, starts, bits, block_offset, logit_rows)
        inputs [A, n, H]   the residual inputs (fused target features, or the parent nodes' outputs)
        ids, positions     [A, n] the tokens (x_t+1) and their rotary positions
        rows, starts [A]   the cache rows (int64 CPU tensors), and where each row's block starts in the
                           drafter's cache (its committed length); the tokens are block positions
                           block_offset.., their K/V are written there
        bits               [m, W] ancestor bits of the block's positions, or None (causal)
        logit_rows         None, or [A]: only token logit_rows[a] of each row gets logits
        -> outputs [A, n, H] (the layer's h), logits [A, n, V'] over the draft vocabulary ([A, V'] with
           logit_rows)

It computes what `EagleDraftModel.qkv / attend / finish / logits` compute, in float32, over the same
weights (a linear rounded to Q8_0 blocks is read as those blocks) and the target's own embedding table
(float32 or bfloat16, widened exactly); tests/test_eagle_native.py compares the two on fresh random
drafters.
"""

from __future__ import annotations

import torch

from .. import ops
from ..core.blocks import recover_blocks
from ..core.native import linear_slots, on_huge_pages
from ..core.packed import weight_key
from ..core.runtime import TargetRuntime
from .eagle_model import EagleDraftModel, rotary_cos_sin


def native_eagle_reason(draft: EagleDraftModel, embedding: torch.Tensor) -> str | None:
    """None when `NativeEagleLayer` can run `draft` with the target's `embedding`, else why not."""
    weight = draft.fc.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"{weight.device.type} {weight.dtype} weights (it runs float32 on the CPU)"
    if embedding.device.type != "cpu" or embedding.dtype not in (torch.float32, torch.bfloat16):
        return f"a {embedding.device.type} {embedding.dtype} embedding (it reads float32 or bfloat16)"
    if draft.head_dim % 2 or draft.head_dim > 512:
        return f"head_dim {draft.head_dim}"
    if not ops.available("cpu"):
        return f"treespec's compiled CPU ops did not build ({ops.build_info()['error']})"
    return None


class NativeEagleLayer:
    """One EAGLE draft layer as a native model (module docstring). The weights must not change after it is
    built: `of` builds another one when they did."""

    @classmethod
    def of(cls, draft: EagleDraftModel, embedding: torch.Tensor) -> NativeEagleLayer:
        """The layer over `draft`'s current weights, kept in the drafter module's runtime: every drafter
        made from the same module shares it (building one reads every weight for its blocks)."""
        runtime = TargetRuntime.of(draft)
        key = (*(weight_key(p) for p in draft.parameters()), weight_key(embedding))
        with runtime.lock:
            entry = runtime.native.get("eagle")
            if entry is None or entry[0] != key:
                layer = cls(draft, embedding)
                entry = runtime.native["eagle"] = (key, layer, layer.own_bytes)
            return entry[1]

    def __init__(self, draft: EagleDraftModel, embedding: torch.Tensor):
        reason = native_eagle_reason(draft, embedding)
        if reason is not None:
            raise ValueError(f"the native EAGLE layer cannot run this drafter: {reason}")
        self.draft = draft
        d = draft

        def norm(module) -> torch.Tensor:
            return module.weight.detach().float().contiguous()

        tensors = [embedding.detach().contiguous(), norm(d.norm), norm(d.input_norm), norm(d.post_norm)]
        kinds = []
        linears = (d.q_proj, d.k_proj, d.v_proj, d.o_proj, d.gate_proj, d.up_proj, d.down_proj, d.lm_head)
        for linear in linears:
            kind, slots = linear_slots(linear, recover_blocks(linear.weight.detach()), int8=False)
            kinds.append(kind)
            tensors += slots
        tensors.append(norm(d.hidden_norm))
        dims = [1, d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size]
        dims += [d.draft_vocab_size, 1]  # the lm_head's rows; an EAGLE layer
        # what it reads per call on 2 MB pages (copies; the embedding's rows are read one by one)
        tensors = on_huge_pages(tensors, {embedding.data_ptr()})
        self.own_bytes = sum(t.numel() * t.element_size() for t in tensors[1:])  # the copies
        self._native = torch.classes.treespec.NativeModel(
            dims, [d.rms_norm_eps, d.head_dim**-0.5], tensors, kinds, False
        )
        self._cos = self._sin = None  # [P, D] rotary tables

    def _bind(self, cache) -> None:
        """Bind the drafter cache's one layer and size the rotary tables for its capacity."""
        keys, values = cache.layers[0].keys, cache.layers[0].values
        if self._native.bound_to() != keys.data_ptr():
            self._native.bind_cache([keys], [values])
        if self._cos is None or self._cos.shape[0] < cache.max_len:
            positions = torch.arange(cache.max_len)  # [P]
            cos, sin = rotary_cos_sin(positions, self.draft.head_dim, self.draft.rope_theta)  # [P, D] each
            self._cos, self._sin = cos.contiguous(), sin.contiguous()

    def __call__(
        self, inputs, ids, positions, cache, rows, starts, bits=None, block_offset: int = 0, logit_rows=None
    ):
        """The module docstring's call."""
        self._bind(cache)
        return self._native.eagle_step(
            inputs,
            ids.long().contiguous(),
            positions.long().contiguous(),
            rows,
            starts,
            bits,
            block_offset,
            self._cos,
            self._sin,
            logit_rows,
        )
