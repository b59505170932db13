"""A small draft model for speculative decoding: the target's first layers, briefly distilled.

`truncate_model(target, k)` copies the target's embedding, its first k decoder layers, its final norm and
its output layer into a new model of the same class (a shallow copy of the target: at k layers its hidden
state after layer j < k equals the target's exactly). `train_draft_model` then trains the decoder layers
and the final norm on the target's own greedy answers (`training.distill`), so that the draft's next-token
guess agrees with the target's as often as possible. The embedding and the output layer stay frozen (and
equal to the target's, tied if the target's are).

Loss: next-token cross-entropy at the response positions only (position t such that t+1 is a response
token); the output layer runs only at those positions. Batches are whole sequences, right-padded (the
model is causal, so real tokens never see the padding; padding is outside the loss). Held-out metric: top-1
agreement of the draft's greedy token with the target's on the eval split's response positions, a proxy
for how many tokens a chain of draft guesses gets accepted.

The optimizer steps run in the shared loop (`training.loop`). Checkpoints (`training.checkpoint`) are
atomic (a complete folder replaces the previous one) and hold the trained weights, the optimizer state
and the step; `resume=True` continues from the last one with the same data order and refuses a
checkpoint made with other settings or for another target.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel

from ..drafters.heads import fingerprints_match, model_identity
from ..io import atomic_write_json
from . import checkpoint
from .batching import length_batches
from .distill import META_NAME, data_folders, load_distill_data
from .loop import StepOutput, TrainLoop, evaluate_into, final_eval, resume_from
from .loop import run as run_loop

CHECKPOINT_DIR = "checkpoint"
MODEL_DIR = "model"
# settings that may change between a run and its resume (they do not change the weights)
RESUMABLE_CHANGES = (*checkpoint.RESUMABLE_CHANGES, "eval_sequences")  # may differ on --resume
# config attributes that list layer indices (not one entry per layer): keep the indices < k
_LAYER_INDEX_LISTS = ("mlp_only_layers",)
# config attributes that are a layer count / boundary: at most k
_LAYER_COUNTS = ("max_window_layers",)


# -- truncation --------------------------------------------------------------------------------------


def _decoder_layers(model) -> torch.nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no `model.layers` list of decoder layers; truncate_model supports "
            "Hugging Face decoders laid out as model.model.layers (Llama, Qwen2, Mistral, ...)"
        )
    return layers


def truncated_config(config, num_layers: int):
    """A copy of `config` with `num_layers` decoder layers, per-layer settings cut to match."""
    total = config.num_hidden_layers
    new = copy.deepcopy(config)
    for name, value in list(vars(new).items()):
        if "layer" not in name:
            continue
        if name in _LAYER_INDEX_LISTS and isinstance(value, (list, tuple)):
            setattr(new, name, type(value)(i for i in value if i < num_layers))
        elif name in _LAYER_COUNTS and isinstance(value, int) and not isinstance(value, bool):
            setattr(new, name, min(value, num_layers))
        elif isinstance(value, (list, tuple)) and len(value) == total:  # one entry per layer
            setattr(new, name, type(value)(value[:num_layers]))
    new.num_hidden_layers = num_layers
    return new


def truncate_model(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A new causal LM of the same class: copies of the target's embedding, first `num_layers` decoder
    layers, final norm and output layer (tied when the config ties them). Same dtype and device, eval mode.
    """
    layers = _decoder_layers(model)
    total = len(layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < total:
        raise ValueError(
            f"num_layers must be an integer in [1, {total}) for a target with {total} decoder layers, "
            f"got {num_layers!r}"
        )
    config = truncated_config(model.config, num_layers)
    reference = next(model.parameters())
    draft = type(model)(config).to(device=reference.device, dtype=reference.dtype)
    pattern = re.compile(r"^model\.layers\.(\d+)\.")
    state = {}
    for name, tensor in model.state_dict().items():
        match = pattern.match(name)
        if match is None or int(match.group(1)) < num_layers:
            state[name] = tensor
    draft.load_state_dict(state, strict=True)  # copies the values into the draft's own tensors
    tie = getattr(config, "tie_word_embeddings", False)
    output, inputs = draft.get_output_embeddings(), draft.get_input_embeddings()
    if tie and output is not None and output.weight is not inputs.weight:
        raise RuntimeError(f"{type(model).__name__}: the config ties the embeddings but the copy does not")
    if model.generation_config is not None:
        draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()


# -- settings and data -------------------------------------------------------------------------------


@dataclass
class DraftTrainConfig:
    """Settings of one draft-training run (saved with the checkpoint; a resume must match them)."""

    data: str
    out: str
    num_layers: int = 6
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 300
    batch_tokens: int = 4096  # rows x padded width per optimizer step
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_sequences: int | None = None  # evaluate on the first N eval sequences (None: all)
    checkpoint_every: int = 50
    seed: int = 0
    bf16: bool = True  # bf16 autocast; weights and optimizer stay float32
    extra: dict = field(default_factory=dict)


class BatchPlan:
    """The seeded data order: step -> batch of sequence indices, the same in a resumed run.

    Each epoch shuffles the sequences, packs pools of `pool` consecutive ones by length (little padding)
    and shuffles the resulting batches.
    """

    def __init__(self, lengths: list[int], batch_tokens: int, seed: int, pool: int = 256):
        self.lengths, self.batch_tokens, self.seed, self.pool = lengths, batch_tokens, seed, pool
        self._epochs: list[list[list[int]]] = []

    def epoch(self, e: int) -> list[list[int]]:
        while len(self._epochs) <= e:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + len(self._epochs))
            perm = torch.randperm(len(self.lengths), generator=gen).tolist()
            batches = []
            for start in range(0, len(perm), self.pool):
                pool = perm[start : start + self.pool]
                batches += length_batches(self.lengths, max_tokens=self.batch_tokens, order=pool)
            shuffle = torch.randperm(len(batches), generator=gen).tolist()
            self._epochs.append([batches[i] for i in shuffle])
        return self._epochs[e]

    def batch(self, step: int) -> list[int]:
        e = 0
        while step >= len(self.epoch(e)):
            step -= len(self.epoch(e))
            e += 1
        return self.epoch(e)[step]


