"""Train Medusa heads on a frozen base model (Medusa-1 style), by self-distillation.

The data are the base model's own answers (`treespec.training.distill`). At a response position t the base
model's output layer predicts token t+1; head k learns token t+2+k from the same last hidden state
(sequential heads also see the true tokens x_{t+1..t+1+k} before it: teacher forcing).
The loss is sum_k 0.8**k * CE_k, so nearer heads, whose guesses are checked first, weigh more.
With `draft_vocab_size` the heads' output layer covers only the most frequent tokens of the training
answers (CE over those; a target outside is ignored in the loss and counted as a miss in evaluation).

The base model is frozen, so its last hidden states are computed once (one batched forward per batch of
sequences) and cached on disk beside the output; training then only runs the heads and the shared
output layer. The loop runs unchanged under `accelerate launch` (DDP across processes): every process
reads the same cached states and trains on its own slice of each batch.

The optimizer steps run in the shared loop (`training.loop`). Checkpoints (`training.checkpoint`) are
atomic (a complete folder replaces the previous one) and `resume=True` continues from the last one with
the same data order, so a killed run loses at most `checkpoint_every` steps.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..drafters.heads import MedusaHeads, model_identity
from ..drafters.self_spec import layer_hidden_states
from ..io import atomic_write, atomic_write_json
from . import checkpoint
from .batching import length_batches
from .distill import load_distill_data
from .loop import StepOutput, TrainLoop, final_eval, resume_from
from .loop import run as run_loop

HIDDEN_NAME = "hidden_states-v2.safetensors"  # v2: tokens from t+1 on
CHECKPOINT_DIR = "checkpoint"
RESUMABLE_CHANGES = checkpoint.RESUMABLE_CHANGES  # may differ on --resume


@dataclass
class TrainConfig:
    """Settings of one training run (saved with the checkpoint; a resume must match them)."""

    data: str
    out: str
    num_heads: int = 4
    num_layers: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    max_steps: int = 1000
    batch_size: int = 256  # positions per optimizer step, over all processes
    loss_decay: float = 0.8
    eval_every: int = 200
    checkpoint_every: int = 100
    seed: int = 0
    bf16: bool = True
    hidden_batch_tokens: int = 4096
    max_positions: int | None = None  # cap on training positions (None: all)
    sequential: bool = False  # Hydra-style heads (see treespec.drafters.heads)
    own_lm_head: bool = False  # each head gets its own output layer (initialised from the base model's)
    draft_vocab_size: int = 0  # 0: the whole vocabulary
    exit_layer: int = 0  # k > 0: train one exit head on layer k for self-speculative drafting
    extra: dict = field(default_factory=dict)


# -- examples ----------------------------------------------------------------------------------------


@torch.inference_mode()
def last_hidden_states(
    model, sequences: list[Tensor], batch_tokens: int = 4096, desc: str = "hidden", layer: int = 0
) -> list[Tensor]:
    """The base model's final-norm hidden state at every position: list of [T_i, H] (model dtype).
    With `layer` k > 0: the final norm of the residual stream after the first k layers instead."""
    out: list[Tensor | None] = [None] * len(sequences)
    batches = length_batches([len(s) for s in sequences], max_tokens=batch_tokens)
    base = model.base_model
    from tqdm import tqdm

    for batch in tqdm(batches, desc=desc, unit="batch"):
        width = max(len(sequences[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # right padding: causal, so it is never seen
        for row, i in enumerate(batch):
            ids[row, : len(sequences[i])] = sequences[i]
        if layer:
            hidden = layer_hidden_states(model, ids.to(model.device), layer)  # [b, width, H]
        else:
            hidden = base(input_ids=ids.to(model.device)).last_hidden_state  # [b, width, H]
        for row, i in enumerate(batch):
            out[i] = hidden[row, : len(sequences[i])].cpu()
    return out  # type: ignore[return-value]


def head_examples(
    hidden: list[Tensor], sequences: list[Tensor], prompt_lengths: list[int], num_heads: int
) -> tuple[Tensor, Tensor]:
    """Training pairs at every response position t (from the last prompt token on).

    Returns x [M, H] (hidden at t) and y [M, K+1]: tokens t+1, t+2, ..., t+1+K (-100 past the end).
    Head k's target is y[:, k+1]; sequential head k conditions on y[:, k].
    """
    xs, ys = [], []
    for h, seq, p in zip(hidden, sequences, prompt_lengths, strict=True):
        T = len(seq)
        positions = torch.arange(max(p - 1, 0), T - 1)  # [m]: t such that t+1 is a response token
        if len(positions) == 0:
            continue
        targets = positions[:, None] + 1 + torch.arange(num_heads + 1)[None]  # [m, K+1]
        y = torch.where(targets < T, seq[targets.clamp(max=T - 1)], torch.full_like(targets, -100))
        xs.append(h[positions])
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)  # [M, H], [M, K+1]


def cached_examples(
    model,
    data_folder: str | Path,
    cache_folder: Path,
    split: str,
    num_heads: int,
    batch_tokens: int,
    exit_layer: int = 0,
):
    """Hidden states of one split, computed once and kept in `cache_folder` (safetensors).

    exit_layer k > 0: examples for an exit head, x = norm(layer-k state at t+1) and y[:, 1] = x_{t+2},
    i.e. the token right after the state's own position (head 0 of Medusa heads is one token further).
    """
    layer_tag = f"layer{exit_layer}-" if exit_layer else ""
    path = cache_folder / f"{split}-{layer_tag}{HIDDEN_NAME}"
    data = load_distill_data(data_folder, split)
    if path.is_file():
        tensors = load_file(path)
        if tensors["x"].shape[0] > 0 and int(tensors["num_sequences"]) == len(data.sequences):
            return tensors["x"], tensors["y"][:, : num_heads + 1]
    hidden = last_hidden_states(model, data.sequences, batch_tokens, f"hidden states ({split})", exit_layer)
    if exit_layer:
        hidden = [torch.cat([h[1:], h[-1:]]) for h in hidden]  # [T, H]: row t holds position t+1
    x, y = head_examples(hidden, data.sequences, data.prompt_lengths, max(num_heads, 8))
    cache_folder.mkdir(parents=True, exist_ok=True)
    tensors = {"x": x.contiguous(), "y": y.contiguous(), "num_sequences": torch.tensor(len(data.sequences))}
    atomic_write(path, lambda tmp: save_file(tensors, tmp))
    return x, y[:, : num_heads + 1]


def draft_vocabulary(data_folder: str | Path, size: int, vocab_size: int) -> Tensor:
    """The `size` most frequent token ids of the training answers (prompt tokens break ties): [size]."""
    data = load_distill_data(data_folder, "train")
    answer = torch.zeros(vocab_size, dtype=torch.float64)
    prompt = torch.zeros(vocab_size, dtype=torch.float64)
    for seq, p in zip(data.sequences, data.prompt_lengths, strict=True):
        answer += torch.bincount(seq[p:], minlength=vocab_size)[:vocab_size]
        prompt += torch.bincount(seq[:p], minlength=vocab_size)[:vocab_size]
    score = answer * (prompt.max() + 1) + prompt  # [V]: answers first, prompts second
    return score.argsort(descending=True, stable=True)[:size]  # [size]


# -- loss and metrics --------------------------------------------------------------------------------


def heads_loss(logits: Tensor, targets: Tensor, decay: float) -> tuple[Tensor, list[float]]:
    """logits [K, M, V'], targets [M, K] (draft-vocabulary indices) -> sum_k decay**k * CE_k, each CE_k."""
    losses = []
    total = logits.new_zeros((), dtype=torch.float32)
    for k in range(logits.shape[0]):
        ce = F.cross_entropy(logits[k].float(), targets[:, k], ignore_index=-100)
        losses.append(float(ce.detach()))
        total = total + decay**k * ce
    return total, losses


@torch.no_grad()
def evaluate(
    heads: MedusaHeads,
    lm_head: Tensor,
    x: Tensor,
    y: Tensor,
    embedding: Tensor | None = None,
    batch: int = 1024,
) -> dict:
    """Top-1 and top-5 accuracy of each head on (x [M, H], y [M, K+1]); a target outside the draft
    vocabulary counts as a miss."""
    K = heads.num_heads
    hits1, hits5, counts = torch.zeros(K), torch.zeros(K), torch.zeros(K)
    targets = heads.draft_index(y[:, 1 : K + 1])  # [M, K] (-100 outside the draft vocabulary)
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch], y[i : i + batch]  # [b, H], [b, K+1]
        logits = heads.predict(xb, yb, lm_head, embedding)  # [K, b, V']
        top5 = logits.topk(5, dim=-1).indices  # [K, b, 5]
        valid = yb[:, 1 : K + 1].T >= 0  # [K, b]
        target = targets[i : i + batch].T  # [K, b]
        hits1 += ((top5[..., 0] == target) & valid).sum(dim=1)
        hits5 += ((top5 == target[..., None]).any(-1) & valid).sum(dim=1)
        counts += valid.sum(dim=1)
    return {
        "top1": (hits1 / counts.clamp(min=1)).tolist(),
        "top5": (hits5 / counts.clamp(min=1)).tolist(),
        "positions": int(counts[0]),
    }


