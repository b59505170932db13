"""The bench's prompt sets ("workloads"), built from the data treespec ships in data/. All are for
evaluation only: nothing is trained or tuned on any of them.

- `spec-bench`: the first turn of Spec-Bench questions, a stratified subset (`select_prompts`).
- `sharegpt-heldout`: ShareGPT first turns of the distillation data's held-out split (the prompts the
  shipped drafters were never trained on; `training.distill.is_eval`), cut to 1500 characters, in the
  split's fixed hash order. Prompts of the style users send, beside Spec-Bench's.
- `refine`: a repetitive workload, multi-turn self-refinement. For each Spec-Bench question (the same
  stratified subset), the model's own plain greedy answer is generated once while the workload is built
  (not timed), then three requests are timed in a row: the question itself; the conversation so far +
  "Rewrite your answer to be more concise."; the conversation + "Check your answer for mistakes and give
  the corrected answer in full." The later answers copy much of the earlier one (in the prompt, and in
  the drafter's cache of earlier answers), as edits of a draft, of code in the prompt, or repeated
  agent requests do.

Every prompt is a dict: question_id, category, turns (the user turns, for the record) and ids (the
prompt's token ids, through the chat template).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..core.generate import chat_ids, encode_prompt
from ..training.distill import is_eval, load_prompts, order_hash
from .models import default_data_file

WORKLOADS = ("spec-bench", "sharegpt-heldout", "refine")
HELDOUT_FRACTION = 0.05  # the distillation data's eval_fraction (data/distill/*/meta.json)
MAX_PROMPT_CHARS = 1500
REFINE_TURNS = (
    ("refine-concise", "Rewrite your answer to be more concise."),
    ("refine-fix", "Check your answer for mistakes and give the corrected answer in full."),
)


def load_questions(path: Path) -> list[dict]:
    """Spec-Bench questions, one JSON object per line (question_id, category, turns)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def select_prompts(
    questions: list[dict], num_prompts: int, categories: list[str] | None = None
) -> list[dict]:
    """Round-robin over categories in file order; N >= number of categories covers each one."""
    by_category: dict[str, list[dict]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    if categories:
        missing = [c for c in categories if c not in by_category]
        if missing:
            raise SystemExit(f"unknown categories {missing}; the file has {list(by_category)}")
        by_category = {c: qs for c, qs in by_category.items() if c in categories}
    limit = num_prompts if num_prompts > 0 else sum(len(qs) for qs in by_category.values())
    picked: list[dict] = []
    for i in range(max((len(qs) for qs in by_category.values()), default=0)):
        for qs in by_category.values():
            if i < len(qs) and len(picked) < limit:
                picked.append(qs[i])
    return picked


def sharegpt_heldout(num_prompts: int, path: Path | None = None) -> list[dict]:
    """The first `num_prompts` (0: all) held-out ShareGPT prompts, in the split's fixed hash order."""
    path = path or Path(default_data_file()).parent / "sharegpt_prompts.json"
    prompts, _ = load_prompts(path)
    held = sorted((p for p in prompts if is_eval(p.id, HELDOUT_FRACTION)), key=lambda p: order_hash(p.id))
    held = held[:num_prompts] if num_prompts > 0 else held
    return [
        {"question_id": p.id, "category": "sharegpt-heldout", "turns": [p.text[:MAX_PROMPT_CHARS]]}
        for p in held
    ]


@torch.inference_mode()
def refine(model, tokenizer, questions: list[dict], max_new_tokens: int) -> list[dict]:
    """The self-refinement workload over `questions` (module docstring): 3 prompts per question."""
    import treespec

    out = []
    for q in questions:
        question = q["turns"][0]
        first_ids = encode_prompt(question, tokenizer)
        answer = treespec.generate(model, first_ids, None, tokenizer, max_new_tokens=max_new_tokens).text
        out.append({"question_id": f"{q['question_id']}", "category": "refine-first", "turns": [question]})
        out[-1]["ids"] = first_ids
        for category, request in REFINE_TURNS:
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": request},
            ]
            out.append(
                {
                    "question_id": f"{q['question_id']}-{category}",
                    "category": category,
                    "turns": [question, request],
                    "ids": chat_ids(tokenizer, messages),
                }
            )
    return out


def build_workload(
    name: str, tokenizer, model=None, num_prompts: int = 16, categories=None, data=None, max_new_tokens=128
) -> list[dict]:
    """The prompts of workload `name` (`WORKLOADS`), each with its token ids."""
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if name == "sharegpt-heldout":
        prompts = sharegpt_heldout(num_prompts)
    else:
        questions = select_prompts(
            load_questions(Path(data) if data else default_data_file()), num_prompts, categories
        )
        if name == "refine":
            return refine(model, tokenizer, questions, max_new_tokens)
        prompts = questions
    for p in prompts:
        p["ids"] = encode_prompt(p["turns"][0], tokenizer)
    return prompts