def make_batch(sequences: list[Tensor], prompt_lengths: list[int], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Right-padded ids [B, W] and targets [B, W]: targets[b, t] = ids[b, t+1] where t+1 is a response
    token, else -100."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # [B, W]
    targets = torch.full((len(sequences), width), -100, dtype=torch.long)  # [B, W]
    for row, (seq, p) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        ids[row, : len(seq)] = seq
        targets[row, p - 1 : len(seq) - 1] = seq[p:]  # position t predicts token t+1 (a response token)
    return ids, targets


def _check_data(folder: str | Path, target) -> None:
    """The data must be the target's own answers: same vocabulary and weight fingerprint (one folder or
    several, `distill.data_folders`: they share one model, which `load_distill_data` checks)."""
    meta = json.loads((data_folders(folder)[0] / META_NAME).read_text())
    made_by = meta.get("model", {})
    mine = model_identity(target)
    if made_by.get("vocab_size") != mine["vocab_size"] or not fingerprints_match(
        made_by.get("fingerprint", []), mine["fingerprint"]
    ):
        raise ValueError(
            f"{folder}: the data were made by {made_by.get('name')!r} (vocab {made_by.get('vocab_size')}), "
            f"not by the target {mine['name']!r} (vocab {mine['vocab_size']}); a draft must learn its own "
            "target's answers: make data with scripts/make_distill_data.py for this target, or pass the "
            "model that made them"
        )


def _load_split(folder: str | Path, split: str, limit: int | None = None) -> tuple[list[Tensor], list[int]]:
    """Sequences with at least one response token, and their prompt lengths (first `limit` only)."""
    data = load_distill_data(folder, split)
    pairs = [(s, p) for s, p in zip(data.sequences, data.prompt_lengths, strict=True) if len(s) > p]
    if limit is not None:
        pairs = pairs[:limit]
    if not pairs:
        raise ValueError(f"{folder}: the {split} split has no sequence with a response token")
    return [s for s, _ in pairs], [p for _, p in pairs]


# -- loss and evaluation -----------------------------------------------------------------------------


def response_logits(draft: PreTrainedModel, ids: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The draft's logits at the positions with a target only: ([M, V], targets [M])."""
    hidden = draft.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, W, H] after the final norm
    mask = targets >= 0  # [B, W]
    logits = draft.get_output_embeddings()(hidden[mask])  # [M, V]
    return logits, targets[mask]


@torch.no_grad()
def evaluate_draft(
    draft: PreTrainedModel,
    sequences: list[Tensor],
    prompt_lengths: list[int],
    batch_tokens: int = 4096,
    bf16: bool = False,
) -> dict:
    """Top-1 agreement with the target's greedy tokens and mean cross-entropy on the response positions."""
    was_training = draft.training
    draft.eval()
    device = next(draft.parameters()).device
    hits, loss, count = 0, 0.0, 0
    for batch in length_batches([len(s) for s in sequences], max_tokens=batch_tokens):
        ids, targets = make_batch([sequences[i] for i in batch], [prompt_lengths[i] for i in batch])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits, y = response_logits(draft, ids.to(device), targets.to(device))  # [M, V], [M]
        hits += int((logits.argmax(-1) == y).sum())
        loss += float(F.cross_entropy(logits.float(), y, reduction="sum"))
        count += len(y)
    draft.train(was_training)
    return {"top1": hits / max(count, 1), "loss": loss / max(count, 1), "positions": count}


# -- checkpoints -------------------------------------------------------------------------------------


def _trainable(draft: PreTrainedModel) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in draft.named_parameters() if p.requires_grad}


def save_checkpoint(
    folder: Path, draft: PreTrainedModel, optimizer, step: int, cfg: DraftTrainConfig, log: list, target: dict
) -> None:
    """Write <folder>/checkpoint atomically: the trained weights, optimizer, step, settings, log and the
    target's identity."""
    weights = dict(_trainable(draft))
    checkpoint.save(folder / CHECKPOINT_DIR, weights, optimizer, step, cfg, log, extra={"target": target})


