"""The compiled ops (csrc/, treespec.ops) against the torch references, on fresh random inputs.

- tree attention == `tree_attention_reference` within dtype tolerance: random trees (and causal
  chains), GQA ratios 1/3/4, head dims 64/128, prefixes 0-2000, batch 1-3, fp32 and bf16, K/V read as
  strided views of a larger cache-like buffer, q as the transposed view transformers passes; both CPU
  engines (AMX and FMA) where the machine has AMX; outputs poisoned with NaN before each call;
- the fused KV commit == `TreeKVCache.commit`'s torch reference, bit for bit;
- greedy `treespec.generate` with `DecodeOptions(kernel="compiled")` == "reference" on a tiny random Llama;
- the fake kernels (torch.compile), the CUDA file compiling with nvcc and its torch binding parsing
  against torch's headers (the CUDA op itself: test_cuda.py).

The first run builds the extension (about 30 s here; cached in $TREESPEC_CACHE/ext afterwards).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from conftest import (
    attention_inputs,
    bad_op_calls,
    check_tree_attention,
    filled_cache_pair,
    random_heads,
    random_tree_mask,
    tiny_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils import cpp_extension

import treespec
from treespec import ops
from treespec.core.attention import tree_attention_compiled, tree_attention_sdpa
from treespec.core.tree import pack_bits

CSRC = Path(__file__).resolve().parents[1] / "csrc"


@pytest.fixture(scope="module", autouse=True)
def built():
    if not ops.load():
        pytest.skip(f"the compiled extension is not available: {ops.build_info()['error']}")


prefixes = st.one_of(st.integers(0, 130), st.integers(0, 130), st.integers(0, 130), st.integers(131, 2000))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([64, 128]),
    prefix=prefixes,
    n=st.integers(1, 64),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    causal=st.booleans(),
    engine=st.sampled_from(["amx", "fma"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_tree_attention_matches_reference(
    batch, kv_heads, group, head_dim, prefix, n, dtype, causal, engine, seed
):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = attention_inputs(batch, kv_heads, group, head_dim, prefix, n, dtype, gen)
    mask = None if causal else random_tree_mask(n, gen)
    check_tree_attention(q, k, v, mask, head_dim**-0.5, engine)


@pytest.mark.parametrize("engine", ["amx", "fma"])
@pytest.mark.parametrize(
    "case",
    [
        # (batch, kv_heads, group, head_dim, prefix, n, tree)
        (1, 3, 3, 64, 1900, 1, False),  # decode: long prefix split across threads, merged
        (1, 1, 8, 64, 700, 1, False),  # decode, 8 heads per KV head
        (2, 2, 4, 128, 300, 100, False),  # chunked prefill: causal over two ancestor words
        (1, 2, 3, 64, 50, 130, True),  # a tree of 130 nodes: three words per row
        (1, 1, 1, 64, 0, 64, True),  # no prefix at all
        (1, 2, 2, 96, 80, 20, True),  # head_dim 96
        (1, 2, 2, 8, 33, 9, True),  # head_dim 8 (the tiny test models)
        (1, 1, 96, 64, 10, 5, True),  # 96 heads per KV head: query tiles of 2 tokens
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_edge_shapes(case, engine, dtype):
    batch, kv_heads, group, head_dim, prefix, n, tree = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    q, k, v = attention_inputs(batch, kv_heads, group, head_dim, prefix, n, dtype, gen)
    mask = random_tree_mask(n, gen) if tree else None
    check_tree_attention(q, k, v, mask, 0.3, engine)


def test_tree_attention_uses_all_threads_and_one():
    gen = torch.Generator().manual_seed(3)
    q, k, v = attention_inputs(1, 3, 3, 64, 1500, 16, torch.float32, gen)
    mask = random_tree_mask(16, gen)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads, 4}):
            torch.set_num_threads(t)
            check_tree_attention(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(threads)


def test_ops_reject_bad_inputs():
    """In this process, on the CPU; test_cuda.py runs the same calls in a subprocess on the test device."""
    for _what, message, call in bad_op_calls("cpu"):
        with pytest.raises(RuntimeError, match=message):
            call()


def test_fake_kernels_trace():
    """The ops carry fake kernels: FakeTensor / torch.compile tracing sees shapes without running them."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = attention_inputs(1, 2, 3, 64, 20, 5, torch.float32, gen)
    bits = pack_bits(random_tree_mask(5, gen))
    torch.library.opcheck(
        torch.ops.treespec.tree_attention.default,
        (q, k, v, bits, 0.125),
        test_utils=("test_schema", "test_faketensor"),
    )
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv, fb = (mode.from_tensor(t) for t in (q, k, v, bits))
        out = torch.ops.treespec.tree_attention(fq, fk, fv, fb, 0.125)
        assert out.shape == (1, 5, 6, 64)
        torch.ops.treespec.commit_kv(
            [fk.clone()],
            [fv.clone()],
            mode.from_tensor(torch.tensor([1])),
            mode.from_tensor(torch.tensor([0])),
        )


