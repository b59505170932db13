"""Tree attention, plugged into transformers through its AttentionInterface.

One forward over n new tokens sees keys [0, L) with L = c + n: the committed prefix [0, c) is
visible to every new token; inside the new block [c, L) token i sees token j only where
`tree_mask[i, j]` (j is i or one of its ancestors). With no tree mask the block is causal (a chain),
which covers prefill (c = 0), chunked prefill and one-token decoding (n = 1) with the same code.

The tree mask travels as the `tree_mask=` keyword of the model's forward: transformers passes
unknown keywords down to the attention function, so no state is hung on the HF modules.

- `tree_attention_reference`: explicit matmul + softmax in float32; the oracle every faster path is
  tested against.
- `tree_attention_sdpa`: torch's scaled_dot_product_attention with a boolean [n, L] mask; the
  default fast path in plain torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "treespec"


def block_mask(tree_mask: torch.Tensor | None, n: int, kv_len: int, device) -> torch.Tensor:
    """Boolean [n, kv_len] visibility of n new tokens over keys [0, kv_len): prefix + tree block."""
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=device).tril_()  # a chain: causal
    prefix = torch.ones(n, kv_len - n, dtype=torch.bool, device=device)
    return torch.cat([prefix, tree_mask.to(device)], dim=1)  # [n, L]


def tree_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Reference tree attention.

    query: [B, H, n, D]; key, value: [B, Hkv, L, D] with H a multiple of Hkv (GQA, not expanded);
    tree_mask: [n, n] bool or None (causal). Returns [B, H, n, D] in query's dtype.
    """
    B, H, n, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    G = H // Hkv
    q = query.float().reshape(B, Hkv, G * n, D)  # query heads of one KV group side by side
    scores = q @ key.float().transpose(-1, -2) * scaling  # [B, Hkv, G*n, L]
    visible = block_mask(tree_mask, n, L, query.device).repeat(G, 1)  # [G*n, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [B, Hkv, G*n, L]
    out = probs @ value.float()  # [B, Hkv, G*n, D]
    return out.reshape(B, H, n, D).to(query.dtype)


def tree_attention_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Same contract as `tree_attention_reference`, through torch SDPA (GQA handled by SDPA)."""
    n, L = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if n == 1 or (tree_mask is None and n == L):
        # decode (sees everything) or prefill from an empty cache (plain causal): no mask needed
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=n > 1, scale=scaling, enable_gqa=gqa
        )
    mask = block_mask(tree_mask, n, L, query.device)  # [n, L]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)


KERNELS = {"reference": tree_attention_reference, "sdpa": tree_attention_sdpa}


def treespec_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tree_mask: torch.Tensor | None = None,
    tree_kernel: str = "sdpa",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as attn_implementation "treespec".

    transformers calls it with q [B, H, n, D], k/v [B, Hkv, L, D] and expects [B, n, H, D].
    treespec builds no HF mask (this implementation has no mask function): visibility comes
    from `tree_mask` only, so padded batches are not supported here.
    """
    if attention_mask is not None:
        raise ValueError("treespec attention takes no HF attention mask: pass tree_mask= (or nothing)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = KERNELS[tree_kernel](query, key, value, tree_mask, scaling)  # [B, H, n, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, treespec_attention)


@contextlib.contextmanager
def tree_attention_enabled(model) -> Iterator[None]:
    """Run `model` with treespec attention inside the block; its previous implementation is restored after."""
    previous = model.config._attn_implementation
    if previous == ATTN_IMPLEMENTATION:
        yield
        return
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
