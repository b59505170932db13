"""Every causal-LM family of the installed transformers that builds from a tiny config: treespec against HF
greedy (float32, prompt 12 tokens, 24 new), plain and with a tree that drafts HF's continuation behind a wrong
sibling at every depth (depth 3); optionally with a sliding window of 8 positions (passed by the run).

    python benchmarks/log/2026-12-08-a-architecture-sweep.py [--window 8] > sweep.txt

ok: equal to HF (the tree's accepted length in brackets: 4.00 = every step took the whole branch); DIFF:
another text; refused: the exception treespec raised; HF fails: transformers itself did not run the config.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import hf_greedy  # noqa: E402
from test_architectures import GQA, MHA, KnownContinuation  # noqa: E402

import treespec  # noqa: E402

OWN = {  # families whose configs name their sizes otherwise
    "Bloom": dict(vocab_size=96, hidden_size=48, n_layer=2, n_head=6),
    "GPT2": dict(vocab_size=96, n_embd=48, n_layer=2, n_head=6),
    "GPTJ": dict(vocab_size=96, n_embd=48, n_layer=2, n_head=6, rotary_dim=4),
    "CodeGen": dict(vocab_size=96, n_embd=48, n_layer=2, n_head=6, rotary_dim=4),
    "Mpt": dict(vocab_size=96, d_model=48, n_layers=2, n_heads=6, max_seq_len=512),
    "OPT": dict(
        vocab_size=96,
        hidden_size=48,
        ffn_dim=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        word_embed_proj_dim=48,
    ),
    "FalconMamba": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2),
    "Jamba": {**GQA, "attn_layer_period": 2, "attn_layer_offset": 1},
}
MULTI_HEAD = {"GPTNeoX", "Persimmon", "Phi", "StableLm", "GPTBigCode", "Falcon", "Olmo", "Xglm", "BioGpt"}
FAMILIES = [
    "Llama",
    "Qwen2",
    "Mistral",
    "Qwen3",
    "Qwen3Moe",
    "Qwen2Moe",
    "Gemma",
    "Gemma2",
    "Gemma3Text",
    "Phi3",
    "Phi",
    "Olmo",
    "Olmo2",
    "Olmo3",
    "Olmoe",
    "Granite",
    "GraniteMoe",
    "Cohere",
    "Cohere2",
    "Starcoder2",
    "Mixtral",
    "SmolLM3",
    "Glm",
    "Exaone4",
    "Arcee",
    "Ernie4_5",
    "Apertus",
    "Nemotron",
    "BitNet",
    "DiffLlama",
    "Lfm2",
    "GptOss",
    "GPTNeoX",
    "Falcon",
    "GPT2",
    "GPTJ",
    "CodeGen",
    "OPT",
    "Mpt",
    "Persimmon",
    "GPTBigCode",
    "StableLm",
    "Bloom",
    "FalconMamba",
    "Jamba",
    "Doge",
]


def build(family: str, window: int | None):
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM", None) or getattr(
        transformers, f"{family}LMHeadModel", None
    )
    if family == "Gemma3Text":
        model_cls = transformers.Gemma3ForCausalLM
    settings = OWN.get(family) or (MHA if family in MULTI_HEAD else GQA)
    if window:
        settings = {**settings, "sliding_window": window, "use_sliding_window": True}
    torch.manual_seed(0)
    config = config_cls(**settings)
    config.pad_token_id = 0
    return model_cls(config).float().eval()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--families", default=",".join(FAMILIES))
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 12, 13]
    for family in args.families.split(","):
        try:
            model = build(family, args.window)
            want = hf_greedy(model, prompt, 24)
        except Exception as e:  # noqa: BLE001 - a config transformers itself does not run
            print(f"{family:12s} HF fails: {type(e).__name__}: {str(e)[:70]}")
            continue
        cells = []
        for name, drafter in (("plain", None), ("tree", KnownContinuation(want, 96))):
            try:
                out = treespec.generate(model, prompt, drafter, max_new_tokens=24, eos_token_id=[])
                verdict = "ok" if out.token_ids == want else "DIFF"
                cells.append(f"{name} {verdict} ({out.stats.mean_accept_length:.2f})")
            except Exception as e:  # noqa: BLE001 - the refusal is the result
                cells.append(f"{name} refused: {type(e).__name__}: {str(e)[:90]}")
        print(f"{family:12s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
