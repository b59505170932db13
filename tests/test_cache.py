"""TreeKVCache: after random accept patterns the committed cache equals sequential decoding's."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import treespec
from treespec.core.attention import tree_attention_enabled
from treespec.core.cache import CacheCapacityError, TreeKVCache
from treespec.core.pages import HUGE_PAGE, huge_page_copies, huge_page_zeros


def _forward(model, cache, ids, positions, tree_mask=None, kernel="sdpa"):
    return model.base_model(
        input_ids=torch.tensor([ids]),
        position_ids=torch.tensor([positions]),
        cache=cache,
        use_cache=True,
        tree_attention=treespec.AttentionPlan(kernel, tree_mask),
    ).last_hidden_state[0]


def _sequential_cache(model, tokens: list[int], max_len: int) -> TreeKVCache:
    """The cache that plain one-token-at-a-time decoding of `tokens` builds."""
    cache = TreeKVCache.for_model(model, max_len)
    with tree_attention_enabled(model), torch.inference_mode():
        for pos, tok in enumerate(tokens):
            _forward(model, cache, [tok], [pos])
            cache.commit_all()
    return cache


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_committed_cache_equals_sequential_decoding(data):
    model = tiny_model("llama", num_hidden_layers=2)
    vocab = model.config.vocab_size
    tree = treespec.default_tree(data.draw(st.sampled_from([8, 16, 32])), 4)
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12))
    cache = TreeKVCache.for_model(model, 256)
    committed = list(prompt)
    with tree_attention_enabled(model), torch.inference_mode():
        _forward(model, cache, prompt, list(range(len(prompt))))
        cache.commit_all()
        for _ in range(data.draw(st.integers(1, 5))):
            tokens = data.draw(
                st.lists(st.integers(0, vocab - 1), min_size=tree.num_nodes, max_size=tree.num_nodes)
            )
            c = cache.committed
            _forward(model, cache, tokens, (c + tree.depth).tolist(), tree.ancestor_mask)
            leaf = data.draw(st.integers(0, tree.num_nodes - 1))
            path = tree.path_to(leaf)  # a random accepted branch: root .. some node
            cache.commit(path)
            committed += [tokens[i] for i in path]
    assert cache.committed == len(committed)
    reference = _sequential_cache(model, committed, 256)
    for layer in range(len(cache.layers)):
        k, v = cache.committed_kv(layer)
        k_ref, v_ref = reference.committed_kv(layer)
        torch.testing.assert_close(k, k_ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(v, v_ref, rtol=1e-9, atol=1e-9)


def test_commit_copies_only_nodes_out_of_place():
    cache = TreeKVCache(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=1, max_len=16)
    keys = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    cache.update(keys, keys, 0)
    assert cache.pending == 6
    cache.commit([0, 1, 4])  # nodes 0 and 1 are in place, node 4 moves to slot 2
    k, _ = cache.committed_kv(0)
    assert k.flatten().tolist() == [0.0, 1.0, 4.0]
    assert cache.committed == 3 and cache.pending == 0


def test_rollback_and_capacity():
    cache = TreeKVCache(num_layers=2, batch_size=1, num_kv_heads=2, head_dim=4, max_len=8)
    kv = torch.randn(1, 2, 6, 4)
    for layer in range(2):
        cache.update(kv, kv, layer)
    cache.commit_all()
    cache.rollback(2)
    assert cache.get_seq_length() == 2
    with pytest.raises(ValueError, match="roll back"):
        cache.rollback(5)
    with pytest.raises(CacheCapacityError, match="larger max_len"):
        cache.update(torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4), 0)
    with pytest.raises(ValueError, match="outside the pending block"):
        cache.update(kv[:, :, :3], kv[:, :, :3], 0)
        cache.commit([0, 5])


def test_memory_report_splits_committed_and_speculative():
    model = tiny_model("llama", dtype=torch.float32)
    cache = TreeKVCache.for_model(model, 100, spec_reserve=32)
    per_token = (
        2 * model.config.num_hidden_layers * model.config.num_key_value_heads * 8 * 4
    )  # K+V, D=8, fp32
    assert cache.bytes_per_token() == per_token
    mem = cache.memory_bytes()
    assert mem == {
        "per_token": per_token,
        "committed": 0,
        "speculative": 32 * per_token,
        "allocated": 100 * per_token,
    }


def test_the_cache_goes_under_the_keyword_this_transformers_reads():
    """transformers before the `cache=` keyword takes `past_key_values=`; an unknown keyword vanishes into
    **kwargs and every forward would silently run without treespec's cache (seen on a GPU machine with
    transformers 5.17: sampled text went wrong). The keyword is read off the installed transformers."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel

    from treespec.core.cache import CACHE_KWARG

    for forward in (LlamaModel.forward, LlamaDecoderLayer.forward):
        assert CACHE_KWARG in inspect.signature(forward).parameters


