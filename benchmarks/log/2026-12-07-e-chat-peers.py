"""Log 2026-12-07-e: three-turn conversations (a Spec-Bench question, then the refine workload's two
requests), each engine holding its own conversation (its own replies in the history), greedy, 128 new tokens
a turn. treespec `Chat` (float32 and int8; the history's K/V kept), treespec `generate` fresh every turn,
llama.cpp with its prefix match (`keep_prefix`) and reset every turn, vLLM n-gram (its prefix caching is on
by default) and HF `generate`. Engines take turns per question, in a rotating order.

    python benchmarks/log/2026-12-07-e-chat-peers.py [--questions 8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import treespec
from treespec.core.generate import chat_ids
from treespec.core.tokens import eos_token_ids
from treespec.tools.bench import hf_greedy
from treespec.tools.models import default_data_file, default_model_folder
from treespec.tools.peers import LlamaCppPeer, VllmPeer
from treespec.tools.workloads import REFINE_TURNS, load_questions, select_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = treespec.load_model()
    stop = eos_token_ids(model, tokenizer)
    n = args.max_new_tokens
    questions = select_prompts(load_questions(default_data_file()), args.questions)
    llamacpp = LlamaCppPeer(stop_token_ids=stop)
    vllm = VllmPeer(default_model_folder(), "float32", ngram=5)
    drafters = {m: treespec.as_drafter(model, "auto", numerics=m) for m in ("fast", "int8")}
    options = {m: treespec.DecodeOptions(numerics=m) for m in ("fast", "int8")}
    for m in ("fast", "int8"):  # warm-up: the first call's one-time setup and cost curves
        treespec.generate(model, "Hello", drafters[m], tokenizer, max_new_tokens=8, options=options[m])

    def fresh(numerics):
        def turn(state, ids):
            result = treespec.generate(model, ids, drafters[numerics], tokenizer, max_new_tokens=n,
                                       options=options[numerics])  # fmt: skip
            return result.token_ids

        return turn

    def chat(numerics):
        def turn(state, ids):
            if "chat" not in state:
                state["chat"] = treespec.Chat(model, tokenizer, drafters[numerics], max_new_tokens=n,
                                              options=options[numerics])  # fmt: skip
            result = state["chat"].send(state["message"])
            assert result.prompt_ids == ids
            return result.token_ids

        return turn

    engines = {
        "treespec Chat (float32)": chat("fast"),
        "treespec Chat (int8)": chat("int8"),
        "treespec generate, fresh each turn (float32)": fresh("fast"),
        "llama.cpp, prefix kept": lambda state, ids: llamacpp.run(ids, n, keep_prefix=True)["token_ids"],
        "llama.cpp, reset each turn": lambda state, ids: llamacpp.run(ids, n)["token_ids"],
        "vLLM n-gram (prefix caching)": lambda state, ids: vllm.run(ids, n)["token_ids"],
        "HF generate": lambda state, ids: hf_greedy(model, tokenizer, ids, n),
    }
    names = list(engines)
    totals = {e: {"seconds": 0.0, "tokens": 0, "turn_seconds": [0.0, 0.0, 0.0]} for e in names}
    replies: dict[str, list[list[int]]] = {e: [] for e in names}
    messages_of = [q["turns"][0] for q in questions]
    for i, first in enumerate(messages_of):
        order = names[i % len(names) :] + names[: i % len(names)]
        for engine in order:
            state: dict = {}
            history: list[dict] = []
            for turn, message in enumerate([first, *(request for _, request in REFINE_TURNS)]):
                history.append({"role": "user", "content": message})
                ids = chat_ids(tokenizer, history)
                state["message"] = message
                t0 = time.perf_counter()
                tokens = engines[engine](state, ids)
                seconds = time.perf_counter() - t0
                totals[engine]["seconds"] += seconds
                totals[engine]["tokens"] += len(tokens)
                totals[engine]["turn_seconds"][turn] += seconds
                replies[engine].append(tokens)
                history.append(
                    {"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)}
                )
            if "chat" in state:
                state["chat"].close()
        print(f"question {i + 1}/{len(questions)} done", flush=True)
    llamacpp.close()
    vllm.close()
    hf = replies["HF generate"]
    report = {"command": f"python benchmarks/log/2026-12-07-e-chat-peers.py --questions {args.questions}",
              "engines": {}}  # fmt: skip
    for engine in names:
        total = totals[engine]
        same = sum(a == b for a, b in zip(replies[engine], hf, strict=True))
        report["engines"][engine] = {**total, "tokens_per_second": total["tokens"] / total["seconds"],
                                     "turns_equal_to_hf": same, "turns": len(hf)}  # fmt: skip
    base = report["engines"]["HF generate"]["tokens_per_second"]
    ref = report["engines"]["llama.cpp, prefix kept"]["tokens_per_second"]
    for engine, r in report["engines"].items():
        turns = " / ".join(f"{s:.1f}" for s in r["turn_seconds"])
        print(f"{engine:46s} {r['tokens_per_second']:6.1f} tok/s  {r['tokens_per_second'] / base:5.2f}x HF  "
              f"{r['tokens_per_second'] / ref:5.2f}x llama.cpp kept  turns {turns} s  "
              f"= HF {r['turns_equal_to_hf']}/{r['turns']}")  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
