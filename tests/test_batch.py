"""A batch of sequences: each row's output equals its own single-sequence output; rows never disturb each
other; the batched cache and the per-row attention against their single-row references."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ARCHS,
    hf_greedy,
    random_eagle,
    random_heads,
    second_token_counts,
    second_token_marginals,
    tiny_model,
    total_variation,
)

import treespec
from treespec import ops
from treespec.core.attention import AttentionPlan, tree_attention_reference, treespec_attention
from treespec.core.cache import CacheCapacityError, TreeKVCache
from treespec.core.decoder import Decoder
from treespec.core.drafting import SequenceStart
from treespec.core.pricing import StepPricer


def _prompts(model, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _drafters(model):
    """(name, make) of every drafter that batches: plain decoding, independent heads with and without a
    lookup branch, sequential heads, the EAGLE-style drafter (each made fresh: lookup keeps state)."""
    heads, sequential = random_heads(model), random_heads(model, sequential=True, seed=1)
    tree = treespec.default_tree(16, 4)
    eagle = random_eagle(model, seed=2, draft_size=40)
    return [
        ("plain", lambda: None),
        ("heads", lambda: treespec.make_drafter(heads, tree, model)),
        (
            "heads+lookup",
            lambda: treespec.TreePlanner(
                [treespec.make_drafter(heads, tree, model), treespec.PromptLookup(3)]
            ),
        ),
        ("lookup", lambda: treespec.TreePlanner([treespec.PromptLookup(4)])),
        ("sequential", lambda: treespec.make_drafter(sequential, tree, model)),
        ("eagle", lambda: treespec.EagleDrafter(eagle, EAGLE_TREE, model)),
    ]


EAGLE_TREE = treespec.Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def test_batched_eagle_drafts_what_each_row_drafts_alone():
    """The EAGLE drafter's batched catch-up and drafting (rows at different lengths, accepting different
    counts, one leaving the batch) propose exactly what each row's drafter proposes alone."""
    model = tiny_model("llama", dtype=torch.float32)
    draft = random_eagle(model, seed=5, draft_size=40, std=0.2)
    prompts = _prompts(model, [5, 61, 12], seed=21)
    batch = Decoder(model, treespec.EagleDrafter(draft, EAGLE_TREE, model))
    batch.prefill(prompts, max_new_tokens=40)
    singles = [Decoder(model, treespec.EagleDrafter(draft, EAGLE_TREE, model)) for _ in prompts]
    for single, prompt in zip(singles, prompts, strict=True):
        single.prefill(prompt, max_new_tokens=40)
    live = [0, 1, 2]
    for step in range(6):
        if step == 3:
            batch.drop_rows([1])
            live = [0, 2]
        proposal = batch.drafter.propose(batch.hidden, batch.roots)  # [A, N]
        for a, row in enumerate(live):
            alone = singles[row].drafter.propose(singles[row].hidden, singles[row].roots)
            assert proposal.tokens[a].tolist() == alone.tokens[0].tolist()
            torch.testing.assert_close(proposal.probs[a], alone.probs[0], atol=1e-5, rtol=1e-4)
        result = batch.step()
        for row, path in zip(result.rows, result.paths, strict=True):
            assert path == singles[row].step().paths[0]