@contextlib.contextmanager
def _fresh_loader_state():
    """Let a test re-run ops.load's decision; the loaded library itself stays loaded."""
    saved = dict(ops._state)
    ops._state.update(tried=False, ok=False, error=None)
    try:
        yield
    finally:
        ops._state.clear()
        ops._state.update(saved)


def test_failed_build_falls_back_with_one_warning(monkeypatch):
    def broken_build():
        raise RuntimeError("error: no C++ compiler here")

    monkeypatch.setattr(ops, "_build_and_load", broken_build)
    gen = torch.Generator().manual_seed(2)
    q, k, v = attention_inputs(1, 2, 3, 64, 30, 8, torch.float32, gen)
    mask = random_tree_mask(8, gen)
    model = tiny_model("llama", dtype=torch.float32)
    with _fresh_loader_state(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not ops.available() and not ops.available()
        got = tree_attention_compiled(q, k, v, mask, 0.125)
        tree_attention_compiled(q, k, v, mask, 0.125)
        res = treespec.generate(model, [1, 2, 3], random_heads(model), max_new_tokens=6, eos_token_id=[])
    messages = [str(w.message) for w in caught if "treespec" in str(w.message)]
    assert len(messages) == 1, messages
    assert "could not be built" in messages[0] and "no C++ compiler here" in messages[0]
    torch.testing.assert_close(got, tree_attention_sdpa(q, k, v, mask, 0.125))
    assert len(res.token_ids) == 6


def test_no_ext_env_disables_silently(monkeypatch):
    monkeypatch.setenv("TREESPEC_NO_EXT", "1")
    with _fresh_loader_state(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not ops.available()
        assert ops.build_info()["error"] == "disabled by TREESPEC_NO_EXT"
    assert not [w for w in caught if "treespec" in str(w.message)]


# ---- fused commit ----------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    num_layers=st.integers(1, 5),
    tree_size=st.sampled_from([8, 16, 32, 64]),
    steps=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    data=st.data(),
)
def test_fused_commit_equals_reference(num_layers, tree_size, steps, dtype, data):
    tree = treespec.default_tree(tree_size, 4)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    fused, ref = filled_cache_pair(num_layers, 2, 3, 16, 512, dtype, gen)
    starts = [data.draw(st.integers(0, 100)) for _ in range(2)]  # each row its own committed length
    fused.lengths, ref.lengths = list(starts), list(starts)
    for _ in range(steps):
        rows = data.draw(st.sampled_from([[0, 1], [1, 0], [0], [1]]))  # a forward over some rows
        for cache in (fused, ref):
            cache.begin(rows, tree.num_nodes)  # a forward wrote each row's tree block
        paths = [tree.path_to(data.draw(st.integers(0, tree.num_nodes - 1))) for _ in rows]
        fused.commit(paths)
        ref.commit(paths)
        assert fused.lengths == ref.lengths
    for a, b in zip(fused.layers, ref.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_commit_kv_moves_in_order():
    """Moves apply in order: a move may read a slot an earlier move wrote (documented semantics)."""
    keys = [torch.arange(8.0).view(1, 1, 8, 1).repeat(1, 2, 1, 4) for _ in range(2)]
    values = [k.clone() * 10 for k in keys]
    ops.commit_kv(keys, values, [3, 1], [1, 5])  # slot 1 <- 3, then slot 5 <- slot 1 (now 3)
    for k in keys:
        assert k[0, 0, :, 0].tolist() == [0, 3, 2, 3, 4, 3, 6, 7]
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.commit_kv(keys, values, [9], [0])
    with pytest.raises(RuntimeError, match="shape, strides"):
        ops.commit_kv(keys, [values[0], values[1][:, :1]], [1], [0])


# ---- end to end ------------------------------------------------------------------------------------


def test_generate_compiled_equals_reference():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    prompt = torch.randint(
        0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(11)
    ).tolist()
    tree = treespec.default_tree(64, 4)
    kw = dict(max_new_tokens=32, eos_token_id=[])

    def speculative(**options):
        drafter = treespec.as_drafter(model, heads, tree)
        return treespec.generate(model, prompt, drafter, options=treespec.DecodeOptions(**options), **kw)

    ref = speculative(kernel="reference")
    assert speculative(kernel="compiled").token_ids == ref.token_ids
    assert speculative().token_ids == ref.token_ids  # "auto" picks "compiled"
    kw = dict(max_new_tokens=16, eos_token_id=[])
    compiled, reference = (treespec.DecodeOptions(kernel=k) for k in ("compiled", "reference"))
    base = treespec.generate_baseline(model, prompt, options=compiled, **kw)  # n = 1 decoding through the op
    assert base.token_ids == treespec.generate_baseline(model, prompt, options=reference, **kw).token_ids


def test_generate_with_head_dim_64_bf16_runs_the_kernel():
    """A bf16 model whose head_dim takes the AMX path; checks the dispatch, not greedy equality (bf16)."""
    model = tiny_model(
        "qwen2", dtype=torch.bfloat16, hidden_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    heads = random_heads(model)
    res = treespec.generate(
        model,
        [1, 2, 3, 4, 5],
        heads,
        max_new_tokens=12,
        eos_token_id=[],
        options=treespec.DecodeOptions(kernel="compiled"),
    )
    assert len(res.token_ids) == 12


# ---- CUDA ------------------------------------------------------------------------------------------


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).is_file()), None)


