"""numerics="int8" (csrc/int8_linear.h, core.native): int8 activations against weight blocks, row-invariant.

- the kernel: the VNNI kernel equals the scalar reference bit for bit, a row's output does not depend on the
  other rows, the activation quantizer follows its definition, and the product is near the float one;
- the native step in int8: every verified tree node (random trees of 1-64 nodes, B = 1-8, Llama / Qwen2 /
  Mistral, float32 and bf16) gets exactly the bits of one-token steps, and its logits stay near the float
  model's;
- decoding: speculative output equals the int8 plain loop's output with every kind of drafter;
- what it cannot run is refused with the reason.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import ARCHS, NATIVE_ARCHS, tiny_model
from test_bitwise import speculative_text_equals_plain_text
from test_native import _model as native_model
from test_native import _random_tree, _verify, one_token_logits

from treespec import ops
from treespec.core import decoder as decoder_module
from treespec.core.attention import AttentionPlan
from treespec.core.cache import TreeKVCache
from treespec.core.decoder import Decoder, decoding_mode
from treespec.core.native import NativeStep, int8_reason, q8_blocks

pytestmark = pytest.mark.skipif(not ops.available("cpu"), reason="treespec's compiled CPU ops did not build")

REFERENCE = 1  # csrc Int8Engine::kReference
# head_dim 32: int8 numerics quantize blocks of 32
SHAPE = dict(hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


def _q4_blocks(N: int, K: int, gen: torch.Generator):
    """Random Q4_1 blocks (q uint8 [N, K/2], d, m float16 [N, K/32]) and their float weight [N, K]."""
    q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand(N, K // 32, generator=gen) * 0.02).half()
    m = (-torch.rand(N, K // 32, generator=gen) * 0.1).half()
    lo, hi = (q & 15).view(N, K // 32, 16), (q >> 4).view(N, K // 32, 16)
    values = torch.cat([lo, hi], dim=-1).float()  # [N, B, 32] in k order
    return q, d, m, (d.float()[..., None] * values + m.float()[..., None]).view(N, K)


def _q8_blocks(N: int, K: int, gen: torch.Generator):
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    d = (torch.rand(N, K // 32, generator=gen) * 0.02).half()
    return q, d, None, (d.float()[..., None] * q.float().view(N, K // 32, 32)).view(N, K)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize(
    "N,K,M", [(48, 64, 1), (37, 96, 7), (576, 576, 16), (20, 32, 13), (5, 1536, 3), (100, 64, 5), (70, 96, 9)]
)
def test_int8_kernel_equals_its_reference_and_is_row_invariant(kind, N, K, M):
    gen = torch.Generator().manual_seed(N * K + M)
    q, d, m, weight = (_q4_blocks if kind == "q4_1" else _q8_blocks)(N, K, gen)
    bias = torch.randn(N, generator=gen)
    x = torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 4
    x[0, :32] = 0.0  # an all-zero block quantizes to zeros with scale 0
    reference = torch.ops.treespec.int8_linear(x, q, d, m, bias, REFERENCE)
    for engine in torch.ops.treespec.int8_engines():  # the reference, AVX2, VNNI: what this build has
        fast = torch.ops.treespec.int8_linear(x, q, d, m, bias, engine)
        assert torch.equal(fast, reference), engine
        for row in {0, M // 2, M - 1}:
            alone = torch.ops.treespec.int8_linear(x[row : row + 1].clone(), q, d, m, bias, engine)
            assert torch.equal(alone[0], fast[row]), engine
        # a task's columns, starting or ending inside a weight panel: those and nothing else written
        for n0, n1 in ((16, N), (0, 16), (16, 48), (48, 64)):
            if n0 < n1 <= N:
                part = torch.ops.treespec.int8_linear(x, q, d, m, bias, engine, n0, n1)
                assert torch.equal(part[:, n0:n1], reference[:, n0:n1]), engine
                assert part[:, :n0].isnan().all() and part[:, n1:].isnan().all(), engine
    exact = x @ weight.T + bias
    assert float((fast - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int8_kernel_sums_extreme_blocks_exactly(kind):
    """The largest weights against the largest activations of either sign: the SIMD kernels sum bytes in
    16-bit lanes first, so a sum that saturated there would differ from the reference's integers."""
    N, K, M = 64, 96, 9
    gen = torch.Generator().manual_seed(11)
    if kind == "q4_1":
        q = torch.full((N, K // 2), 0xFF, dtype=torch.uint8)  # every nibble 15
        q[N // 2 :] = torch.randint(0, 256, (N // 2, K // 2), dtype=torch.uint8, generator=gen)
        m = torch.full((N, K // 32), -0.5).half()
    else:
        q = torch.full((N, K), 127, dtype=torch.int8)
        q[N // 4 : N // 2] = -127
        q[N // 2 :] = torch.randint(-127, 128, (N // 2, K), dtype=torch.int8, generator=gen)
        m = None
    d = torch.full((N, K // 32), 0.01).half()
    x = torch.ones(M, K) * torch.tensor([1.0, -1.0, 3.0, -2.0, 1.0, -1.0, 0.5, 2.0, -4.0])[:, None]
    x[1, ::2] = -x[1, ::2]  # alternating signs: a pair of opposite products
    reference = torch.ops.treespec.int8_linear(x, q, d, m, None, REFERENCE)
    for engine in torch.ops.treespec.int8_engines():
        for rows in (1, 2, 3, 4, M):  # tiles of every size the kernels have (9 rows: three of 3)
            fast = torch.ops.treespec.int8_linear(x[:rows].clone(), q, d, m, None, engine)
            assert torch.equal(fast, reference[:rows]), (engine, rows)
    if kind == "q4_1":
        lo, hi = (q & 15).view(N, K // 32, 16), (q >> 4).view(N, K // 32, 16)
        values = torch.cat([lo, hi], dim=-1).float() * d.float()[..., None] + m.float()[..., None]
    else:
        values = q.float().view(N, K // 32, 32) * d.float()[..., None]
    exact = x @ values.view(N, K).T  # these activations quantize without error
    assert torch.allclose(reference, exact, rtol=1e-5, atol=1e-3)


def test_this_build_has_the_simd_engines_of_its_cpu():
    engines = torch.ops.treespec.int8_engines()
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.is_file() else set()
    assert REFERENCE in engines
    if {"avx2", "fma", "f16c"} <= flags:
        assert 2 in engines
    if {"avx512_vnni", "avx512bw"} <= flags:
        assert engines[-1] == 3


def test_activations_quantize_as_defined():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=gen) * 3
    x[1, 32:64] = 0.0
    x[2, :32] = torch.arange(32) - 15.5  # halves: with amax 127 (below) every one is a tie
    x[2, 0] = 127.0  # the block scales by exactly 1, so ties round to even
    x[2, 1:8] = torch.tensor([2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5])
    q, d, s = torch.ops.treespec.int8_quantize(x)
    blocks = x.view(5, 3, 32)
    amax = blocks.abs().amax(-1)  # [5, 3]
    assert torch.equal(d, amax / 127)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    expected = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8).view(5, 96)
    assert torch.equal(q, expected)
    assert torch.equal(s, expected.view(5, 3, 32).sum(-1, dtype=torch.int32))
    assert q.abs().max() == 127 and torch.equal(q[1, 32:64], torch.zeros(32, dtype=torch.int8))
    assert q[2, 1:8].tolist() == [2, -4, 0, 0, 2, 126, -126]


def test_dense_weights_become_q8_blocks_within_half_a_step():
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(4))
    q, d = q8_blocks(weight)
    rebuilt = (d.float()[..., None] * q.float().view(24, 2, 32)).view(24, 64)
    step = d.float().repeat_interleave(32, dim=1)
    assert q.dtype == torch.int8 and d.dtype == torch.float16
    assert torch.all((rebuilt - weight).abs() <= step * 0.5 + 1e-6)


def _model(arch: str, dtype, blocks: bool, seed: int):
    """test_native's tiny model (dense or Q4_1 blocks) in the int8 shape."""
    return native_model(arch, dtype, blocks, seed, **SHAPE)


@pytest.mark.parametrize("arch", sorted(NATIVE_ARCHS))
@pytest.mark.parametrize(
    "dtype,blocks", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
)
def test_int8_nodes_get_the_bits_of_one_token_steps(arch, dtype, blocks):
    model = _model(arch, dtype, blocks, seed=11)
    generator = random.Random(f"{arch}{dtype}{blocks}")
    with torch.inference_mode(), decoding_mode(model, "exact"):
        native = NativeStep(model, int8=True)
        native.refresh()
        for nodes, batch in [(1, 3), (9, 2), (64, 1), (5, 8), (23, 4)]:
            prompts = [
                [generator.randrange(96) for _ in range(generator.randint(2, 12))] for _ in range(batch)
            ]
            mask = _random_tree(nodes, generator)
            tokens = torch.randint(0, 96, (batch, nodes))
            hidden, _, _ = _verify(model, native, prompts, list(range(batch)), mask, tokens, ())
            logits = native.logits(hidden)  # [B, N, V]
            for row in generator.sample(range(batch), min(batch, 2)):
                node = generator.randrange(nodes)
                path = tokens[row, mask[node]].tolist()  # root .. node
                alone = one_token_logits(model, native, prompts[row], path, nodes)
                assert torch.equal(alone, logits[row, node]), (nodes, row, node)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_int8_logits_stay_near_the_float_ones(arch):
    model = _model(arch, torch.float32, True, seed=12)
    generator = random.Random(arch)
    prompts = [[generator.randrange(96) for _ in range(9)] for _ in range(3)]
    mask = _random_tree(12, generator)
    tokens = torch.randint(0, 96, (3, 12))
    with torch.inference_mode(), decoding_mode(model, "exact"):
        outs = []
        for int8 in (False, True):
            native = NativeStep(model, exact=True, int8=int8)
            native.refresh()
            hidden, _, _ = _verify(model, native, prompts, [0, 1, 2], mask, tokens, ())
            outs.append(native.logits(hidden).float())
    floats, ints = outs
    assert not torch.equal(floats, ints)  # the int8 forms really ran
    cosine = torch.nn.functional.cosine_similarity(floats, ints, dim=-1)  # [3, 12]
    assert cosine.min() > 0.98, cosine.min()
    assert (floats.argmax(-1) == ints.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_text_equals_the_int8_plain_text(dtype):
    speculative_text_equals_plain_text(_model("llama", dtype, False, seed=5), "int8")


def test_int8_refuses_what_it_cannot_run_with_the_reason():
    model = _model("llama", torch.float32, False, seed=1)
    assert Decoder(model, numerics="int8").native.int8
    with pytest.raises(ValueError, match="step='hf'"):
        Decoder(model, numerics="int8", step="hf")
    with pytest.raises(ValueError, match="compile=False"):
        Decoder(model, numerics="int8", compile=True)
    odd = tiny_model("llama", dtype=torch.float32)  # hidden 48, head_dim 8
    assert "hidden_size 48" in int8_reason(odd)
    with pytest.raises(ValueError, match="blocks of 32"):
        Decoder(odd, numerics="int8")
    with pytest.raises(ValueError, match="float64"):
        Decoder(tiny_model("llama", **SHAPE), numerics="int8")


def _one_token_at_a_time(model, native: NativeStep, prompt: list[int]):
    """Hidden [H] at the last token and the cache after feeding `prompt` one token per call."""
    cache = TreeKVCache.for_model(model, max_len=len(prompt) + 1)
    for token in prompt:
        cache.begin([0], 1)
        depth = torch.zeros(1, dtype=torch.long)
        hidden = native(torch.tensor([[token]]), cache.positions(depth), cache, AttentionPlan("exact"))
        cache.commit_all()
    return hidden[0, -1], cache


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_int8_prefill_runs_the_prompt_in_int8_numerics(arch, monkeypatch):
    """A prompt runs through the native step in int8 numerics too (one call of P rows): its hidden state
    and K/V are those of P one-token int8 steps up to the attention kernel's rounding (far closer than the
    HF forward's float32 ones); a long prompt runs in calls of NATIVE_PREFILL_CHUNK tokens, each after the
    ones before it: chunks of whole 64-key tiles give one call's bits, others stay as near."""
    model = _model(arch, torch.float32, True, seed=13)
    prompts = [[random.Random(f"{arch}{row}").randrange(96) for _ in range(5 + 6 * row)] for row in range(2)]
    hf = Decoder(model)  # fast numerics: the HF forward's prefill
    hf.prefill(prompts, max_new_tokens=4)
    decoder = Decoder(model, numerics="int8")
    roots = decoder.prefill(prompts, max_new_tokens=4)
    with torch.inference_mode(), decoding_mode(model, "exact"):
        native = NativeStep(model, int8=True)
        native.refresh()
        for row, prompt in enumerate(prompts):
            hidden, cache = _one_token_at_a_time(model, native, prompt)
            assert roots[row] == int(native.logits(hidden).argmax())
            near = (decoder.hidden[row] - hidden).abs().max()
            assert near < 1e-4 and near < (hf.hidden[row] - hidden).abs().max() / 10
            last = decoder.cache.layers[-1].keys[row, :, : len(prompt)]
            torch.testing.assert_close(last, cache.layers[-1].keys[0, :, : len(prompt)], atol=1e-4, rtol=1e-4)
    long_prompts = [[random.Random(f"{arch}{row}+").randrange(96) for _ in range(150)] for row in range(2)]
    whole = Decoder(model, numerics="int8")
    whole.prefill(long_prompts, max_new_tokens=4)
    monkeypatch.setattr(decoder_module, "NATIVE_PREFILL_CHUNK", 64)
    chunked = Decoder(model, numerics="int8")
    chunked.prefill(long_prompts, max_new_tokens=4)
    assert torch.equal(chunked.hidden, whole.hidden)
    assert torch.equal(chunked.cache.layers[-1].keys[:, :, :150], whole.cache.layers[-1].keys[:, :, :150])
    monkeypatch.setattr(decoder_module, "NATIVE_PREFILL_CHUNK", 4)
    small = Decoder(model, numerics="int8")
    small.prefill(prompts, max_new_tokens=4)
    assert (small.hidden - decoder.hidden).abs().max() < 1e-4