def test_batched_eagle_catch_up_with_rows_committing_different_counts():
    """observe() with ragged rows (padded features): each row's next proposal equals its drafter alone."""
    model = tiny_model("llama", dtype=torch.float32)
    draft = random_eagle(model, seed=6, draft_size=40, std=0.2)
    F = len(draft.feature_layers) * model.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    prompts = _prompts(model, [4, 30, 9], seed=22)
    batch = treespec.EagleDrafter(draft, EAGLE_TREE, model)
    singles = [treespec.EagleDrafter(draft, EAGLE_TREE, model) for _ in prompts]
    for row, prompt in enumerate(prompts):
        features = torch.randn(1, len(prompt) - 1, F, generator=gen)
        batch.start(SequenceStart(prompt, 64, None, "sdpa", features, row, len(prompts)))
        singles[row].start(SequenceStart(prompt, 64, None, "sdpa", features))
    for committed in ([[7], [3, 4, 5], [8, 9]], [[1, 2, 3, 4], [6], [2]]):
        longest = max(len(c) for c in committed)
        features = torch.randn(len(committed), longest, F, generator=gen)  # the padding is noise too
        batch.observe(committed, features)
        for row, tokens in enumerate(committed):
            singles[row].observe([tokens], features[row : row + 1, : len(tokens)])
        roots = torch.tensor([5, 6, 7])
        proposal = batch.propose(torch.zeros(3, 1), roots)
        for row, single in enumerate(singles):
            alone = single.propose(torch.zeros(1, 1), roots[row : row + 1])
            assert proposal.tokens[row].tolist() == alone.tokens[0].tolist()
            torch.testing.assert_close(proposal.probs[row], alone.probs[0], atol=1e-5, rtol=1e-4)
    assert batch.cache.lengths == [3 + 1 + 4, 29 + 3 + 1, 8 + 2 + 1]  # prompt - 1, then each commit


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
def test_each_row_equals_its_single_sequence_output(batch):
    """Greedy, float32, random drafters: every row equals the same prompt decoded alone (and HF greedy)."""
    model = tiny_model("llama", dtype=torch.float32)
    lengths = [3 + 11 * i for i in range(batch)]
    if batch > 2:
        lengths[1] = 300  # rows hundreds of tokens apart
    prompts = _prompts(model, lengths, seed=batch)
    for name, make in _drafters(model):
        singles = [
            treespec.generate(model, p, make(), max_new_tokens=24, eos_token_id=[]).token_ids for p in prompts
        ]
        results = treespec.generate(model, prompts, make(), max_new_tokens=24, eos_token_id=[])
        assert [r.token_ids for r in results] == singles, name
        assert [r.prompt_ids for r in results] == prompts
        assert all(r.stats.new_tokens == 24 and r.stats.steps >= 1 for r in results)
    assert singles[0] == hf_greedy(model, prompts[0], 24)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("kernel", ["reference", "sdpa", "compiled"])
def test_batches_on_every_architecture_and_kernel(arch, kernel):
    model = tiny_model(arch, dtype=torch.float32)
    heads = random_heads(model)
    prompts = _prompts(model, [4, 40, 9, 17], seed=3)
    results = treespec.generate(
        model,
        prompts,
        heads,
        max_new_tokens=20,
        eos_token_id=[],
        options=treespec.DecodeOptions(kernel=kernel),
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(model, prompt, 20), (arch, kernel)


def test_heads_that_match_the_model_accept_deep_in_every_row():
    """Identity heads on a model that repeats itself: speculation works row by row (not just plain steps)."""
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model, std=0.0)
    prompts = [[3] * 6, [5] * 9, [3] * 12]
    results = treespec.generate(
        model,
        prompts,
        heads,
        max_new_tokens=30,
        eos_token_id=[],
        options=treespec.DecodeOptions(plain_above=None),
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(model, prompt, 30)
        single = treespec.generate(model, prompt, heads, max_new_tokens=30, eos_token_id=[])
        assert result.stats.accept_lengths == single.stats.accept_lengths
        assert result.stats.steps < 30


@pytest.mark.parametrize("step", ["hf", "native"])
def test_a_row_that_hits_eos_first_stops_and_leaves_the_batch(step, monkeypatch):
    from treespec.core.native import NativeStep

    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    prompts = _prompts(model, [5, 8, 13], seed=4)
    free = hf_greedy(model, prompts[0], 30)
    eos = free[3]
    expected = [hf_greedy(model, p, 30, eos_token_id=eos) for p in prompts]
    assert len(expected[0]) < len(expected[1])  # the eos token stops row 0 early

    treespec.core.support.check_logits(model)  # the model's one-time logits check, before the count
    widths = []  # rows in each forward (the prefills run the HF forward on both paths)
    hook = model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: widths.append(args[0].shape[0])
    )
    native_call = NativeStep.__call__
    monkeypatch.setattr(
        NativeStep,
        "__call__",
        lambda self, tokens, *a, **k: widths.append(tokens.shape[0]) or native_call(self, tokens, *a, **k),
    )
    options = treespec.DecodeOptions(step=step)
    try:
        results = treespec.generate(
            model, prompts, heads, max_new_tokens=30, eos_token_id=eos, options=options
        )
    finally:
        hook.remove()
    assert [r.token_ids for r in results] == expected
    assert results[0].token_ids[-1] == eos
    # prefills one row at a time, then steps over 3 rows, then fewer once row 0 stopped
    steps = widths[len(prompts) :]
    assert steps[0] == 3 and min(steps) < 3 and steps == sorted(steps, reverse=True)
    assert results[0].stats.steps < results[1].stats.steps


