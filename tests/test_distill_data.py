"""Self-distillation data: shards, greedy correctness of batched generation, split, resume, reader checks.

A tiny random Llama with the real SmolLM2 tokenizer (for its chat template) keeps generation fast.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import load_script, tiny_llama_over
from transformers import AutoTokenizer, LlamaForCausalLM

import treespec
from treespec.core.generate import encode_prompt
from treespec.training.distill import (
    DistillDataError,
    Prompt,
    is_eval,
    load_distill_data,
    load_prompts,
    make_distill_data,
    plan_shards,
    read_answers,
    read_shard,
    trim_response,
)
from treespec.training.reference import hf_generate

EOS = 2
SETTINGS = dict(max_new_tokens=6, max_prompt_chars=300, batch_size=3, shard_size=2, eval_fraction=0.3)
TEXTS = [
    "Hi",
    "Write a haiku about the sea.",
    "Explain how a hash table works, with an example in Python. " * 3,
    "What is 2 + 2?",
    "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 40,  # cut to 300 characters
    "Translate 'good morning' into French, German and Spanish.",
    "List three prime numbers.",
    "Why is the sky blue? Answer briefly.",
]


def tiny_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama over the SmolLM2 vocabulary (float64: batched == unbatched exactly)."""
    return tiny_llama_over(tokenizer, seed, bos_token_id=1, eos_token_id=EOS)


