"""Log 2026-12-07-e: a three-turn conversation per Spec-Bench question (the question, then the refine
workload's two requests in a row), each turn decoded by `treespec.Chat` (the history's K/V kept) and by a
fresh `treespec.generate` call on the same prompt ids; the two alternate which goes first per question.

    python benchmarks/log/2026-12-07-e-chat-turns.py [--questions 8] [--numerics fast,int8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import treespec
from treespec.core.generate import chat_ids
from treespec.tools.models import default_data_file
from treespec.tools.workloads import REFINE_TURNS, load_questions, select_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--numerics", default="fast,int8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = treespec.load_model()
    questions = select_prompts(load_questions(default_data_file()), args.questions)
    report = {
        "command": "python benchmarks/log/2026-12-07-e-chat-turns.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "runs": {},
    }
    for numerics in args.numerics.split(","):
        options = treespec.DecodeOptions(numerics=numerics)
        drafter = treespec.as_drafter(model, "auto", numerics=numerics)
        treespec.generate(model, "Hello", drafter, tokenizer, max_new_tokens=8, options=options)  # warm-up
        totals = {
            m: {"seconds": 0.0, "prefill": 0.0, "tokens": 0, "prompt_tokens": 0, "kept": 0}
            for m in ("chat", "fresh")
        }
        by_turn = [{m: {"seconds": 0.0, "prefill": 0.0} for m in ("chat", "fresh")} for _ in range(3)]
        equal = turns = 0
        for i, q in enumerate(questions):
            chat = treespec.Chat(
                model, tokenizer, drafter, max_new_tokens=args.max_new_tokens, options=options
            )
            history: list[dict] = []
            for turn, message in enumerate([q["turns"][0], *(request for _, request in REFINE_TURNS)]):
                history.append({"role": "user", "content": message})
                ids = chat_ids(tokenizer, history)
                results = {}
                for method in ("chat", "fresh") if (i + turn) % 2 == 0 else ("fresh", "chat"):
                    t0 = time.perf_counter()
                    if method == "chat":
                        result = chat.send(message)
                    else:
                        result = treespec.generate(
                            model,
                            ids,
                            drafter,
                            tokenizer,
                            max_new_tokens=args.max_new_tokens,
                            options=options,
                        )
                    seconds = time.perf_counter() - t0
                    results[method] = result
                    total, row = totals[method], by_turn[turn][method]
                    total["seconds"] += seconds
                    total["prefill"] += result.stats.time_prefill
                    total["tokens"] += len(result.token_ids)
                    total["prompt_tokens"] += len(result.prompt_ids)
                    total["kept"] += result.stats.prompt_reused
                    row["seconds"] += seconds
                    row["prefill"] += result.stats.time_prefill
                assert results["chat"].prompt_ids == ids
                equal += results["chat"].token_ids == results["fresh"].token_ids
                turns += 1
                history.append({"role": "assistant", "content": results["chat"].text})
            chat.close()
        for total in totals.values():
            total["tokens_per_second"] = total["tokens"] / total["seconds"]
        report["runs"][numerics] = {
            "totals": totals,
            "by_turn": by_turn,
            "equal_replies": equal,
            "turns": turns,
        }
        chat_t, fresh_t = totals["chat"], totals["fresh"]
        print(
            f"{numerics}: chat {chat_t['tokens_per_second']:.1f} tok/s (prefill {chat_t['prefill']:.2f} s, "
            f"{chat_t['kept']} of {chat_t['prompt_tokens']} prompt tokens kept), fresh "
            f"{fresh_t['tokens_per_second']:.1f} tok/s (prefill {fresh_t['prefill']:.2f} s); "
            f"replies equal {equal}/{turns}",
            flush=True,
        )
        for turn, row in enumerate(by_turn):
            chat_row, fresh_row = row["chat"], row["fresh"]
            print(
                f"  turn {turn + 1}: chat {chat_row['seconds']:.2f} s (prefill {chat_row['prefill']:.2f}),"
                f" fresh {fresh_row['seconds']:.2f} s (prefill {fresh_row['prefill']:.2f})",
                flush=True,
            )
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
