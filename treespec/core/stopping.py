"""When generation stops: end-of-sequence ids, stop strings and the token budget, applied token by token."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def eos_token_ids(model, tokenizer=None, eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """The end-of-sequence ids: `eos_token_id` when given, else the model's generation config, else the
    tokenizer's. Sorted, unique; [] when none is known."""
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return []
    ids = eos_token_id if isinstance(eos_token_id, Sequence) else [eos_token_id]
    return sorted({int(e) for e in ids})


class StopCondition:
    """Stops on an EOS id, on a stop string in the decoded text, or after `max_new_tokens` tokens."""

    def __init__(self, eos: Sequence[int], stop: str | Sequence[str] | None, tokenizer, max_new_tokens: int):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.eos = set(eos)
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        if self.stops and tokenizer is None:
            raise ValueError("stop strings need tokenizer= to decode the text")
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens

    def extend(self, out: list[int], new: list[int], streamer=None) -> bool:
        """Append `new` to `out` up to the first stop; stream what was kept. True when generation ends."""
        kept, finished = [], False
        for token in new:
            out.append(token)
            kept.append(token)
            if token in self.eos or len(out) >= self.max_new_tokens or self._hits_stop(out):
                finished = True
                break
        if streamer is not None and kept:
            streamer.put(torch.tensor(kept))
        return finished

    def _hits_stop(self, out: list[int]) -> bool:
        if not self.stops:
            return False
        text = self.tokenizer.decode(out[-64:], skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def text(self, out: list[int]) -> str | None:
        """The decoded text, cut before the first stop string (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        for s in self.stops:
            if s in text:
                text = text[: text.index(s)]
        return text
