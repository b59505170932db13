"""The target's verification forward: the decoder layers over a block of tokens, and its logits.

    full_forward(model, ids [B, n], positions [B, n], cache, plan) -> hidden [B, n, H]
    output_logits(model, hidden [..., H]) -> logits [..., V]

The tokens' K/V land in `cache` at each row's committed end (the cache's own `update`), and attention
follows `plan` (tree attention, `core.attention`). The decoder runs it as its default scorer, the
compiled step (`core.compiled`) compiles it, the native step (`core.native`) is measured against it.
"""

from __future__ import annotations

import torch

from .attention import AttentionPlan
from .cache import CACHE_KWARG


def full_forward(
    model, ids: torch.Tensor, positions: torch.Tensor, cache, plan: AttentionPlan, feature_layers=()
):
    """The decoder without lm_head: ids, positions [B, n] -> final hidden states [B, n, H].

    feature_layers: indices into transformers' `hidden_states` (0 = the embeddings, i = after layer i);
    when given, returns (hidden [B, n, H], features [B, n, len(feature_layers) * H]) concatenated in order."""
    if not feature_layers:
        out = model.base_model(
            input_ids=ids, position_ids=positions, use_cache=True, tree_attention=plan, **{CACHE_KWARG: cache}
        )
        return out.last_hidden_state
    out = model.base_model(
        input_ids=ids,
        position_ids=positions,
        use_cache=True,
        tree_attention=plan,
        output_hidden_states=True,
        **{CACHE_KWARG: cache},
    )
    features = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1)  # [B, n, F]
    return out.last_hidden_state, features


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Base model logits of hidden states [..., H] -> [..., V], with what the model's own forward does to its
    lm_head's output: Cohere's `logit_scale` (x), Granite's `logits_scaling` (/), Gemma's soft-capping
    (`support.check_logits` checks this against the model's forward once)."""
    logits = model.get_output_embeddings()(hidden)
    scale = getattr(model, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1:
        logits = logits * scale
    divisor = getattr(model.config, "logits_scaling", None)
    if divisor and divisor != 1:
        logits = logits / divisor
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
