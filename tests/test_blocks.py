"""Exact block weights (core.blocks) and the block_linear op against F.linear on the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, random_heads, tiny_model

import treespec
from treespec import ops
from treespec.core.blocks import BlockMatrix, exact_bf16, recover_blocks, round_to_q8_0
from treespec.core.packed import linear_kinds, packed_linears
from treespec.core.pages import HUGE_PAGE
from treespec.core.runtime import TargetRuntime

needs_ops = pytest.mark.skipif(not ops.available("cpu"), reason="treespec's compiled ops did not build here")


def q4_1_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 weight [n, k] whose blocks are Q4_1 values, made the way a GGUF file is read."""
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.08).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # quantization puts the block's minimum at 0 and its maximum at 15
    return (d[..., None] * q + m[..., None]).reshape(n, k)


def q8_0_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    d = (torch.rand(n, k // 32, generator=gen) * 0.002).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q[..., 0] = 127
    return (d[..., None] * q).reshape(n, k)


def blockify(model: torch.nn.Module) -> None:
    """Round every linear weight of `model` to Q4_1 values in place (as a GGUF-converted model has them)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight.view(module.out_features, -1, 32)
                lo, hi = w.amin(-1), w.amax(-1)
                d, m = ((hi - lo) / 15).half().float(), lo.half().float()
                q = torch.round((w - m[..., None]) / d[..., None]).clamp(0, 15)
                module.weight.copy_((d[..., None] * q + m[..., None]).reshape_as(module.weight))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_exact_blocks_are_found_and_rebuild_the_weight_bit_for_bit(kind):
    gen = torch.Generator().manual_seed(1)
    weight = (q4_1_weight if kind == "q4_1" else q8_0_weight)(40, 96, gen)
    blocks = recover_blocks(weight)
    assert blocks is not None and blocks.kind == kind
    assert torch.equal(blocks.dequantize().view(torch.int32), weight.view(torch.int32))
    assert blocks.nbytes() < weight.numel() * 4 / (3 if kind == "q4_1" else 2)


def test_weights_without_exact_blocks_are_refused_whole():
    gen = torch.Generator().manual_seed(2)
    assert recover_blocks(torch.randn(16, 64, generator=gen)) is None  # plain float32
    weight = q4_1_weight(16, 64, gen)
    weight[7, 33] += 1e-4  # one weight off the grid: no partial blocks
    assert recover_blocks(weight) is None
    assert recover_blocks(q4_1_weight(16, 64, gen)[:, :48]) is None  # not a multiple of 32
    assert recover_blocks(q4_1_weight(16, 64, gen).double()) is None


@needs_ops
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 32])
@pytest.mark.parametrize("batch", [1, 2])
def test_block_linear_equals_f_linear_on_the_dequantized_weight(kind, rows, batch):
    # batch x rows products: every tile height of the kernel (1-6 rows) and the remainders after full tiles
    gen = torch.Generator().manual_seed(rows)
    weight = (q4_1_weight if kind == "q4_1" else q8_0_weight)(70, 160, gen)
    bias = torch.randn(70, generator=gen)
    x = torch.randn(batch, rows, 160, generator=gen)  # [B, n, K]
    matrix = BlockMatrix(recover_blocks(weight))
    with torch.inference_mode():
        got = matrix(x, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_ops
def test_a_model_with_block_weights_decodes_exactly_through_them():
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    model = tiny_model("llama", dtype=torch.float32, **sizes)
    blockify(model)
    heads = random_heads(model, seed=5)
    prompt = [3, 17, 5, 9, 22, 4]
    outs = {}
    for linears in ("auto", "onednn"):
        decoder = treespec.Decoder(
            model,
            treespec.make_drafter(heads, treespec.default_tree(16, 4), model),
            acceptance="greedy",
            linears=linears,
        )
        out = decoder.prefill(prompt, max_new_tokens=30)
        while len(out) < 30:
            out += decoder.step().committed[0]
        outs[linears] = out[:30]
        kinds = linear_kinds(model)
        assert set(kinds) == ({"blocks-q4_1"} if linears == "auto" else {"onednn"}), kinds
    assert outs["auto"] == outs["onednn"] == hf_greedy(model, prompt, 30)
    with torch.inference_mode(), packed_linears(model):
        pass
    assert not any("forward" in m.__dict__ for m in model.modules())


@needs_ops
def test_a_packing_gathers_the_blocks_on_2_mb_pages_and_reports_their_memory():
    model = tiny_model(
        "llama", dtype=torch.float32, hidden_size=64, intermediate_size=128, num_attention_heads=4
    )
    blockify(model)
    with torch.no_grad():  # a Q8_0 lm_head, as GGUF files store the output layer (blocks without minimums)
        model.lm_head.weight.copy_(round_to_q8_0(model.lm_head.weight))
    prompt = [3, 17, 5, 9]
    result = treespec.generate(model, prompt, None, max_new_tokens=12, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 12)
    packing = TargetRuntime.of(model).packing
    blocks = [linear.matrix.blocks.blocks for linear in packing.linears]
    assert {b.kind for b in blocks} == {"q4_1", "q8_0"}
    tensors = [t for b in blocks for t in (b.q, b.d, b.m) if t is not None]
    start = min(t.data_ptr() for t in tensors)
    assert start % HUGE_PAGE == 0  # one buffer, from a 2 MB boundary, in packing order
    assert max(t.data_ptr() + t.numel() * t.element_size() for t in tensors) - start < 2 * sum(
        t.numel() * t.element_size() for t in tensors
    )
    for linear, b in zip(packing.linears, blocks, strict=True):  # still the weights, bit for bit
        assert torch.equal(b.dequantize(), linear.module.weight)
    memory = TargetRuntime.of(model).memory_bytes()  # (a Q8_0 block weight has no minimums to count)
    assert memory["packed_linears"] >= sum(t.numel() * t.element_size() for t in tensors)


@needs_ops
@pytest.mark.parametrize("rows", [1, 16, 24, 25, 64, 300])
def test_packed_block_weights_use_the_kernel_for_few_rows_and_a_gemm_for_many(rows, monkeypatch):
    from treespec.core import packed

    gen = torch.Generator().manual_seed(rows)
    weight = q4_1_weight(70, 160, gen)
    x = torch.randn(1, rows, 160, generator=gen)  # [B, n, K]
    matrix = packed.PackedMatrix(weight)
    assert matrix.kind == "blocks-q4_1"
    calls = []
    kernel = BlockMatrix.__call__
    monkeypatch.setattr(BlockMatrix, "__call__", lambda self, *a: calls.append(1) or kernel(self, *a))
    with torch.inference_mode():
        got = matrix(x)
    assert bool(calls) == (rows <= packed.BLOCK_ROWS_MAX)
    # many rows: the oneDNN copy of the float32 weight, built on first use only
    assert (matrix.packed is not None) == (rows > packed.BLOCK_ROWS_MAX)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_weights_rounded_to_q8_0_are_found_as_exact_blocks(seed):
    from treespec.core.blocks import round_to_q8_0

    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(48, 96, generator=gen) * (10.0 ** (seed - 2))
    weight[0, :32] = 0.0  # an all-zero block
    rounded = round_to_q8_0(weight)
    assert (rounded - weight).abs().max() <= weight.abs().max() / 127  # half a step at most, roughly
    blocks = recover_blocks(rounded)
    assert blocks is not None and blocks.kind == "q8_0"
    assert torch.equal(blocks.dequantize(), rounded)
    with pytest.raises(ValueError, match="multiple of 32"):
        round_to_q8_0(torch.ones(2, 33))


def test_float32_weights_of_bf16_values_get_their_bf16_copy_and_others_none():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 96, generator=gen).bfloat16().float()  # a bf16 checkpoint loaded in float32
    weight[0, :4] = torch.tensor([-0.0, float("inf"), float("-inf"), 0.0])
    weight[1, 0] = torch.tensor(0x7FC10000, dtype=torch.int32).view(torch.float32)  # a NaN with low bits 0
    copy = exact_bf16(weight)
    assert copy is not None and copy.dtype == torch.bfloat16 and copy.shape == weight.shape
    widened = copy.view(torch.int16).to(torch.int32) << 16  # what the kernels do to each weight
    assert torch.equal(widened, weight.view(torch.int32))  # every bit, -0.0 and the NaN's payload too
    off = weight.clone()
    off.view(torch.int32)[7, 11] += 1  # one weight one float32 ulp away from a bf16 value
    assert exact_bf16(off) is None
    assert exact_bf16(torch.randn(8, 32, generator=gen)) is None  # float32 values
    assert exact_bf16(weight.bfloat16()) is None  # bf16 weights need no copy
