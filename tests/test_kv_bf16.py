"""K/V stored in bf16 under a float32 model (`DecodeOptions(kv_dtype="bfloat16")`,
core.decoder.kv_storage_dtype).

The native step writes each K/V row rounded to bf16 and its row-invariant attention widens them exactly where
it reads them; the HF forward (prefill, other architectures) reads the same cache widened. So: the native
step over a bf16 cache gives the HF forward's hidden states over a bf16 cache (to float rounding) and the
K/V the HF forward rounds, bit for bit; every tree node gets the bits of a one-token step (int8 and bitwise
numerics); speculative text equals the plain loop's; and what it cannot keep is refused.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ARCHS, tiny_model
from test_bitwise import speculative_text_equals_plain_text
from test_int8 import _model as int8_model
from test_native import _filled_cache, _model, _random_tree

import treespec
from treespec import ops
from treespec.core.attention import AttentionPlan
from treespec.core.cache import TreeKVCache
from treespec.core.decoder import Decoder, decoding_mode, full_forward
from treespec.core.native import NativeStep
from treespec.core.tree import pack_bits
from treespec.tools.bench import run_names, split_numerics

pytestmark = pytest.mark.skipif(not ops.available("cpu"), reason="treespec's compiled CPU ops did not build")


def _bf16_cache(model, prompts: list[list[int]], nodes: int) -> TreeKVCache:
    """A bf16 cache with each prompt prefilled into its own row through the HF forward (exact attention)."""
    return _filled_cache(model, prompts, nodes, torch.bfloat16, "exact")


def _tree_forward(model, scorer, prompts, mask, tokens):
    """One verification of the tree `mask` (tokens [B, N]) over every row of a fresh bf16 cache."""
    cache = _bf16_cache(model, prompts, mask.shape[0])
    cache.begin(list(range(len(prompts))), mask.shape[0])
    plan = AttentionPlan("exact", mask, pack_bits(mask)) if mask.shape[0] > 1 else AttentionPlan("exact")
    hidden = scorer(tokens, cache.positions(mask.sum(1) - 1), cache, cache.attention_plan(plan))
    return hidden, cache


# exact False: the native step's fast attention kernel where a task has more rows than VL - 2 (a prompt's
# prefill in int8 numerics runs so), the row-invariant one below that
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("blocks,exact", [(False, True), (True, True), (True, False)])
def test_the_native_step_over_bf16_kv_equals_the_hf_forward(arch, blocks, exact):
    model = _model(arch, torch.float32, blocks, seed=21)
    generator = random.Random(f"{arch}{blocks}{exact}")
    with torch.inference_mode(), decoding_mode(model, "exact"):
        native = NativeStep(model, exact=exact)
        native.refresh()
        for nodes, batch in [(1, 2), (6, 1), (19, 3), (70, 1)]:
            prompts = [
                [generator.randrange(96) for _ in range(generator.randint(2, 90))] for _ in range(batch)
            ]
            mask = _random_tree(nodes, generator)
            tokens = torch.randint(0, 96, (batch, nodes))
            ours, our_cache = _tree_forward(model, native, prompts, mask, tokens)
            theirs, their_cache = _tree_forward(
                model, lambda *a: full_forward(model, *a), prompts, mask, tokens
            )
            assert our_cache.layers[0].keys.dtype == torch.bfloat16
            error = (ours - theirs).abs().max().item()
            assert error < 2e-4 * max(1.0, theirs.abs().max().item()), (nodes, batch, error)
            # layer 0's K/V come from the same inputs on both paths: rounded to the same bf16 values
            for row, prompt in enumerate(prompts):
                end = len(prompt) + nodes
                for name in ("keys", "values"):
                    mine = getattr(our_cache.layers[0], name)[row, :, :end].float()
                    other = getattr(their_cache.layers[0], name)[row, :, :end].float()
                    assert (mine - other).abs().max().item() <= 1e-2 * max(1.0, other.abs().max().item())


@pytest.mark.parametrize("int8", [False, True])
def test_tree_nodes_over_bf16_kv_get_the_bits_of_one_token_steps(int8):
    model = int8_model("llama", torch.float32, True, seed=22)  # dims in multiples of 32
    generator = random.Random(int8)
    with torch.inference_mode(), decoding_mode(model, "exact"):
        native = NativeStep(model, exact=True, int8=int8)
        native.refresh()
        for nodes, batch in [(9, 2), (40, 1), (5, 3)]:
            prompts = [
                [generator.randrange(96) for _ in range(generator.randint(2, 70))] for _ in range(batch)
            ]
            mask = _random_tree(nodes, generator)
            tokens = torch.randint(0, 96, (batch, nodes))
            logits = native.logits(_tree_forward(model, native, prompts, mask, tokens)[0])  # [B, N, V]
            for row in range(batch):
                node = generator.randrange(nodes)
                cache = _bf16_cache(model, [prompts[row]], nodes)
                for token in tokens[row, mask[node]].tolist():  # root .. node, one token a call
                    cache.begin([0], 1)
                    position = cache.positions(torch.zeros(1, dtype=torch.long))
                    one = native(torch.tensor([[token]]), position, cache, AttentionPlan("exact"))
                    cache.commit_all()
                assert torch.equal(native.logits(one)[0, -1], logits[row, node]), (nodes, row, node)


@pytest.mark.parametrize("numerics", ["int8", "bitwise"])
def test_speculative_text_over_bf16_kv_equals_the_plain_text(numerics):
    model = int8_model("qwen2", torch.float32, False, seed=5)
    speculative_text_equals_plain_text(model, numerics, "bfloat16")


def test_bf16_kv_holds_the_float32_keys_rounded_to_bf16():
    model = int8_model("llama", torch.float32, True, seed=23)
    prompt = [random.Random(0).randrange(96) for _ in range(30)]
    outs = {}
    for kv_dtype in ("model", "bfloat16"):
        decoder = Decoder(model, numerics="int8", kv_dtype=kv_dtype)
        decoder.prefill(prompt, max_new_tokens=4)
        keys = decoder.cache.layers[0].keys  # layer 0: the same inputs either way
        assert keys.dtype == (torch.float32 if kv_dtype == "model" else torch.bfloat16)
        outs[kv_dtype] = keys[0, :, :30].clone()  # (the released buffer serves the next cache)
        decoder.release()
    assert torch.equal(outs["bfloat16"], outs["model"].bfloat16())  # each K rounded once, to nearest even


def test_kv_dtype_refuses_what_it_cannot_keep():
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match='numerics="int8" or "bitwise"'):
        Decoder(model, kv_dtype="bfloat16")  # fast numerics: float32 text promised
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        Decoder(model, numerics="int8", kv_dtype="float16")
    bf16 = tiny_model("llama", dtype=torch.bfloat16)
    assert Decoder(bf16, kv_dtype="bfloat16").kv_dtype == torch.bfloat16  # already its dtype: any numerics
    with pytest.raises(ValueError, match='numerics="int8" or "bitwise"'):
        treespec.generate(model, [1, 2, 3], None, options=treespec.DecodeOptions(kv_dtype="bfloat16"))


def test_the_bench_names_bf16_kv_runs_as_numerics():
    assert split_numerics("int8+kv-bf16") == ("int8", "bfloat16")
    assert split_numerics("bitwise") == ("bitwise", "model")
    assert split_numerics("fast+kv-bf16") is None and split_numerics("int8+kv-f16") is None
    assert run_names(["plain", "hf"], ["int8", "int8+kv-bf16"]) == ["plain@int8", "plain@int8+kv-bf16", "hf"]
