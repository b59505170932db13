"""Calibration: the acceptance table on known ranks, and the budget choice."""

from __future__ import annotations

import pytest
import torch

import treespec
from treespec.calibrate import acceptance_table, choose_budget


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
