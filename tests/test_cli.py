"""The `treespec` console script: help, viz, errors at the boundary, bench/train delegation, drafters
from options (heads and their tree.json, draft model, exit head), generate."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch
from conftest import tiny_model

import treespec
from treespec.tools import cli, drafter_options
from treespec.tools.cli import main
from treespec.tools.models import default_heads_folder, default_suffix_cache_file
from treespec.tools.trace import Step, Trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_trace() -> Trace:
    """Two hand-made steps on the tree root -> {[0] -> [0, 0], [1]} (nodes 0, 1, 2, 3)."""

    def step(path: list[int], bonus: str, text: str) -> Step:
        return Step(
            token_ids=[5, 6, 7, 8],
            token_texts=["Hi", " there", "!", " you"],
            draft_probs=[1.0, 0.6, 0.3, 0.5],
            path=path,
            bonus_id=9,
            bonus_text=bonus,
            text=text,
        )

    return Trace(
        choices=[[0], [1], [0, 0]],
        prompt_ids=[1, 2],
        prompt_text="Say hi",
        token_ids=[5, 6, 8, 9, 5, 9],
        text="Hi there you\nHi\n",
        start_text="Hi",
        steps=[step([0, 1, 3], "\n", "Hi there you\n"), step([0], "\n", "Hi there you\nHi\n")],
        stats={"summary": "6 tokens in 2 steps"},
    )


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.json"
    tiny_trace().save(path)
    return path


def run(argv, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----- help -----


@pytest.mark.parametrize("command", [[], ["generate"], ["viz"], ["tune"], ["bench"], ["train"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    if command == ["bench"]:  # the library benchmark's own parser answered, under its command name
        assert "usage: treespec bench" in out and "--num-prompts" in out
    if command == ["train"]:
        assert "usage: treespec train" in out and "--exit-layer" in out


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


# ----- bench / train delegation -----


@pytest.mark.parametrize("command", ["bench", "train"])
def test_program_gets_the_arguments(monkeypatch, capsys, command):
    """bench and train run library code (treespec.tools.*), not files of a checkout's scripts/."""
    module = __import__(cli.PROGRAMS[command][0], fromlist=["main"])
    assert module.__name__.startswith("treespec.tools.")

    def fake_main(argv, prog=None):
        print("ARGS", argv, prog)
        return 3

    monkeypatch.setattr(module, "main", fake_main)
    code, out, _ = run([command, "--epochs", "1", "--help"], capsys)
    assert code == 3
    assert f"ARGS ['--epochs', '1', '--help'] treespec {command}" in out


def test_program_errors_exit_2(tmp_path, capsys):
    code, _, err = run(["bench", "--heads", tmp_path / "no-heads", "--methods", "heads"], capsys)
    assert code == 2 and "no-heads" in err and "Traceback" not in err


# ----- viz -----


def test_viz_tree_png(tmp_path, capsys):
    tree_json = tmp_path / "tree.json"
    treespec.default_tree(16, 4).save(tree_json)
    png = tmp_path / "tree.png"
    code, _, err = run(["viz", tree_json, "-o", png], capsys)
    assert code == 0, err
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_viz_default_size_with_acceptance_svg(tmp_path, capsys):
    table = tmp_path / "acceptance.json"
    table.write_text(json.dumps({"acceptance": treespec.core.tree.prior_acceptance(4)}))
    svg = tmp_path / "tree.svg"
    code, _, err = run(["viz", "32", "--acceptance", table, "-o", svg], capsys)
    assert code == 0, err
    assert ET.parse(svg).getroot().tag.endswith("svg")


def test_viz_trace_html_and_step(trace_file, tmp_path, capsys):
    html = tmp_path / "run.html"
    assert run(["viz", "--trace", trace_file, "-o", html], capsys)[0] == 0
    assert 'id="step-counter"' in html.read_text(encoding="utf-8")
    png = tmp_path / "step.png"
    assert run(["viz", "--trace", trace_file, "-o", png, "--step", 2], capsys)[0] == 0
    assert png.read_bytes().startswith(PNG_MAGIC)