def test_cuda_source_compiles_with_nvcc(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not on this machine")
    cmd = [
        nvcc,
        "-c",
        "-arch=sm_90",
        "-std=c++17",
        "-O0",
        "-Xptxas",
        "-O1",
        f"-I{CSRC}",
        str(CSRC / "tree_attention_cuda.cu"),
        "-o",
        str(tmp_path / "tree_attention_cuda.o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_cuda_binding_compiles_against_torchs_headers(tmp_path):
    """bindings_cuda.cpp (the torch side of the CUDA op) parses with the host compiler: torch's headers, the
    CUDA toolkit's, and a stand-in for the one generated header a CPU build of torch does not ship."""
    nvcc, compiler = _nvcc(), shutil.which("c++") or shutil.which("g++")
    if nvcc is None or compiler is None:
        pytest.skip("nvcc (for the CUDA headers) or a C++ compiler is not on this machine")
    homes = [cpp_extension.CUDA_HOME, Path(nvcc).resolve().parent.parent, "/usr/local/cuda"]
    found = [Path(h) / "include" for h in homes if h]
    found = [folder for folder in found if (folder / "cuda_runtime_api.h").is_file()]
    if not found:
        pytest.skip(f"no CUDA include folder (cuda_runtime_api.h) under {homes}")
    stand_in = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stand_in.parent.mkdir(parents=True)
    stand_in.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [CSRC, *cpp_extension.include_paths(), found[0], tmp_path]  # torch's own header first
    cmd = [compiler, "-std=c++17", "-fsyntax-only", "-w", "-DTREESPEC_WITH_CUDA"]
    cmd += [f"-I{path}" for path in includes] + [str(CSRC / "bindings_cuda.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_killed_build_does_not_block_the_next(tmp_path):
    """A build killed mid-way leaves torch's `lock` file: the next build waits for a live builder only,
    then removes the dead one's file instead of waiting on it forever."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from treespec import ops\n"
            "with ops._exclusive_build(Path(sys.argv[1])):\n"
            "    (Path(sys.argv[1]) / 'lock').touch(); print('building', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "building"
        entered, seen = threading.Event(), []

        def next_build():
            with ops._exclusive_build(tmp_path):
                seen.append((tmp_path / "lock").exists())
                entered.set()

        waiter = threading.Thread(target=next_build)
        waiter.start()
        assert not entered.wait(1.0), "entered while a live build held the folder"
        assert (tmp_path / "lock").exists()  # a live builder's file is left alone
        holder.kill()  # the build dies without removing its lock file
        assert entered.wait(30.0), "still waiting after the builder died"
        waiter.join()
        assert seen == [False]
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_torch_max_indices(dtype):
    """ops.argmax_rows (greedy acceptance's argmax) gives x.max(dim=-1).indices on fresh random rows:
    ties (small integer values), NaN (a row's first NaN wins), +-inf, rows of every length around the
    kernel's 8- and 32-value rounds, views with strides, and more than one leading dimension."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    for trial in range(400):
        V = int(torch.randint(1, 150, (), generator=gen))
        x = torch.randint(-4, 5, (int(torch.randint(1, 6, (), generator=gen)), V), generator=gen).float()
        if trial % 3 == 0:
            x[torch.rand(x.shape, generator=gen) < 0.03] = float("nan")
        if trial % 4 == 0:
            x[torch.rand(x.shape, generator=gen) < 0.1] = float("inf")
        if trial % 7 == 0:
            x.fill_(float("-inf"))
        x = x.to(dtype)
        for view in (x, x[:, ::2], x.view(1, *x.shape)):
            assert torch.equal(ops.argmax_rows(view), view.max(dim=-1).indices), (trial, view)
    vocab = torch.randn(3, 49152, generator=gen).to(dtype)
    assert torch.equal(ops.argmax_rows(vocab), vocab.max(dim=-1).indices)