def unbatched_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: plain HF greedy generate on one unpadded prompt, cut after the first eos."""
    x = torch.tensor([ids])
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=EOS
    )
    return trim_response(out[0, len(ids) :].tolist(), [EOS])


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(treespec.tools.models.default_model_folder())


@pytest.fixture(scope="module")
def model(tokenizer):
    """The tiny model, edited so that some greedy responses end early with eos: the eos row of the output
    layer takes the place of the second token greedy gives for the first prompt."""
    model = tiny_model(tokenizer)
    first = unbatched_greedy(model, encode_prompt(TEXTS[0], tokenizer), 2)
    with torch.no_grad():
        weight = model.lm_head.weight  # [V, H]
        weight[EOS] = weight[first[1]]
        weight[first[1]] = 0.0
    return model


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    items = [
        {"id": f"p{i:02d}", "conversations": [{"from": "human", "value": t}]} for i, t in enumerate(TEXTS)
    ]
    items.insert(3, {"id": "empty", "conversations": [{"from": "human", "value": "  "}]})
    items.insert(5, {"id": "banner", "conversations": [{"from": "system", "value": "*Shared from X*"}]})
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps(items))
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory, model, tokenizer, prompts_file) -> Path:
    """One complete dataset made once; tests copy it before changing anything."""
    out = tmp_path_factory.mktemp("made") / "data"
    make_distill_data(out, model, tokenizer, prompts_file, progress=False, **SETTINGS)
    return out


def copy_of(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "data"
    shutil.copytree(folder, dest)  # copy2 keeps mtimes
    return dest


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")}


def test_load_prompts_skips_items_without_human_text(prompts_file):
    prompts, skipped = load_prompts(prompts_file)
    assert [p.id for p in prompts] == [f"p{i:02d}" for i in range(len(TEXTS))]
    assert skipped == ["empty", "banner"]


def test_hf_generate_on_a_padded_batch_equals_each_prompt_alone(model, tokenizer):
    prompts = [encode_prompt(text, tokenizer)[:40] for text in TEXTS[:4]]  # 4 lengths: left padding
    assert len({len(p) for p in prompts}) > 1
    got = hf_generate(model, prompts, 5, eos_ids=[EOS], pad_id=EOS)
    assert got == [unbatched_greedy(model, p, 5) for p in prompts]
    assert hf_generate(model, [], 5) == []


def test_shards_hold_prompt_plus_unbatched_greedy_response(made, model, tokenizer):
    meta = json.loads((made / "meta.json").read_text())
    assert meta["complete"] and meta["settings"]["dtype"] == "float64"
    assert meta["model"] == treespec.drafters.heads.model_identity(model)
    assert meta["data"]["skipped"] == ["empty", "banner"] and meta["data"]["prompts"] == len(TEXTS)
    files = sorted(p.name for p in made.glob("*.safetensors"))
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in made.iterdir())
    assert files == sorted(s["file"] for s in meta["shards"])
    assert all(s["prompts"] <= SETTINGS["shard_size"] for s in meta["shards"])

    train, evals = load_distill_data(made, "train"), load_distill_data(made, "eval")
    assert len(train.sequences) > 0 and len(evals.sequences) > 0
    assert sorted(train.prompt_ids + evals.prompt_ids) == [f"p{i:02d}" for i in range(len(TEXTS))]
    responses = []
    for data in (train, evals):
        for seq, plen, pid in zip(data.sequences, data.prompt_lengths, data.prompt_ids, strict=True):
            assert seq.dtype == torch.int64 and seq.dim() == 1
            prompt = encode_prompt(TEXTS[int(pid[1:])][: SETTINGS["max_prompt_chars"]], tokenizer)
            assert seq[:plen].tolist() == prompt
            expected = unbatched_greedy(model, prompt, SETTINGS["max_new_tokens"])
            assert seq[plen:].tolist() == expected, pid
            responses.append(expected)
    # The eos edit makes both kinds of responses appear: stopped at eos, and cut at max_new_tokens.
    assert any(r[-1] == EOS and len(r) < SETTINGS["max_new_tokens"] for r in responses)
    assert any(EOS not in r and len(r) == SETTINGS["max_new_tokens"] for r in responses)
    assert all(EOS not in r[:-1] for r in responses)


def test_long_prompt_is_cut_before_templating(made, tokenizer):
    data = next(d for d in (load_distill_data(made, s) for s in ("train", "eval")) if "p04" in d.prompt_ids)
    i = data.prompt_ids.index("p04")
    text = tokenizer.decode(data.sequences[i][: data.prompt_lengths[i]])
    assert TEXTS[4][:300] in text and TEXTS[4][:301] not in text


def test_eval_split_is_a_fixed_hash_of_the_id():
    def rule(pid: str, fraction: float) -> bool:  # SPLIT_RULE, written out independently
        return int(hashlib.sha256(("eval:" + pid).encode()).hexdigest()[:16], 16) / 2**64 < fraction

    ids = [f"id{i}" for i in range(4000)]
    assert [is_eval(i, 0.05) for i in ids] == [rule(i, 0.05) for i in ids]
    assert 0.04 < sum(is_eval(i, 0.05) for i in ids) / len(ids) < 0.06
    assert all(is_eval(i, 0.3) for i in ids if is_eval(i, 0.05))  # a larger fraction only adds prompts

    prompts = [Prompt(i, "x") for i in ids[:300]]
    plan = plan_shards(prompts, 16, 0.05)
    shuffled = prompts[:]
    random.Random(0).shuffle(shuffled)
    assert plan_shards(shuffled, 16, 0.05) == plan  # file order does not matter
    assert {s.split for s in plan} == {"train", "eval"}
    for split in ("train", "eval"):
        assert all(
            is_eval(i, 0.05) == (split == "eval") for s in plan if s.split == split for i in s.prompt_ids
        )
    limited = plan_shards(prompts, 16, 0.05, limit=100)  # each limited shard is a prefix of the full one
    full = {s.name: s for s in plan}
    assert all(full[s.name].prompt_ids[: len(s.prompt_ids)] == s.prompt_ids for s in limited)
    assert sum(len(s.prompt_ids) for s in limited) == 100


def test_resume_redoes_only_the_missing_or_corrupt_shard(made, tmp_path, model, tokenizer, prompts_file):
    out = copy_of(made, tmp_path)
    before = mtimes(out)
    files = sorted(before)
    gone, damaged = out / files[0], out / files[-1]
    original = {p: p.read_bytes() for p in (gone, damaged)}
    gone.unlink()
    damaged.write_bytes(original[damaged][: len(original[damaged]) // 2])

    def answer(prompts, max_new_tokens, temperature, seed, eos_ids):  # another engine for the redone ones
        return [unbatched_greedy(model, p, max_new_tokens) for p in prompts]

    meta = make_distill_data(
        out, model, tokenizer, prompts_file, progress=False, answer=answer, engine="redo", **SETTINGS
    )
    after = mtimes(out)
    assert sorted(after) == files and meta["complete"]
    engines = {s["file"]: s["engine"] for s in meta["shards"]}
    assert engines == {name: "redo" if name in (gone.name, damaged.name) else "hf" for name in files}
    changed = {name for name in files if after[name] != before[name]}
    assert changed == {gone.name, damaged.name}
    for path, data in original.items():
        assert read_shard(path).tokens.tolist() == read_shard_bytes(tmp_path, data).tokens.tolist()

    make_distill_data(
        out,
        model,
        tokenizer,
        prompts_file,
        progress=False,
        batch_size=1,
        **{k: v for k, v in SETTINGS.items() if k != "batch_size"},
    )  # nothing to do: batch size is not a setting of the data
    assert mtimes(out) == after


def read_shard_bytes(tmp_path: Path, data: bytes):
    path = tmp_path / "reference.safetensors"
    path.write_bytes(data)
    return read_shard(path)


def test_limit_then_full_run_reuses_complete_shards(tmp_path, model, tokenizer, prompts_file, made):
    out = tmp_path / "data"
    meta = make_distill_data(out, model, tokenizer, prompts_file, progress=False, limit=3, **SETTINGS)
    assert not meta["complete"] and sum(t["prompts"] for t in meta["totals"].values()) == 3
    first = mtimes(out)
    complete = {s["file"] for s in meta["shards"] if s["complete"]}
    assert complete and complete != set(first)  # some full shards, some partial

    meta = make_distill_data(out, model, tokenizer, prompts_file, progress=False, **SETTINGS)
    assert meta["complete"]
    second = mtimes(out)
    assert {n for n in first if second[n] == first[n]} == complete
    for name in second:  # same data as a run without the limit
        assert read_shard(out / name).tokens.tolist() == read_shard(made / name).tokens.tolist()

    make_distill_data(out, model, tokenizer, prompts_file, progress=False, limit=3, **SETTINGS)
    assert mtimes(out) == second  # a smaller limit never shrinks finished shards


def test_resume_with_other_settings_or_model_is_refused(made, tmp_path, model, tokenizer, prompts_file):
    out = copy_of(made, tmp_path)
    before = mtimes(out)
    with pytest.raises(DistillDataError, match="max_new_tokens: folder has 6, now 7"):
        make_distill_data(
            out, model, tokenizer, prompts_file, progress=False, **{**SETTINGS, "max_new_tokens": 7}
        )
    with pytest.raises(DistillDataError, match="fingerprint"):
        make_distill_data(
            out, tiny_model(tokenizer, seed=1), tokenizer, prompts_file, progress=False, **SETTINGS
        )
    other_prompts = tmp_path / "other.json"
    other_prompts.write_text(
        json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "Hello"}]}])
    )
    with pytest.raises(DistillDataError, match="prompts file differs"):
        make_distill_data(out, model, tokenizer, other_prompts, progress=False, **SETTINGS)
    assert mtimes(out) == before


def test_reader_refuses_missing_or_corrupt_shards(made, tmp_path):
    out = copy_of(made, tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    name = next(s["file"] for s in meta["shards"] if s["split"] == "train")
    path = out / name
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # flip bits in the token data
    path.write_bytes(bytes(data))
    with pytest.raises(DistillDataError, match=name):
        load_distill_data(out, "train")
    path.write_bytes(bytes(data[:20]))  # truncated: not even a readable header
    with pytest.raises(DistillDataError, match=f"{name}: corrupt shard"):
        read_shard(path)
    path.unlink()
    with pytest.raises(DistillDataError, match=f"{name}: shard file is missing"):
        load_distill_data(out, "train")
    (out / "meta.json").unlink()
    with pytest.raises(DistillDataError, match="meta.json is missing"):
        load_distill_data(out, "eval")


def test_several_folders_train_on_all_and_evaluate_on_the_first(
    tmp_path, model, tokenizer, prompts_file, made
):
    """A greedy set plus a sampled set of the same prompts: train joins both, eval is the greedy set's;
    a folder from another model is refused; "a,b" names the same folders as a list."""
    sampled = tmp_path / "sampled"
    settings = {**SETTINGS, "temperature": 5.0, "seed": 3}
    make_distill_data(sampled, model, tokenizer, prompts_file, progress=False, **settings)
    greedy_train, sampled_train = load_distill_data(made), load_distill_data(sampled)
    both = load_distill_data([made, sampled])
    assert [t.tolist() for t in both.sequences] == [
        t.tolist() for t in greedy_train.sequences + sampled_train.sequences
    ]
    assert both.prompt_ids == greedy_train.prompt_ids + sampled_train.prompt_ids
    joined = load_distill_data(f"{made},{sampled}")
    assert [t.tolist() for t in joined.sequences] == [t.tolist() for t in both.sequences]
    eval_both, eval_greedy = load_distill_data([made, sampled], "eval"), load_distill_data(made, "eval")
    assert [t.tolist() for t in eval_both.sequences] == [t.tolist() for t in eval_greedy.sequences]
    other = tmp_path / "other"
    make_distill_data(
        other, tiny_model(tokenizer, seed=1), tokenizer, prompts_file, progress=False, **SETTINGS
    )
    with pytest.raises(DistillDataError, match="another model"):
        load_distill_data([made, other])


def test_cli(tmp_path, tokenizer, prompts_file, capsys):
    model_dir = tmp_path / "tiny"
    tiny_model(tokenizer).to(torch.float32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    script = load_script("make_distill_data")
    out = tmp_path / "out"
    args = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--prompts",
        str(prompts_file),
        "--out",
        str(out),
    ]
    args += ["--limit", "4", "--shard-size", "2", "--eval-fraction", "0.3"]
    assert script.main(args + ["--max-new-tokens", "3"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["dtype"] == "float32" and meta["last_run"]["limit"] == 4
    assert sum(t["prompts"] for t in meta["totals"].values()) == 4
    assert len(load_distill_data(out, "train").sequences) > 0
    assert script.main(args + ["--max-new-tokens", "4"]) == 2
    assert "refusing to resume" in capsys.readouterr().err


def test_sampling_is_seeded_per_shard(tmp_path, model, tokenizer, prompts_file):
    settings = {**SETTINGS, "temperature": 5.0, "seed": 3}
    out = tmp_path / "sampled"
    meta = make_distill_data(out, model, tokenizer, prompts_file, progress=False, **settings)
    assert meta["settings"]["temperature"] == 5.0 and meta["settings"]["seed"] == 3
    name = meta["shards"][0]["file"]
    first = read_shard(out / name).tokens.tolist()
    (out / name).unlink()
    make_distill_data(out, model, tokenizer, prompts_file, progress=False, **settings)
    assert read_shard(out / name).tokens.tolist() == first  # a redone shard samples the same tokens


def test_splits_limit_what_is_generated(tmp_path, model, tokenizer, prompts_file, made):
    out = tmp_path / "data"
    make_distill_data(out, model, tokenizer, prompts_file, progress=False, splits=("eval",), **SETTINGS)
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names and all(n.startswith("eval-") for n in names)
    got, want = load_distill_data(out, "eval").sequences, load_distill_data(made, "eval").sequences
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    make_distill_data(out, model, tokenizer, prompts_file, progress=False, **SETTINGS)  # then the rest
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(
        p.name for p in made.glob("*.safetensors")
    )


def test_another_engine_answers_each_shard_in_one_call_and_its_answers_are_cut_at_eos(
    tmp_path, model, tokenizer, prompts_file, made
):
    calls = []

    def engine(prompts, max_new_tokens, temperature, seed, eos_ids):
        calls.append((len(prompts), temperature, seed))
        # the model's own greedy answers, then tokens past the eos and past max_new_tokens: both cut
        return [unbatched_greedy(model, p, max_new_tokens) + [EOS, 5, 6] for p in prompts]

    out = tmp_path / "engine"
    make_distill_data(
        out, model, tokenizer, prompts_file, progress=False, answer=engine, engine="test 1.0", **SETTINGS
    )
    shards = json.loads((made / "meta.json").read_text())["shards"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["last_run"]["engine"] == "test 1.0"
    assert all(s["engine"] == "test 1.0" for s in meta["shards"])  # each shard names what answered it
    assert all(s["engine"] == "hf" for s in shards)
    assert [n for n, _, _ in calls] == [
        s["prompts"] for s in sorted(shards, key=lambda s: s["split"] != "eval")
    ]
    assert all(t == 0.0 and seed is None for _, t, seed in calls)
    for split in ("train", "eval"):
        ours, reference = load_distill_data(out, split), load_distill_data(made, split)
        assert ours.prompt_ids == reference.prompt_ids
        assert [s.tolist() for s in ours.sequences] == [s.tolist() for s in reference.sequences]


def test_an_engine_that_loses_answers_is_refused(tmp_path, model, tokenizer, prompts_file):
    def engine(prompts, max_new_tokens, temperature, seed, eos_ids):
        return [[EOS]] * (len(prompts) - 1)

    with pytest.raises(RuntimeError, match="answers to"):
        make_distill_data(
            tmp_path / "d", model, tokenizer, prompts_file, progress=False, answer=engine, **SETTINGS
        )


def test_answers_are_the_tokens_after_each_prompt(made):
    """`read_answers` (what warms a SuffixCache): each train sequence's answer, in shard order."""
    data = load_distill_data(made, "train")
    answers = read_answers(made)
    assert len(answers) == len(data.sequences) > 0
    for answer, seq, length in zip(answers, data.sequences, data.prompt_lengths, strict=True):
        assert answer == seq[length:].tolist() and len(answer) >= 1
    assert len(read_answers(made, "eval")) == len(load_distill_data(made, "eval").sequences)
