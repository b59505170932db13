"""HF reference generation: transformers' own `model.generate` over a batch of prompt token ids.

The one place that left-pads prompts, runs `generate` and cuts each answer after its first end token.
Distillation data (`training.distill`) are the model's answers made this way; benchmarks and tests use
the same call as the reference that speculative decoding must reproduce (greedy by default).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def trim_response(tokens: list[int], eos_ids: Iterable[int]) -> list[int]:
    """Generated tokens up to and including the first eos (what follows it is padding)."""
    stop = set(eos_ids)
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in one batch: input ids [B, W] (pad_id on the left) and attention mask [B, W]."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, W]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, W]
    for row, ids in enumerate(prompts):  # every prompt ends at column W-1
        if len(ids):
            input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


@torch.no_grad()
def hf_generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | None = None,
    *,
    eos_ids: Iterable[int] = (),
    pad_id: int | None = None,
    **generate_kwargs,
) -> list[list[int]]:
    """Each prompt's new tokens from one left-padded `model.generate` call, cut after the first of eos_ids.

    prompts: B lists of token ids (a batch of one is not padded). Greedy unless `generate_kwargs` say
    otherwise (a `generation_config=`, or `do_sample=True`); they are passed to `generate` as given (e.g.
    `prompt_lookup_num_tokens`, `eos_token_id`). pad_id: default the generation config's pad token, else
    the first of eos_ids, else 0.
    """
    if not prompts:
        return []
    eos_ids = list(eos_ids)
    config = generate_kwargs.get("generation_config")
    if pad_id is None:
        pad_id = getattr(config, "pad_token_id", None)
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    if config is None:
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", pad_id)
    if max_new_tokens is not None:
        generate_kwargs["max_new_tokens"] = max_new_tokens
    device = next(model.parameters()).device
    input_ids, attention_mask = left_padded(prompts, pad_id)  # [B, W] each
    out = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **generate_kwargs
    )  # [B, W + T]
    return [trim_response(row, eos_ids) for row in out[:, input_ids.shape[1] :].tolist()]
