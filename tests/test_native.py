"""The native step (core.native, csrc/native_step_cpu.cpp) against the HF forward it replaces.

On fresh random tiny models (Llama, Qwen2, Mistral, Qwen3; float32 and bfloat16; dense and exact-block
weights): random trees of 1-40 nodes over batches of 1-8 rows with their own prompt lengths must give the
hidden states, the K/V written to the cache, the target features and the logits of the HF forward (to
float rounding); greedy decoding through it equals transformers' greedy generate; bitwise numerics through
it give every node the bits of a one-token step; and what it cannot run is refused with the reason.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import NATIVE_ARCHS, hf_greedy, random_heads, tiny_model
from test_bitwise import _ancestors, _random_parents
from test_blocks import blockify

import treespec
from treespec import ops
from treespec.core.attention import AttentionPlan
from treespec.core.cache import TreeKVCache
from treespec.core.decoder import Decoder, decoding_mode, full_forward, output_logits
from treespec.core.native import NativeStep, model_reason
from treespec.core.tree import pack_bits

pytestmark = pytest.mark.skipif(not ops.available("cpu"), reason="treespec's compiled CPU ops did not build")

DTYPES = [torch.float32, torch.bfloat16]
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


def _random_tree(n: int, generator: random.Random) -> torch.Tensor:
    """The ancestor mask [n, n] of a random tree (node 0 the root, parents before children)."""
    return _ancestors(_random_parents(n, generator))


def _filled_cache(
    model, prompts: list[list[int]], nodes: int, dtype: torch.dtype | None = None, kernel: str = "compiled"
) -> TreeKVCache:
    """A cache (K/V in `dtype`, default the model's) with each prompt prefilled (HF forward, attention
    through `kernel`) into its own row."""
    size = max(map(len, prompts)) + nodes + 1
    cache = TreeKVCache.for_model(model, max_len=size, batch_size=len(prompts), dtype=dtype)
    for row, prompt in enumerate(prompts):
        cache.begin([row], len(prompt))
        positions = cache.positions(torch.arange(len(prompt)))
        full_forward(
            model, torch.tensor([prompt]), positions, cache, cache.attention_plan(AttentionPlan(kernel))
        )
        cache.commit_all()
    return cache


def _verify(model, scorer, prompts, rows, mask, tokens, feature_layers):
    """One verification forward of the tree (`mask`, tokens [A, N]) over `rows` through `scorer`:
    (hidden [A, N, H], features, the cache after it)."""
    cache = _filled_cache(model, prompts, mask.shape[0])
    cache.begin(rows, mask.shape[0])
    depth = mask.sum(1) - 1
    plan = (
        AttentionPlan("compiled", mask, pack_bits(mask)) if mask.shape[0] > 1 else AttentionPlan("compiled")
    )
    out = scorer(
        tokens, cache.positions(depth), cache, cache.attention_plan(plan), feature_layers=feature_layers
    )
    hidden, features = out if feature_layers else (out, None)
    return hidden, features, cache


def one_token_logits(model, native: NativeStep, prompt: list[int], path: list[int], nodes: int):
    """Logits [V] after feeding `path` to `native` one token per call, over a cache holding `prompt`."""
    cache = _filled_cache(model, [prompt], nodes)
    for token in path:
        cache.begin([0], 1)
        one = native(
            torch.tensor([[token]]),
            cache.positions(torch.zeros(1, dtype=torch.long)),
            cache,
            AttentionPlan("exact"),
        )
        cache.commit_all()
    return native.logits(one)[0, -1]


def _model(arch: str, dtype, blocks: bool, seed: int, **overrides):
    model = tiny_model(arch, dtype=torch.float32, seed=seed, **{**SHAPE, **overrides})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norm weights of their own (transformers starts them at 1): a swapped one shows
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5, generator=generator)
    if blocks:
        blockify(model)  # Q4_1 values: the native step reads them as blocks
    return model.to(dtype)


# exact blocks are float32 weights: dense float32, dense bf16, float32 blocks
@pytest.mark.parametrize("arch", sorted(NATIVE_ARCHS))
@pytest.mark.parametrize(
    "dtype,blocks", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
)
def test_native_step_equals_the_hf_forward(arch, dtype, blocks):
    model = _model(arch, dtype, blocks, seed=11)
    generator = random.Random(f"{arch}{dtype}{blocks}")
    layers = model.config.num_hidden_layers
    feature_layers = (0, 1, layers)
    tolerance = 2e-4 if dtype == torch.float32 else 6e-2
    with torch.inference_mode(), decoding_mode(model, "auto"):
        native = NativeStep(model)
        native.refresh()
        for nodes, batch in [(1, 1), (1, 5), (4, 2), (16, 1), (40, 3), (7, 8)]:
            prompts = [
                [generator.randrange(96) for _ in range(generator.randint(1, 30))] for _ in range(batch)
            ]
            rows = sorted(generator.sample(range(batch), generator.randint(1, batch)))
            mask = _random_tree(nodes, generator)
            tokens = torch.randint(0, 96, (len(rows), nodes))
            reference = _verify(
                model,
                lambda *a, **k: full_forward(model, *a, **k),
                prompts,
                rows,
                mask,
                tokens,
                feature_layers,
            )
            fast = _verify(model, native, prompts, rows, mask, tokens, feature_layers)
            for name, ours, theirs in [
                ("hidden", fast[0], reference[0]),
                ("features", fast[1], reference[1]),
            ]:
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
                error = (ours.float() - theirs.float()).abs().max().item()
                assert error < tolerance * max(1.0, theirs.float().abs().max().item()), (
                    name,
                    nodes,
                    batch,
                    error,
                )
            for layer in (0, layers - 1):  # the K/V the step wrote, where the HF forward wrote them
                for row in rows:
                    end = len(prompts[row]) + nodes
                    ours = fast[2].layers[layer].keys[row, :, :end].float()
                    theirs = reference[2].layers[layer].keys[row, :, :end].float()
                    assert (ours - theirs).abs().max().item() < tolerance * 10, (layer, row)
            logits = native.logits(fast[0])
            expected = output_logits(model, fast[0])
            assert logits.dtype == expected.dtype
            assert (logits.float() - expected.float()).abs().max().item() < tolerance * 10


@pytest.mark.parametrize(
    "dtype,blocks,int8",
    [(torch.float32, False, False), (torch.bfloat16, False, False), (torch.float32, True, False),
     (torch.float32, True, True)],
)  # fmt: skip
def test_logits_argmax_is_the_argmax_of_the_logits(dtype, blocks, int8):
    """NativeStep.logits_argmax: the logits of `logits` and their max(dim=-1).indices, with the argmax
    taken per lm_head task (256 columns) and merged: a vocabulary of several tasks, the largest logit
    tied across tasks (equal lm_head rows), and a row of NaN (its first NaN, column 0)."""
    shape = dict(hidden_size=128, num_attention_heads=4) if int8 else {}  # int8: sizes in 32s
    seed = int(torch.randint(0, 10**6, ()))
    model = _model("llama", torch.float32, blocks, seed=seed, vocab_size=1000, **shape)
    hidden = torch.randn(3, 5, model.config.hidden_size)  # [A, N, H]
    with torch.no_grad():  # rows 70, 300 and 900 (three tasks) equal, along hidden[1, 2]: its largest logit
        weight = model.lm_head.weight
        weight[[300, 900]] = weight[70] = 4 * hidden[1, 2] / hidden[1, 2].norm()
    if blocks:
        blockify(model)  # the tied rows quantized alike
    model = model.to(dtype)
    hidden = hidden.to(dtype)
    hidden[2, 4] = float("nan")
    with torch.inference_mode(), decoding_mode(model, "auto"):
        native = NativeStep(model, int8=int8)
        native.refresh()
        logits, best = native.logits_argmax(hidden)
        torch.testing.assert_close(logits, native.logits(hidden), rtol=0, atol=0, equal_nan=True)
        assert best.dtype == torch.long and torch.equal(best, logits.max(dim=-1).indices)
        assert best[1, 2] == 70 and best[2, 4] == 0


@pytest.mark.parametrize("arch", sorted(NATIVE_ARCHS))
def test_greedy_through_the_native_step_equals_hf_greedy(arch):
    model = tiny_model(arch, dtype=torch.float32, seed=2)
    prompts = [[5, 17, 3, 22], [9, 9, 1], [40, 2, 71, 33, 8, 15, 60]]
    expected = [hf_greedy(model, p, 24) for p in prompts]
    heads = random_heads(model, seed=3)
    options = treespec.DecodeOptions(step="native")
    for drafter in (None, heads, treespec.SuffixDrafter()):
        out = treespec.generate(model, prompts, drafter, max_new_tokens=24, eos_token_id=[], options=options)
        assert [r.token_ids for r in out] == expected, type(drafter).__name__
        alone = treespec.generate(
            model, prompts[2], drafter, max_new_tokens=24, eos_token_id=[], options=options
        )
        assert alone.token_ids == expected[2]


def test_greedy_on_block_weights_with_biases_equals_hf_greedy():
    """Exact Q4_1 blocks and every bias a Llama can have (q, k, v, o and the MLP's)."""
    model = _model("llama", torch.float32, True, seed=4, attention_bias=True, mlp_bias=True)
    assert model_reason(model) is None
    prompts = [[5, 17, 3, 22, 61, 7], [30, 1]]
    expected = [hf_greedy(model, p, 20) for p in prompts]
    heads = random_heads(model, seed=1)
    for drafter in (None, heads):
        decoder_out = treespec.generate(
            model,
            prompts,
            drafter,
            max_new_tokens=20,
            eos_token_id=[],
            options=treespec.DecodeOptions(step="native"),
        )
        assert [r.token_ids for r in decoder_out] == expected


# blocks: Q4_1 weights, the MLP's down projection 37 blocks wide (the one-row kernel converts its float16
# scales 16 blocks at a time: two whole groups and a partial one)
@pytest.mark.parametrize("dtype,blocks", [(dtype, False) for dtype in DTYPES] + [(torch.float32, True)])
def test_bitwise_native_nodes_get_the_bits_of_one_token_steps(dtype, blocks):
    model = _model("qwen2", dtype, blocks, seed=6, **({"intermediate_size": 37 * 32} if blocks else {}))
    generator = random.Random(str(dtype))
    with torch.inference_mode(), decoding_mode(model, "exact"):
        native = NativeStep(model, exact=True)
        native.refresh()
        for nodes, batch in [(9, 2), (33, 1), (5, 4)]:
            prompts = [
                [generator.randrange(96) for _ in range(generator.randint(2, 12))] for _ in range(batch)
            ]
            mask = _random_tree(nodes, generator)
            tokens = torch.randint(0, 96, (batch, nodes))
            hidden, _, _ = _verify(model, native, prompts, list(range(batch)), mask, tokens, ())
            logits = native.logits(hidden)  # [B, N, V]
            for row in range(batch):
                node = generator.randrange(nodes)
                path = tokens[row, mask[node]].tolist()  # root .. node
                alone = one_token_logits(model, native, prompts[row], path, nodes)
                assert torch.equal(alone, logits[row, node]), (nodes, row, node)


def test_bitwise_native_nodes_after_long_prompts_get_the_bits_of_one_token_steps():
    """Rows of one call with prompts of 40-1030 tokens (a long context's score and value loops, rows of
    different lengths in one step) against one-token steps."""
    model = _model("llama", torch.float32, True, seed=12)
    generator = random.Random(12)
    with torch.inference_mode(), decoding_mode(model, "exact"):
        native = NativeStep(model, exact=True)
        native.refresh()
        for nodes, lengths in [(16, (500, 1030)), (1, (513, 40)), (6, (1021, 511))]:
            prompts = [[generator.randrange(96) for _ in range(length)] for length in lengths]
            mask = _random_tree(nodes, generator)
            tokens = torch.randint(0, 96, (len(prompts), nodes))
            hidden, _, _ = _verify(model, native, prompts, list(range(len(prompts))), mask, tokens, ())
            logits = native.logits(hidden)  # [B, N, V]
            for row in range(len(prompts)):
                for node in {0, nodes - 1, generator.randrange(nodes)}:
                    path = tokens[row, mask[node]].tolist()  # root .. node
                    alone = one_token_logits(model, native, prompts[row], path, nodes)
                    assert torch.equal(alone, logits[row, node]), (nodes, row, node)


def test_wide_block_weights_give_the_hf_forward_at_one_row_and_many():
    # 37 blocks of 32 in the down projection: the one-row kernel's scale groups of 16 (two and a part)
    model = _model("llama", torch.float32, True, seed=8, intermediate_size=37 * 32)
    generator = random.Random(8)
    with torch.inference_mode(), decoding_mode(model, "auto"):
        native = NativeStep(model)
        native.refresh()
        for nodes in (1, 3):
            prompts = [[generator.randrange(96) for _ in range(9)]]
            mask = _random_tree(nodes, generator)
            tokens = torch.randint(0, 96, (1, nodes))
            reference = _verify(
                model, lambda *a, **k: full_forward(model, *a, **k), prompts, [0], mask, tokens, ()
            )
            fast = _verify(model, native, prompts, [0], mask, tokens, ())
            error = (fast[0] - reference[0]).abs().max().item()
            assert error < 2e-4 * max(1.0, reference[0].abs().max().item()), (nodes, error)


@pytest.mark.parametrize("kept", [0, 40])
def test_a_long_causal_block_gives_the_hf_forward(kept):
    """A prompt's prefill (a causal block of 150 tokens, after `kept` cached ones) runs the fast attention
    kernel in query tiles of 64 tokens, each over the keys up to its last token."""
    model = _model("qwen2", torch.float32, True, seed=9)
    generator = random.Random(kept)
    tokens = torch.tensor([[generator.randrange(96) for _ in range(kept + 150)]])  # [1, kept + 150]
    outs = []
    with torch.inference_mode(), decoding_mode(model, "auto"):
        native = NativeStep(model)
        native.refresh()
        for scorer in (lambda *a: full_forward(model, *a), native):
            cache = TreeKVCache.for_model(model, max_len=kept + 151)
            for start, end in ((0, kept), (kept, kept + 150)):
                if end > start:
                    cache.begin([0], end - start)
                    positions = cache.positions(torch.arange(end - start))
                    plan = cache.attention_plan(AttentionPlan())  # causal
                    out = scorer(tokens[:, start:end], positions, cache, plan)
                    cache.commit_all()
            outs.append(out)  # [1, 150, H]
    error = (outs[1] - outs[0]).abs().max().item()
    assert error < 2e-4 * max(1.0, outs[0].abs().max().item()), error


def test_auto_takes_the_native_step_where_it_covers_the_model():
    model = tiny_model("mistral", dtype=torch.float32)
    assert Decoder(model).step_kind == "native"
    assert Decoder(model, step="hf").step_kind == "hf"
    assert Decoder(model, kernel="sdpa").step_kind == "hf"
    assert Decoder(model, compile=True).step_kind == "hf"
    assert Decoder(model, numerics="bitwise").native.exact


def test_native_refuses_what_it_cannot_run_with_the_reason():
    with pytest.raises(ValueError, match="float64"):
        Decoder(tiny_model("llama"), step="native")  # float64 weights
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="compile=True"):
        Decoder(model, step="native", compile=True)
    with pytest.raises(ValueError, match="kernel='sdpa'"):
        Decoder(model, step="native", kernel="sdpa")
    with pytest.raises(ValueError, match="unknown step"):
        Decoder(model, step="fastest")
    gelu = tiny_model("llama", dtype=torch.float32, hidden_act="gelu")
    assert "hidden_act" in model_reason(gelu) and Decoder(gelu).step_kind == "hf"


