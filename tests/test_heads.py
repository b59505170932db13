"""Medusa heads: identity init, shapes, checkpoints (round trip, refusals), base-model checks, gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from treespec.drafters.heads import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadsLoadError,
    MedusaHeads,
    ResidualBlock,
    fingerprints_match,
    model_fingerprint,
    model_identity,
)

VOCAB, HIDDEN = 128, 32


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model_a() -> LlamaForCausalLM:
    return tiny_model(0)


@pytest.fixture(scope="module")
def model_b() -> LlamaForCausalLM:
    return tiny_model(1)


def randomise(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return heads


def last_hidden(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden after the final norm [B, T, H], logits [B, T, V])."""
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


# --------------------------------------------------------------------------------------------------------
# Identity init and forward
# --------------------------------------------------------------------------------------------------------


def test_residual_block_starts_as_identity():
    block = ResidualBlock(HIDDEN)
    x = torch.randn(2, 5, HIDDEN)
    assert torch.equal(block(x), x)


@pytest.mark.parametrize("num_layers", [0, 1, 2])
def test_shared_heads_start_as_the_base_output_layer(model_a, num_layers):
    heads = MedusaHeads.for_model(model_a, num_heads=3, num_layers=num_layers)
    lm_head = model_a.get_output_embeddings()
    hidden = torch.randn(2, 7, HIDDEN)
    assert torch.equal(heads.head_hidden(hidden), hidden.expand(3, 2, 7, HIDDEN))
    with torch.no_grad():
        want = lm_head(hidden)  # [B, T, V]
        for logits in (heads(hidden, lm_head), heads(hidden, lm_head.weight)):
            assert logits.shape == (3, 2, 7, VOCAB)
            for k in range(3):
                assert torch.equal(logits[k], want)
        # One row: the stacked matmul may pick another kernel (gemm vs gemv), so allow rounding only.
        one = torch.randn(1, 1, HIDDEN)
        torch.testing.assert_close(heads(one, lm_head)[2], lm_head(one), rtol=1e-6, atol=1e-6)


def test_own_heads_start_as_a_copy_of_the_base_output_layer(model_a):
    heads = MedusaHeads.for_model(model_a, num_heads=2, own_lm_head=True)
    ids = torch.randint(0, VOCAB, (2, 6))
    hidden, logits = last_hidden(model_a, ids)
    with torch.no_grad():
        out = heads(hidden)  # lm_head not needed
        for k in range(2):
            assert torch.equal(out[k], logits)
        assert torch.equal(heads(hidden, torch.zeros(1)), out)  # ignored when the heads have their own
    assert heads.lm_heads[0].weight.data_ptr() != model_a.lm_head.weight.data_ptr()


def test_forward_shapes_and_missing_lm_head(model_a):
    heads = randomise(MedusaHeads.for_model(model_a, num_heads=4, num_layers=2))
    hidden = torch.randn(3, 5, HIDDEN)
    assert heads(hidden, model_a.lm_head).shape == (4, 3, 5, VOCAB)
    with pytest.raises(ValueError, match="lm_head"):
        heads(hidden)
    with pytest.raises(ValueError, match="shape"):
        heads(hidden, torch.zeros(VOCAB + 1, HIDDEN))
    with pytest.raises(ValueError, match="hidden"):
        heads(torch.randn(3, 5, HIDDEN + 1), model_a.lm_head)


def test_for_model_follows_model_dtype(model_a):
    model = tiny_model(0).to(torch.bfloat16)
    heads = MedusaHeads.for_model(model, num_heads=2, own_lm_head=True)
    assert all(p.dtype == torch.bfloat16 for p in heads.parameters())
    assert heads.base_model["name"] == model_identity(model)["name"]
    assert heads(torch.randn(1, 3, HIDDEN), None).dtype == torch.bfloat16


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(0, HIDDEN, VOCAB)
    with pytest.raises(ValueError, match="num_layers"):
        MedusaHeads(2, HIDDEN, VOCAB, num_layers=-1)


# --------------------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_gradient_of_head_k_reaches_only_head_k(model_a, own_lm_head):
    heads = randomise(MedusaHeads.for_model(model_a, num_heads=3, num_layers=2, own_lm_head=own_lm_head))
    logits = heads(torch.randn(2, 4, HIDDEN), model_a.lm_head.weight.detach())
    logits[1].logsumexp(-1).sum().backward()
    for k in range(3):
        params = list(heads.blocks[k].parameters())
        if own_lm_head:
            params += list(heads.lm_heads[k].parameters())
        touched = any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
        assert touched == (k == 1)


# --------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_round_trip_is_bit_identical(model_a, tmp_path, own_lm_head):
    heads = randomise(MedusaHeads.for_model(model_a, num_heads=3, num_layers=2, own_lm_head=own_lm_head))
    heads.save_pretrained(tmp_path / "heads")
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    loaded = MedusaHeads.from_pretrained(tmp_path / "heads")
    assert loaded.config == heads.config
    assert loaded.base_model == heads.base_model
    want, got = heads.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert all(p.requires_grad and p.device.type == "cpu" for p in loaded.parameters())
    hidden = torch.randn(1, 3, HIDDEN)
    with torch.no_grad():
        assert torch.equal(loaded(hidden, model_a.lm_head), heads(hidden, model_a.lm_head))