def test_a_row_whose_prompt_nearly_fills_the_cache():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    tree = treespec.default_tree(8, 4)
    limit = model.config.max_position_embeddings
    prompts = _prompts(model, [limit - 20, 6], seed=5)  # row 0 ends at the model's last position
    results = treespec.generate(
        model, prompts, treespec.as_drafter(model, heads, tree), max_new_tokens=20, eos_token_id=[]
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(model, prompt, 20)
    too_long = [prompts[1], prompts[0] + [1]]
    with pytest.raises(CacheCapacityError, match="prompt 1 has"):
        treespec.generate(
            model, too_long, treespec.as_drafter(model, heads, tree), max_new_tokens=20, eos_token_id=[]
        )


def test_sampling_in_a_batch_matches_the_base_model_per_row():
    """temperature 1: each row's 2nd token follows the base model's exact marginal for its own prompt."""
    model = tiny_model("llama", dtype=torch.float32, vocab_size=10, initializer_range=0.5)
    heads = random_heads(model, std=0.5)
    tree = treespec.default_tree(16, 4)
    prompts = [[1, 4, 2], [7, 7, 3, 0]]
    exact = second_token_marginals(model, prompts)  # [V] per prompt
    counts = second_token_counts(
        model, prompts, lambda seed: treespec.as_drafter(model, heads, tree), seeds=200, copies=8
    )
    for count, p in zip(counts, exact, strict=True):
        assert sum(count.values()) == 1600
        assert total_variation(count, p) < 0.06  # noise at n=1600 over 10 tokens is ~0.025


def test_plain_steps_above_the_row_limit():
    """plain_above: while more rows are live than that, steps verify the root alone; output unchanged."""
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model, std=0.0)
    prompts = [[3] * 6, [5] * 9, [3] * 12]
    tree = treespec.default_tree(8, 4)
    decoder = Decoder(model, treespec.make_drafter(heads, tree, model), plain_above=2)
    decoder.prefill(prompts, max_new_tokens=20)
    step = decoder.step()
    assert step.nodes == 1 and all(len(p) == 1 for p in step.paths)
    decoder.drop_rows([1])
    step = decoder.step()
    assert step.rows == [0, 2] and step.nodes == tree.num_nodes
    full = treespec.generate(
        model,
        prompts,
        treespec.as_drafter(model, heads, tree),
        max_new_tokens=20,
        eos_token_id=[],
        options=treespec.DecodeOptions(plain_above=1),
    )
    assert [r.token_ids for r in full] == [hf_greedy(model, p, 20) for p in prompts]


