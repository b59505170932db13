"""Token-id conventions shared by generation, distillation and benchmarks: which ids end a sequence."""

from __future__ import annotations

import numbers
import operator
from typing import Any

import torch


def eos_token_ids(model: Any, tokenizer: Any = None, eos_token_id: Any = None) -> list[int]:
    """The end-of-sequence ids, sorted and unique.

    The first that is not None wins: `eos_token_id` (explicit; `[]` means "never stop"), then
    `model.generation_config.eos_token_id`, then `tokenizer.eos_token_id`. Each may be an int, a
    sequence of ints or an integer tensor. None everywhere gives [].
    """
    ids = eos_token_id
    if ids is None:
        ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if isinstance(ids, numbers.Integral):
        ids = [ids]
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"eos_token_id must be an int or a sequence of ints, got {ids!r}")
    try:
        return sorted({operator.index(i) for i in ids})
    except TypeError as error:
        raise TypeError(f"eos_token_id must be an int or a sequence of ints, got {ids!r}") from error
