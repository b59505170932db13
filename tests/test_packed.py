"""Prepacked oneDNN linears (core.packed) against F.linear, the reference they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, random_heads, tiny_model

import treespec
from treespec.core.packed import PackedMatrix, packed_linears, packing_supported

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64])
def test_packed_matrix_equals_f_linear_on_fresh_random_inputs(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 96, generator=gen)  # [out, in]
    x = torch.randn(2, rows, 96, generator=gen)  # [B, n, in]
    matrix = PackedMatrix(weight)
    assert matrix.packed is not None
    with torch.inference_mode():
        torch.testing.assert_close(matrix(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_packed_linears_match_the_stock_model_and_restore_it_afterwards():
    model = tiny_model("llama", dtype=torch.float32)
    assert packing_supported(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        stock = model(ids).logits
        with packed_linears(model):
            with packed_linears(model):  # nested users share one packing
                pass
            assert all("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))
            packed = model(ids).logits
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(packed, stock, rtol=1e-4, atol=1e-5)


def test_a_changed_weight_is_repacked_not_served_stale():
    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.inference_mode(), packed_linears(model):
        model(ids)  # packs
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.5)  # in place: same storage, new version
    with torch.inference_mode():
        stock = model(ids).logits
        with packed_linears(model):
            packed = model(ids).logits
    torch.testing.assert_close(packed, stock, rtol=1e-4, atol=1e-5)


def test_autograd_inside_the_block_uses_f_linear():
    model = tiny_model("llama", dtype=torch.float32)
    with packed_linears(model):
        loss = model(torch.tensor([[1, 2, 3]])).logits.sum()
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_other_dtypes_run_stock():
    model = tiny_model("llama", dtype=torch.float64)
    assert not packing_supported(model)
    with packed_linears(model):
        assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_output_with_packed_linears_equals_hf_and_the_unpacked_decoder(arch):
    model = tiny_model(arch, dtype=torch.float32, seed=3)
    heads = random_heads(model, seed=4)
    prompt = [3, 17, 5, 9, 22, 4]
    outs = {}
    for linears in ("auto", "onednn", "torch"):
        drafter = treespec.make_drafter(heads, treespec.default_tree(16, 4), model)
        decoder = treespec.Decoder(model, drafter, acceptance="greedy", linears=linears)
        out = decoder.prefill(prompt, max_new_tokens=40)
        while len(out) < 40:
            out += decoder.step().committed[0]
        outs[linears] = out[:40]
    assert outs["auto"] == outs["onednn"] == outs["torch"] == hf_greedy(model, prompt, 40)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported() or not treespec.ops.available("cpu"),
    reason="needs oneDNN bf16 and treespec's compiled CPU ops",
)
@pytest.mark.parametrize("amx", [False, True])
def test_one_bf16_row_takes_exact_linear_without_amx_and_more_rows_take_onednn(monkeypatch, amx):
    """A plain step's one bf16 row: `exact_linear` on CPUs without AMX (faster there), oneDNN with AMX
    and for every larger row count; each equals its reference on fresh random inputs."""
    from treespec.core import packed

    monkeypatch.setattr(packed, "cpu_has_amx", lambda: amx)
    calls = []
    exact_product = PackedMatrix._exact
    monkeypatch.setattr(
        PackedMatrix, "_exact", lambda self, x, b: calls.append(x.shape) or exact_product(self, x, b)
    )
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(96, 576, generator=gen).to(torch.bfloat16)  # [out, in]
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    matrix = PackedMatrix(w, "auto")
    assert matrix.exact_one_row is not amx and matrix.kind == "onednn"
    for rows in (1, 3, 17):
        shape = (2, rows, 576) if rows == 17 else (rows, 576)
        x = torch.randn(shape, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            got = matrix(x, bias)
        exact = (torch.ops.treespec.exact_linear(x.float(), w) + bias.float()).to(torch.bfloat16)
        onednn = torch.ops.mkldnn._linear_pointwise(x, matrix.pack(), bias, "none", [], "")
        assert torch.equal(got, exact if rows == 1 and not amx else onednn), rows
        torch.testing.assert_close(
            got.float(), F.linear(x.float(), w.float(), bias.float()), rtol=2e-2, atol=5e-2
        )
    assert calls == ([] if amx else [(1, 576)])  # only the one-row call took the exact product


def test_one_row_of_a_float32_weight_of_bf16_values_reads_its_bf16_copy():
    """A bf16 checkpoint loaded in float32: one row multiplies through `exact_linear` over the weight's
    bf16 copy (the bits of the float32 exact product, from half the bytes); more rows stay on oneDNN; a
    weight of other float32 values gets no copy."""
    if not treespec.ops.available("cpu"):
        pytest.skip("treespec's compiled ops did not build here")
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(200, 576, generator=gen).bfloat16().float()  # [out, in]
    bias = torch.randn(200, generator=gen)
    matrix = PackedMatrix(w, "auto")
    with torch.inference_mode():
        for shape in [(1, 576), (1, 1, 576), (3, 576)]:
            x = torch.randn(shape, generator=gen)
            got = matrix(x, bias)
            if shape[-2] == 1:
                assert torch.equal(got, torch.ops.treespec.exact_linear(x, w) + bias), shape
            else:
                onednn = torch.ops.mkldnn._linear_pointwise(x, matrix.pack(), bias, "none", [], "")
                assert torch.equal(got, onednn)
            torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)  # K = 576 sums
        assert matrix.bf16_copy() is not None
        assert matrix.memory_bytes() >= w.numel() * 2  # the copy counts
        exact = PackedMatrix(w, "exact")  # bitwise numerics: every row count through the copy, same bits
        x = torch.randn(5, 576, generator=gen)
        assert torch.equal(exact(x), torch.ops.treespec.exact_linear(x, w))
        other = PackedMatrix(torch.randn(200, 576, generator=gen), "auto")
        other(torch.randn(1, 576, generator=gen))
        assert other.bf16_copy() is None