def test_step_pricer_takes_the_kind_of_step_that_pays():
    pricer = StepPricer(recheck=4, smoothing=1.0, min_accepted=2)
    # two steps of each kind first; the first of each is a warm-up (a drafter's first call is slow)
    for speculative, seconds in ((True, 5.0), (True, 2.0), (False, 3.0), (False, 1.0)):
        assert pricer.speculate(8) is speculative
        pricer.record(8, speculative, seconds, accepted=1.5)
    assert pricer.seconds == {(8, True): 2.0, (8, False): 1.0}
    # 1.5 tokens per row for 2 s against 1 token for 1 s: plain pays; after 4 steps the other kind runs
    # once, and each recheck that confirms the choice doubles the wait (4, then 8, then 16 steps)
    choices = []
    for _ in range(12):  # the pricer's steps 5 to 16
        choice = pricer.speculate(8)
        pricer.record(8, choice, 2.0 if choice else 1.0, accepted=1.5)
        choices.append(choice)
    assert choices == [True] + [False] * 7 + [True] + [False] * 3
    assert pricer.interval == 16 and pricer.next_recheck == 29
    assert pricer.best(16) is False  # lost at 8 rows: loses at more rows too, without measuring
    assert pricer.best(4) is False  # fewer rows within a factor of two: the nearest measured count decides
    assert pricer.best(3) is None  # further away: unknown, measured on its own
    for _ in range(4):  # 4 tokens per row for 2 s: the mean over recent steps is 2.75, speculation pays
        pricer.record(8, True, 2.0, accepted=4.0)
    assert pricer.accept == pytest.approx((4 * 1.5 + 4 * 4.0) / 8)
    assert pricer.best(8) is True and pricer.best(4) is True and pricer.best(3) is True
    assert pricer.best(16) is True and pricer.best(17) is None
    # a close call (3% here) decides neither more rows nor fewer ones within the factor of two
    close = StepPricer(smoothing=1.0, min_accepted=2)
    for speculative, seconds in ((True, 5.0), (True, 1.55), (False, 3.0), (False, 1.0)):
        close.speculate(8)
        close.record(8, speculative, seconds, accepted=1.5)
    assert close.best(8) is False and close.best(16) is False  # a loss at fewer rows still decides more
    assert close.best(4) is None and close.speculate(4) is True  # measured at 4 rows: speculation first


def test_step_pricer_recheck_that_overturns_resets_the_wait():
    pricer = StepPricer(recheck=2, smoothing=0.3, min_accepted=2)
    for speculative, seconds in ((True, 2.0), (True, 2.0), (False, 1.0), (False, 1.0)):
        assert pricer.speculate(4) is speculative
        pricer.record(4, speculative, seconds, accepted=1.5)
    assert pricer.speculate(4)  # step 5: the recheck of speculation (plain was chosen)
    pricer.record(4, True, 1.0, accepted=3.0)  # 1 s now (replaced, not averaged), 2 tokens: it pays
    assert pricer.seconds[(4, True)] == 1.0
    assert pricer.best(4) is True and pricer.interval == 2 and pricer.next_recheck == 7
    # rows finishing one by one from 8: counts within a factor of two of a measured one are inferred
    pricer = StepPricer(smoothing=1.0, recheck=100)
    for rows in range(8, 0, -1):
        for _ in range(6):
            choice = pricer.speculate(rows)
            pricer.record(rows, choice, 2.0 if choice else 1.0, accepted=1.5)  # plain always pays
    assert {rows for rows, speculative in pricer.seconds if speculative} == {8, 3, 1}
    # the warm-up is once per kind, not per row count: a new count costs one speculative step
    assert (
        pricer.samples[(8, True)] == 1 and pricer.samples[(3, True)] == 1 and pricer.samples[(3, False)] == 5
    )


def test_auto_fallback_keeps_the_output():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    prompts = _prompts(model, [5, 9, 14, 3], seed=12)
    decoder = Decoder(
        model, treespec.make_drafter(heads, treespec.default_tree(16, 4), model), plain_above="auto"
    )
    decoder.prefill(prompts, max_new_tokens=30)
    kinds = [decoder.step().nodes for _ in range(6)]
    # measures both kinds of step (after a warm-up step of each kind) before choosing
    assert kinds[:4] == [16, 16, 1, 1]
    assert set(decoder.pricer.seconds) == {(4, True), (4, False)}
    results = treespec.generate(model, prompts, heads, max_new_tokens=30, eos_token_id=[])
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 30) for p in prompts]
    with pytest.raises(ValueError, match="plain_above must be"):
        Decoder(model, None, plain_above="sometimes")


