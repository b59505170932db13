"""How often tests/test_union.py's repeated-request check (steps < 25) fails when 10% of clock reads add a
10-200 ms pause (session 18; run from the repository root: python benchmarks/log/2026-12-04-b-pause-probe.py)."""

import random
import sys
import time

import torch

sys.path.insert(0, "tests")
from conftest import tiny_model  # noqa: E402
from test_union import cost, repeating_prompts  # noqa: E402

import treespec  # noqa: E402
from treespec.drafters import dynamic  # noqa: E402
from treespec.drafters.suffix import SuffixDrafter  # noqa: E402


def steps_on_repeat(seed: int, share: float = 0.1) -> int:
    rng, real, paused = random.Random(seed), time.perf_counter, [0.0]

    def clock() -> float:
        if rng.random() < share:
            paused[0] += rng.choice([0.01, 0.05, 0.2])
        return real() + paused[0]

    dynamic.time.perf_counter = clock
    model = tiny_model("llama", dtype=torch.float32)
    drafter = treespec.DynamicTreeDrafter(SuffixDrafter(), cost)
    for prompt in [[5] * 9, *repeating_prompts(3, 2), [5] * 9]:
        treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[])
    steps = treespec.generate(model, [5] * 9, drafter, max_new_tokens=40, eos_token_id=[]).stats.steps
    dynamic.time.perf_counter = real
    return steps


if __name__ == "__main__":
    fails = sum(steps_on_repeat(seed) >= 25 for seed in range(1, 31))
    print(f"fails {fails} / 30")
