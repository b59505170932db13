"""The loop of `treespec.generate` over the decoder core: prompt encoding, stop conditions, streamers.

    prompts -> ids -> Decoder.prefill -> first token of every row
    until every row stops: Decoder.step() -> committed tokens per row -> stop conditions -> streamers

One prompt is a batch of one. With no drafter the tree is the root alone: the same loop is plain
one-token-at-a-time decoding on the same cache and attention (the baseline benchmarks compare against).
The public `generate`, which also turns a recipe name or heads into a drafter, sits above core and the
drafters, in `treespec.api`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .decoder import Decoder
from .runtime import TargetRuntime
from .stats import GenerationStats
from .stopping import StopCondition
from .tree import Tree


@dataclass
class GenerationResult:
    """What `generate` returns per prompt: the new token ids, their text, and per-step statistics."""

    token_ids: list[int]
    text: str | None
    prompt_ids: list[int]
    stats: GenerationStats
    tree: Tree | None = None  # the drafter's candidate tree (root-only for plain decoding)
    trace: list[dict] = field(default_factory=list)  # with trace=True: per step tokens, probs, path, bonus


@dataclass(frozen=True)
class DecodeOptions:
    """How treespec runs the model (none of these change the text a greedy decode produces).

    kernel: tree attention: "auto" ("compiled" when the extension builds for the model's dtype and device,
    else "sdpa"), "compiled", "sdpa" or "reference". linears: "auto", "onednn" or "torch" (`core.packed`).
    compile: verify through torch.compile (the first call per size class compiles). plain_above: in a
    batch, plain one-token steps while more rows than this are live; "auto" times both kinds of step as
    the batch runs; None: always speculate. max_length: cache capacity (default: the model's
    max_position_embeddings). chat: a string prompt goes through the chat template (None: when the
    tokenizer has one). numerics: "fast" (the fastest kernels: a verified node may differ from a one-token
    step in the last bit, which can flip a near-tied greedy choice, mostly in bfloat16), "bitwise"
    (row-invariant kernels, CPU: speculative output equals the plain loop's output, bit for bit) or "int8"
    (bitwise with 8-bit activations in every linear of the native step: speculative output equals the
    int8 plain loop's, which can differ from the float model's; `core.decoder.numerics_settings`).
    step: "auto" (the native step where it covers the model: Llama, Qwen2, Mistral, Qwen3 on the CPU, no
    compile), "native" (refused with the reason where it cannot run) or "hf" (transformers' forward;
    `core.native`). kv_dtype: what the cache stores K/V in, "model" or "bfloat16" (a float32 model's cache
    in half the bytes, and attention reads half as much a step; its K/V rounded to bf16, so with
    numerics "int8" or "bitwise" only: another text than float32 K/V, still the plain loop's text under
    speculation; `core.decoder.kv_storage_dtype`)."""

    kernel: str = "auto"
    linears: str = "auto"
    compile: bool = False
    plain_above: int | str | None = "auto"
    max_length: int | None = None
    chat: bool | None = None
    numerics: str = "fast"
    step: str = "auto"
    kv_dtype: str = "model"


def decode(
    decoder: Decoder,
    prompt_ids: list[list[int]],
    stopping: list[StopCondition],
    streamers: list,
    max_length: int | None = None,
    trace: bool = False,
) -> list[GenerationResult]:
    """The loop of `generate`: prefill every row, step until every row met its stop condition."""
    for ids, s in zip(prompt_ids, streamers, strict=True):
        if s is not None:
            s.put(torch.tensor([ids]))
    runtime = TargetRuntime.of(decoder.model)
    setup_before = runtime.setup_seconds  # one-time work this call does (the model's first call)
    started = decoder.clock()
    outs: list[list[int]] = [[] for _ in prompt_ids]
    stats: list[GenerationStats | None] = [None] * len(prompt_ids)
    steps: list[dict] = []
    max_new_tokens = max(s.max_new_tokens for s in stopping)
    # the model stays in treespec's mode for the whole call: each step's own `running()` then only counts
    # itself in, instead of switching the attention implementation (a walk over every module) per step
    with decoder.running():
        firsts = decoder.prefill(prompt_ids, max_new_tokens, max_length)
        done = [r for r, first in enumerate(firsts) if stopping[r].extend(outs[r], [first], streamers[r])]
        while True:
            for row in done:
                stats[row] = decoder.close_row(row, len(outs[row]), started)
                if streamers[row] is not None:
                    streamers[row].end()
            decoder.drop_rows(done)
            if not decoder.live:
                break
            step = decoder.step()
            if trace:
                steps.append(step.as_trace(0))
            done = [
                row
                for row, committed in zip(step.rows, step.committed, strict=True)
                if stopping[row].extend(outs[row], committed, streamers[row])
            ]
    for row_stats in stats:
        row_stats.time_setup = min(runtime.setup_seconds - setup_before, row_stats.time_total)
    return [
        GenerationResult(out, stopping[r].text(out), prompt_ids[r], stats[r], decoder.tree, steps)
        for r, out in enumerate(outs)
    ]


def is_batch(prompts) -> bool:
    """A batch of prompts: a list or tuple of strings or id sequences, or a [B, T] tensor with B > 1."""
    if isinstance(prompts, torch.Tensor):
        return prompts.dim() == 2 and prompts.shape[0] > 1
    if isinstance(prompts, (list, tuple)) and prompts:
        return all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompts)
    return False


def encode_prompt(
    prompt, tokenizer=None, chat: bool | None = None, vocab_size: int | None = None
) -> list[int]:
    """A prompt as token ids. A string goes through the chat template when the tokenizer has one
    (chat=None: auto) or through the plain tokenizer otherwise; ids (a list or a [T] / [1, T] tensor)
    are checked against `vocab_size`."""
    if isinstance(prompt, str):
        return _encode_text(prompt, tokenizer, chat)
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] != 1:
            raise ValueError(f"one prompt is a [T] or [1, T] tensor; got {tuple(prompt.shape)}")
        if prompt.is_floating_point() or prompt.is_complex():
            raise ValueError(f"token ids must be integers; got a {prompt.dtype} tensor")
        prompt = prompt.reshape(-1).tolist()
    if prompt is None or not isinstance(prompt, Sequence) or not prompt:
        raise ValueError("the prompt is empty or not a prompt: pass a string or a list of token ids")
    bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int)), None)
    if bad is not None:
        raise ValueError(
            f"token ids must be integers, got {bad!r} ({type(bad).__name__}): pass one string (with "
            "tokenizer=) or a list of int token ids"
        )
    outside = [t for t in prompt if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:
        raise ValueError(
            f"token id {outside[0]} is outside the model's vocabulary [0, {vocab_size}): pass ids the "
            "model's tokenizer produced"
        )
    return [int(t) for t in prompt]


def _encode_text(prompt: str, tokenizer, chat: bool | None) -> list[int]:
    if not prompt.strip():
        raise ValueError("the prompt is empty: pass some text or token ids")
    if tokenizer is None:
        raise ValueError("a string prompt needs tokenizer=: pass the model's tokenizer, or token ids")
    use_chat = getattr(tokenizer, "chat_template", None) is not None if chat is None else chat
    if use_chat:
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation ([{"role": ..., "content": ...}]) through the tokenizer's chat template, ready for
    the assistant's next answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids  # transformers 5
    return [int(t) for t in ids]


def row_streamers(streamer, rows: int) -> list:
    """One streamer (or None) per row of a batch: `streamer` must be None or a list of `rows` of them."""
    if streamer is None:
        return [None] * rows
    if not isinstance(streamer, (list, tuple)) or len(streamer) != rows:
        raise ValueError(
            f"a batch of {rows} prompts streams through a list of {rows} streamers (one per prompt, None "
            "for rows not streamed); HF streamers take one sequence each"
        )
    return list(streamer)


def vocab_size(model) -> int | None:
    embedding = model.get_input_embeddings()
    return None if embedding is None else int(embedding.weight.shape[0])
