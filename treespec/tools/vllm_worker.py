"""A vLLM engine behind a pipe, for the benchmark's `vllm` and `vllm_ngram` methods.

Runs inside vLLM's own virtual environment (`make vllm-env`; vLLM pins an older transformers than
treespec), so it imports nothing from treespec. The parent (`treespec.tools.peers`) starts it as

    <vllm-venv>/bin/python vllm_worker.py --model FOLDER --dtype float32 [--ngram K] [--max-len N]
        [--draft FOLDER --draft-method eagle3|medusa --draft-tokens K]   (a drafter `treespec export` wrote)

and speaks JSON lines: the worker prints {"ready": ...} once its engine is up, then answers each request
{"ids": [prompt token ids], "max_new_tokens": m} with {"token_ids": [...], "seconds": s} (greedy,
stopping at the model's end-of-sequence tokens), and each batch request {"batch": [[ids], ...],
"max_new_tokens": m, "temperature": t, "seed": s, "stop_token_ids": [...]} (distillation data: vLLM
schedules the whole batch itself) with {"batch_token_ids": [[...], ...], "seconds": s}, the stop token
kept at the end of each answer that ended on one, and {"metrics": true} with vLLM's speculative-decoding
counters {"drafts", "draft_tokens", "accepted_tokens", "accepted_per_position"}; it exits on end of
input. Everything vLLM prints goes to stderr so that stdout carries only these lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ngram", type=int, default=0, help="n-gram speculation: tokens per step (0 = off)")
    p.add_argument("--max-len", type=int, default=4096, help="max model length (prompt + new tokens)")
    p.add_argument("--draft", default=None, help="an exported drafter folder (treespec export)")
    p.add_argument("--draft-method", default="eagle3", help="vLLM's method for --draft (eagle3, medusa)")
    p.add_argument("--draft-tokens", type=int, default=3, help="tokens drafted per step with --draft")
    return p.parse_args()


def make_engine(args):
    from vllm import LLM

    speculative = None
    if args.ngram:
        speculative = {
            "method": "ngram",
            "num_speculative_tokens": args.ngram,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
        }
    if args.draft:
        speculative = {
            "method": args.draft_method,
            "model": args.draft,
            "num_speculative_tokens": args.draft_tokens,
        }
    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_len,
        speculative_config=speculative,
        enforce_eager=False,
        seed=0,
        disable_log_stats=speculative is None,  # the speculative counters need the stats
    )


def spec_metrics(llm) -> dict:
    """vLLM's speculative-decoding counters so far (zeros without speculation)."""
    found = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    try:
        metrics = llm.get_metrics()
    except Exception:  # an engine without speculation runs with its stats off: nothing was counted
        return found
    for metric in metrics:
        if metric.name in names:
            found[names[metric.name]] = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["accepted_per_position"] = [int(v) for v in metric.values]
    return found


def serve(llm, reply) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("metrics"):
            reply(spec_metrics(llm))
            continue
        if "batch" in request:
            reply(answer_batch(llm, request))
            continue
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(request["max_new_tokens"]),
            repetition_penalty=float(request.get("repetition_penalty", 1.0)),  # HF's rule
        )
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=request["ids"])], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        reply({"token_ids": list(out[0].outputs[0].token_ids), "seconds": seconds})


def answer_batch(llm, request: dict) -> dict:
    """Answers to a batch of prompts in one `generate` call, each ending with its stop token if it hit one."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    stop = [int(t) for t in request.get("stop_token_ids", [])]
    params = SamplingParams(
        temperature=float(request.get("temperature", 0.0)),
        top_k=-1,
        top_p=1.0,
        max_tokens=int(request["max_new_tokens"]),
        # no per-request seed: vLLM 0.32's CPU build fails on one ("CPU Generator does not use offset")
        # once batches grow; sampling follows the engine's own seed (0) instead, not reproducible per shard
        seed=None,
        stop_token_ids=stop,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["batch"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    answers = []
    for out in outs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        hit = completion.stop_reason if isinstance(completion.stop_reason, int) else None
        if hit is not None and (not tokens or tokens[-1] != hit):
            tokens.append(hit)  # vLLM leaves a stop_token_ids token out of the answer: keep it, as HF does
        answers.append(tokens)
    return {"batch_token_ids": answers, "seconds": time.perf_counter() - t0}


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    real_stdout = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's own prints go to stderr

    def reply(obj: dict) -> None:
        real_stdout.write(json.dumps(obj) + "\n")
        real_stdout.flush()

    import vllm

    llm = make_engine(args)
    reply({"ready": True, "vllm": vllm.__version__, "ngram": args.ngram, "draft": args.draft})
    serve(llm, reply)


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running this
    main()