def test_the_pricer_is_shared_per_model_and_drafter_setting(monkeypatch):
    """A batch starts from what earlier batches measured (same model, drafter kind and tree)."""
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    tree = treespec.default_tree(16, 4)
    auto = {"plain_above": "auto"}
    first = Decoder(model, treespec.make_drafter(heads, tree, model), **auto)
    again = Decoder(model, treespec.make_drafter(heads, tree, model), **auto)
    other_tree = Decoder(model, treespec.make_drafter(heads, treespec.default_tree(8, 4), model), **auto)
    own = StepPricer()
    given = Decoder(model, treespec.make_drafter(heads, tree, model), pricer=own, **auto)
    assert first.pricer is again.pricer and other_tree.pricer is not first.pricer and given.pricer is own
    assert (
        Decoder(
            tiny_model("llama", dtype=torch.float32), treespec.make_drafter(heads, tree, model), **auto
        ).pricer
        is not first.pricer
    )
    # generate hands compile= and the other settings to the decoder
    made = []

    class Made(Exception):
        pass

    def spy(*args, **kwargs):  # records the settings; compiling would take a minute
        made.append(kwargs)
        raise Made

    monkeypatch.setattr(treespec.api, "Decoder", spy)
    prompts = _prompts(model, [4, 6], seed=30)
    with pytest.raises(Made):
        treespec.generate(
            model,
            prompts,
            heads,
            max_new_tokens=3,
            eos_token_id=[],
            options=treespec.DecodeOptions(plain_above=None, compile=True),
        )
    assert made[0]["compile"] is True and made[0]["plain_above"] is None


