"""Calibration: the acceptance table on known ranks, and the budget choice."""

from __future__ import annotations

import json

import pytest
import torch

import treespec
from treespec.training.calibrate import acceptance_table, choose_budget


def test_acceptance_table_counts_ranks_given_the_parent():
    # identity heads and an identity output layer: every head's logits are x itself
    heads = treespec.MedusaHeads(num_heads=2, hidden_size=4, vocab_size=4)
    lm_head = torch.eye(4)
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0]]).repeat(4, 1)  # ranks: token 0 -> 0, 1 -> 1, 2 -> 2, 3 -> 3
    # column 0 is token t+1 (unused by independent heads); head 0 ranks 0,0,1,3; head 1 ranks 1,3,-,0
    y = torch.tensor([[2, 0, 1], [2, 0, 3], [2, 1, -100], [2, 3, 0]])
    table = acceptance_table(heads, lm_head, x, y, max_rank=2)
    assert table[0] == [pytest.approx(2 / 4), pytest.approx(1 / 4)]
    # head 1 counts only rows whose head-0 token was within the ranks and that have a target: rows 0, 1
    assert table[1] == [pytest.approx(0.0), pytest.approx(1 / 2)]


def test_choose_budget_trades_acceptance_for_cost():
    table = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.1]]
    cheap_big = {4: 1.0, 8: 1.0, 16: 1.0}
    best, report = choose_budget(table, cheap_big)
    assert best == 16  # free nodes: the biggest tree wins
    assert report[16]["expected_accept_length"] > report[4]["expected_accept_length"]
    steep = {4: 1.0, 8: 2.0, 16: 4.0}
    best, _ = choose_budget(table, steep)
    assert best == 4  # cost doubling per budget: the smallest wins


def test_tree_from_calibration_reads_the_acceptance_file(tmp_path):
    table = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.1]]
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps({"acceptance": table, "chosen": 8}))
    assert treespec.Tree.from_calibration(path, 8) == treespec.Tree.from_acceptance(table, 8)
    assert treespec.Tree.from_calibration(table, 5) == treespec.Tree.from_acceptance(table, 5)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an acceptance file"):
        treespec.Tree.from_calibration(tmp_path / "bad.json", 8)


def test_acceptance_table_of_sequential_heads_uses_the_true_previous_tokens():
    # no blocks and P_k = identity: u_k = x + embed(x_{t+1}) + ... + embed(x_{t+1+k}), logits = u_k
    heads = treespec.MedusaHeads(num_heads=2, hidden_size=4, vocab_size=4, num_layers=0, sequential=True)
    with torch.no_grad():
        for proj in heads.token_proj:
            proj.weight.copy_(torch.eye(4))
    embedding = torch.eye(4) * 10  # token i adds 10 to logit i: each head guesses the token it was shown
    x = torch.tensor([0.0, 0.1, 0.2, 0.3]).repeat(3, 1)  # breaks ties
    y = torch.tensor([[1, 1, 2], [2, 3, 3], [0, 0, -100]])  # columns: t+1, t+2 (head 0), t+3 (head 1)
    table = acceptance_table(heads, torch.eye(4), x, y, max_rank=2, embedding=embedding)
    assert table[0] == [pytest.approx(2 / 3), pytest.approx(1 / 3)]  # rows 0, 2 repeat t+1; row 1 rank 1
    # head 1 counts rows 0 and 1 (row 2 has no target): row 1 sees 2 then 3 and guesses 3 (right);
    # row 0 sees 1 twice, and target 2 ranks third behind 1 and 3 (a miss)
    assert table[1] == [pytest.approx(1 / 2), pytest.approx(0.0)]
