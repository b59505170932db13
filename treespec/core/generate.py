"""`generate`: the Python API over the decoder core (prompt encoding, drafter choice, stopping, streaming).

    prompt -> ids -> Decoder.prefill -> first token
    until a stop: Decoder.step() -> committed tokens -> stop conditions -> streamer

With heads=None and no drafter the tree is the root alone: the same loop is plain one-token-at-a-time
decoding on the same cache and attention (the baseline that benchmarks compare against).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..drafters.base import Drafter
from ..drafters.heads import MedusaHeads
from ..drafters.lookup import LookupDrafter
from ..drafters.medusa import make_drafter
from .acceptance import SamplingConfig
from .batch import BatchDecoder
from .decoder import Decoder
from .stats import GenerationStats
from .stopping import StopCondition
from .tokens import eos_token_ids
from .tree import Tree, default_tree


@dataclass
class GenerationResult:
    """What `generate` returns: the new token ids, their text, and per-step statistics."""

    token_ids: list[int]
    text: str | None
    prompt_ids: list[int]
    stats: GenerationStats
    tree: Tree | None = None  # the candidate tree used (root-only for plain decoding)
    trace: list[dict] = field(
        default_factory=list
    )  # with trace=True: per step tokens, draft_probs, path, bonus


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
            raise ValueError(
                f"treespec.generate decodes one sequence at a time; got a batch of {prompt.shape[0]}"
            )
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
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt)["input_ids"]
    return [int(t) for t in ids]


def choose_drafter(
    model, heads: MedusaHeads | None, tree: Tree | None, drafter: Drafter | None, lookup: int
) -> Drafter | None:
    """The drafter that generate's arguments ask for: `drafter`, or one made from `heads` and `tree`
    (default: the heads' own calibrated tree, else a 32-node tree), plus a prompt-lookup branch."""
    if drafter is not None and (heads is not None or tree is not None):
        raise ValueError("pass either drafter= or heads (with an optional tree=), not both")
    if drafter is None and heads is not None:
        heads.check_compatible(model)
        tree = tree or getattr(heads, "tree", None) or default_tree(32, heads.num_heads)
        drafter = make_drafter(heads, tree, model)
    elif drafter is None and tree is not None:
        raise ValueError("tree= needs heads to fill it: pass heads (or a drafter without tree=)")
    return LookupDrafter(drafter, lookup) if lookup else drafter


def accepts_batches(generate_one):
    """`generate` on a batch of prompts (`is_batch`) calls `generate_batch` with the same arguments."""
    signature = inspect.signature(generate_one)

    @functools.wraps(generate_one)
    def generate(*args, **kwargs):
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        if not is_batch(arguments["prompt_or_input_ids"]):
            return generate_one(*args, **kwargs)
        if arguments.pop("trace", False):
            raise ValueError("trace= takes one prompt; decode a batch without it")
        arguments["prompts"] = arguments.pop("prompt_or_input_ids")
        return generate_batch(**arguments)

    return generate


@accepts_batches
@torch.inference_mode()
def generate(
    model,
    heads: MedusaHeads | None,
    prompt_or_input_ids,
    tokenizer=None,
    tree: Tree | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    streamer=None,
    acceptance: str = "sampling",
    seed: int | None = None,
    kernel: str = "auto",
    chat: bool | None = None,
    max_length: int | None = None,
    drafter: Drafter | None = None,
    trace: bool = False,
    lookup: int = 0,
    compile: bool = False,
    plain_above: int | str | None = "auto",
) -> GenerationResult | list[GenerationResult]:
    """Generate up to `max_new_tokens` tokens with tree speculation; returns a `GenerationResult`.

    prompt_or_input_ids: a string (chat template when the tokenizer has one), ids or a [1, T] tensor.
    heads: MedusaHeads (None: plain decoding), drafting into `tree` (default: the heads' tree.json, else
    32 nodes); or drafter=: any `Drafter` (e.g. DraftModelDrafter, SelfSpeculativeDrafter) with heads=None.
    lookup: an extra prompt-lookup branch of that length. temperature 0 is greedy (== the base model's
    greedy output); > 0 samples losslessly (acceptance="sampling") or with Medusa's typical rule (not
    lossless); top_k/top_p as in HF. eos_token_id: default from the model's generation config; stop:
    strings that end generation; streamer: HF-style (`put`, `end`). kernel: "auto" ("compiled" when the
    extension builds for the model's dtype and device, else "sdpa"), "compiled", "sdpa" or "reference".
    max_length: cache capacity (default: max_position_embeddings). trace: keep every step's tree.
    compile: verify through torch.compile (`Decoder(compile=True)`; the first call per tree size compiles).

    A batch of prompts (a list of strings, a list of id lists, or a [B, T] tensor with B > 1) decodes them
    together and returns one `GenerationResult` per prompt (`generate_batch`; plain_above is its option).
    """
    stopping = StopCondition(eos_token_ids(model, tokenizer, eos_token_id), stop, tokenizer, max_new_tokens)
    prompt_ids = encode_prompt(prompt_or_input_ids, tokenizer, chat, vocab_size=_vocab_size(model))
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    drafter = choose_drafter(model, heads, tree, drafter, lookup)
    decoder = Decoder(
        model, drafter, acceptance=acceptance, sampling=sampling, kernel=kernel, seed=seed, compile=compile
    )
    if streamer is not None:
        streamer.put(torch.tensor([prompt_ids]))
    started = decoder.clock()
    out: list[int] = []
    steps = []
    # the model stays in treespec's mode for the whole call: each step's own `running()` then only counts
    # itself in, instead of switching the attention implementation (a walk over every module) per step
    with decoder.running():
        first = decoder.prefill(prompt_ids, max_new_tokens, max_length)
        finished = stopping.extend(out, [first], streamer)
        while not finished:
            step = decoder.step()
            if trace:
                steps.append(step.as_trace())
            finished = stopping.extend(out, step.committed, streamer)
    stats = decoder.finish(len(out), started)
    if streamer is not None:
        streamer.end()
    text = stopping.text(out)
    return GenerationResult(out, text, prompt_ids, stats, decoder.tree, steps)


def is_batch(prompts) -> bool:
    """A batch of prompts: a list or tuple of strings or id sequences, or a [B, T] tensor with B > 1."""
    if isinstance(prompts, torch.Tensor):
        return prompts.dim() == 2 and prompts.shape[0] > 1
    if isinstance(prompts, (list, tuple)) and prompts:
        return all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompts)
    return False


