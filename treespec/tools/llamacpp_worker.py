"""A llama.cpp engine (llama-cpp-python) behind a pipe, for the benchmark's `llamacpp` and `llamacpp_lookup`
methods and the demo's llama.cpp line.

Runs inside its own virtual environment (`make llamacpp-env`: llama-cpp-python built from source for this
CPU), so it imports nothing from treespec. The parent (`treespec.tools.peers.LlamaCppPeer`) starts it as

    <llamacpp-venv>/bin/python llamacpp_worker.py --model FILE.gguf --threads N [--n-ctx N]
        [--lookup K --lookup-ngram G]   (llama-cpp-python's prompt-lookup decoding: K tokens drafted per
                                         step from the longest earlier match of the last G tokens or fewer)

and speaks JSON lines: the worker prints {"ready": true, ...} once the model is loaded, then answers each
request {"ids": [prompt token ids], "max_new_tokens": m, "stop_token_ids": [...]} with {"token_ids": [...],
"seconds": s}: greedy decoding from exactly those ids (no tokenisation, no BOS added, nothing reused from
the previous request's cache), stopping after m tokens or on a stop token (kept at the end, as HF's
`generate` keeps its end token; without stop_token_ids, the model's end-of-generation tokens). `seconds`
times the generation alone. It exits on end of input. llama.cpp's own prints go to stderr so that stdout
carries only these lines.

Greedy here means llama-cpp-python's `generate(temp=0)`: its sampler chain is then the penalties
sampler (a no-op at repeat_penalty 1.0, frequency and presence 0, which are set explicitly: earlier
versions defaulted to repeat_penalty 1.1 in `__call__`) followed by llama.cpp's greedy (argmax) sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--threads", type=int, required=True, help="threads for generation and for the prompt")
    p.add_argument("--n-ctx", type=int, default=4096, help="context length (prompt + new tokens)")
    p.add_argument("--n-batch", type=int, default=512, help="prompt tokens per decode call")
    p.add_argument("--lookup", type=int, default=0, help="prompt-lookup decoding: tokens per step (0 = off)")
    p.add_argument("--lookup-ngram", type=int, default=2, help="prompt lookup: longest n-gram matched")
    return p.parse_args()


def make_engine(args):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = None
    if args.lookup:
        draft = LlamaPromptLookupDecoding(max_ngram_size=args.lookup_ngram, num_pred_tokens=args.lookup)
    return Llama(
        model_path=args.model,
        n_ctx=args.n_ctx,
        n_batch=args.n_batch,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_gpu_layers=0,
        seed=0,
        # a draft model makes llama-cpp-python keep every position's logits, but it sizes that buffer from
        # this argument (n_batch rows when False): without it a draft step past position n_batch fails
        logits_all=draft is not None,
        draft_model=draft,
        verbose=False,
    )


def end_tokens(llm) -> list[int]:
    """The model's end-of-generation tokens (llama.cpp's EOG set: EOS, EOT, ...)."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]


def greedy(llm, ids: list[int], max_new_tokens: int, stop: set[int], keep_prefix: bool = False) -> list[int]:
    """Greedy continuation of exactly `ids`: at most max_new_tokens tokens, ending on a stop token if one
    comes. The context is reset first, so no prefix is reused from the request before; with keep_prefix,
    llama-cpp-python keeps the K/V of the longest prefix `ids` shares with the tokens it evaluated last
    (its own prefix match: a conversation's next turn)."""
    if not keep_prefix:
        llm.reset()
    tokens: list[int] = []
    if max_new_tokens <= 0:
        return tokens
    for token in llm.generate(
        ids,
        temp=0.0,
        top_k=1,
        top_p=1.0,
        min_p=0.0,
        typical_p=1.0,
        repeat_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        reset=True,
    ):
        tokens.append(int(token))
        if token in stop or len(tokens) >= max_new_tokens:
            break
    return tokens


def serve(llm, reply, default_stop: list[int]) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        ids = [int(t) for t in request["ids"]]
        n = int(request["max_new_tokens"])
        stop = set(int(t) for t in request.get("stop_token_ids") or default_stop)
        if len(ids) + n > llm.n_ctx():
            reply({"error": f"prompt ({len(ids)}) + new tokens ({n}) exceed n_ctx {llm.n_ctx()}"})
            continue
        t0 = time.perf_counter()
        tokens = greedy(llm, ids, n, stop, bool(request.get("keep_prefix")))
        reply({"token_ids": tokens, "seconds": time.perf_counter() - t0})


def main() -> None:
    args = parse_args()
    real_stdout = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # llama.cpp's own prints go to stderr

    def reply(obj: dict) -> None:
        real_stdout.write(json.dumps(obj) + "\n")
        real_stdout.flush()

    import llama_cpp

    llm = make_engine(args)
    stop = end_tokens(llm)
    reply(
        {
            "ready": True,
            "llama_cpp_python": llama_cpp.__version__,
            "model": args.model,
            "threads": args.threads,
            "n_ctx": llm.n_ctx(),
            "lookup": args.lookup,
            "lookup_ngram": args.lookup_ngram if args.lookup else None,
            "end_tokens": stop,
            "system": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        }
    )
    serve(llm, reply, stop)


if __name__ == "__main__":
    main()
