"""Traces and pictures: Trace round trips, tree and step drawings, and the HTML page in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from conftest import random_heads, tiny_model

import treespec
from treespec.core.tree import prior_acceptance
from treespec.tools import viz
from treespec.tools.trace import Trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PIECES = ["a", " b", "\n", "\t", "c d", "$x$", "é", "</script><b>"]  # whitespace, mathtext, HTML


class FakeTokenizer:
    """Decodes token i to PIECES[i] + str(i) (never empty, so the text grows every step)."""

    name_or_path = "fake-tokenizer"

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[i % len(PIECES)] + str(i) for i in ids)


@pytest.fixture(scope="module")
def result():
    """A real traced run on a tiny random Llama; 8 tokens in the vocabulary, so the heads'
    top-k candidates often include the right token and some steps accept drafted nodes."""
    model = tiny_model("llama", dtype=torch.float32, vocab_size=8)
    heads = random_heads(model, num_heads=4, seed=1)
    drafter = treespec.as_drafter(model, heads, treespec.default_tree(16, 4))
    return treespec.generate(model, [1, 2, 3, 4], drafter, max_new_tokens=24, eos_token_id=[], trace=True)


@pytest.fixture(scope="module")
def trace(result) -> Trace:
    return Trace.from_result(result, FakeTokenizer())


def graph_data(graph):
    return dict(graph.nodes(data=True)), sorted(graph.edges(data=True)), graph.graph


# ----- Trace -----


def test_trace_from_result(result, trace):
    tok = FakeTokenizer()
    assert len(trace.steps) == result.stats.steps >= 3
    assert any(step.accept_length > 1 for step in trace.steps), "no step accepted a drafted node"
    assert trace.choices == [list(c) for c in result.tree.choices]
    assert trace.prompt_text == tok.decode([1, 2, 3, 4])
    assert result.text is None and trace.text == tok.decode(result.token_ids)
    assert trace.stats["summary"] == result.stats.summary()
    texts = [trace.start_text] + [s.text for s in trace.steps]
    for earlier, later in zip(texts, texts[1:], strict=False):
        assert later.startswith(earlier) and later != earlier
    assert texts[-1] == tok.decode(result.token_ids)
    for raw, step in zip(result.trace, trace.steps, strict=True):
        assert step.token_ids == raw["tokens"] and step.path == raw["path"] and step.bonus_id == raw["bonus"]
        assert step.token_texts == [tok.decode([t]) for t in raw["tokens"]]
        assert step.draft_probs[0] == 1.0 and len(step.draft_probs) == 16


def test_trace_json_round_trip_gives_the_same_pictures(trace, tmp_path):
    path = tmp_path / "trace.json"
    trace.save(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["format"] == "treespec.trace" and data["version"] == 1
    loaded = Trace.load(path)
    assert loaded == trace
    for k in range(len(trace.steps)):
        assert graph_data(viz.step_graph(loaded, k)) == graph_data(viz.step_graph(trace, k))
    assert viz.html_data(loaded) == viz.html_data(trace)


def _mangle(data: dict, how: str) -> object:
    step = data["steps"][0]
    if how == "format":
        data["format"] = "treespec.tree"
    elif how == "version":
        data["version"] = 99
    elif how == "missing":
        del data["prompt_text"]
    elif how == "tokens":
        step["token_ids"] = step["token_ids"][:-1]
    elif how == "path":
        step["path"] = [0, 2, 1]
    elif how == "probs":
        step["draft_probs"][1] = 1.5
    elif how == "choices":
        data["choices"] = [[0, 0]]
    return data


@pytest.mark.parametrize(
    "how, message",
    [
        ("format", "not a trace file"),
        ("version", "version 99"),
        ("missing", 'missing "prompt_text"'),
        ("tokens", "step 1: expected 16 tokens"),
        ("path", "not a branch"),
        ("probs", "draft_probs"),
        ("choices", "no parent"),
    ],
)
def test_trace_load_rejects_bad_files(trace, tmp_path, how, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_mangle(trace.to_dict(), how)))
    with pytest.raises(ValueError, match=message) as info:
        Trace.load(path)
    assert str(info.value).startswith(str(path))


def test_trace_load_rejects_non_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as info:
        Trace.load(path)
    assert str(path) in str(info.value)


# ----- static trees -----


def check_picture(path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000
    if path.suffix == ".png":
        assert data.startswith(PNG_MAGIC)
    else:
        assert ET.fromstring(data).tag.endswith("svg")


@pytest.mark.parametrize("size", [8, 64])
@pytest.mark.parametrize("ext", ["png", "svg"])
def test_draw_tree(tmp_path, size, ext):
    tree = treespec.default_tree(size, 4)
    out = tmp_path / f"tree.{ext}"
    graph = viz.draw_tree(tree, out)
    check_picture(out)
    assert graph.number_of_nodes() == tree.num_nodes
    assert graph.number_of_edges() == tree.num_nodes - 1
    assert graph.nodes[0]["label"] == "root"
    for node in range(1, tree.num_nodes):
        assert graph.nodes[node]["label"] == f"h{int(tree.head[node])} r{int(tree.rank[node])}"
        assert graph.has_edge(int(tree.parents[node]), node)


def test_draw_tree_with_acceptance(tmp_path):
    tree = treespec.default_tree(32, 4)
    table = prior_acceptance(4)
    graph = viz.draw_tree(tree, tmp_path / "tree.png", acceptance=table)
    probs = [graph.nodes[i]["prob"] for i in range(tree.num_nodes)]
    assert probs[0] == 1.0
    assert sum(probs) == pytest.approx(tree.expected_accept_length(table))
    node = tree.choices.index((0, 1)) + 1
    assert probs[node] == pytest.approx(table[0][0] * table[1][1])
    assert graph.nodes[node]["label"].startswith("h1 r1\n")
    own = viz.draw_tree(tree, None, acceptance=table, mode="node")
    assert own.nodes[node]["prob"] == pytest.approx(table[1][1])
    with pytest.raises(ValueError, match="head 3"):
        viz.draw_tree(tree, None, acceptance=table[:3])


def test_layered_layout_is_top_down_and_centred():
    tree = treespec.default_tree(64, 4)
    graph = tree.to_networkx()
    pos = viz.layered_layout(graph)
    assert len(set(pos.values())) == tree.num_nodes  # no two nodes share a place
    leaves = [n for n in graph if graph.out_degree(n) == 0]
    assert sorted(pos[n][0] for n in leaves) == list(range(len(leaves)))
    for node in graph:
        assert pos[node][1] == -int(tree.depth[node])
        kids = tree.children(node)
        if kids:
            assert pos[node][0] == (pos[kids[0]][0] + pos[kids[-1]][0]) / 2


def test_bad_picture_format(tmp_path):
    with pytest.raises(ValueError, match="unsupported picture format"):
        viz.draw_tree(treespec.default_tree(8, 4), tmp_path / "tree.jpg")


# ----- one step -----


def test_import_treespec_leaves_the_viz_extra_unloaded():
    """matplotlib and rich are the optional viz extra: importing treespec (and viz) must not load them."""
    code = (
        "import sys, treespec, treespec.tools.viz, treespec.tools.cli; "
        "loaded = [m for m in ('matplotlib', 'rich') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_drawing_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    tree = treespec.default_tree(8, num_heads=4)
    assert viz.tree_graph(tree).number_of_nodes() == tree.num_nodes  # graphs need no matplotlib
    with pytest.raises(ImportError, match=r"pip install treespec\[viz\]"):
        viz.draw_tree(tree, tmp_path / "tree.png")
    assert not (tmp_path / "tree.png").exists()


def test_visible():
    assert viz.visible(" a\n\tb") == "␣a↵⇥b"
    assert viz.visible("") == "∅"
    assert viz.visible("\x00\u200b") == "\\x00\\u200b"
    assert viz.visible("abcdefghijklmnop", 8) == "abcdefg…"


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_draw_step(trace, tmp_path, ext):
    k = next(i for i, s in enumerate(trace.steps) if s.accept_length > 1)
    step, n = trace.steps[k], trace.tree.num_nodes
    out = tmp_path / f"step.{ext}"
    graph = viz.draw_step(trace, k, out)
    check_picture(out)
    assert graph.number_of_nodes() == n + 1
    assert graph.number_of_edges() == n
    assert {node for node, ok in graph.nodes(data="accepted") if ok} == set(step.path)
    bonus = graph.nodes[n]
    assert bonus["kind"] == "bonus" and bonus["token_id"] == step.bonus_id
    assert list(graph.predecessors(n)) == [step.path[-1]]
    assert graph.graph["step"] == k + 1
    for node in range(n):
        attrs = graph.nodes[node]
        assert attrs["kind"] == ("root" if node == 0 else "accepted" if node in step.path else "rejected")
        assert attrs["label"].split("\n")[0] == viz.visible(step.token_texts[node])
    for parent, child in zip(step.path, step.path[1:], strict=False):
        assert graph.edges[parent, child]["kind"] == "accepted"


def test_step_labels_make_whitespace_visible(trace):
    for k in range(len(trace.steps)):
        for _, label in viz.step_graph(trace, k).nodes(data="label"):
            token_line, prob_line = label.split("\n")
            assert not set(" \n\t") & set(token_line)
            assert prob_line in ("root", "bonus") or prob_line.startswith("p")
    shown = {line for s in trace.steps for t in s.token_texts for line in [viz.visible(t)]}
    assert {"␣b1", "↵2", "⇥3"} <= shown


# ----- HTML -----


def test_html_is_self_contained(trace, tmp_path):
    out = tmp_path / "run.html"
    viz.write_html(trace, out)
    page = out.read_text(encoding="utf-8")
    for needle in ('id="step-counter"', 'id="generated-text"', 'id="next"', 'id="prev"'):
        assert needle in page
    assert "<script src" not in page and "<link" not in page
    assert page.replace("http://www.w3.org/2000/svg", "").count("http") == 0
    assert page.count("</script>") == 2  # token texts with "</script>" are escaped in the JSON


def find_chromium() -> tuple[str, str] | None:
    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium through Selenium with the system chromedriver (no downloads)."""
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install selenium)"
    )
    found = find_chromium()
    if found is None:
        pytest.skip(
            "Chromium not found: apt-get install -y chromium chromium-driver (make install tries this)"
        )
    binary, driver_path = found
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "SEVERE"})
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    try:
        driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    except WebDriverException as e:
        pytest.skip(f"Chromium did not start: {e.msg}")
    yield driver
    driver.quit()


def test_html_steps_in_chromium(trace, tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    out = tmp_path / "run.html"
    viz.write_html(trace, out)
    browser.get(out.as_uri())
    n = len(trace.steps)

    def read() -> tuple[str, str]:
        counter = browser.find_element(By.ID, "step-counter").text
        return counter, browser.find_element(By.ID, "generated-text").get_property("textContent")

    shot = browser.get_screenshot_as_png()
    assert shot.startswith(PNG_MAGIC) and len(shot) > 10_000
    counter, text = read()
    assert counter == f"step 1 / {n}"
    assert text == trace.steps[0].text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#tree g.node")) == trace.tree.num_nodes + 1
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chart rect.bar")) == n

    browser.find_element(By.ID, "next").click()
    counter2, text2 = read()
    assert counter2 == f"step 2 / {n}" and text2 != text

    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_RIGHT)
    counter3, text3 = read()
    assert counter3 == f"step 3 / {n}" and text3 != text2

    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_LEFT)
    assert read() == (counter2, text2)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors
