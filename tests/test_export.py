"""Export to serving formats: vLLM's Medusa layout and the EAGLE-3 layout, names, shapes and the maps
back to token ids; what a format cannot express is refused with what to use instead."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_heads, tiny_model
from safetensors.torch import load_file

import treespec
from treespec.tools.export import ExportError, export_eagle3, export_medusa


def test_medusa_export_has_vllms_names_and_the_draft_rows(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    draft = torch.randperm(96, generator=torch.Generator().manual_seed(0))[:40]
    heads = random_heads(model, num_heads=3, draft_vocab=draft)
    out = export_medusa(heads, model, tmp_path / "m", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["num_hidden_layers"] == 1
    assert config["truncated_vocab_size"] == 40 and config["original_lm_head"] and config["medusa_fc_bias"]
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["blocks.2.layers.0.weight"], heads.blocks[2][0].linear.weight)
    assert torch.equal(tensors["lm_heads.0.weight"], model.lm_head.weight[draft])
    assert torch.equal(tensors["token_map"], draft)
    # what vLLM computes for head k (x + SiLU(W x + b), then the draft rows) equals the heads' logits
    x = torch.randn(5, model.config.hidden_size)
    for k in range(3):
        block = x + torch.nn.functional.silu(
            x @ tensors[f"blocks.{k}.layers.0.weight"].T + tensors[f"blocks.{k}.layers.0.bias"]
        )
        expected = heads(x[None], model.lm_head)[k, 0]
        torch.testing.assert_close(block @ tensors["lm_heads.0.weight"].T, expected)


def test_medusa_export_refuses_sequential_and_exit_heads(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ExportError, match="sequential.*EAGLE"):
        export_medusa(random_heads(model, sequential=True), model, tmp_path / "a")
    exit_head = treespec.ExitHead.for_model(model, exit_layer=1)
    with pytest.raises(ExportError, match="exit heads"):
        export_medusa(exit_head, model, tmp_path / "b")


def test_eagle3_export_names_and_vocabulary_map(tmp_path):
    model = tiny_model("llama", dtype=torch.float32, num_hidden_layers=4)
    vocab = torch.randperm(96, generator=torch.Generator().manual_seed(1))[:50]
    draft = treespec.EagleDraftModel.for_model(model, vocab)
    out = export_eagle3(draft, model, tmp_path / "e", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 50
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == draft.feature_layers == [2, 2, 1]
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (48, 96)  # [heads x D, 2H]
    assert torch.equal(tensors["lm_head.weight"], draft.lm_head.weight)
    assert torch.equal(torch.arange(50) + tensors["d2t"], vocab)  # token = draft index + d2t
    assert tensors["t2d"].sum() == 50 and bool(tensors["t2d"][vocab].all())


def test_eagle3_export_refuses_the_final_normed_state(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    draft = treespec.EagleDraftModel.for_model(model, torch.arange(40), feature_layers=[2])
    with pytest.raises(ExportError, match="--feature-layers"):
        export_eagle3(draft, model, tmp_path / "e")


def test_export_command(tmp_path, capsys):
    from treespec.tools.cli import main

    code = main(["export", "--out", str(tmp_path / "x"), "--heads", str(tmp_path / "missing")])
    assert code == 2 and "--heads" in capsys.readouterr().err
