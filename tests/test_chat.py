"""treespec.Chat: a conversation whose turns prefill only what the template adds after the kept history."""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_llama_over
from transformers import AutoTokenizer

import treespec
from treespec.core.generate import chat_ids


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(treespec.tools.models.default_model_folder())


@pytest.mark.parametrize("numerics,kv_dtype", [("fast", "model"), ("int8", "model"), ("int8", "bfloat16")])
def test_each_turn_keeps_the_history_and_replies_as_a_fresh_call(tokenizer, numerics, kv_dtype):
    # SmolLM2's vocabulary and chat template over a tiny random Llama (int8: sizes in 32s)
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2) if numerics == "int8" else {}
    model = tiny_llama_over(tokenizer, dtype=torch.float32, eos_token_id=2, **sizes)
    heads = random_heads(model, seed=3)
    drafter = treespec.make_drafter(heads, treespec.default_tree(8, 4), model)
    options = treespec.DecodeOptions(numerics=numerics, kv_dtype=kv_dtype)
    with treespec.Chat(model, tokenizer, drafter, max_new_tokens=12, options=options) as chat:
        turns = [
            "Write a haiku about the sea.",  # its reply: 4 tokens, so the cache is sized for a short talk
            "Shorter, please.",
            "Now one about the mountains, the rivers and the forests below them, and the sky above them all.",
        ]
        history: list[dict] = []
        capacities = set()
        for turn, message in enumerate(turns):
            reply = chat.send(message, max_new_tokens=4 if turn == 0 else None)
            capacities.add(chat.decoder.cache.max_len)
            history.append({"role": "user", "content": message})
            prompt = chat_ids(tokenizer, history)
            assert reply.prompt_ids == prompt
            limit = 4 if turn == 0 else 12
            fresh = treespec.generate(
                model, prompt, drafter, tokenizer, max_new_tokens=limit, options=options
            )
            assert reply.token_ids == fresh.token_ids, turn
            if turn:  # the history before this turn's message stayed in the cache
                assert reply.stats.prompt_reused > len(chat_ids(tokenizer, history[:-2])) // 2, turn
            history.append({"role": "assistant", "content": reply.text})
            assert chat.messages == history
        assert len(capacities) > 1  # the conversation outgrew its first cache and its history moved along
        stored = torch.float32 if kv_dtype == "model" else torch.bfloat16
        assert chat.decoder.cache.layers[0].keys.dtype == stored
        chat.reset()
        assert chat.messages == []
        again = chat.send("Name a colour.")  # a new conversation: the template's opening is kept
        opening = chat_ids(tokenizer, [{"role": "user", "content": turns[0]}])
        shared = next(i for i, (a, b) in enumerate(zip(opening, again.prompt_ids, strict=False)) if a != b)
        assert again.stats.prompt_reused == shared > 0
    assert chat.decoder.cache is None  # closed: the cache's pages went back to the model's runtime


def test_a_tokenizer_without_a_chat_template_is_refused(tokenizer):
    model = tiny_llama_over(tokenizer, dtype=torch.float32)
    plain = AutoTokenizer.from_pretrained(treespec.tools.models.default_model_folder())
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        treespec.Chat(model, plain, None)
    with pytest.raises(ValueError, match="non-empty"):
        treespec.Chat(model, tokenizer, None).send("  ")


def test_a_conversation_longer_than_the_model_says_to_start_again(tokenizer):
    model = tiny_llama_over(tokenizer, dtype=torch.float32, max_position_embeddings=64)
    chat = treespec.Chat(model, tokenizer, None, max_new_tokens=8)
    chat.send("Hi")
    with pytest.raises(treespec.CacheCapacityError, match=r"chat\.reset\(\)"):
        chat.send("Tell me everything about the sea, the mountains, the rivers and the sky. " * 3)
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]  # the failed turn left no trace


def test_a_repetition_penalty_counts_the_whole_conversation(tokenizer):
    """A later turn prefills only its new tokens, but the penalty counts every token of the conversation:
    each reply equals HF generate's with the penalty on the whole rendered conversation (a penalty below 1
    favours seen tokens, so the replies copy from the history: one that forgot it fails here)."""
    model = tiny_llama_over(tokenizer, dtype=torch.float32, eos_token_id=2)
    drafter = treespec.make_drafter(random_heads(model, seed=3), treespec.default_tree(8, 4), model)
    sampling = treespec.SamplingConfig(repetition_penalty=0.3)
    history: list[dict] = []
    with treespec.Chat(model, tokenizer, drafter, max_new_tokens=10, sampling=sampling) as chat:
        for message in ("Write a haiku about the sea.", "Again, about the sea."):
            reply = chat.send(message)
            history.append({"role": "user", "content": message})
            prompt = torch.tensor([chat_ids(tokenizer, history)])
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=10,
                do_sample=False,
                repetition_penalty=0.3,
                eos_token_id=2,
                pad_token_id=2,
            )
            assert reply.token_ids == out[0, prompt.shape[1] :].tolist()
            history.append({"role": "assistant", "content": reply.text})
        assert reply.stats.prompt_reused > 0
