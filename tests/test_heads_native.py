"""The native heads (drafters/heads_native.py, csrc/native_heads.cpp) against the torch heads they replace."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_heads, tiny_model

import treespec
from treespec import ops
from treespec.core.blocks import round_to_q8_0
from treespec.core.drafting import SequenceStart
from treespec.core.native import q8_blocks
from treespec.core.runtime import TargetRuntime
from treespec.drafters.heads_native import int8_reference, level_plan
from treespec.drafters.medusa import SequentialDrafter

pytestmark = pytest.mark.skipif(not ops.available("cpu"), reason="treespec's CPU ops did not build")

SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


def _setup(
    seed: int,
    draft_vocab: int | None,
    layers: int,
    blocks: bool,
    bf16_heads_values: bool,
    sequential: bool = True,
):
    model = tiny_model("llama", dtype=torch.float32, seed=seed, **SHAPE)
    if blocks:  # the output rows as exact Q8_0 blocks, as the default model's tied lm_head has them
        with torch.no_grad():
            model.lm_head.weight.copy_(round_to_q8_0(model.lm_head.weight))
    vocab = None
    if draft_vocab:
        vocab = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))[
            :draft_vocab
        ]
    # small weights: a softmax far from saturation, so no two candidates tie at probability 0 (where the
    # torch top-k, which ranks probabilities, may order them either way)
    heads = random_heads(
        model, num_heads=4, seed=seed, std=0.05, sequential=sequential, draft_vocab=vocab, num_layers=layers
    )
    if bf16_heads_values:  # a bf16 checkpoint loaded in float32: the native heads read bf16 copies
        with torch.no_grad():
            for p in heads.parameters():
                if p.is_floating_point():
                    p.copy_(p.bfloat16().float())
    return model, heads


@pytest.mark.parametrize("draft_vocab", [None, 40])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("blocks,bf16_values", [(False, False), (True, True)])
def test_native_heads_draft_what_the_torch_heads_draft(draft_vocab, layers, blocks, bf16_values):
    model, heads = _setup(3 + layers, draft_vocab, layers, blocks, bf16_values)
    tree = treespec.default_tree(16, 4)
    args = (heads, tree, model.get_output_embeddings(), model.get_input_embeddings())
    native = SequentialDrafter(*args, native=True, int8=False)  # float: the torch path's numerics
    reference = SequentialDrafter(*args, native=False)
    assert native.native is not None and reference.native is None
    if blocks:
        assert native.output.blocks is not None  # the output rows were read as their Q8_0 blocks
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for trial in range(12):
            B = 1 + trial % 3
            hidden = torch.randn(B, SHAPE["hidden_size"], generator=gen) * 2  # fresh inputs each trial
            roots = torch.randint(0, model.config.vocab_size, (B,), generator=gen)
            for depth in (None, 0, 1, 2, 3):
                got, want = native.propose(hidden, roots, depth), reference.propose(hidden, roots, depth)
                assert torch.equal(got.tokens, want.tokens), (trial, depth)
                torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-6)


def test_native_heads_read_a_bf16_embedding_exactly():
    model, heads = _setup(5, None, 1, False, False)
    tree = treespec.default_tree(12, 4)
    embedding = model.get_input_embeddings().weight.detach().bfloat16()  # a bf16 target's table
    args = (heads, tree, model.get_output_embeddings(), embedding)
    native = SequentialDrafter(*args, native=True, int8=False)  # float: the torch path's numerics
    reference = SequentialDrafter(*args, native=False)
    hidden, roots = torch.randn(2, SHAPE["hidden_size"]), torch.tensor([3, 17])
    with torch.no_grad():
        got, want = native.propose(hidden, roots), reference.propose(hidden, roots)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-6)


def test_generation_with_native_heads_equals_greedy_decoding():
    model, heads = _setup(9, 40, 2, True, True)
    drafter = treespec.make_drafter(heads, treespec.default_tree(16, 4), model)
    assert drafter.native is not None  # the default: native where it can
    for prompt in ([5, 9, 2], [11, 4, 8, 1, 30]):
        result = treespec.generate(model, prompt, drafter, max_new_tokens=16, eos_token_id=[])
        assert result.token_ids == hf_greedy(model, prompt, 16)


def test_native_heads_refuse_what_they_cannot_draft():
    model = tiny_model("llama", dtype=torch.float32, **SHAPE)
    own = treespec.MedusaHeads.for_model(model, num_heads=4, own_lm_head=True, sequential=True)
    with pytest.raises(ValueError, match="their own output layers"):
        treespec.drafters.heads_native.NativeHeads(
            own, model.lm_head.weight, None, model.get_input_embeddings().weight
        )
    heads = random_heads(model, sequential=True).double()
    args = (heads, treespec.default_tree(8, 4), model.get_output_embeddings(), model.get_input_embeddings())
    with pytest.raises(ValueError, match="native=True, but .*float64 heads"):
        SequentialDrafter(*args, native=True)
    assert SequentialDrafter(*args).native is None  # native=None: the torch path, no error


def test_native_heads_check_their_inputs():
    model, heads = _setup(2, None, 1, False, False)
    drafter = SequentialDrafter(
        heads, treespec.default_tree(8, 4), model.get_output_embeddings(), model.get_input_embeddings()
    )
    hidden = torch.randn(1, SHAPE["hidden_size"])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        drafter.native(hidden, torch.tensor([model.config.vocab_size]), drafter.plan)
    with pytest.raises(RuntimeError, match="roots for"):
        drafter.native(hidden, torch.tensor([1, 2]), drafter.plan)
    bad = drafter.plan.clone()
    bad[5] = 99  # an expanded node outside the tree
    with pytest.raises(RuntimeError, match="outside the tree"):
        drafter.native(hidden, torch.tensor([1]), bad)
    with pytest.raises(RuntimeError, match="ends early"):
        drafter.native(hidden, torch.tensor([1]), drafter.plan[:4])


def test_native_heads_live_in_the_heads_runtime_and_follow_new_weights():
    model, heads = _setup(4, None, 1, False, True)
    tree = treespec.default_tree(8, 4)
    args = (heads, tree, model.get_output_embeddings(), model.get_input_embeddings())
    a, b = SequentialDrafter(*args, int8=False), SequentialDrafter(*args, int8=False)
    assert a.native is b.native  # built once per heads and weights
    runtime = TargetRuntime.of(heads)
    assert runtime.memory_bytes()["native_step"] > 0  # the bf16 copies of the heads' weights
    hidden, roots = torch.randn(1, SHAPE["hidden_size"]), torch.tensor([4])
    with torch.no_grad():
        for p in heads.parameters():
            if p.is_floating_point():
                p.mul_(-1.0)  # trained in between: new weights
        a.start(SequenceStart(tokens=[1, 4], capacity=32, cache=None, kernel="exact"))
        fresh = SequentialDrafter(*args, native=False).propose(hidden, roots)
        got = a.propose(hidden, roots)
    assert a.native is not b.native
    assert torch.equal(got.tokens, fresh.tokens)


def test_level_plan_flattens_the_tree_levels():
    tree = treespec.Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    plan = level_plan(tree).tolist()
    assert plan[:2] == [tree.num_nodes, tree.max_depth]
    # level 0: the root expanded into ranks 0 and 1
    assert plan[2:5] == [1, 2, 2] and plan[5:7] == [0, 0]


@pytest.mark.parametrize("draft_vocab", [None, 40])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("blocks", [False, True])
def test_int8_native_heads_draft_what_their_reference_drafts(draft_vocab, layers, blocks):
    model, heads = _setup(11 + layers, draft_vocab, layers, blocks, False)
    tree = treespec.default_tree(16, 4)
    args = (heads, tree, model.get_output_embeddings(), model.get_input_embeddings())
    native = SequentialDrafter(*args, native=True, int8=True)
    assert native.native.int8
    output = native.output.blocks.blocks if native.output.blocks is not None else None
    assert (output is not None) == blocks
    embedding = model.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for trial in range(8):
            B = 1 + trial % 3
            hidden = torch.randn(B, SHAPE["hidden_size"], generator=gen) * 2
            roots = torch.randint(0, model.config.vocab_size, (B,), generator=gen)
            for depth in (None, 1, 2):
                got = native.propose(hidden, roots, depth)
                tokens, probs = int8_reference(
                    heads, tree, native.weight, output, embedding, hidden, roots, depth
                )
                assert torch.equal(got.tokens, tokens), (trial, depth)
                torch.testing.assert_close(got.probs, probs, rtol=1e-3, atol=1e-6)


def test_int8_heads_stay_close_to_the_float_heads():
    """int8 drafting quantizes what the float heads compute: the same top guesses nearly everywhere."""
    model, heads = _setup(21, None, 2, True, True)
    tree = treespec.default_tree(16, 4)
    args = (heads, tree, model.get_output_embeddings(), model.get_input_embeddings())
    int8, reference = SequentialDrafter(*args, int8=True), SequentialDrafter(*args, native=False)
    hidden = torch.randn(32, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(4))
    roots = torch.arange(32) % model.config.vocab_size
    with torch.no_grad():
        got, want = int8.propose(hidden, roots, 1), reference.propose(hidden, roots, 1)
    first = [i for i, d in enumerate(tree.depth.tolist()) if d == 1]  # the root's children
    agree = (got.tokens[:, first] == want.tokens[:, first]).float().mean().item()
    assert agree > 0.9, agree
    torch.testing.assert_close(got.probs[:, first], want.probs[:, first], atol=0.02, rtol=0.1)


def test_heads_of_partial_blocks_draft_in_float():
    model = tiny_model(
        "llama", dtype=torch.float32, hidden_size=48, num_attention_heads=4, num_key_value_heads=2
    )
    heads = random_heads(model, sequential=True, std=0.05)
    args = (heads, treespec.default_tree(8, 4), model.get_output_embeddings(), model.get_input_embeddings())
    assert SequentialDrafter(*args).native.int8 is False  # the default: float, where int8 cannot quantize
    with pytest.raises(ValueError, match="hidden size 48 in int8"):
        SequentialDrafter(*args, native=True, int8=True)


def _int8_head_topk_reference(heads, weight, blocks, hidden, count, k):
    """What NativeHeads.head_topk computes in int8, in Python over the int8 kernels' scalar engine."""

    def linear(x, w, bias, found=None):
        q, d, m = (*q8_blocks(w), None) if found is None else (found.q, found.d.half(), None)
        return torch.ops.treespec.int8_linear(x.float().contiguous(), q, d, m, bias, 1)

    tokens, probs = [], []
    for h in range(count):
        u = hidden.float()
        for block in heads.blocks[h]:
            u = u + torch.nn.functional.silu(linear(u, block.linear.weight, block.linear.bias.float()))
        top = linear(u, weight, None, blocks).softmax(dim=-1).topk(k, dim=-1)  # [B, k]
        tokens.append(heads.token_ids(top.indices))
        probs.append(top.values)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)  # [B, count, k]