def test_streaming_per_row():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    prompts = _prompts(model, [4, 7], seed=6)

    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, ids):
            self.puts.append(ids.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streams = [Collect(), None]
    results = treespec.generate(model, prompts, heads, max_new_tokens=15, eos_token_id=[], streamer=streams)
    assert streams[0].puts[0] == prompts[0] and streams[0].ended
    assert sum(streams[0].puts[1:], []) == results[0].token_ids
    with pytest.raises(ValueError, match="list of 2 streamers"):
        treespec.generate(model, prompts, heads, max_new_tokens=5, streamer=Collect())


def test_drafters_with_their_own_cache_refuse_batches():
    model = tiny_model("llama", dtype=torch.float32)
    draft = tiny_model("llama", dtype=torch.float32, seed=1)
    prompts = _prompts(model, [4, 7], seed=7)
    with pytest.raises(ValueError, match="one sequence at a time"):
        treespec.generate(model, prompts, treespec.DraftModelDrafter(draft, gamma=3))
    with pytest.raises(ValueError, match="trace= takes one prompt"):
        treespec.generate(model, prompts, trace=True)


def test_a_batch_as_a_tensor_and_a_single_prompt_as_a_list_of_ids():
    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.tensor(_prompts(model, [6, 6], seed=8))
    results = treespec.generate(model, ids, max_new_tokens=5, eos_token_id=[])
    assert [r.token_ids for r in results] == [hf_greedy(model, row.tolist(), 5) for row in ids]
    single = treespec.generate(model, ids[0].tolist(), max_new_tokens=5, eos_token_id=[])
    assert isinstance(single, treespec.GenerationResult)


# -- the cache and the attention against their single-row references ----------------------------------


def test_batch_cache_rows_equal_single_sequence_caches():
    """After several steps, each row's committed K/V equals what single-sequence decoding committed."""
    model = tiny_model("llama", dtype=torch.float64)
    heads = random_heads(model, std=0.0)
    tree = treespec.default_tree(16, 4)
    prompts = [[3] * 5, _prompts(model, [40], seed=9)[0], [4, 4, 4]]
    batch = Decoder(model, treespec.make_drafter(heads, tree, model), plain_above="auto")
    batch.prefill(prompts, max_new_tokens=20)
    for _ in range(4):
        batch.step()
    for row, prompt in enumerate(prompts):
        single = treespec.Decoder(model, treespec.make_drafter(heads, tree, model))
        single.prefill(prompt, max_new_tokens=20)
        while single.cache.committed < batch.cache.lengths[row]:
            single.step()
        n = batch.cache.lengths[row]
        for layer in range(model.config.num_hidden_layers):
            k, v = batch.cache.row_kv(row, layer)  # [Hkv, n, D]
            k1, v1 = single.cache.committed_kv(layer)  # [1, Hkv, c, D]
            torch.testing.assert_close(k, k1[0, :, :n])
            torch.testing.assert_close(v, v1[0, :, :n])


def test_batch_cache_commit_moves_each_row_on_its_own():
    cache = TreeKVCache(
        num_layers=2, batch_size=3, num_kv_heads=1, head_dim=2, max_len=16, dtype=torch.float64
    )
    cache.lengths = [2, 5, 0]
    cache.begin([0, 1], 4)
    new = torch.arange(2 * 4 * 2, dtype=torch.float64).reshape(2, 1, 4, 2)  # [A, Hkv, n, D]
    for layer in cache.layers:
        keys, values = layer.update(new, -new)
        assert keys.shape == (3, 1, 9, 2)  # every row up to the furthest write (5 + 4)
    cache.commit([[0, 2], [0, 1, 3]])
    assert cache.lengths == [4, 8, 0] and cache.committed == 8
    keys = cache.layers[1].keys
    torch.testing.assert_close(keys[0, 0, 2:4], new[0, 0, [0, 2]])
    torch.testing.assert_close(keys[1, 0, 5:8], new[1, 0, [0, 1, 3]])
    torch.testing.assert_close(cache.layers[0].values[1, 0, 5:8], -new[1, 0, [0, 1, 3]])
    with pytest.raises(CacheCapacityError, match="row 1 has 8 committed tokens"):
        cache.begin([1], 9)
    with pytest.raises(ValueError, match="not distinct rows"):
        cache.begin([0, 0], 1)


@pytest.mark.parametrize("kernel", ["reference", "sdpa", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nodes", [1, 8, 70])
def test_rows_attention_equals_each_row_alone(kernel, dtype, nodes):
    """Fresh random q/k/v and prefix lengths per row: the per-row attention (for "compiled": the op
    `tree_attention_rows`) equals the reference run on each row's own keys [0, c + n)."""
    if kernel == "compiled" and dtype == torch.float64:
        pytest.skip("the compiled op takes float32 / bf16 / fp16")
    gen = torch.Generator().manual_seed(11 + nodes)
    trees = {
        1: treespec.Tree.from_choices([]),  # plain steps
        8: treespec.default_tree(8, 4),
        # more than one 64-bit word of ancestor bits per node
        70: treespec.Tree.from_choices([[i] for i in range(40)] + [[0, i] for i in range(29)]),
    }
    tree = trees[nodes]
    n, H, Hkv, D, B = tree.num_nodes, 4, 2, 16, 4
    prefix = [0, 130, 7, 64]
    rows = (3, 0, 1)  # a forward over some rows, not in cache order
    L = max(prefix[r] for r in rows) + n
    key = torch.randn(B, Hkv, L + 5, D, generator=gen, dtype=dtype)
    value = torch.randn(B, Hkv, L + 5, D, generator=gen, dtype=dtype)
    query = torch.randn(len(rows), H, n, D, generator=gen, dtype=dtype)
    assert tree.num_nodes == nodes
    plan = AttentionPlan.for_tree(tree, kernel, "cpu")
    lens = torch.tensor([prefix[r] for r in rows])
    plan = AttentionPlan(plan.kernel, plan.mask, plan.bits, torch.tensor(rows), lens)
    out, _ = treespec_attention(None, query, key[:, :, :L], value[:, :, :L], None, 0.25, tree_attention=plan)
    assert out.shape == (len(rows), n, H, D)
    for a, r in enumerate(rows):
        end = prefix[r] + n
        mask = tree.ancestor_mask if tree.num_nodes > 1 else None
        want = tree_attention_reference(
            query[a : a + 1], key[r : r + 1, :, :end], value[r : r + 1, :, :end], mask, 0.25
        )
        torch.testing.assert_close(out[a : a + 1], want.transpose(1, 2), atol=1e-5, rtol=1e-4)


def test_compiled_op_refuses_rows_outside_the_cache():
    if not ops.available("cpu"):
        pytest.skip(f"the compiled extension is not available: {ops.build_info()['error']}")
    q = torch.zeros(2, 2, 1, 8)
    k = torch.zeros(3, 1, 10, 8)
    with pytest.raises(RuntimeError, match="outside a cache of 3 rows"):
        ops.tree_attention_rows(q, k, k, None, 1.0, torch.tensor([0, 3]), torch.tensor([2, 2]))
    with pytest.raises(RuntimeError, match="reads keys up to 11"):
        ops.tree_attention_rows(q, k, k, None, 1.0, torch.tensor([0, 1]), torch.tensor([2, 10]))


def test_compiled_batch_steps_equal_single_sequences():
    """torch.compile over batched steps (the op taking per-row lengths): rows equal HF greedy."""
    if not ops.available("cpu"):
        pytest.skip(f"the compiled extension is not available: {ops.build_info()['error']}")
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    prompts = _prompts(model, [4, 60, 9], seed=13)
    results = treespec.generate(
        model,
        prompts,
        heads,
        max_new_tokens=16,
        eos_token_id=[],
        options=treespec.DecodeOptions(compile=True, kernel="compiled"),
    )
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 16) for p in prompts]


class _PerStepTrees(treespec.BaseDrafter):
    """A batched drafter whose every step proposes another random subtree of its inner drafter's tree,
    with the nodes' probabilities and a predicted accepted length (as a dynamic tree does)."""

    batched = True

    def __init__(self, inner, seed: int):
        self.inner, self.tree = inner, inner.tree
        self.gen = torch.Generator().manual_seed(seed)
        self.trees: list[treespec.Tree] = []

    def keep_rows(self, rows):
        self.inner.keep_rows(rows)

    def propose(self, hidden, roots, max_depth=None):
        full = self.inner.propose(hidden, roots, max_depth)
        choices = self.tree.choices
        keep = set()
        for c in choices:  # a random subset closed under prefixes
            if (len(c) == 1 or c[:-1] in keep) and torch.rand(1, generator=self.gen).item() < 0.6:
                keep.add(c)
        sub = [c for c in choices if c in keep]
        tree = treespec.Tree.from_choices(sub)
        index = {(): 0} | {c: i + 1 for i, c in enumerate(choices)}
        order = torch.tensor([index[()]] + [index[tuple(c)] for c in tree.choices])  # [n] inner nodes
        self.trees.append(tree)
        return treespec.Proposal(full.tokens[:, order], full.probs[:, order], tree, 1.0 + len(sub) / 10)

    def observe(self, committed, features=None):
        self.inner.observe(committed, features)


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
def test_per_step_trees_in_a_batch_equal_each_row_alone(batch):
    """Proposal.tree, probs and expected_accept are honoured for every row: each row's greedy output is
    HF's, every step verifies that step's tree, and the prediction reaches the statistics."""
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model, std=0.0)
    prompts = [[3 + i % 4] * (5 + 3 * i) for i in range(batch)]
    drafter = _PerStepTrees(treespec.make_drafter(heads, treespec.default_tree(16, 4), model), seed=batch)
    decoder = Decoder(model, drafter, acceptance="greedy")
    outs = [[r] for r in decoder.prefill(prompts, max_new_tokens=24)]
    while decoder.live:
        step = decoder.step()
        assert step.tree is drafter.trees[-1] and step.nodes == step.tree.num_nodes
        assert len(step.draft_probs) == len(step.rows) and len(step.draft_probs[0]) == step.nodes
        assert step.expected_accept == 1.0 + (step.nodes - 1) / 10
        for row, committed in zip(step.rows, step.committed, strict=True):
            outs[row] += committed
        decoder.drop_rows([row for row in step.rows if len(outs[row]) >= 24])
    assert len({t.num_nodes for t in drafter.trees}) > 1  # the trees did change from step to step
    for prompt, out in zip(prompts, outs, strict=True):
        assert out[:24] == hf_greedy(model, prompt, 24)
    assert decoder.stats[0].predicted_accept[0] == 1.0 + (drafter.trees[0].num_nodes - 1) / 10
