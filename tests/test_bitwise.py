"""numerics="bitwise": every verified tree node gets the bits a one-token forward gives it (issue 31).

The row-invariant kernels (csrc/exact_*.cpp, the block kernel) are checked on fresh random inputs against
a reference and against themselves at other row counts; then whole tiny models (Llama, Qwen2, Mistral;
float32 and bfloat16): for random trees of 1-64 nodes over batches of 1-8 rows with different prompt
lengths, each node's logits must equal, bit for bit, the logits of plain one-token decoding of its path.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ARCHS, random_heads, tiny_model

import treespec
from treespec import ops
from treespec.core.attention import AttentionPlan
from treespec.core.blocks import BlockMatrix, recover_blocks, round_to_q8_0
from treespec.core.cache import TreeKVCache
from treespec.core.decoder import decoding_mode, full_forward, output_logits
from treespec.core.tree import pack_bits

pytestmark = pytest.mark.skipif(not ops.available("cpu"), reason="treespec's compiled CPU ops did not build")

DTYPES = [torch.float32, torch.bfloat16]


def _row_splits(rows: int, generator: random.Random) -> list[tuple[int, int]]:
    """Random (start, count) slices of `rows` rows: the same rows computed among other row counts."""
    out = [(0, rows), (0, 1), (rows - 1, 1)]
    for _ in range(12):
        count = generator.randint(1, rows)
        out.append((generator.randint(0, rows - count), count))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [8, 37, 64, 100, 576])
def test_exact_linear_is_row_invariant_and_correct(dtype, K):
    torch.manual_seed(K)
    w = torch.randn(70, K).to(dtype)
    x = torch.randn(23, K)
    full = torch.ops.treespec.exact_linear(x, w)  # [23, 70]
    reference = x.double() @ w.double().T
    assert (full.double() - reference).abs().max().item() < 1e-4 * K**0.5
    for start, count in _row_splits(23, random.Random(K)):
        part = torch.ops.treespec.exact_linear(x[start : start + count], w)
        assert torch.equal(part, full[start : start + count]), (start, count)


def test_block_linear_is_row_invariant():
    torch.manual_seed(1)
    matrix = BlockMatrix(recover_blocks(round_to_q8_0(torch.randn(96, 576))))
    x = torch.randn(41, 576)
    full = matrix(x)
    for start, count in _row_splits(41, random.Random(1)):
        assert torch.equal(matrix(x[start : start + count]), full[start : start + count]), (start, count)


def _random_parents(n: int, generator: random.Random) -> list[int]:
    return [-1] + [generator.randrange(i) for i in range(1, n)]


def _ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j], j = True, parents[j]
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (3, 3, 24)])
def test_exact_attention_node_equals_one_token_step(dtype, heads, kv_heads, head_dim):
    generator = random.Random(heads * head_dim)
    torch.manual_seed(heads * head_dim)
    # and long prefixes (a decoding step's, a prompt's block after one): hundreds of the prefix's 16-key
    # score chunks, then the keys after the last whole chunk and the block's own
    for n, c in [(1, 5), (2, 0), (5, 17), (16, 130), (70, 33), (16, 505), (1, 513), (9, 1020), (40, 1000)]:
        mask = _ancestors(_random_parents(n, generator))
        L = c + n
        k = torch.randn(1, kv_heads, L + 3, head_dim).to(dtype)[:, :, :L]  # a view of a larger cache
        v = torch.randn(1, kv_heads, L + 3, head_dim).to(dtype)[:, :, :L]
        q = torch.randn(1, heads, n, head_dim).to(dtype)
        out = torch.ops.treespec.tree_attention_exact(q, k, v, pack_bits(mask), 0.125)  # [1, n, H, D]
        reference = treespec.tree_attention_reference(q, k, v, mask, 0.125).transpose(1, 2)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out.float() - reference.float()).abs().max().item() < tolerance
        for i in range(n):
            path = [c + j for j in range(n) if mask[i, j]]  # the prefix, then i's path in depth order
            k1 = torch.cat([k[:, :, :c], k[:, :, path]], dim=2)
            v1 = torch.cat([v[:, :, :c], v[:, :, path]], dim=2)
            alone = torch.ops.treespec.tree_attention_exact(q[:, :, i : i + 1], k1, v1, None, 0.125)
            assert torch.equal(alone[0, 0], out[0, i]), (n, c, i)


def _prefill(model, cache: TreeKVCache, row: int, prompt: list[int]) -> None:
    cache.begin([row], len(prompt))
    ids = torch.tensor([prompt])
    positions = cache.positions(torch.arange(len(prompt)))
    full_forward(model, ids, positions, cache, cache.attention_plan(AttentionPlan("exact")))
    cache.commit_all()


def _plain_logits(model, prompt: list[int], path: list[int]) -> torch.Tensor:
    """Logits [V] after feeding `path` one token per forward to a one-row cache holding `prompt`."""
    cache = TreeKVCache.for_model(model, max_len=len(prompt) + len(path) + 1)
    _prefill(model, cache, 0, prompt)
    for token in path:
        cache.begin([0], 1)
        positions = cache.positions(torch.zeros(1, dtype=torch.long))
        hidden = full_forward(model, torch.tensor([[token]]), positions, cache, AttentionPlan("exact"))
        cache.commit_all()
    return output_logits(model, hidden)[0, -1]


def _tree_logits(model, prompts: list[list[int]], parents: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, N, V] of one verification forward of the tree (`parents`, tokens [B, N]) over every row."""
    mask = _ancestors(parents)
    depth = mask.sum(1) - 1  # [N]
    cache = TreeKVCache.for_model(
        model, max_len=max(map(len, prompts)) + len(parents), batch_size=len(prompts)
    )
    for row, prompt in enumerate(prompts):
        _prefill(model, cache, row, prompt)
    cache.begin(list(range(len(prompts))), len(parents))
    plan = AttentionPlan("exact", mask, pack_bits(mask)) if len(parents) > 1 else AttentionPlan("exact")
    hidden = full_forward(model, tokens, cache.positions(depth), cache, cache.attention_plan(plan))
    return output_logits(model, hidden)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_verified_logits_equal_one_token_decoding(arch, dtype):
    model = tiny_model(
        arch, dtype=dtype, seed=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    generator = random.Random(f"{arch}{dtype}")
    with torch.inference_mode(), decoding_mode(model, "exact"):
        for nodes, batch in [(1, 3), (2, 1), (7, 8), (16, 2), (64, 1), (33, 5)]:
            prompts = [
                [generator.randrange(96) for _ in range(generator.randint(1, 20))] for _ in range(batch)
            ]
            parents = _random_parents(nodes, generator)
            tokens = torch.randint(0, 96, (batch, nodes))
            logits = _tree_logits(model, prompts, parents, tokens)  # [B, N, V]
            mask = _ancestors(parents)
            for row in range(batch):
                for node in generator.sample(range(nodes), min(nodes, 6)):
                    path = tokens[row, mask[node]].tolist()  # root .. node, in depth order
                    alone = _plain_logits(model, prompts[row], path)
                    assert torch.equal(alone, logits[row, node]), (nodes, batch, row, node)


def _near_tied(model) -> None:
    """Make the second half of the vocabulary near copies of the first (each output row nudged by about one
    ulp), so greedy choices are near-ties: where kernels that sum in another order flip a choice."""
    with torch.no_grad():
        w = model.lm_head.weight  # [V, H]
        half = w.shape[0] // 2
        copy = w[:half].float()
        nudge = torch.nextafter(copy, torch.full_like(copy, float("inf")))
        if w.dtype == torch.bfloat16:  # one bf16 ulp up in one column per row
            nudge = (copy.view(torch.int32) + (1 << 16)).view(torch.float32)
        column = torch.zeros_like(copy, dtype=torch.bool)
        column[torch.arange(half), torch.randint(0, w.shape[1], (half,))] = True
        w[half:] = torch.where(column, nudge, copy).to(w.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_speculative_text_equals_plain_text(dtype):
    model = tiny_model(
        "llama", dtype=dtype, seed=5, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    _near_tied(model)
    speculative_text_equals_plain_text(model, "bitwise")


def speculative_text_equals_plain_text(model, numerics: str, kv_dtype: str = "model") -> None:
    """Heads, heads + lookup and suffix trees, alone and over a batch of 4, give the plain loop's text in
    these numerics (and K/V storage)."""
    generator = random.Random(7)
    prompts = [[generator.randrange(96) for _ in range(length)] for length in (3, 11, 6, 17)]
    options = treespec.DecodeOptions(numerics=numerics, kv_dtype=kv_dtype)
    plain = [r.token_ids for r in treespec.generate(model, prompts, None, max_new_tokens=24, options=options)]
    heads = random_heads(model, seed=1)
    with_lookup = treespec.TreePlanner([treespec.as_drafter(model, heads), treespec.PromptLookup(3)])
    drafters = [heads, with_lookup, treespec.SuffixDrafter()]
    for drafter in drafters:
        for batch in (prompts[:1], prompts):
            out = treespec.generate(model, batch, drafter, max_new_tokens=24, options=options)
            assert [r.token_ids for r in out] == plain[: len(batch)], type(drafter).__name__


def test_bitwise_refuses_what_it_cannot_keep():
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="compile=False"):
        treespec.Decoder(model, numerics="bitwise", compile=True)
    with pytest.raises(ValueError, match="leave kernel and linears"):
        treespec.Decoder(model, numerics="bitwise", kernel="sdpa")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        treespec.Decoder(tiny_model("llama"), numerics="bitwise")  # float64
    with pytest.raises(ValueError, match="unknown numerics"):
        treespec.Decoder(model, numerics="exactish")


def test_a_prefill_runs_the_fastest_linears():
    """A prompt's prefill is shared by plain and speculative decoding as it is: no row invariance needed."""
    from treespec.core.packed import PackedMatrix, packed_linears, shared_forward

    model = tiny_model("llama", dtype=torch.float32)
    linear = model.model.layers[0].mlp.up_proj
    x = torch.randn(40, linear.in_features)
    with torch.inference_mode(), packed_linears(model, mode="exact"):
        exact = linear(x)
        with shared_forward(model):
            shared = linear(x)
        fastest = PackedMatrix(linear.weight, "auto")(x)
    assert torch.equal(exact, torch.ops.treespec.exact_linear(x, linear.weight))
    assert torch.equal(shared, fastest)
