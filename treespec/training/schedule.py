"""The learning-rate schedule of the training loop (`training.loop`): heads, EAGLE layer, draft models."""

from __future__ import annotations

import math
from typing import Any


def lr_at(step: int, cfg: Any) -> float:
    """Linear warm-up over cfg.warmup_steps, then cosine decay to 10% of cfg.lr at cfg.max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
