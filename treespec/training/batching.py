"""Length bucketing: batches of sequences of similar length, so padded batches waste little.

Used by distillation (generation batches of at most `batch_size` prompts), by the hidden-state pass of
head training and by draft-model training (batches of at most `batch_tokens` padded tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def length_batches(
    lengths: Sequence[int],
    *,
    max_tokens: int | None = None,
    max_rows: int | None = None,
    order: Iterable[int] | None = None,
) -> list[list[int]]:
    """Indices `order` (default: all) sorted by (length, index) and cut into consecutive batches.

    A batch closes before it would hold more than `max_rows` rows or more than `max_tokens` padded
    tokens (rows x longest length); a sequence longer than `max_tokens` gets a batch of its own.
    """
    if max_tokens is not None and max_tokens < 1 or max_rows is not None and max_rows < 1:
        raise ValueError(f"max_tokens and max_rows must be >= 1, got {max_tokens} and {max_rows}")
    indices = range(len(lengths)) if order is None else order
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in sorted(indices, key=lambda i: (lengths[i], i)):
        too_long = max_tokens is not None and (len(batch) + 1) * lengths[i] > max_tokens
        too_many = max_rows is not None and len(batch) >= max_rows
        if batch and (too_long or too_many):
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches
