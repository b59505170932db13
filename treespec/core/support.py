"""Which transformers models the decoder can run, and a clear refusal for the others.

Tree verification needs two things of a causal LM:
- every layer keeps its past as K/V in the cache transformers hands it: a recurrent, state-space or
  convolution layer would carry a state that the tree's rejected branches have already advanced, so hybrid
  models (Jamba, Mamba, Qwen3-Next, ...) are refused by their config's `layer_types` before anything runs;
- every layer's attention runs through transformers' AttentionInterface, where treespec shows each tree
  node its ancestors only. A model that computes attention itself (Bloom) still decodes one token at a
  time on treespec's cache, but it cannot verify a tree: the first forward counts the calls
  (`attention.attention_forward`) and a drafter is refused.

What an architecture adds to its attention (soft-capped scores, sinks, sliding windows) is followed by
`attention.ScoreTerms`; the native step (`core.native`) takes the architectures it names and no window.
What its forward does to the lm_head's output (a scale, soft-capping) is followed by `forward.output_logits`,
and `check_logits` compares that with the model's own logits once per model, so a model that changes its
logits some other way is refused instead of sampled from another distribution.
"""

from __future__ import annotations

import time

import torch

from .cache import text_config
from .forward import output_logits
from .runtime import TargetRuntime

ATTENTION_LAYERS = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """A model treespec cannot decode (or cannot verify trees on), with the reason and what to do."""


def layer_kinds(model) -> list[str]:
    """The kinds of the model's decoder layers as its config names them (empty when it names none)."""
    return list(getattr(text_config(model), "layer_types", None) or ())


def check_layers(model) -> None:
    """Refuse a model with layers that keep a state other than K/V (recurrent, state-space, convolution,
    chunked attention), naming them."""
    other = sorted({kind for kind in layer_kinds(model) if kind not in ATTENTION_LAYERS})
    if other:
        raise UnsupportedModelError(
            f"{type(model).__name__} has layers of kind {', '.join(other)}: treespec's cache holds attention "
            "K/V only (full or sliding-window), and a draft rejected after such a layer ran would leave its "
            "state advanced; decode this model with transformers' generate"
        )


def window_of(model) -> int | None:
    """The model's sliding window in tokens when some layers use one (None: every layer sees the whole
    prefix)."""
    config = text_config(model)
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    kinds = layer_kinds(model)
    return window if not kinds or "sliding_attention" in kinds else None


def check_attention_calls(
    model, record, writes: int, speculating: bool, compiled: bool, past_window: bool = False
) -> None:
    """After a forward in which `writes` layers wrote treespec's cache, with `record` its attention calls
    (`attention.ForwardRecord`): refuse tree verification when some layers attended on their own, a
    compiled step when the layers do not pass the plan on (a compiled graph cannot read it from the
    context), and a sequence past the config's sliding window when no layer named the window to its
    attention (transformers would apply it through its own cache, which treespec replaces)."""
    if past_window and record.windowed == 0:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s config sets sliding_window={window_of(model)} but its layers do not "
            "pass a window to their attention, so treespec cannot follow it: keep prompt + max_new_tokens "
            "within the window, or drop sliding_window from the config if the model was not trained with one"
        )
    if speculating and record.calls < writes:
        raise UnsupportedModelError(
            f"{type(model).__name__} computes attention in {writes - record.calls} of its {writes} layers "
            "without transformers' AttentionInterface, so treespec cannot show each tree node its ancestors "
            "only: decode it with drafter=None (one token a step on treespec's cache) or with transformers' "
            "generate"
        )
    if speculating and compiled and record.planless:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s layers do not pass keyword arguments on to their attention, which a "
            "compiled step needs to see each tree's plan: decode it with compile=False"
        )


def check_logits(model) -> None:
    """Refuse a model whose own forward turns its last hidden states into other logits than
    `forward.output_logits` does (checked once per model, on three tokens)."""
    runtime = TargetRuntime.of(model)
    if runtime.logits_checked:
        return
    started = time.perf_counter()  # one-time work, reported as setup (`GenerationStats.time_setup`)
    device = next(model.parameters()).device
    ids = torch.arange(3, device=device)[None] % model.get_output_embeddings().weight.shape[0]  # [1, 3]
    training = model.training  # dropout off for the comparison
    try:
        with torch.inference_mode():
            model.eval()
            want = model(input_ids=ids, use_cache=False).logits.float()  # [1, 3, V]
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state  # [1, 3, H]
            got = output_logits(model, hidden).float()
    finally:
        model.train(training)
    gap = (got - want).abs().max().item()
    if not gap <= 1e-4 * max(1.0, want.abs().max().item()):
        raise UnsupportedModelError(
            f"{type(model).__name__}'s forward turns its lm_head's output into other logits than treespec "
            f"computes (largest difference {gap:.3g} on a three-token input): it changes them in a way "
            "treespec does not follow (it follows Cohere's logit_scale, Granite's logits_scaling and "
            "soft-capping); decode this model with transformers' generate"
        )
    runtime.logits_checked = True
    runtime.setup_seconds += time.perf_counter() - started
