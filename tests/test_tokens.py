"""treespec.core.tokens.eos_token_ids: one rule for which ids end a sequence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treespec.core.tokens import eos_token_ids


def _model(eos):
    return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))


TOKENIZER = SimpleNamespace(eos_token_id=7)


@pytest.mark.parametrize(
    "model, tokenizer, explicit, want",
    [
        (_model(2), TOKENIZER, None, [2]),  # the generation config before the tokenizer
        (_model([5, 2, 5]), TOKENIZER, None, [2, 5]),  # sorted, unique
        (_model((3, 1)), None, None, [1, 3]),
        (_model(None), TOKENIZER, None, [7]),  # the tokenizer when the config names none
        (SimpleNamespace(), TOKENIZER, None, [7]),  # a model without a generation config
        (_model(None), None, None, []),
        (_model(None), SimpleNamespace(eos_token_id=None), None, []),
        (_model(2), TOKENIZER, 9, [9]),  # explicit wins
        (_model(2), TOKENIZER, [4, 4, 1], [1, 4]),
        (_model(2), TOKENIZER, [], []),  # explicit "never stop"
        (_model(torch.tensor([6, 2])), None, None, [2, 6]),
        (_model(torch.tensor(6)), None, None, [6]),
    ],
)
def test_eos_token_ids(model, tokenizer, explicit, want):
    got = eos_token_ids(model, tokenizer, explicit)
    assert got == want and all(type(i) is int for i in got)


@pytest.mark.parametrize("bad", ["2", [2.5], [None]])
def test_eos_token_ids_refuses_what_is_not_ids(bad):
    with pytest.raises(TypeError, match="eos_token_id"):
        eos_token_ids(_model(None), None, bad)
