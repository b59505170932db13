"""The EAGLE draft layer through the native step (drafters/eagle_native.py) against the torch layer."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_eagle, tiny_model

import treespec
from treespec import ops
from treespec.core.runtime import TargetRuntime

pytestmark = pytest.mark.skipif(not ops.available("cpu"), reason="treespec's compiled CPU ops did not build")

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [1, 0, 0], [0, 0, 0, 0]]


def _pair(model, draft, tree):
    native = treespec.EagleDrafter(draft, tree, model, native=True)
    torch_layer = treespec.EagleDrafter(draft, tree, model, native=False)
    assert native.native is not None and torch_layer.native is None
    return native, torch_layer


def _assert_same_proposals(got, want, atol=2e-5):
    """Same tokens where the torch layer's choice is clear of the next candidate; probabilities close."""
    torch.testing.assert_close(got.probs, want.probs, atol=atol, rtol=1e-4)
    assert got.tokens.tolist() == want.tokens.tolist()


@pytest.mark.parametrize("seed", range(3))
def test_native_layer_drafts_what_the_torch_layer_drafts(seed):
    """A batch of two sequences of different lengths, a branching tree, several steps of catch-up and
    drafting: every proposal and every kept output equal within float32 rounding."""
    model = tiny_model("llama", dtype=torch.float32)
    draft = random_eagle(model, seed, draft_size=60 if seed else 0, std=0.2)
    tree = treespec.Tree.from_choices(TREE)
    native, reference = _pair(model, draft, tree)
    gen = torch.Generator().manual_seed(100 + seed)
    F = len(draft.feature_layers) * model.config.hidden_size
    prompts = [torch.randint(96, (5 + 4 * r + seed,), generator=gen).tolist() for r in range(2)]
    for drafter in (native, reference):
        for row, prompt in enumerate(prompts):
            features = torch.randn(1, len(prompt) - 1, F, generator=torch.Generator().manual_seed(row))
            drafter.start(treespec.SequenceStart(prompt, 64, None, "sdpa", features, row=row, rows=2))
    for step in range(4):
        roots = torch.randint(96, (2,), generator=gen)
        got = native.propose(torch.zeros(2, 8), roots)
        want = reference.propose(torch.zeros(2, 8), roots)
        _assert_same_proposals(got, want)
        # rows accept different counts: the catch-up pads the shorter row
        committed = [torch.randint(96, (1 + (step + r) % 3,), generator=gen).tolist() for r in range(2)]
        features = torch.randn(2, 3, F, generator=gen)
        native.observe(committed, features)
        reference.observe(committed, features)
        torch.testing.assert_close(native.last_hidden, reference.last_hidden, atol=2e-5, rtol=1e-4)
        assert native.cache.lengths == reference.cache.lengths


def test_native_layer_limits_depth_like_the_torch_layer():
    model = tiny_model("qwen2", dtype=torch.float32)
    draft = random_eagle(model, 4, std=0.2)
    native, reference = _pair(model, draft, treespec.Tree.from_choices(TREE))
    prompt = torch.randint(96, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    features = torch.randn(1, 8, len(draft.feature_layers) * model.config.hidden_size)
    for drafter in (native, reference):
        drafter.start(treespec.SequenceStart(prompt, 40, None, "sdpa", features))
    for depth in (0, 1, 2):
        roots = torch.tensor([7])
        got = native.propose(torch.zeros(1, 8), roots, max_depth=depth)
        _assert_same_proposals(got, reference.propose(torch.zeros(1, 8), roots, max_depth=depth))


def test_greedy_output_through_the_native_layer_equals_the_base_models():
    model = tiny_model("mistral", dtype=torch.float32)
    draft = random_eagle(model, 2, draft_size=50, std=0.2)
    drafter = treespec.EagleDrafter(draft, treespec.Tree.from_choices(TREE), model, native=True)
    prompt = torch.randint(96, (11,), generator=torch.Generator().manual_seed(8)).tolist()
    result = treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 40)
    assert result.stats.drafter["steps"] == result.stats.steps