def bad_case(tmp_path, trace_file, case: str) -> tuple[list, str]:
    """(arguments, the file or phrase the error message must name)."""
    bad = tmp_path / "bad.json"
    out = tmp_path / "out.png"
    if case == "tree not json":
        bad.write_text("{oops")
        return ["viz", bad, "-o", out], str(bad)
    if case == "tree malformed":
        bad.write_text(json.dumps({"format": "treespec.tree", "version": 1, "choices": [[0, 1]]}))
        return ["viz", bad, "-o", out], str(bad)
    if case == "tree missing":
        return ["viz", tmp_path / "nope.json", "-o", out], str(tmp_path / "nope.json")
    if case == "acceptance":
        bad.write_text(json.dumps([[0.5, "x"]]))
        return ["viz", "8", "--acceptance", bad, "-o", out], str(bad)
    if case == "trace not json":
        bad.write_text("[1, 2")
        return ["viz", "--trace", bad, "-o", tmp_path / "run.html"], str(bad)
    if case == "trace is a tree":
        treespec.default_tree(8, 4).save(bad)
        return ["viz", "--trace", bad, "-o", tmp_path / "run.html"], str(bad)
    if case == "step out of range":
        return ["viz", "--trace", trace_file, "-o", out, "--step", 3], "out of range"
    if case == "output format":
        return ["viz", "8", "-o", tmp_path / "tree.jpg"], "tree.jpg"
    if case == "generate tree":
        bad.write_text("not json")
        return ["generate", "hi", "--tree", bad], str(bad)  # fails before loading the model
    if case == "generate heads":
        return ["generate", "hi", "--heads", tmp_path / "no-heads"], "no-heads"
    if case == "generate draft model":  # fails before loading the model
        return ["generate", "hi", "--draft-model", tmp_path / "no-draft"], "--draft-model"
    if case == "generate exit head":
        return ["generate", "hi", "--exit-head", tmp_path / "no-exit"], "no-exit"
    if case == "generate penalty":  # fails before loading the model
        return ["generate", "hi", "--repetition-penalty", "-1"], "repetition_penalty must be > 0"
    if case == "generate min-p":
        return ["generate", "hi", "--temperature", "1", "--min-p", "2"], "min_p must be in [0, 1]"
    if case == "chat penalty":
        return ["chat", "--repetition-penalty", "0"], "repetition_penalty must be > 0"
    if case == "tune data":
        return ["tune", "--exit-head", tmp_path, "--data", tmp_path / "no-data"], "no-data"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "tree not json",
        "tree malformed",
        "tree missing",
        "acceptance",
        "trace not json",
        "trace is a tree",
        "step out of range",
        "output format",
        "generate tree",
        "generate heads",
        "generate draft model",
        "generate exit head",
        "generate penalty",
        "generate min-p",
        "chat penalty",
        "tune data",
    ],
)
def test_bad_input_exits_2_naming_the_problem(tmp_path, trace_file, capsys, case):
    argv, named = bad_case(tmp_path, trace_file, case)
    code, _, err = run(argv, capsys)
    assert code == 2
    assert named in err and err.startswith("treespec ")
    assert "Traceback" not in err


def test_show_tree_prints_each_step(capsys):
    cli.print_trace_trees(tiny_trace())
    out = capsys.readouterr().out
    assert "step 1 / 2: accepted length 3" in out and "step 2 / 2" in out
    assert "␣there" in out and "↵  (bonus)" in out


# ----- drafters from options: heads, their tree, chain drafters -----


@pytest.fixture
def heads_dir(tmp_path):
    """(tiny model, folder of 2 untrained heads for it without a tree.json)."""
    model = tiny_model(dtype=torch.float32)
    folder = tmp_path / "heads"
    treespec.MedusaHeads.for_model(model, num_heads=2).save_pretrained(folder)
    return model, folder