@torch.inference_mode()
def generate_batch(
    model,
    heads: MedusaHeads | None,
    prompts,
    tokenizer=None,
    tree: Tree | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    streamer=None,
    acceptance: str = "sampling",
    seed: int | None = None,
    kernel: str = "auto",
    chat: bool | None = None,
    max_length: int | None = None,
    drafter: Drafter | None = None,
    lookup: int = 0,
    plain_above: int | str | None = "auto",
    compile: bool = False,
) -> list[GenerationResult]:
    """Decode several prompts together (`BatchDecoder`); one `GenerationResult` per prompt, in order.

    prompts: a list of strings or of id lists (any lengths), or a [B, T] tensor. Each row stops on its own
    (EOS, stop strings, max_new_tokens) and then costs no more work. streamer: None, or a list with one
    HF-style streamer (or None) per prompt. plain_above: plain one-token steps while more rows than this
    are live; "auto" (default) times plain and speculative steps as the batch runs and takes the one
    that pays at each row count; None: always speculate (`BatchDecoder`). Statistics are per row; a
    step's time counts in every row that took part. compile: steps through torch.compile. Heads, lookup
    and EAGLE batch; draft models, self-speculation and dynamic trees refuse. Others as in `generate`.
    """
    if isinstance(prompts, torch.Tensor):
        prompts = list(prompts)
    vocab = _vocab_size(model)
    prompt_ids = [encode_prompt(p, tokenizer, chat, vocab_size=vocab) for p in prompts]
    streamers = _row_streamers(streamer, len(prompt_ids))
    eos = eos_token_ids(model, tokenizer, eos_token_id)
    stopping = [StopCondition(eos, stop, tokenizer, max_new_tokens) for _ in prompt_ids]
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    drafter = choose_drafter(model, heads, tree, drafter, lookup)
    settings = dict(acceptance=acceptance, sampling=sampling, kernel=kernel, seed=seed, compile=compile)
    decoder = BatchDecoder(model, drafter, plain_above=plain_above, **settings)
    for ids, s in zip(prompt_ids, streamers, strict=True):
        if s is not None:
            s.put(torch.tensor([ids]))
    started = decoder.clock()
    outs: list[list[int]] = [[] for _ in prompt_ids]
    stats: list[GenerationStats | None] = [None] * len(prompt_ids)
    with decoder.running():  # one switch of the model's mode for the whole call (as in `generate`)
        firsts = decoder.prefill(prompt_ids, max_new_tokens, max_length)
        done = [
            row
            for row, first in enumerate(firsts)
            if stopping[row].extend(outs[row], [first], streamers[row])
        ]
        while True:
            for row in done:
                stats[row] = decoder.close(row, len(outs[row]), started)
                if streamers[row] is not None:
                    streamers[row].end()
            decoder.finish(done)
            if not decoder.live:
                break
            step = decoder.step()
            done = [
                row
                for row, committed in zip(step.rows, step.committed, strict=True)
                if stopping[row].extend(outs[row], committed, streamers[row])
            ]
    return [
        GenerationResult(out, stopping[row].text(out), prompt_ids[row], stats[row], decoder.tree)
        for row, out in enumerate(outs)
    ]


def _row_streamers(streamer, rows: int) -> list:
    """One streamer (or None) per row of a batch: `streamer` must be None or a list of `rows` of them."""
    if streamer is None:
        return [None] * rows
    if not isinstance(streamer, (list, tuple)) or len(streamer) != rows:
        raise ValueError(
            f"a batch of {rows} prompts streams through a list of {rows} streamers (one per prompt, None "
            "for rows not streamed); HF streamers take one sequence each"
        )
    return list(streamer)


def _vocab_size(model) -> int | None:
    embedding = model.get_input_embeddings()
    return None if embedding is None else int(embedding.weight.shape[0])


def generate_baseline(model, prompt_or_input_ids, tokenizer=None, **kwargs) -> GenerationResult:
    """Plain one-token-at-a-time decoding through the same cache, attention and loop (no drafting)."""
    return generate(model, None, prompt_or_input_ids, tokenizer=tokenizer, **kwargs)
