"""Export what treespec trains to the formats serving engines load (`treespec export`).

    export_medusa(heads, model, out)     independent Medusa heads -> vLLM's Medusa format
    export_eagle3(draft, model, out)     the EAGLE-style drafter  -> vLLM / SGLang's EAGLE-3 format
    export_model(model, tokenizer, out)  the embedded default model -> a plain HF folder (config +
                                         safetensors + tokenizer) that engines serve as the target

Medusa (vLLM `MedusaConfig` / `models/medusa.py`): config.json with model_type "medusa", num_heads,
num_hidden_layers (residual blocks per head), hidden_size, vocab_size, truncated_vocab_size, and
`medusa_fc_bias`; weights blocks.{i}.layers.{j}.weight|bias (a block is x + SiLU(W x + b), as here),
lm_heads.{i}.weight, and `token_map` (draft index -> token id) with a draft vocabulary. Heads that share
the base model's output layer get `original_lm_head` and one lm_heads.0.weight (the draft rows).

EAGLE-3 (vLLM `models/llama_eagle3.py`, the speculators layout): a Llama config with
architectures ["LlamaForCausalLMEagle3"], draft_vocab_size, target_hidden_size and
eagle_aux_hidden_state_layer_ids (the target layers whose inputs are fused); weights fc.weight,
layers.0.{self_attn.q/k/v/o_proj, mlp.gate/up/down_proj, input_layernorm, hidden_norm,
post_attention_layernorm}.weight, norm.weight, lm_head.weight [draft vocab, H] and d2t (draft index ->
token id offset: token = index + d2t[index]) with t2d (a bool per token id: in the draft vocabulary).

What a format cannot express is refused with the reason and what to use instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..core.cache import text_config
from ..drafters.eagle_model import EagleDraftModel
from ..drafters.heads import MedusaHeads
from ..io import atomic_write, atomic_write_text


class ExportError(ValueError):
    """The drafter cannot be written in the asked format (the message says what to use instead)."""


def _save(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write(folder / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), {"format": "pt"}))
    atomic_write_text(folder / "config.json", json.dumps(config, indent=2) + "\n")
    return folder


def export_medusa(heads: MedusaHeads, model, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Independent Medusa heads -> a vLLM Medusa folder (config.json + model.safetensors)."""
    if heads.exit_layer:
        raise ExportError(
            "these are exit heads for self-speculative drafting; vLLM has no such drafter. Export Medusa "
            "heads (train_heads.py without --exit-layer) or an EAGLE drafter"
        )
    if heads.sequential:
        raise ExportError(
            "these heads are sequential (Hydra-style: each head also reads the token before its guess); "
            "vLLM's Medusa format has independent heads only. Train independent heads "
            "(train_heads.py without --sequential), or export an EAGLE drafter (--eagle) instead"
        )
    vocab, draft_size = heads.vocab_size, heads.draft_vocab_size or heads.vocab_size
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size,
        "vocab_size": vocab,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "truncated_vocab_size": draft_size,
        "medusa_fc_bias": True,
        "original_lm_head": not heads.own_lm_head,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    tensors = {}
    for i, blocks in enumerate(heads.blocks):
        for j, block in enumerate(blocks):
            tensors[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight.to(dtype)
            tensors[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias.to(dtype)
    if heads.own_lm_head:
        for i, lm in enumerate(heads.lm_heads):
            tensors[f"lm_heads.{i}.weight"] = lm.weight.to(dtype)  # [V', H]
    else:
        tensors["lm_heads.0.weight"] = heads.output_weight(model.get_output_embeddings()).to(dtype)  # [V', H]
    if heads.draft_vocab is not None:
        tensors["token_map"] = heads.draft_vocab.to(torch.long)
    return _save(Path(out), config, tensors)


def export_eagle3(
    draft: EagleDraftModel, model, out: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """The EAGLE-style drafter -> an EAGLE-3 folder for vLLM (--speculative-config method "eagle3")."""
    target = text_config(model)
    if target.hidden_size != draft.hidden_size:
        raise ExportError(
            f"EAGLE-3 engines run the draft layer at the target's width; this drafter has hidden size "
            f"{draft.hidden_size} and the target {target.hidden_size}"
        )
    last = target.num_hidden_layers
    if any(k < 0 or k >= last for k in draft.feature_layers):
        raise ExportError(
            f"EAGLE-3 engines fuse the inputs of target layers 0..{last - 1}; this drafter reads hidden "
            f"states {draft.feature_layers} (0 = embeddings, {last} = the final normed state), which they "
            "cannot provide: train it with --feature-layers inside that range (the default 2, L/2, L-3)"
        )
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": draft.hidden_size,
        "intermediate_size": draft.intermediate_size,
        "num_attention_heads": draft.num_heads,
        "num_key_value_heads": draft.num_kv_heads,
        "head_dim": draft.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": draft.rms_norm_eps,
        "rope_theta": draft.rope_theta,
        "hidden_act": "silu",
        "max_position_embeddings": getattr(target, "max_position_embeddings", 8192),
        "vocab_size": draft.vocab_size,
        "draft_vocab_size": draft.draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "tie_word_embeddings": False,
        "eagle_aux_hidden_state_layer_ids": list(draft.feature_layers),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(draft.feature_layers),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    names = {
        "fc": "fc",
        "q_proj": "layers.0.self_attn.q_proj",
        "k_proj": "layers.0.self_attn.k_proj",
        "v_proj": "layers.0.self_attn.v_proj",
        "o_proj": "layers.0.self_attn.o_proj",
        "gate_proj": "layers.0.mlp.gate_proj",
        "up_proj": "layers.0.mlp.up_proj",
        "down_proj": "layers.0.mlp.down_proj",
        "input_norm": "layers.0.input_layernorm",
        "hidden_norm": "layers.0.hidden_norm",
        "post_norm": "layers.0.post_attention_layernorm",
        "norm": "norm",
        "lm_head": "lm_head",
    }
    tensors = {f"{theirs}.weight": getattr(draft, mine).weight.to(dtype) for mine, theirs in names.items()}
    index = torch.arange(draft.draft_vocab_size)
    tensors["d2t"] = draft.draft_vocab.cpu() - index  # token id = draft index + d2t[index]
    t2d = torch.zeros(draft.vocab_size, dtype=torch.bool)
    t2d[draft.draft_vocab.cpu()] = True
    tensors["t2d"] = t2d
    return _save(Path(out), config, tensors)


def export_model(model, tokenizer, out: str | Path) -> Path:
    """The target model as a plain HF folder (safetensors + tokenizer) that engines serve."""
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