def test_heads_carry_their_tree(heads_dir):
    model, folder = heads_dir
    assert treespec.MedusaHeads.for_model(model, num_heads=2).tree is None
    assert treespec.MedusaHeads.from_pretrained(folder, model=model).tree is None  # no tree.json
    tree = treespec.Tree.from_choices([[0], [1], [0, 0]])
    tree.save(folder / "tree.json")
    heads = treespec.MedusaHeads.from_pretrained(folder, model=model)
    assert heads.tree is not None and heads.tree.choices == tree.choices


def test_heads_refuse_a_tree_deeper_than_themselves(heads_dir):
    model, folder = heads_dir
    treespec.Tree.from_choices([[0], [0, 0], [0, 0, 0]]).save(folder / "tree.json")
    with pytest.raises(treespec.HeadsLoadError, match="depth 3 but the heads .* have only 2"):
        treespec.MedusaHeads.from_pretrained(folder, model=model)
    (folder / "tree.json").write_text("{oops")
    with pytest.raises(treespec.HeadsLoadError, match="tree.json: not valid JSON"):
        treespec.MedusaHeads.from_pretrained(folder)


def test_pick_tree_explicit_wins(heads_dir):
    model, folder = heads_dir
    shipped = treespec.Tree.from_choices([[0], [1]])
    shipped.save(folder / "tree.json")
    heads = treespec.MedusaHeads.from_pretrained(folder, model=model)
    assert drafter_options.pick_tree(None, heads)[0] is heads.tree  # the heads' own tree by default
    explicit = treespec.Tree.from_choices([[0], [0, 0]])
    assert drafter_options.pick_tree(explicit, heads)[0] is explicit
    sized, source = drafter_options.pick_tree(8, heads)
    assert sized.num_nodes == 8 and sized.max_depth <= 2 and "default_tree(8, 2)" in source
    with pytest.raises(ValueError, match="depth 3 but the heads have 2"):
        drafter_options.pick_tree(treespec.Tree.from_choices([[0], [0, 0], [0, 0, 0]]), heads, "deep.json")


def test_default_heads_only_for_the_default_model(tmp_path):
    shipped = default_heads_folder()
    assert (shipped / "tree.json").is_file()  # a checkout's heads/ or the wheel's treespec/heads
    assert drafter_options.heads_folder(None, None) == shipped
    assert drafter_options.heads_folder(None, "some/other-model") is None  # untrained, with a warning
    assert drafter_options.heads_folder(str(tmp_path), "x") == tmp_path
    with pytest.raises(ValueError, match="not a heads folder"):
        drafter_options.heads_folder(str(tmp_path / "missing"), None)


def test_untrained_heads_warn(heads_dir, capsys):
    model, _ = heads_dir
    heads, desc = drafter_options.load_heads(None, model, num_heads=3)
    assert heads.num_heads == 3 and heads.tree is None and "untrained" in desc
    assert "untrained heads" in capsys.readouterr().err


def test_chain_options(heads_dir, tmp_path):
    model, _ = heads_dir
    exit_dir = tmp_path / "exit"
    treespec.MedusaHeads.for_model(model, num_heads=1, exit_layer=1).save_pretrained(exit_dir)
    (exit_dir / "tune.json").write_text("{}")  # not read: --gamma wins
    chain = drafter_options.load_chain_option(model, exit_head=str(exit_dir), gamma=3)
    assert chain.kind == "exit_head" and chain.gamma == 3 and "exit layer 1" in chain.description
    drafter = chain.drafter(model)
    assert isinstance(drafter, treespec.SelfSpeculativeDrafter) and drafter.gamma == 3
    assert chain.drafter(model, 2).gamma == 2
    with pytest.raises(ValueError, match="--branching applies to --draft-model only"):
        chain.drafter(model, branching="1:2")
    with pytest.raises(ValueError, match="not both"):
        drafter_options.load_chain_option(model, str(exit_dir), str(exit_dir))
    assert drafter_options.load_chain_option(model) is None
    draft_dir = tmp_path / "draft"
    model.save_pretrained(draft_dir)
    chain = drafter_options.load_chain_option(model, draft_model=str(draft_dir))
    assert chain.kind == "draft_model" and chain.gamma == 4 and "2 layers), gamma 4" in chain.description
    drafter = chain.drafter(model, storage="int8", branching="1:2")
    assert isinstance(drafter, treespec.DraftModelDrafter) and drafter.gamma == 4


