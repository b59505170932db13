"""`make demo` (scripts/demo.py) on the real default model: both drafters run, answer as HF does in
float32, and print the speedup; in int8 numerics the recipe answers as the int8 plain loop does."""

from __future__ import annotations

import pytest
from conftest import load_script

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("drafter", ["auto", "static"])
def test_the_demo_answers_as_hf_does_and_prints_the_speedup(capsys, drafter):
    demo = load_script("demo")
    argv = ["--prompt", "Name three primary colors.", "--max-new-tokens", "16", "--dtype", "float32"]
    assert demo.main([*argv, "--drafter", drafter]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "over HF generate" in out
    row = next(line for line in out.splitlines() if line.startswith("Name three primary colors."))
    assert row.split()[-1] == "yes"  # the answer equals HF generate's
    int8 = next(line for line in out.splitlines() if line.startswith("treespec int8    :"))
    assert "tokens/s" in int8 and "answers equal to its plain int8 loop's: 1/1" in int8
