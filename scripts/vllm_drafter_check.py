#!/usr/bin/env python
"""Export an EAGLE-style drafter, serve it with vLLM's CPU build, and check it against vLLM and treespec.

    make vllm-env     # once: vLLM's CPU build in .venv-vllm
    python scripts/vllm_drafter_check.py --eagle heads/smollm2-135m-instruct-eagle --num-prompts 8

Exports the drafter in the EAGLE-3 layout (`treespec export`), starts vLLM twice on the embedded
SmolLM2 (float32, greedy): plain, and with the drafter (method "eagle3", a chain of --draft-tokens), and
decodes the same Spec-Bench prompts (same chat template) with treespec's EagleDrafter drafting the
same chain. Checks that the export loads, that vLLM's output with speculation equals its output
without, and that vLLM's acceptance rate (accepted / drafted tokens) is within --tolerance of
treespec's; prints the table and writes JSON. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    import treespec
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import treespec
from treespec.core.generate import encode_prompt
from treespec.tools.bench import load_questions, select_prompts
from treespec.tools.export import export_eagle3
from treespec.tools.models import default_data_file, default_model_folder
from treespec.tools.peers import VllmPeer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm_drafter_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--eagle", required=True, help="EAGLE-style drafter folder (train_eagle.py)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=3, help="chain length, in vLLM and treespec")
    p.add_argument("--tolerance", type=float, default=0.15, help="largest relative acceptance difference")
    p.add_argument("--vllm-python", default=None, help="vLLM environment's python (default .venv-vllm)")
    p.add_argument("--out", default=None, help="results JSON (default: print only)")
    args = p.parse_args(argv)

    model, tokenizer = treespec.load_model(dtype="float32")
    draft = treespec.EagleDraftModel.from_pretrained(args.eagle, model=model)
    prompts = select_prompts(load_questions(default_data_file()), args.num_prompts)
    ids = [encode_prompt(q["turns"][0], tokenizer) for q in prompts]

    # treespec: the same drafter, the same chain, greedy
    drafted = accepted = 0
    treespec_outputs = []
    for prompt in ids:
        drafter = treespec.EagleDrafter(draft, treespec.Tree.chain(args.draft_tokens), model)
        result = treespec.generate(model, prompt, drafter, tokenizer, max_new_tokens=args.max_new_tokens)
        treespec_outputs.append(list(result.token_ids))
        drafted += result.stats.steps * args.draft_tokens
        accepted += sum(result.stats.accept_lengths) - result.stats.steps
    treespec_rate = accepted / drafted if drafted else 0.0

    with tempfile.TemporaryDirectory() as tmp:
        exported = export_eagle3(draft, model, Path(tmp) / "eagle3", dtype=torch.float32)
        runs = {}
        for name, extra in (("vllm", {}), ("vllm_eagle3", {"draft": exported})):
            t0 = time.perf_counter()
            peer = VllmPeer(
                default_model_folder(),
                "float32",
                python=args.vllm_python,
                draft_tokens=args.draft_tokens,
                log=Path(tmp) / f"{name}.log",
                **extra,
            )
            started = time.perf_counter() - t0
            outputs = [peer.run(prompt, args.max_new_tokens)["token_ids"] for prompt in ids]
            metrics = peer.spec_metrics() if extra else {}
            peer.close()
            runs[name] = {"outputs": outputs, "metrics": metrics, "start_seconds": started}
    m = runs["vllm_eagle3"]["metrics"]
    vllm_rate = m["accepted_tokens"] / m["draft_tokens"] if m["draft_tokens"] else 0.0
    same = sum(a == b for a, b in zip(runs["vllm"]["outputs"], runs["vllm_eagle3"]["outputs"], strict=True))
    same_treespec = sum(
        a[: len(b)] == b[: len(a)] for a, b in zip(treespec_outputs, runs["vllm"]["outputs"], strict=True)
    )
    relative = abs(vllm_rate - treespec_rate) / max(treespec_rate, 1e-9)
    report = {
        "prompts": len(ids),
        "draft_tokens": args.draft_tokens,
        "vllm_speculative_equals_vllm_plain": f"{same}/{len(ids)}",
        "treespec_equals_vllm_plain": f"{same_treespec}/{len(ids)}",
        "acceptance_rate": {"treespec": treespec_rate, "vllm_eagle3": vllm_rate},
        "relative_difference": relative,
        "vllm_metrics": m,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    ok = same == len(ids) and relative <= args.tolerance
    print("checks passed" if ok else "a check failed", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running this
    sys.exit(main())