def load_checkpoint(
    folder: Path, draft: PreTrainedModel, optimizer, cfg: DraftTrainConfig, target: dict
) -> tuple[int, list]:
    """Restore the trained weights and optimizer from <folder>/checkpoint; returns (step, log). Refuses
    (before changing anything) a corrupt checkpoint, other settings or another target."""
    ckpt = folder / CHECKPOINT_DIR

    def same_target(extra: dict) -> None:
        made_for = extra.get("target", {})
        if not fingerprints_match(made_for.get("fingerprint", []), target["fingerprint"]):
            raise checkpoint.CheckpointError(
                f"{ckpt}: made for the target {made_for.get('name')!r}, not {target['name']!r}; "
                "use another --out or the same target model"
            )

    return checkpoint.load(ckpt, dict(_trainable(draft)), optimizer, cfg, RESUMABLE_CHANGES, same_target)


# -- the training loop -------------------------------------------------------------------------------


def _draft_optimizer(
    draft: PreTrainedModel, cfg: DraftTrainConfig
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Make the decoder layers and the final norm trainable (the rest frozen); AdamW with weight decay on
    matrices only. Returns (trained parameters, optimizer)."""
    draft.requires_grad_(False)
    draft.model.layers.requires_grad_(True)
    if getattr(draft.model, "norm", None) is not None:
        draft.model.norm.requires_grad_(True)
    params = list(_trainable(draft).values())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]  # norms, biases
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
    )
    return params, optimizer


def _draft_forward(
    cfg: DraftTrainConfig, draft: PreTrainedModel, sequences: list[Tensor], prompt_lengths: list[int]
):
    """forward(step) for the loop: next-token cross-entropy on the step-th batch of `BatchPlan`."""
    plan = BatchPlan([len(s) for s in sequences], cfg.batch_tokens, cfg.seed)
    device = next(draft.parameters()).device

    def forward(step: int) -> StepOutput:
        batch = plan.batch(step)
        ids, targets = make_batch(
            [sequences[i] for i in batch], [prompt_lengths[i] for i in batch]
        )  # [B, W] each
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            logits, y = response_logits(draft, ids.to(device), targets.to(device))  # [M, V], [M]
            loss = F.cross_entropy(logits.float(), y)
        return StepOutput(loss, postfix={"tokens": ids.numel()})

    return forward


def train_draft_model(cfg: DraftTrainConfig, target_model, resume: bool = False) -> dict:
    """Distill a truncated copy of the target (scripts/make_draft_model.py loads it, float32) on cfg.data;
    write <out>/model (safetensors) and <out>/training.json.

    Returns the training record: settings, steps, seconds, eval history and the final held-out top-1.
    """
    out = Path(cfg.out)
    draft = truncate_model(target_model, cfg.num_layers)  # checks num_layers first
    save_dtype = draft.dtype
    target = model_identity(target_model)
    _check_data(cfg.data, target_model)
    train_seqs, train_prompts = _load_split(cfg.data, "train")
    eval_seqs, eval_prompts = _load_split(cfg.data, "eval", cfg.eval_sequences)

    if draft.dtype not in (torch.float32, torch.float64):
        draft = draft.float()  # float32 master weights; bf16 only inside autocast
    params, optimizer = _draft_optimizer(draft, cfg)
    step, log = resume_from(
        out / CHECKPOINT_DIR, resume, lambda: load_checkpoint(out, draft, optimizer, cfg, target), warn=True
    )
    out.mkdir(parents=True, exist_ok=True)

    def evaluate() -> dict:
        return evaluate_draft(draft, eval_seqs, eval_prompts, cfg.batch_tokens, cfg.bf16)

    def save(at: int, at_log: list) -> None:
        save_checkpoint(out, draft, optimizer, at, cfg, at_log, target)

    if not any("eval" in e for e in log):
        evaluate_into(log, step, evaluate, _describe)  # the truncated model before training: the baseline
    forward = _draft_forward(cfg, draft, train_seqs, train_prompts)
    draft.train()
    result = run_loop(
        TrainLoop(cfg, optimizer, forward, evaluate, _describe, save, "train draft", params, cfg.grad_clip),
        step,
        log,
    )
    draft.eval()

    final = final_eval(result.log, result.step, evaluate, _describe)
    record = {
        "config": asdict(cfg),
        "target": target,
        "steps": result.step,
        "seconds_this_run": result.seconds,
        "seconds_per_step": result.seconds_per_step,  # optimizer steps only
        "train_sequences": len(train_seqs),
        "eval_sequences": len(eval_seqs),
        "eval_top1": final["top1"],
        "eval_history": [{"step": e["step"], **e["eval"]} for e in result.log if "eval" in e],
        "log": result.log,
    }
    draft.requires_grad_(False)
    draft.to(save_dtype).save_pretrained(out / MODEL_DIR)  # transformers 5 writes safetensors only
    atomic_write_json(out / "training.json", record, indent=1)
    return record


def _describe(result: dict) -> str:
    return f"eval top-1 {result['top1']:.4f} loss {result['loss']:.4f}"
