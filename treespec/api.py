"""`generate`: the public entry point, above the decoder core and the drafters.

    generate(model, prompts, drafter="auto")   a recipe name (`treespec.recipes`), a `Recipe`, heads, a
                                               `Drafter`, or None -> the drafter -> `core.generate.decode`

`as_drafter` is where a name or heads become a drafter; everything else (prompt encoding, the decode loop,
stop conditions, streamers) is `core.generate`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import recipes
from .core.acceptance import SamplingConfig
from .core.decoder import Decoder
from .core.drafting import Drafter
from .core.generate import (
    DecodeOptions,
    GenerationResult,
    decode,
    encode_prompt,
    is_batch,
    row_streamers,
    vocab_size,
)
from .core.stopping import StopCondition
from .core.tokens import eos_token_ids
from .core.tree import Tree, default_tree
from .drafters.heads import MedusaHeads
from .drafters.medusa import make_drafter


@torch.inference_mode()
def generate(
    model,
    prompts,
    /,
    drafter: Drafter | MedusaHeads | str | None = "auto",
    tokenizer=None,
    *,
    max_new_tokens: int = 128,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    streamer=None,
    options: DecodeOptions | None = None,
    trace: bool = False,
) -> GenerationResult | list[GenerationResult]:
    """Generate up to `max_new_tokens` tokens per prompt with tree speculation.

    prompts: one prompt (a string, an id list or a [1, T] tensor) -> a `GenerationResult`; a list of them
    or a [B, T] tensor -> a list of results, decoded together. drafter: a recipe name from
    `treespec.recipes.RECIPES` or a `Recipe` (default "auto": the best shipped recipe for the model, plain
    decoding where none ships), None (plain decoding), MedusaHeads (drafting into their tree.json, else a
    32-node tree) or any `Drafter`. sampling: `SamplingConfig` (default greedy: the output equals the base
    model's greedy output). eos_token_id: default from the model's generation config; stop: strings that
    end a row; streamer: HF-style (`put`, `end`), a list of one per prompt for a batch. options:
    `DecodeOptions`. trace: keep every step's tree (one prompt)."""
    if prompts is None or isinstance(prompts, MedusaHeads):
        raise TypeError(
            "generate(model, heads, prompt, ...) is gone: call generate(model, prompts, drafter, tokenizer, "
            "sampling=SamplingConfig(...), options=DecodeOptions(...)) with the heads as the drafter"
        )
    options = options or DecodeOptions()
    batch = is_batch(prompts)
    if trace and batch:
        raise ValueError("trace= takes one prompt; decode a batch without it")
    rows = list(prompts) if batch else [prompts]
    prompt_ids = [encode_prompt(p, tokenizer, options.chat, vocab_size=vocab_size(model)) for p in rows]
    streamers = row_streamers(streamer, len(prompt_ids)) if batch else [streamer]
    eos = eos_token_ids(model, tokenizer, eos_token_id)
    stopping = [StopCondition(eos, stop, tokenizer, max_new_tokens) for _ in prompt_ids]
    decoder = Decoder(
        model,
        as_drafter(model, drafter, compile=options.compile, numerics=options.numerics),
        sampling=sampling,
        kernel=options.kernel,
        linears=options.linears,
        compile=options.compile,
        plain_above=options.plain_above,
        numerics=options.numerics,
        step=options.step,
        kv_dtype=options.kv_dtype,
    )
    try:
        results = decode(decoder, prompt_ids, stopping, streamers, options.max_length, trace)
    finally:
        decoder.release()  # the cache's pages serve the next call's cache
    return results if batch else results[0]


def as_drafter(
    model,
    drafter: Drafter | MedusaHeads | str | None,
    tree: Tree | None = None,
    compile: bool = False,
    numerics: str = "fast",
) -> Drafter | None:
    """The drafter `generate` runs: a recipe name or `Recipe` builds (once per model, kept on its runtime)
    the recipe's drafter for the kernels that run (`compile`, `numerics`: the cost curve a dynamic recipe
    prices on); heads draft into `tree` (default: the heads' own calibrated tree, else a 32-node tree); a
    drafter or None as given."""
    if isinstance(drafter, MedusaHeads):
        drafter.check_compatible(model)
        tree = tree or drafter.tree or default_tree(32, drafter.num_heads)
        return make_drafter(drafter, tree, model)
    if tree is not None:
        raise ValueError("tree= needs heads to fill it: pass MedusaHeads as the drafter")
    if isinstance(drafter, (str, recipes.Recipe)):
        return recipes.recipe_drafter(model, drafter, compile=compile, numerics=numerics)
    return drafter


def generate_baseline(model, prompts, tokenizer=None, **kwargs) -> GenerationResult | list[GenerationResult]:
    """Plain one-token-at-a-time decoding through the same cache, attention and loop (no drafting)."""
    return generate(model, prompts, None, tokenizer, **kwargs)