def test_round_trip_dtype_and_overwrite(model_a, tmp_path):
    heads = randomise(MedusaHeads.for_model(model_a, num_heads=2)).to(torch.bfloat16)
    heads.save_pretrained(tmp_path)
    heads.save_pretrained(tmp_path)  # overwriting an existing checkpoint is fine
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["dtype"] == "bfloat16"
    assert next(MedusaHeads.from_pretrained(tmp_path).parameters()).dtype == torch.bfloat16
    as_float = MedusaHeads.from_pretrained(tmp_path, dtype="float32")
    assert next(as_float.parameters()).dtype == torch.float32
    # With a model: follow the model's dtype unless told otherwise.
    assert next(MedusaHeads.from_pretrained(tmp_path, model=model_a).parameters()).dtype == torch.float32
    kept = MedusaHeads.from_pretrained(tmp_path, model=model_a, dtype=torch.bfloat16)
    assert next(kept.parameters()).dtype == torch.bfloat16


@pytest.fixture
def saved(model_a, tmp_path) -> Path:
    folder = tmp_path / "my-heads"
    randomise(MedusaHeads.for_model(model_a, num_heads=2, num_layers=1)).save_pretrained(folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / CONFIG_NAME).read_text())
    config.update(changes)
    (folder / CONFIG_NAME).write_text(json.dumps(config))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def scramble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))


def put_nan(path: Path) -> None:
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, path)


def add_tensor(path: Path) -> None:
    tensors = load_file(path)
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, path)


def drop_tensor(path: Path) -> None:
    tensors = load_file(path)
    del tensors[sorted(tensors)[0]]
    save_file(tensors, path)


CORRUPTIONS = {
    "missing folder": lambda f: f.rename(f.with_name("elsewhere")),
    "missing config": lambda f: (f / CONFIG_NAME).unlink(),
    "missing weights": lambda f: (f / WEIGHTS_NAME).unlink(),
    "unreadable json": lambda f: (f / CONFIG_NAME).write_text("{not json"),
    "wrong format tag": lambda f: edit_config(f, format="someone.else"),
    "future version": lambda f: edit_config(f, version=99),
    "bad field type": lambda f: edit_config(f, num_heads="2"),
    "truncated weights": lambda f: truncate(f / WEIGHTS_NAME),
    "corrupted header": lambda f: scramble_header(f / WEIGHTS_NAME),
    "nan weight": lambda f: put_nan(f / WEIGHTS_NAME),
    "unexpected tensor": lambda f: add_tensor(f / WEIGHTS_NAME),
    "missing tensor": lambda f: drop_tensor(f / WEIGHTS_NAME),
    "more layers in config": lambda f: edit_config(f, num_layers=2),
    "shape mismatch": lambda f: edit_config(
        f, hidden_size=HIDDEN * 2, base_model={"name": "x", "hidden_size": HIDDEN * 2, "vocab_size": VOCAB}
    ),
    "base model sizes disagree": lambda f: edit_config(f, vocab_size=VOCAB + 1),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_checkpoints_are_refused(saved, corruption):
    CORRUPTIONS[corruption](saved)
    with pytest.raises(HeadsLoadError) as caught:
        MedusaHeads.from_pretrained(saved)
    assert isinstance(caught.value, ValueError)
    assert str(saved) in str(caught.value)


def test_shape_mismatch_message(saved):
    CORRUPTIONS["shape mismatch"](saved)
    with pytest.raises(HeadsLoadError, match="shape"):
        MedusaHeads.from_pretrained(saved)


def test_refusal_leaves_the_checkpoint_untouched(saved):
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    put_nan(saved / WEIGHTS_NAME)
    nan_bytes = (saved / WEIGHTS_NAME).read_bytes()
    with pytest.raises(HeadsLoadError, match="NaN"):
        MedusaHeads.from_pretrained(saved)
    assert (saved / WEIGHTS_NAME).read_bytes() == nan_bytes
    assert (saved / CONFIG_NAME).read_bytes() == before[CONFIG_NAME]


# --------------------------------------------------------------------------------------------------------
# Base model identity
# --------------------------------------------------------------------------------------------------------


def test_fingerprint_is_stable_across_dtypes(model_a, model_b):
    a = model_fingerprint(model_a)
    assert len(a) == 16 and all(isinstance(v, float) for v in a)
    assert a == model_fingerprint(tiny_model(0))
    assert not fingerprints_match(a, model_fingerprint(model_b))
    for dtype in (torch.bfloat16, torch.float16):
        low = model_fingerprint(tiny_model(0).to(dtype))
        assert low != a and fingerprints_match(a, low)
    assert not fingerprints_match(a, a[:-1])


def test_check_compatible(model_a, model_b):
    heads = MedusaHeads.for_model(model_a, num_heads=2)
    heads.check_compatible(model_a)
    for dtype in (torch.bfloat16, torch.float16):
        heads.check_compatible(tiny_model(0).to(dtype))
    model_a.config.name_or_path, model_b.config.name_or_path = "org/model-a", "org/model-b"
    try:
        heads = MedusaHeads.for_model(model_a, num_heads=2)
        with pytest.raises(ValueError) as caught:
            heads.check_compatible(model_b)
    finally:
        model_a.config.name_or_path = model_b.config.name_or_path = ""
    message = str(caught.value)
    assert "org/model-a" in message and "org/model-b" in message
    assert f"hidden {HIDDEN}, vocab {VOCAB}" in message and "scripts/train_heads.py" in message


def test_check_compatible_refuses_other_sizes(model_a):
    heads = MedusaHeads(2, HIDDEN, VOCAB * 2)
    with pytest.raises(ValueError, match=f"vocab {VOCAB * 2}"):
        heads.check_compatible(model_a)


def test_from_pretrained_checks_the_model(model_a, model_b, tmp_path):
    MedusaHeads.for_model(model_a, num_heads=2).save_pretrained(tmp_path)
    MedusaHeads.from_pretrained(tmp_path, model=tiny_model(0).to(torch.bfloat16))
    with pytest.raises(HeadsLoadError) as caught:
        MedusaHeads.from_pretrained(tmp_path, model=model_b)
    assert str(tmp_path) in str(caught.value) and "fingerprint" in str(caught.value)
