"""The `treespec` console script: help, viz, errors at the boundary, script delegation, generate."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

import treespec
from treespec.tools import cli
from treespec.tools.cli import main
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


@pytest.mark.parametrize("command", [[], ["generate"], ["viz"], ["bench"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    if command == ["bench"]:
        assert "--num-prompts" in out  # scripts/bench.py's own parser answered


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


# ----- bench / train delegation -----


def test_missing_script_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "SCRIPTS_DIR", tmp_path)
    code, _, err = run(["train", "--help"], capsys)
    assert code == 2
    assert str(tmp_path / "train_heads.py") in err and "source checkout" in err
    assert "Traceback" not in err


def test_script_gets_the_arguments(monkeypatch, tmp_path, capsys):
    (tmp_path / "train_heads.py").write_text("def main(argv):\n    print('ARGS', argv)\n    return 0\n")
    monkeypatch.setattr(cli, "SCRIPTS_DIR", tmp_path)
    code, out, _ = run(["train", "--epochs", "1", "--help"], capsys)
    assert code == 0
    assert "ARGS ['--epochs', '1', '--help']" in out


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