def test_a_bf16_target_drafts_through_the_native_layer_like_the_torch_layer():
    """A bf16 target's float32 drafter (what `load_eagle_option` makes on CPU) reads the bf16 embedding."""
    model = tiny_model(
        "llama", dtype=torch.float32, hidden_size=64, intermediate_size=128, num_attention_heads=4
    )
    draft = random_eagle(model, 7, draft_size=64, std=0.2).round_to_blocks()
    model.to(torch.bfloat16)
    native, reference = _pair(model, draft, treespec.Tree.from_choices(TREE))
    prompt = [4, 5, 6, 7, 8, 9]
    features = torch.randn(1, 5, len(draft.feature_layers) * 64).to(torch.bfloat16)
    for drafter in (native, reference):
        drafter.start(treespec.SequenceStart(prompt, 40, None, "sdpa", features))
    for root in (11, 3):
        roots = torch.tensor([root])
        got, want = native.propose(torch.zeros(1, 8), roots), reference.propose(torch.zeros(1, 8), roots)
        _assert_same_proposals(got, want)
        native.observe([[root, 2]], features[:, :2])
        reference.observe([[root, 2]], features[:, :2])


def test_native_layer_is_refused_where_it_cannot_run():
    model = tiny_model("llama", dtype=torch.float32)
    draft = random_eagle(model, 0).to(torch.bfloat16)
    tree = treespec.Tree.from_choices([[0]])
    with pytest.raises(ValueError, match="native EAGLE layer cannot run here.*bfloat16"):
        treespec.EagleDrafter(draft, tree, model, native=True)
    assert treespec.EagleDrafter(draft, tree, model).native is None  # default: the torch layer
    assert treespec.EagleDrafter(random_eagle(model, 0), tree, model, linears="torch").native is None


def test_native_layer_refuses_bad_calls_with_the_reason():
    model = tiny_model("llama", dtype=torch.float32)
    draft = random_eagle(model, 1, std=0.2)
    tree = treespec.Tree.from_choices(TREE)
    drafter = treespec.EagleDrafter(draft, tree, model, native=True)
    prompt = [3, 4, 5, 6]
    features = torch.randn(1, 3, len(draft.feature_layers) * model.config.hidden_size)
    drafter.start(treespec.SequenceStart(prompt, 12, None, "sdpa", features))
    layer, cache = drafter.native, drafter.cache
    rows, starts = torch.tensor([0]), torch.tensor([cache.lengths[0]])
    x, ids, positions = (
        torch.zeros(1, 2, model.config.hidden_size),
        torch.tensor([[1, 2]]),
        torch.tensor([[3, 3]]),
    )
    with pytest.raises(RuntimeError, match="bits must be int64"):  # rows for block positions 0..4 needed
        layer(x, ids, positions, cache, rows, starts, drafter.slot_bits[:2], block_offset=3)
    with pytest.raises(RuntimeError, match="writes up to"):  # past the cache's capacity
        layer(x, ids, positions, cache, rows, starts, drafter.slot_bits, block_offset=9)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        layer(
            x, torch.tensor([[1, 10**6]]), positions, cache, rows, starts, drafter.slot_bits, block_offset=0
        )
    with pytest.raises(RuntimeError, match="logit_rows must be"):  # token 2 of a call of 2
        layer(x, ids, positions, cache, rows, starts, drafter.slot_bits, 0, logit_rows=torch.tensor([2]))
    with pytest.raises(RuntimeError, match="EAGLE inputs must be"):
        layer(x[:, :1], ids, positions, cache, rows, starts, drafter.slot_bits, block_offset=0)


def test_native_layer_follows_weights_changed_between_sequences():
    """A drafter kept across sequences drafts with the draft layer's current weights (trained further,
    say): the native layer is rebuilt when a weight changed."""
    model = tiny_model("llama", dtype=torch.float32)
    draft = random_eagle(model, 6, std=0.2).round_to_blocks()  # the native layer reads copies: Q8_0 blocks
    tree = treespec.Tree.from_choices(TREE)
    native, reference = _pair(model, draft, tree)
    prompt = [3, 4, 5, 6, 7]
    features = torch.randn(1, 4, len(draft.feature_layers) * model.config.hidden_size)
    with torch.no_grad():
        draft.q_proj.weight.mul_(-1.5)  # K = 2H = 96: whole blocks
    draft.round_to_blocks()
    for drafter in (native, reference):
        drafter.start(treespec.SequenceStart(prompt, 40, None, "sdpa", features))
    roots = torch.tensor([9])
    _assert_same_proposals(
        native.propose(torch.zeros(1, 8), roots), reference.propose(torch.zeros(1, 8), roots)
    )
    memory = TargetRuntime.of(draft).memory_bytes()  # the layer's copies, counted in the drafter's runtime
    assert memory["native_step"] > 0 and memory["total"] >= memory["native_step"]