@pytest.mark.parametrize("draft_vocab", [None, 40])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("blocks", [False, True])
def test_independent_native_heads_draft_what_their_references_draft(draft_vocab, layers, blocks):
    model, heads = _setup(layers, draft_vocab, layers, blocks, False, sequential=False)
    tree = treespec.default_tree(16, 4)
    float_native = treespec.drafters.medusa.MedusaDrafter(heads, tree, model.lm_head, native=True, int8=False)
    int8_native = treespec.drafters.medusa.MedusaDrafter(heads, tree, model.lm_head, native=True, int8=True)
    reference = treespec.drafters.medusa.MedusaDrafter(heads, tree, model.lm_head, native=False)
    output = reference.output.blocks.blocks if reference.output.blocks is not None else None
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for trial in range(8):
            B = 1 + trial % 3
            hidden = torch.randn(B, SHAPE["hidden_size"], generator=gen) * 2
            roots = torch.randint(0, model.config.vocab_size, (B,), generator=gen)
            for depth in (None, 0, 1, 3):
                got, want = (
                    float_native.propose(hidden, roots, depth),
                    reference.propose(hidden, roots, depth),
                )
                assert torch.equal(got.tokens, want.tokens), (trial, depth)
                torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-6)
            count = 1 + trial % 4
            tokens, probs = int8_native.native.head_topk(hidden, count, 3)
            want_tokens, want_probs = _int8_head_topk_reference(
                heads, reference.weight, output, hidden, count, 3
            )
            assert torch.equal(tokens, want_tokens), trial
            torch.testing.assert_close(probs, want_probs, rtol=1e-3, atol=1e-6)


def test_generation_with_independent_native_heads_equals_greedy_decoding():
    model = tiny_model("llama", dtype=torch.float32, seed=2, **SHAPE)
    heads = random_heads(model, num_heads=4, seed=2, std=0.05)
    drafter = treespec.make_drafter(heads, treespec.default_tree(16, 4), model)
    assert drafter.native is not None
    result = treespec.generate(model, [3, 8, 1, 5], drafter, max_new_tokens=16, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, [3, 8, 1, 5], 16)