# -- the training loop -------------------------------------------------------------------------------


def _examples(cfg: TrainConfig, model, cache: Path, accelerator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training and held-out examples, x [M, H] and y [M, K+1] each (the main process computes and
    caches the hidden states first; the others then read them)."""
    args = (cfg.num_heads, cfg.hidden_batch_tokens, cfg.exit_layer)
    if accelerator.is_main_process:
        for split in ("train", "eval"):
            cached_examples(model, cfg.data, cache, split, *args)
    accelerator.wait_for_everyone()
    x, y = cached_examples(model, cfg.data, cache, "train", *args)
    x_eval, y_eval = cached_examples(model, cfg.data, cache, "eval", *args)
    if cfg.max_positions:
        x, y = x[: cfg.max_positions], y[: cfg.max_positions]
    return x, y, x_eval, y_eval


def _new_heads(cfg: TrainConfig, model, vocab_size: int) -> MedusaHeads:
    """Freshly initialised float32 heads for `model` (seeded), tagged with the model's identity."""
    draft_vocab = (
        draft_vocabulary(cfg.data, cfg.draft_vocab_size, vocab_size) if cfg.draft_vocab_size else None
    )
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads.for_model(
        model,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        sequential=cfg.sequential,
        own_lm_head=cfg.own_lm_head,
        draft_vocab=draft_vocab,
        exit_layer=cfg.exit_layer,
    ).float()
    heads.base_model = model_identity(model)
    return heads


def _heads_forward(cfg: TrainConfig, ddp_heads, heads, x, y, lm_weight, embed_weight, accelerator):
    """forward(step) for the loop: the step-th global batch of positions (a seeded permutation per
    epoch, so a resumed run continues the same order), this process's slice of it, and the loss."""
    targets_all = heads.draft_index(y[:, 1:])  # [M, K] draft-vocabulary indices, mapped once
    M, rank, world = len(x), accelerator.process_index, accelerator.num_processes

    def forward(step: int) -> StepOutput:
        epoch, offset = divmod(step * cfg.batch_size, M)
        perm = torch.randperm(M, generator=torch.Generator().manual_seed(cfg.seed + epoch))
        idx = perm[offset : offset + cfg.batch_size][rank::world]  # this process's slice of the global batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16 and x.device.type == "cpu"):
            tokens = y[idx]  # [b, K+1]: x_{t+1} .. x_{t+1+K}
            embeddings = None
            if cfg.sequential:
                before = tokens[:, : cfg.num_heads].T  # [K, b]
                embeddings = heads.embed_tokens(embed_weight, before)[:, None]  # [K, 1, b, H]
            logits = ddp_heads(x[idx].float()[None], lm_weight, token_embeddings=embeddings)
            logits = logits[:, 0]  # [K, b, V']
            loss, per_head = heads_loss(logits, targets_all[idx], cfg.loss_decay)
        return StepOutput(loss, {"per_head": per_head})

    return forward


def train_heads(cfg: TrainConfig, model, resume: bool = False, accelerator=None) -> dict:
    """Train heads for `model` (`treespec.load_model(cfg.extra.get("model"))`: the CLI loads it) on cfg.data.

    Returns the training record (also written to <out>/training.json): settings, steps, time, the
    held-out top-1/top-5 accuracy of every head, and the loss curve.
    """
    from accelerate import Accelerator

    if cfg.exit_layer and (cfg.num_heads != 1 or cfg.sequential):
        raise ValueError("an exit head (exit_layer > 0) is a single head: use num_heads=1, not sequential")
    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    out = Path(cfg.out)
    ckpt = out / CHECKPOINT_DIR  # heads' tensors, optimizer, step, settings, log (`training.checkpoint`)
    model.requires_grad_(False)
    x, y, x_eval, y_eval = _examples(cfg, model, out / "cache", accelerator)
    weight_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    lm_weight = model.get_output_embeddings().weight.detach().to(weight_dtype)  # [V, H]
    embed_weight = model.get_input_embeddings().weight.detach().to(weight_dtype)  # [V, H]
    heads = _new_heads(cfg, model, lm_weight.shape[0])
    lm_weight = heads.output_weight(lm_weight)  # [V', H] gathered once
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    restore = lambda: checkpoint.load(ckpt, heads.state_dict(), optimizer, cfg, RESUMABLE_CHANGES)
    step, log = resume_from(ckpt, resume, restore, accelerator)
    ddp_heads, optimizer = accelerator.prepare(heads, optimizer)

    def evaluate_heads() -> dict:
        return evaluate(heads, lm_weight, x_eval.float(), y_eval, embed_weight)

    def save(at: int, at_log: list) -> None:
        checkpoint.save(ckpt, accelerator.unwrap_model(ddp_heads).state_dict(), optimizer, at, cfg, at_log)

    forward = _heads_forward(cfg, ddp_heads, heads, x, y, lm_weight, embed_weight, accelerator)
    loop = TrainLoop(
        cfg, optimizer, forward, evaluate_heads, _describe, save, "train heads", accelerator=accelerator
    )
    result = run_loop(loop, step, log)

    heads = accelerator.unwrap_model(ddp_heads)
    world = accelerator.num_processes
    _write_rank_checksum(out, heads, accelerator.process_index, world)
    record = {}
    if accelerator.is_main_process:
        record = {
            "config": asdict(cfg),
            "steps": result.step,
            "processes": world,
            "seconds_this_run": result.seconds,
            "train_positions": len(x),
            "eval": final_eval(result.log, result.step, evaluate_heads, _describe),
            "log": result.log,
        }
        heads.to(torch.bfloat16).save_pretrained(out / "heads")
        atomic_write_json(out / "training.json", record, indent=1)
    accelerator.wait_for_everyone()
    return record


def _describe(acc: dict) -> str:
    return f"eval top-1 {_fmt(acc['top1'])} top-5 {_fmt(acc['top5'])}"


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def _write_rank_checksum(out: Path, heads: MedusaHeads, rank: int, world: int) -> None:
    """With several processes, each writes a checksum of its final heads (they must be identical)."""
    if world == 1:
        return
    digest = hashlib.sha256()
    for name, tensor in sorted(heads.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    atomic_write_json(out / f"rank-{rank}.json", {"rank": rank, "sha256": digest.hexdigest()}, indent=None)
