"""compare_heads.py's table rows: the best tree's expected accepted length per node budget."""

from __future__ import annotations

from conftest import load_script


def test_a_row_gives_rank0_acceptance_and_the_best_trees_expected_length():
    script = load_script("compare_heads")
    # 2 nodes: root + (0) = 1 + 0.5; 3 nodes: + (0, 0) at 0.5 * 0.5 = 0.25 beats (1) at 0.2
    assert script.row("x", [[0.5, 0.2], [0.5, 0.1]], [2, 3]) == "| x | 0.500 0.500 | 1.50 / 1.75 |"