def test_a_model_that_ignores_the_cache_is_refused(monkeypatch):
    """An HF forward that writes no K/V into the cache (the cache went under a keyword the model does not
    read) raises at the prefill instead of decoding from an empty cache. (The native step writes the cache
    itself, so the HF forward is asked for here: a short prompt would prefill through the native step.)"""
    import treespec.core.forward as forward_module
    from treespec.core.cache import CacheNotWrittenError

    model = tiny_model("llama", dtype=torch.float32)
    monkeypatch.setattr(forward_module, "CACHE_KWARG", "not_a_cache_keyword")
    hf_forward = treespec.DecodeOptions(step="hf")
    with pytest.raises(CacheNotWrittenError, match="did not write treespec's KV cache"):
        treespec.generate(model, [1, 2, 3], None, max_new_tokens=4, options=hf_forward)
    monkeypatch.undo()
    plain = treespec.generate(model, [1, 2, 3], None, max_new_tokens=4, eos_token_id=[])
    assert plain.token_ids == hf_greedy(model, [1, 2, 3], 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_layers_share_one_buffer_on_huge_pages(dtype):
    """The CPU cache's K/V (huge_page_zeros): zeroed, contiguous, of the asked shape and dtype, each on its
    own 64-byte-aligned bytes of one buffer that starts on a 2 MB boundary; writes stay in their tensor."""
    shape = (2, 3, 37, 8)
    tensors, buffer = huge_page_zeros(5, shape, dtype)
    assert tensors[0].data_ptr() % HUGE_PAGE == 0 and buffer.dtype == torch.uint8
    for t in tensors:
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
        assert not t.any()
    ends = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    assert all(a[1] <= b[0] for a, b in zip(ends[:-1], ends[1:], strict=True))  # in order, none overlapping
    tensors[2].fill_(1.0)
    assert not tensors[1].any() and not tensors[3].any()
    cache = TreeKVCache(4, 2, 3, 8, 37, dtype)
    keys = [layer.keys for layer in cache.layers]
    assert all(k.shape == shape and k.dtype == dtype and not k.any() for k in keys)
    assert len({k.data_ptr() for k in keys}) == 4
    # a spare large enough is carved again, zeroed (its old bytes gone); one too small is not used
    tensors[4].fill_(float("nan"))
    again, same = huge_page_zeros(5, shape, dtype, spare=buffer)
    assert same is buffer and [t.data_ptr() for t in again] == [t.data_ptr() for t in tensors]
    assert not any(t.any() for t in again)
    larger, other = huge_page_zeros(2, (2, 3, 37 * 400, 8), dtype, spare=buffer)  # beyond its 2 MB of slack
    assert other is not buffer and other.numel() > buffer.numel() and not any(t.any() for t in larger)


def test_released_cache_serves_the_next_cache_of_its_model():
    """`TreeKVCache.release` hands the CPU buffer to the model's runtime; the next `for_model` cache that fits
    reuses its pages, zeroed; a larger one allocates anew; the released cache refuses forwards; the runtime
    reports the kept buffer and `close` drops it; `generate` releases its cache (same tokens every call)."""
    model = tiny_model("llama", num_hidden_layers=2)
    runtime = treespec.TargetRuntime.of(model)
    first = TreeKVCache.for_model(model, 40)
    pointer = first.layers[0].keys.data_ptr()
    for layer in first.layers:
        layer.keys.fill_(float("nan"))
    first.release()
    assert first.released and runtime.memory_bytes()["kv_buffer"] > 0
    with pytest.raises(RuntimeError, match="released"):
        first.begin([0], 1)
    second = TreeKVCache.for_model(model, 24)
    assert second.layers[0].keys.data_ptr() == pointer and runtime.memory_bytes()["kv_buffer"] == 0
    assert not any(layer.keys.any() or layer.values.any() for layer in second.layers)
    assert _forward(model, second, [1, 2, 3], [0, 1, 2]).isfinite().all()
    second.release()
    third = TreeKVCache.for_model(model, 50_000)  # beyond the kept buffer and its 2 MB of slack: fresh memory
    assert third.layers[0].keys.data_ptr() != pointer
    third.release()
    assert runtime.memory_bytes()["kv_buffer"] >= third.max_len  # the larger buffer is the one kept
    outs = [treespec.generate(model, [1, 2, 3], None, max_new_tokens=6, eos_token_id=[]) for _ in range(3)]
    outs = [out.token_ids for out in outs]
    assert outs[0] == outs[1] == outs[2] == hf_greedy(model, [1, 2, 3], 6)
    assert runtime.memory_bytes()["kv_buffer"] > 0
    runtime.close()
    assert treespec.TargetRuntime.of(model).memory_bytes()["kv_buffer"] == 0
    # a buffer made under inference mode (as `generate` makes it) is not reused outside it
    with torch.inference_mode():
        TreeKVCache.for_model(model, 24).release()
    outside = TreeKVCache.for_model(model, 24)
    assert not outside.layers[0].keys.is_inference()
    outside.layers[0].keys.fill_(1.0)


def test_huge_page_copies_hold_the_same_values_side_by_side():
    gen = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(5, 7, generator=gen),
        torch.randint(-127, 128, (33,), generator=gen).to(torch.int8),
        torch.randn(3, 64, generator=gen).half(),
        torch.randn(10, generator=gen).t(),
    ]
    copies = huge_page_copies(tensors)
    assert copies[0].data_ptr() % HUGE_PAGE == 0  # the buffer starts on a 2 MB boundary
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
        assert c.data_ptr() % 64 == 0 and c.data_ptr() != t.data_ptr()
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends[:-1], copies[1:], strict=True))  # no overlap
