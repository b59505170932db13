"""The benchmark (treespec.tools.bench, behind `treespec bench` and scripts/bench.py): prompt selection,
the thin script wrapper, and smoke runs on the embedded model (tiny settings, float32, same as HF)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

from treespec.tools import bench
from treespec.tools.models import default_data_file, default_suffix_cache_file

# the checkout's distillation data (the model's own answers to the training prompts)
WARM = str(Path(__file__).resolve().parents[1] / "data" / "distill" / "smollm2-135m-instruct")


def test_shipped_questions_cover_every_category():
    questions = bench.load_questions(default_data_file())
    assert len(questions) == 480
    picked = bench.select_prompts(questions, 13)
    assert len({q["category"] for q in picked}) == 13  # round-robin: one of each category
    two = bench.select_prompts(questions, 3, ["math_reasoning", "qa"])
    assert [q["category"] for q in two] == ["qa", "math_reasoning", "qa"]  # the file's category order


def test_script_is_a_thin_wrapper(capsys):
    script = load_script("bench")
    with pytest.raises(SystemExit) as info:
        script.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python scripts/bench.py" in out and "--methods" in out


def test_method_needing_a_drafter_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--methods", "hf,self_spec"])
    assert info.value.code == 2
    assert "--exit-head" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = ["--num-prompts", "2", "--max-new-tokens", "8", "--dtype", "float32"]
    methods = ["hf", "plain", "heads", "lookup", "heads+lookup", "suffix", "recycling"]
    argv += ["--kernels", "auto,sdpa", "--methods", ",".join(methods), "--lookup", "4"]
    bench.main([*argv, "--out", str(out)])
    runs = bench.run_names(methods, ["fast"], ["auto", "sdpa"])  # hf, plain, plain@sdpa, heads, ...

    result = json.loads(out.read_text())
    prompts = result["prompts"]
    assert len(prompts) == 2
    assert [p["category"] for p in prompts] == ["writing", "roleplay"]  # round-robin over categories
    assert [row["category"] for row in result["summary"]] == ["writing", "roleplay", "overall"]
    for p in prompts:
        assert set(p["methods"]) == set(runs)
        assert 1 <= p["methods"]["hf"]["new_tokens"] <= 8
        for m in runs[1:]:
            assert p["methods"][m]["identical_to_hf"], (m, p)
    overall = result["summary"][-1]["methods"]
    assert overall["heads"]["identical_to_hf"] == 2
    assert overall["heads@sdpa"]["accept_length"] == overall["heads"]["accept_length"]
    assert overall["heads"]["accept_length"] >= 1.0
    assert overall["hf"]["speedup"] == pytest.approx(1.0)
    assert overall["heads+lookup"]["accept_length"] >= 1.0
    printed = capsys.readouterr().out
    assert "same(heads)" in printed and "accept(heads+lookup)" in printed
    assert result["config"]["lookup"] == 4


@pytest.mark.integration
def test_bench_draft_model_self_spec_and_assisted(tmp_path, smollm2, capsys):
    """Every chain drafter (and HF assisted generation) matches HF greedy in float32, with the metrics."""
    import treespec
    from treespec.training.draft_train import truncate_model

    model, tokenizer = smollm2
    draft = tmp_path / "draft"
    truncate_model(model, 2).save_pretrained(draft)
    tokenizer.save_pretrained(draft)
    exit_head = tmp_path / "exit"
    treespec.MedusaHeads.for_model(model, num_heads=1, exit_layer=10).save_pretrained(exit_head)
    out = tmp_path / "b.json"
    methods = [
        "hf",
        "plain",
        "draft_model",
        "draft_model_int8",
        "draft_model_tree",
        "self_spec",
        "hf_assisted",
    ]
    argv = ["--num-prompts", "2", "--max-new-tokens", "8", "--dtype", "float32", "--gamma", "3"]
    argv += ["--draft-model", str(draft), "--exit-head", str(exit_head), "--methods", ",".join(methods)]
    result = bench.main([*argv, "--out", str(out)])
    overall = result["summary"][-1]["methods"]
    for m in methods[1:]:
        assert overall[m]["identical_to_hf"] == 2, m
    for m in ("draft_model", "draft_model_int8", "draft_model_tree", "self_spec"):
        assert 0.0 <= overall[m]["acceptance_rate"] <= 1.0
        assert overall[m]["verify_ms"] > 0 and overall[m]["draft_ms"] > 0
    assert overall["draft_model_int8"]["speculative_memory"] < overall["draft_model"]["speculative_memory"]
    assert "gamma 3" in result["config"]["draft_model"]
    printed = capsys.readouterr().out
    assert "accept rate" in printed and "x baseline" in printed


def test_eagle_methods_default_to_the_shipped_drafter(capsys):
    """Without --eagle the eagle methods use the default model's shipped drafter; another --model has
    none, so they ask for --eagle FOLDER."""
    from treespec.tools.models import DEFAULT_EAGLE_NAME, default_heads_folder

    args = bench.parse_args(["--methods", "hf,eagle"])
    assert args.eagle == str(default_heads_folder(DEFAULT_EAGLE_NAME))
    assert (default_heads_folder(DEFAULT_EAGLE_NAME) / "model.safetensors").is_file()
    assert bench.parse_args(["--methods", "eagle", "--eagle", "elsewhere"]).eagle == "elsewhere"
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--model", "some/other-model", "--methods", "hf,eagle"])
    assert info.value.code == 2
    assert "--eagle FOLDER" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_eagle_methods(tmp_path, smollm2):
    """The EAGLE drafter (untrained here: initialised from the model) matches HF greedy in float32, alone
    and with the lookup branch, drafting a chain from --eagle-tree."""
    import torch

    import treespec

    model, _ = smollm2
    folder = tmp_path / "eagle"
    treespec.EagleDraftModel.for_model(model, torch.arange(2048)).save_pretrained(folder)
    out = tmp_path / "b.json"
    argv = ["--num-prompts", "2", "--max-new-tokens", "8", "--dtype", "float32", "--lookup", "3"]
    argv += ["--eagle", str(folder), "--eagle-tree", "3", "--methods", "hf,eagle,eagle+lookup"]
    result = bench.main([*argv, "--out", str(out)])
    overall = result["summary"][-1]["methods"]
    for m in ("eagle", "eagle+lookup"):
        assert overall[m]["identical_to_hf"] == 2, m
        assert overall[m]["draft_ms"] > 0
    assert "chain of 3" in result["config"]["eagle"]


@pytest.mark.integration
def test_bench_dynamic_methods(tmp_path, smollm2):
    """Dynamic trees (shipped heads + lookup, the EAGLE drafter + lookup, the unions of heads + suffix
    (+ recycling)) stay equal to HF greedy in float32 and report nodes per step and the predicted accepted
    length, priced by a given cost curve."""
    import torch

    import treespec
    from treespec.training.costs import save_cost_curve

    model, _ = smollm2
    folder = tmp_path / "eagle"
    treespec.EagleDraftModel.for_model(model, torch.arange(2048)).save_pretrained(folder)
    curve = tmp_path / "curve.json"
    rows = {"1": 30.0, "4": 32.0, "8": 40.0, "16": 60.0, "32": 120.0}
    save_cost_curve(curve, {"format": "treespec.cost_curve", "verify_ms": {"blocks": {"300": rows}}})
    out = tmp_path / "b.json"
    argv = ["--num-prompts", "2", "--max-new-tokens", "8", "--dtype", "float32", "--lookup", "3"]
    argv += ["--eagle", str(folder), "--eagle-tree", "3", "--cost-curve", str(curve)]
    argv += ["--suffix-warm", WARM]  # the suffix methods start from the model's own earlier answers
    methods = [
        "dynamic",
        "eagle+dynamic",
        "eagle+suffix",
        "eagle+all",
        "all",
        "dynamic+suffix",
        "dynamic+all",
    ]
    result = bench.main([*argv, "--methods", ",".join(["hf", *methods]), "--out", str(out)])
    overall = result["summary"][-1]["methods"]
    for m in methods:
        assert overall[m]["identical_to_hf"] == 2, m
        assert overall[m]["nodes_per_step"] >= 1 and overall[m]["predicted_accept_length"] >= 1
    # each prompt's record keeps what the pricer had learned after it (to tell why trees grew or shrank)
    pricer = [p["methods"]["dynamic"]["pricer"] for p in json.loads(out.read_text())["prompts"]]
    assert pricer[1]["tree_steps"] >= pricer[0]["tree_steps"] and isinstance(pricer[1]["rest_ms"], float)
    assert 0 <= min(pricer[1]["acceptance_by_bin"]) <= max(pricer[1]["acceptance_by_bin"]) <= 1
    assert "pricer" not in result["prompts"][0]["methods"]["hf"]
    assert result["config"]["lookup"] == 3  # dynamic and eagle+dynamic draft a lookup branch
    assert result["config"]["suffix_warm"] == WARM


def test_each_method_gets_its_own_warm_suffix_cache():
    """--suffix-warm: every method starts from the same earlier answers in a cache of its own (one
    method's answers must not reach another's cache in the same run), from a distillation folder or a
    saved cache file; without it, a cold cache."""
    for warm in (WARM, default_suffix_cache_file()):
        new_cache = bench.suffix_cache_factory(str(warm))
        first, second = new_cache(), new_cache()
        assert first is not second and first.num_requests == second.num_requests > 1000
        first.add([1, 2, 3])
        assert first.num_requests == second.num_requests + 1
    assert bench.suffix_cache_factory(None)().num_requests == 0


def test_numerics_runs_are_named_per_value(capsys):
    names = bench.run_names(["hf", "plain", "dynamic", "vllm"], ["fast", "bitwise"])
    assert names == ["hf", "plain", "plain@bitwise", "dynamic", "dynamic@bitwise", "vllm"]
    assert bench.base_method("dynamic@bitwise") == "dynamic"
    with pytest.raises(SystemExit):
        bench.parse_args(["--numerics", "fast,exactish"])
    assert "bitwise" in capsys.readouterr().err


def test_kernel_runs_are_named_per_kernel_beside_the_numerics(capsys):
    names = bench.run_names(["hf", "plain", "dynamic+suffix"], ["fast", "int8"], ["auto", "sdpa"])
    assert names == [
        "hf", "plain", "plain@sdpa", "plain@int8", "plain@int8+sdpa",
        "dynamic+suffix", "dynamic+suffix@sdpa", "dynamic+suffix@int8", "dynamic+suffix@int8+sdpa",
    ]  # fmt: skip
    assert bench.base_method("dynamic+suffix@int8+sdpa") == "dynamic+suffix"
    assert bench.plain_run("heads@sdpa", {"plain@sdpa": 1, "plain": 2}) == 1
    assert bench.parse_args(["--kernels", "auto,sdpa"]).kernels == ["auto", "sdpa"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--kernels", "fastest"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--kernels", "sdpa", "--numerics", "bitwise"])
    assert "choose their own kernels" in capsys.readouterr().err


def test_sharegpt_heldout_prompts_are_the_distillation_eval_split():
    from treespec.tools import workloads
    from treespec.training.distill import is_eval

    prompts = workloads.sharegpt_heldout(0)
    assert len(prompts) >= 50  # enough for the parity check of issue 31
    assert all(is_eval(p["question_id"], workloads.HELDOUT_FRACTION) for p in prompts)
    assert all(len(p["turns"][0]) <= workloads.MAX_PROMPT_CHARS for p in prompts)
    assert [p["question_id"] for p in workloads.sharegpt_heldout(5)] == [
        p["question_id"] for p in prompts[:5]
    ]
    meta = json.loads(
        (default_data_file().parent / "distill" / "smollm2-135m-instruct" / "meta.json").read_text()
    )
    assert meta["settings"]["eval_fraction"] == workloads.HELDOUT_FRACTION


@pytest.mark.integration
def test_bench_refine_workload_with_bitwise_numerics(tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = ["--workload", "refine", "--num-prompts", "1", "--max-new-tokens", "12", "--dtype", "float32"]
    argv += ["--methods", "plain,suffix", "--numerics", "fast,bitwise", "--out", str(out)]
    bench.main(argv)
    result = json.loads(out.read_text())
    categories = [p["category"] for p in result["prompts"]]
    assert categories == ["refine-first", "refine-concise", "refine-fix"]
    refine_prompt = result["prompts"][1]["prompt_tokens"]
    assert refine_prompt > result["prompts"][0]["prompt_tokens"] + 6  # it holds the first answer
    overall = result["summary"][-1]["methods"]
    assert overall["suffix@bitwise"]["identical_to_plain"] == 3
    assert set(overall) == {"plain", "plain@bitwise", "suffix", "suffix@bitwise"}
    assert "plain(suffix@bitwise)" in capsys.readouterr().out


def test_every_recipe_is_a_method_under_its_name():
    from treespec import recipes

    for name in recipes.RECIPES:
        assert bench.method_recipe(name) == name and name in bench.METHODS
    assert bench.method_recipe("heads@bitwise+sdpa") == "heads"
    assert bench.method_recipe("hf") is None and bench.method_recipe("draft_model") is None
    assert bench.is_speculative("dynamic+suffix") and not bench.is_speculative("plain@bitwise")
    assert bench.uses("eagle", ["hf", "eagle+suffix"]) and not bench.uses("eagle", ["dynamic"])
    assert bench.uses("lookup", ["dynamic"]) and not bench.uses("lookup", ["dynamic+suffix"])
    args = bench.parse_args([])  # the defaults: what `treespec generate` runs, beside HF and the plain loop
    assert args.methods == ["hf", "hf_prompt_lookup", "plain", "auto"] and args.dtype == "auto"
    assert bench.plain_run("heads@bitwise", {"plain@bitwise": 1, "plain": 2}) == 1


def test_recipe_runners_decode_as_hf_and_auto_resolves_per_model(tmp_path, steady_clock):
    import torch
    from conftest import hf_greedy, random_heads, tiny_model

    from treespec.training.costs import save_cost_curve

    model = tiny_model("llama", dtype=torch.float32)
    assert bench.resolve_auto(["hf", "auto", "plain"], model) == ["hf", "plain"]  # no drafter ships for it
    curve = tmp_path / "curve.json"
    rows = {"1": 0.3, "4": 0.32, "8": 0.4, "16": 0.6, "32": 1.2}  # a tiny model's scale
    save_cost_curve(curve, {"format": "treespec.cost_curve", "verify_ms": {"blocks": {"300": rows}}})
    methods = ["plain", "heads", "heads+lookup", "dynamic", "dynamic+all", "suffix"]
    heads = random_heads(model)
    runners = bench.make_runners(model, None, heads, None, methods, lookup=3, cost_curve=str(curve))
    prompt = [5, 9, 14, 2, 5, 9, 14]
    want = hf_greedy(model, prompt, 12)
    for name in methods:
        out = runners[name](prompt, 12)["token_ids"]
        assert out and out == want[: len(out)], name  # up to the model's end token


@pytest.mark.integration
def test_bench_with_a_repetition_penalty(tmp_path, smollm2):
    """Every method decodes with HF's penalty: treespec's texts equal HF generate's with the penalty,
    which differ from HF's texts without it."""
    model, tokenizer = smollm2
    out = tmp_path / "b.json"
    argv = ["--num-prompts", "2", "--max-new-tokens", "24", "--dtype", "float32"]
    argv += ["--repetition-penalty", "1.3", "--methods", "hf,plain,dynamic+suffix", "--numerics", "fast,int8"]
    result = bench.main([*argv, "--out", str(out)])
    assert result["config"]["repetition_penalty"] == 1.3
    overall = result["summary"][-1]["methods"]
    assert overall["plain"]["identical_to_hf"] == overall["dynamic+suffix"]["identical_to_hf"] == 2
    assert overall["dynamic+suffix@int8"]["identical_to_plain"] == 2
    questions = bench.select_prompts(bench.load_questions(default_data_file()), 2)
    for q, record in zip(questions, result["prompts"], strict=True):
        unpenalized = bench.hf_greedy(model, tokenizer, bench.prompt_ids(q, tokenizer), 24)
        assert unpenalized != record["methods"]["hf"]["token_ids"]


def test_a_repetition_penalty_refuses_llamacpp():
    args = bench.parse_args(["--methods", "hf,llamacpp", "--repetition-penalty", "1.2"])
    with pytest.raises(ValueError, match="repeat_penalty counts only the last 64 tokens it generated"):
        bench.check_options(args)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        bench.check_options(bench.parse_args(["--methods", "hf", "--repetition-penalty", "0"]))
