"""When generation stops: end-of-sequence ids, stop strings and the token budget, applied token by token."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