def test_a_weight_changed_between_decodes_is_read_anew():
    model = tiny_model("llama", dtype=torch.float32, seed=8)
    prompt = [3, 14, 15, 92]
    options = treespec.DecodeOptions(step="native")
    first = treespec.generate(
        model, prompt, None, max_new_tokens=12, eos_token_id=[], options=options
    ).token_ids
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
        model.lm_head.weight.mul_(-1.0)
    second = treespec.generate(
        model, prompt, None, max_new_tokens=12, eos_token_id=[], options=options
    ).token_ids
    assert second == hf_greedy(model, prompt, 12) and second != first


@pytest.mark.parametrize("arch", sorted(NATIVE_ARCHS))
def test_float32_weights_of_bf16_values_are_read_as_bf16_with_the_same_bits(arch, monkeypatch):
    """A bf16 checkpoint loaded in float32: the native step reads its linears (lm_head included) from
    bf16 copies, half the bytes, and every hidden state, K/V and logit keeps the bits of reading the
    float32 weights; greedy decoding still equals HF's."""
    from treespec.core import native as native_module

    model = _model(arch, torch.float32, False, seed=4)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.bfloat16().float())
    generator = random.Random(arch)
    prompts = [[generator.randrange(96) for _ in range(generator.randint(2, 20))] for _ in range(3)]
    mask = _random_tree(11, generator)
    tokens = torch.randint(0, 96, (3, 11))
    results = []
    for compact in (True, False):
        if not compact:  # the reference: the float32 weights themselves
            monkeypatch.setattr(native_module, "exact_bf16", lambda weight: None)
        with torch.inference_mode(), decoding_mode(model, "auto"):
            native = NativeStep(model)
            runtime = native_module.TargetRuntime.of(model)
            runtime.native.clear()  # built anew for each way of reading the weights
            native.refresh()
            hidden, _, cache = _verify(model, native, prompts, [0, 1, 2], mask, tokens, ())
            results.append((hidden, native.logits(hidden), cache.layers[0].keys.clone()))
            bytes_copied = runtime.native["float"][2]
        assert (bytes_copied >= model.lm_head.weight.numel() * 2) == compact  # the copies are counted
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours, theirs)
    monkeypatch.undo()
    runtime.native.clear()
    prompt = prompts[0]
    options = treespec.DecodeOptions(step="native")
    out = treespec.generate(model, prompt, None, max_new_tokens=10, eos_token_id=[], options=options)
    assert out.token_ids == hf_greedy(model, prompt, 10)