# ----- generate on the real model -----


@pytest.mark.integration
def test_generate_writes_a_loadable_trace(tmp_path, capsys):
    out = tmp_path / "out.json"
    code, stdout, err = run(
        ["generate", "Say hello.", "--max-new-tokens", 4, "--trace", out, "--stream", "--show-tree"], capsys
    )
    assert code == 0, err
    trace = Trace.load(out)
    assert len(trace.token_ids) == 4 and trace.steps
    assert trace.stats["summary"] in stdout and "step 1 / " in stdout
    html = tmp_path / "run.html"
    assert run(["viz", "--trace", out, "-o", html], capsys)[0] == 0


@pytest.mark.integration
def test_generate_uses_the_shipped_heads_and_tree(capsys):
    argv = ["generate", "Why is the sky blue?", "--max-new-tokens", 24, "--drafter", "heads"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "untrained" not in err
    summary = out.strip().splitlines()[-1]
    accepted = float(summary.split("mean accepted length ")[1].split(",")[0])
    assert accepted > 1.3, summary


@pytest.mark.integration
def test_generate_with_an_eagle_drafter(tmp_path, capsys, smollm2):
    model, _ = smollm2
    folder = tmp_path / "eagle"
    treespec.EagleDraftModel.for_model(model, torch.arange(1024)).save_pretrained(folder)
    args = ["generate", "Say hello.", "--max-new-tokens", 6, "--eagle", folder, "--eagle-tree", 2]
    code, out, err = run([*args, "--dtype", "float32"], capsys)
    assert code == 0, err
    assert "mean accepted length" in out.strip().splitlines()[-1]
    code, _, err = run(["generate", "Hi", "--eagle", tmp_path / "missing"], capsys)
    assert code != 0 and "--eagle" in err


@pytest.mark.integration
def test_generate_with_the_shipped_eagle_drafter(capsys):
    """--drafter eagle: the default model's shipped EAGLE-style drafter; float32 greedy keeps the plain
    loop's text and the trained drafter accepts more than one token per step. Another --model is refused
    with the flag to pass."""
    base = ["generate", "Why is the sky blue?", "--max-new-tokens", 32, "--dtype", "float32"]
    code, plain, err = run([*base, "--drafter", "none"], capsys)
    assert code == 0, err
    code, out, err = run([*base, "--drafter", "eagle"], capsys)
    assert code == 0, err
    assert out.strip().splitlines()[:-1] == plain.strip().splitlines()[:-1]
    summary = out.strip().splitlines()[-1]
    assert float(summary.split("mean accepted length ")[1].split(",")[0]) > 1.3, summary
    code, _, err = run(["generate", "Hi", "--model", "some/other-model", "--drafter", "eagle"], capsys)
    assert code != 0 and "--eagle FOLDER" in err


@pytest.mark.integration
def test_generate_with_training_free_drafters_and_bitwise_numerics(tmp_path, capsys):
    cache = tmp_path / "suffix.json"
    base = ["generate", "Name three colours.", "--max-new-tokens", 12, "--dtype", "float32"]
    texts = []
    for extra in (
        ["--drafter", "none"],
        ["--drafter", "suffix", "--suffix-cache", cache],
        ["--drafter", "recycling"],
    ):
        code, out, err = run([*base, *extra, "--numerics", "bitwise"], capsys)
        assert code == 0, err
        texts.append(out.strip().splitlines()[:-1])
    assert texts[1] == texts[0] and texts[2] == texts[0]  # bitwise: speculation keeps the plain text
    shipped = treespec.SuffixCache.load(default_suffix_cache_file()).num_requests
    assert treespec.SuffixCache.load(cache).num_requests == shipped + 1  # the shipped answers, then this one
    code, _, err = run([*base, "--drafter", "suffix", "--lookup", 4], capsys)
    assert code != 0 and "--lookup" in err


def test_the_default_models_suffix_drafter_starts_from_its_shipped_answers(tmp_path):
    """Suffix recipes: a --suffix-cache file when it exists, else the default model's shipped answers;
    another model starts empty."""
    assert cli.suffix_start(None, default_model=True) == default_suffix_cache_file()
    assert cli.suffix_start(None, default_model=False) is None
    missing = tmp_path / "not-yet.json"  # where this run's answers will be saved
    assert cli.suffix_start(str(missing), True) == default_suffix_cache_file()
    own = tmp_path / "own.json"
    treespec.SuffixCache.from_sequences([[1, 2, 3]]).save(own)
    assert cli.suffix_start(str(own), True) == own


def _generate_args(*argv):
    return cli.build_parser().parse_args(["generate", "hi", *map(str, argv)])


def test_generate_picks_its_recipe_from_the_options_before_the_model_loads(tmp_path):
    assert cli.generate_recipe(_generate_args()) == "auto"
    assert cli.generate_recipe(_generate_args("--drafter", "none")) == "plain"
    assert cli.generate_recipe(_generate_args("--tree", "8")) == "heads"
    assert cli.generate_recipe(_generate_args("--eagle", tmp_path)) == "eagle"
    assert cli.generate_recipe(_generate_args("--drafter", "dynamic", "--tree", "8")) == "dynamic"
    assert cli.generate_recipe(_generate_args("--exit-head", tmp_path)) is None  # the chain drafts
    for argv, named in [
        (("--drafter", "suffix", "--tree", "8"), "--heads / --tree"),
        (("--drafter", "dynamic", "--eagle", tmp_path), "--eagle"),
        (("--drafter", "heads", "--exit-head", tmp_path), "--drafter heads"),
        (("--drafter", "eagle+suffix", "--model", "some/other-model"), "--eagle FOLDER"),
    ]:
        with pytest.raises(ValueError, match=named):
            cli.generate_recipe(_generate_args(*argv))
    with pytest.raises(SystemExit):
        _generate_args("--drafter", "fastest")  # not a recipe


def test_generate_builds_the_recipe_with_the_options_parts():
    model = tiny_model("llama", dtype=torch.float32)
    args = _generate_args("--drafter", "heads+lookup", "--lookup", 3, "--tree", 8, "--model", "tiny")
    drafter, parts = cli.generate_drafter(args, model, "heads+lookup", 8)
    assert isinstance(drafter, treespec.TreePlanner) and drafter.tree.num_nodes == 8 + 3
    assert parts.heads.num_heads == 4 and parts.tree.num_nodes == 8
    args = _generate_args("--drafter", "suffix", "--model", "tiny")
    drafter, parts = cli.generate_drafter(args, model, "suffix", None)
    assert isinstance(drafter, treespec.SuffixDrafter) and parts.suffix_drafters == [drafter]
    assert drafter.cache.num_requests == 0  # another model's suffix cache starts cold
    assert cli.generate_drafter(_generate_args("--model", "tiny"), model, "auto", None)[0] is None
    with pytest.raises(ValueError, match="drop --lookup"):
        cli.generate_drafter(_generate_args("--lookup", 2, "--drafter", "suffix"), model, "suffix", None)
    with pytest.raises(ValueError, match="--suffix-cache goes with"):
        cli.generate_drafter(_generate_args("--suffix-cache", "x.json"), model, "heads", None)


def test_chat_keeps_the_conversation_between_lines(monkeypatch, capsys):
    import io

    monkeypatch.setattr(
        "sys.stdin", io.StringIO("What is 2 + 2?\nAnd 3 + 3?\n/reset\nName a colour.\n\nignored\n")
    )
    assert main(["chat", "--max-new-tokens", "8", "--drafter", "dynamic+suffix"]) == 0
    out, err = capsys.readouterr()
    stats = [line for line in err.splitlines() if line.startswith("[") and " tokens in " in line]
    assert len(stats) == 3  # three messages answered; the empty line ended the conversation
    assert "kept in the cache from before" in stats[1]  # the second turn prefilled only its new tokens
    assert "(a new conversation)" in err
    assert out.strip()
