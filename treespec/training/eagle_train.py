"""Train an EAGLE-style draft layer (`drafters.eagle_model`) on a frozen target, by self-distillation.

Data: the target's own answers (`training.distill`). For every sequence the target runs once and its
hidden states are cached on disk (bf16): the fused feature layers, and the final hidden state with the
log-normaliser of its logits, from which the soft labels over the draft vocabulary are recomputed exactly
(p_v = exp(h . w_v - logsumexp) for the V' draft rows), plus the target's greedy token.

Training-time test: the layer is unrolled `ttt_steps` times over each batch (`EagleDraftModel.unrolled`),
step j reading step j-1's outputs, with the attention each drafted position sees at decoding time. Step
j's output at position t guesses token t+2 (target distribution at t+1) for the chain anchored at t-j;
the loss is sum_j decay**j * CE(soft labels, draft distribution) over answer positions, so training sees
what decoding sees. `ttt_steps=1` is plain (EAGLE-1-style) training on the target's features only.

Evaluation (held-out split, every `eval_every` steps): for every anchor, whether each chain step's top
guess is the target's greedy token; per-position acceptance (step k right given steps < k were) and the
expected accepted length of a chain as deep as `ttt_steps` (+1 for the target's own token).

The optimizer steps run in the shared loop (`training.loop`). Runs under `accelerate launch` (DDP, each
process its share of each batch); checkpoints are atomic and `resume=True` continues from the last one
with the same batch order.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..drafters.eagle_model import EagleDraftModel, default_feature_layers
from ..io import atomic_write, atomic_write_json
from . import checkpoint
from .batching import length_batches
from .distill import load_distill_data
from .heads_train import draft_vocabulary
from .loop import StepOutput, TrainLoop, final_eval, resume_from
from .loop import run as run_loop

CHECKPOINT_DIR = "checkpoint"
FEATURES_VERSION = 1


@dataclass
class EagleTrainConfig:
    """Settings of one training run (saved with the checkpoint; a resume must match them)."""

    data: str
    out: str
    max_steps: int = 2000
    batch_tokens: int = 2048  # padded tokens per optimizer step, over all processes
    max_length: int = 512  # sequences are cut to this many tokens
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    ttt_steps: int = 5  # unrolled steps (1 = no training-time test)
    step_decay: float = 0.8
    soft_labels: bool = True  # False: cross-entropy on the target's greedy token
    feature_layers: list[int] | None = None  # default: low / middle / high (default_feature_layers)
    draft_vocab_size: int = 4096
    max_sequences: int | None = None  # use only the first N training sequences (data-size studies)
    eval_every: int = 200
    checkpoint_every: int = 100
    seed: int = 0
    cache: str | None = None  # where the target's features are kept (default <out>/cache); runs may share it
    bf16: bool = True  # the target in bf16 (features) and the layer's matmuls under bf16 autocast (CPU)
    init_from: str | None = None  # a drafter folder to start from (a new round of a committed drafter)
    tree_nodes: int = 16  # the tree.json written beside the drafter: the best tree of this many nodes
    extra: dict = field(default_factory=dict)


# -- the target's features, cached once ----------------------------------------------------------------


@torch.inference_mode()
def cached_features(
    model,
    data_folder: str | Path,
    cache: Path,
    split: str,
    layers: list[int],
    max_length: int,
    batch_tokens=4096,
) -> dict[str, Tensor]:
    """The target's hidden states for every sequence of a split, concatenated along tokens (each sequence
    cut at max_length): tokens [M] int64, starts [S+1] (sequence i is [starts[i], starts[i+1])),
    prompt_lengths [S], "layer{k}" [M, H] bf16 for each k in `layers` and for the last layer (the final,
    normed state: soft labels need it), lse [M] float32 (the log-normaliser of the target's logits) and
    greedy [M] int64 (its top token). Computed with one batched forward per length bucket and kept in
    `cache` (one file per split, length cut and target dtype); a cache without some layer is recomputed
    with all of them."""
    last = model.config.num_hidden_layers
    wanted = sorted(set(layers) | {last})
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # the target's: bf16 or float32
    path = cache / f"features-{split}-T{max_length}-{dtype}-v{FEATURES_VERSION}.safetensors"
    data = load_distill_data(data_folder, split)
    if path.is_file():
        stored = load_file(str(path))
        if stored["starts"].numel() - 1 != len(data.sequences):  # the data grew (more shards or folders)
            stored = {}
        if stored and all(f"layer{k}" in stored for k in wanted):
            return stored
        wanted = sorted(set(wanted) | {int(k[5:]) for k in stored if k.startswith("layer")})
    sequences = [s[:max_length] for s in data.sequences]
    lengths = [len(s) for s in sequences]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    # written in place, batch by batch: the features of every token held once (several GB for 1M tokens)
    hidden = model.config.hidden_size
    tensors = {f"layer{k}": torch.empty(starts[-1], hidden, dtype=torch.bfloat16) for k in wanted}
    tensors["lse"], tensors["greedy"] = torch.empty(starts[-1]), torch.empty(starts[-1], dtype=torch.long)
    lm = model.get_output_embeddings()
    device = lm.weight.device
    from tqdm import tqdm

    for batch in tqdm(length_batches(lengths, max_tokens=batch_tokens), desc=f"target features ({split})"):
        longest = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]], mask[row, : lengths[i]] = sequences[i], 1
        out = model.base_model(
            input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True
        )
        logits = lm(out.last_hidden_state).float()  # [b, T, V]
        lse, greedy = logits.logsumexp(-1), logits.argmax(-1)  # [b, T] each
        for row, i in enumerate(batch):
            span = slice(starts[i], starts[i + 1])
            for k in wanted:  # hidden_states[last] is the final, normed state
                tensors[f"layer{k}"][span] = out.hidden_states[k][row, : lengths[i]]
            tensors["lse"][span], tensors["greedy"][span] = lse[row, : lengths[i]], greedy[row, : lengths[i]]
    tensors["tokens"] = torch.cat(sequences)
    tensors["starts"] = torch.tensor(starts)
    tensors["prompt_lengths"] = torch.tensor(data.prompt_lengths)
    cache.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))
    return tensors


def sequence_lengths(store: dict[str, Tensor], limit: int | None = None) -> list[int]:
    """The token counts of a feature store's sequences (the first `limit` of them, when given)."""
    starts = store["starts"].tolist()
    return [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)][:limit]


def make_batch(
    store: dict[str, Tensor], rows: list[int], layers: list[int], embed: Tensor, lm_draft: Tensor
) -> dict[str, Tensor]:
    """Padded training tensors for sequences `rows` of a feature store (positions t = 0..T-2):

    features [b, T-1, F] at t, emb [b, T-1, H] of x_t+1, labels [b, T-1, V'] the target's log-probs of the
    draft tokens at t+1, greedy [b, T-1] its greedy token at t+1, valid [b, T-1] (x_t+2 exists and is
    part of the answer)."""
    starts, prompts = store["starts"], store["prompt_lengths"]
    lengths = [int(starts[i + 1] - starts[i]) for i in rows]
    t = max(lengths) - 1
    last = max(int(k[5:]) for k in store if k.startswith("layer"))  # the final state (soft labels)
    b, feat = len(rows), sum(store[f"layer{k}"].shape[1] for k in layers)
    out = {
        "features": torch.zeros(b, t, feat),
        "tokens": torch.zeros(b, t, dtype=torch.long),
        "final": torch.zeros(b, t, store[f"layer{last}"].shape[1]),
        "lse": torch.zeros(b, t),
        "greedy": torch.zeros(b, t, dtype=torch.long),
        "valid": torch.zeros(b, t, dtype=torch.bool),
    }
    for row, (i, n) in enumerate(zip(rows, lengths, strict=True)):
        s = int(starts[i])
        out["features"][row, : n - 1] = torch.cat(
            [store[f"layer{k}"][s : s + n - 1] for k in layers], -1
        ).float()
        out["tokens"][row, : n - 1] = store["tokens"][s + 1 : s + n]  # x_t+1
        out["final"][row, : n - 1] = store[f"layer{last}"][s + 1 : s + n].float()  # the target at t+1
        out["lse"][row, : n - 1] = store["lse"][s + 1 : s + n]
        out["greedy"][row, : n - 1] = store["greedy"][s + 1 : s + n]
        first = max(int(prompts[i]) - 2, 0)  # x_t+2 in the answer: t >= P - 2; and t + 2 < n
        out["valid"][row, first : n - 2] = True
    return {
        "features": out["features"],
        "emb": embed[out["tokens"]].float(),  # [b, T-1, H]
        "labels": out["final"] @ lm_draft.float().T - out["lse"][..., None],  # [b, T-1, V'] log-probs
        "greedy": out["greedy"],
        "valid": out["valid"],
    }


# -- loss and evaluation ------------------------------------------------------------------------------


def eagle_loss(
    draft: EagleDraftModel, outputs: list[Tensor], batch: dict[str, Tensor], cfg: EagleTrainConfig
) -> tuple[Tensor, list[float]]:
    """sum_j decay**j * mean CE of step j over its valid positions; also each step's top-1 agreement
    with the target's greedy token."""
    target_index = draft.draft_index(batch["greedy"])  # [b, T-1] (-100 outside the draft vocabulary)
    total, agreement = 0.0, []
    for j, h in enumerate(outputs):
        valid = batch["valid"].clone()
        valid[:, :j] = False  # no chain anchored before position 0
        logq = draft.logits(h).float().log_softmax(-1)[valid]  # [m, V']
        if cfg.soft_labels:
            ce = -(batch["labels"][valid].exp() * logq).sum(-1)  # [m]
        else:
            ce = F.nll_loss(logq, target_index[valid], ignore_index=-100, reduction="none")
        total = total + cfg.step_decay**j * ce.mean()
        agreement.append(float((logq.argmax(-1) == target_index[valid]).float().mean()) if len(logq) else 0.0)
    return total, agreement


def at_anchor(x: Tensor, j: int) -> Tensor:
    """x [b, T] at position a + j for every anchor a: [b, T] (False past the end)."""
    shifted = torch.zeros_like(x)
    shifted[:, : x.shape[1] - j] = x[:, j:]
    return shifted


@torch.no_grad()
def evaluate(
    draft: EagleDraftModel, store, embed, lm_draft, steps: int, batch_tokens: int = 4096, ranks: int = 10
) -> dict:
    """Chain acceptance on held-out sequences: acceptance[k] = P(step k right | steps < k right), the
    expected accepted length of a chain of `steps` drafted tokens (counting the target's own), and
    rank_acceptance[k][r] = P(the target's token is step k's rank-r guess | steps < k right), the table
    `Tree.from_acceptance` builds trees from (as the heads' acceptance.json)."""
    lengths = sequence_lengths(store)
    counts = torch.zeros(steps + 1)  # anchors whose first k steps were all right, k = 0..steps
    rank_counts = torch.zeros(steps, ranks)  # ... and whose step k put the target's token at rank r
    for rows in length_batches(lengths, max_tokens=batch_tokens):
        batch = make_batch(store, rows, draft.feature_layers, embed, lm_draft)
        outputs = draft.unrolled(batch["features"], batch["emb"], steps)
        target = draft.draft_index(batch["greedy"])  # [b, T-1]

        # anchors whose `steps` positions a .. a+steps-1 are all answer positions inside the sequence
        anchors = batch["valid"].clone()
        for j in range(steps):
            anchors &= at_anchor(batch["valid"], j)
        counts[0] += float(anchors.sum())
        right = anchors
        for j, h in enumerate(outputs):
            logits = draft.logits(h).float()  # [b, T-1, V']
            chosen = logits.gather(-1, target.clamp(min=0)[..., None])  # [b, T-1, 1]
            rank = torch.where(target >= 0, (logits > chosen).sum(-1), ranks)  # [b, T-1]
            rank = at_anchor(rank, j).masked_fill(~right, ranks)  # at the anchors still right
            rank_counts[j] += torch.bincount(rank.flatten(), minlength=ranks + 1)[:ranks].float()
            right = right & (rank == 0)
            counts[j + 1] += float(right.sum())
    reach = (counts / counts[0].clamp(min=1)).tolist()  # P(first k right), k = 0..steps
    acceptance = [reach[k + 1] / reach[k] if reach[k] > 0 else 0.0 for k in range(steps)]
    return {
        "acceptance": acceptance,
        "expected_accept_length": 1.0 + sum(reach[1:]),
        # for a chain of k + 1 drafted tokens, k = 0..steps-1 (the last one is expected_accept_length)
        "expected_accept_length_by_chain": [1.0 + sum(reach[1 : k + 2]) for k in range(steps)],
        "rank_acceptance": (rank_counts / counts[:steps, None].clamp(min=1)).tolist(),
        "anchors": int(counts[0]),
    }


# -- the training loop ---------------------------------------------------------------------------------


def _feature_layers(cfg: EagleTrainConfig, model) -> list[int]:
    """The target's hidden_states indices the draft fuses (checked)."""
    num_layers = model.config.num_hidden_layers
    layers = list(cfg.feature_layers or default_feature_layers(num_layers))
    if any(not 0 <= k <= num_layers for k in layers):
        raise ValueError(f"feature_layers must lie in 0..{num_layers} (hidden_states indices), got {layers}")
    return layers


def _features(cfg: EagleTrainConfig, model, layers: list[int], cache: Path, accelerator) -> tuple[dict, dict]:
    """The train and eval feature stores (the main process computes and caches them first)."""
    if accelerator.is_main_process:
        for split in ("train", "eval"):
            cached_features(model, cfg.data, cache, split, layers, cfg.max_length)
    accelerator.wait_for_everyone()
    train = cached_features(model, cfg.data, cache, "train", layers, cfg.max_length)
    return train, cached_features(model, cfg.data, cache, "eval", layers, cfg.max_length)


def _eagle_forward(
    cfg: EagleTrainConfig, ddp_draft, draft, train: dict, lengths, layers, embed, lm_draft, accelerator
):
    """forward(step) for the loop: the step-th batch of sequences (the epoch's length batches in a seeded
    order, so a resumed run continues the same sequence of batches), this process's share, and the loss."""
    batches = length_batches(lengths, max_tokens=cfg.batch_tokens)
    rank, world = accelerator.process_index, accelerator.num_processes

    def forward(step: int) -> StepOutput:
        epoch, offset = divmod(step, len(batches))
        order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        rows = batches[int(order[offset])][rank::world] or batches[int(order[offset])][:1]
        batch = make_batch(train, rows, layers, embed, lm_draft)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16 and lm_draft.device.type == "cpu"):
            outputs = ddp_draft(batch["features"], batch["emb"], cfg.ttt_steps)  # ttt_steps x [b, T-1, H]
            loss, agreement = eagle_loss(draft, outputs, batch, cfg)
        return StepOutput(loss, {"agreement": agreement}, {"top1": f"{agreement[0]:.3f}"})

    return forward


def train_eagle(cfg: EagleTrainConfig, model, resume: bool = False, accelerator=None) -> dict:
    """Train a draft layer for `model` (scripts/train_eagle.py loads cfg.extra['model'] or the embedded
    default, in bf16 when cfg.bf16), from the target's last layer or, with cfg.init_from, from an earlier
    round's drafter.
    Returns the training record (also <out>/training.json); the drafter is saved in <out>/drafter."""
    from accelerate import Accelerator

    if cfg.ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {cfg.ttt_steps}")
    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    out, ckpt = Path(cfg.out), Path(cfg.out) / CHECKPOINT_DIR
    model.requires_grad_(False)
    layers = _feature_layers(cfg, model)
    train, held_out = _features(cfg, model, layers, Path(cfg.cache or out / "cache"), accelerator)

    torch.manual_seed(cfg.seed)
    draft, rounds = _initial_draft(cfg, model, layers)
    embed = model.get_input_embeddings().weight.detach().float()  # [V, H]
    lm_draft = model.get_output_embeddings().weight.detach().float()[draft.draft_vocab]  # [V', H]
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    resumable = (*checkpoint.RESUMABLE_CHANGES, "cache")
    step, log = resume_from(
        ckpt,
        resume,
        lambda: checkpoint.load(ckpt, draft.state_dict(), optimizer, cfg, resumable),
        accelerator,
    )
    ddp_draft, optimizer = accelerator.prepare(draft, optimizer)

    lengths = sequence_lengths(train, cfg.max_sequences or None)  # (0: all of them, as None)
    count = len(lengths)

    def evaluate_eagle(which: EagleDraftModel = draft) -> dict:
        return evaluate(which, held_out, embed, lm_draft, max(cfg.ttt_steps, 5))

    def save(at: int, at_log: list) -> None:
        checkpoint.save(ckpt, draft.state_dict(), optimizer, at, cfg, at_log)

    forward = _eagle_forward(cfg, ddp_draft, draft, train, lengths, layers, embed, lm_draft, accelerator)
    params = list(draft.parameters())
    loop = TrainLoop(
        cfg, optimizer, forward, evaluate_eagle, _describe, save, "train eagle", params, 1.0, accelerator
    )
    result = run_loop(loop, step, log)

    record = {}
    if accelerator.is_main_process:
        answer_positions = sum(max(n - int(train["prompt_lengths"][i]), 0) for i, n in enumerate(lengths))
        final = final_eval(result.log, result.step, evaluate_eagle, _describe)
        this_round = {
            "init_from": cfg.init_from,
            "steps": result.step,
            "seconds": result.seconds,
            "eval": final,
        }
        record = {
            "config": asdict(cfg),
            "feature_layers": layers,
            "steps": result.step,
            "processes": accelerator.num_processes,
            "seconds_this_run": result.seconds,
            "train_sequences": count,
            "train_answer_positions": int(answer_positions),
            "eval": final,
            "rounds": [*rounds, this_round],  # every round behind these weights, the first one first
            # what decoding on CPU runs: the weights rounded to Q8_0 blocks (`round_to_blocks`)
            "eval_q8_0": evaluate_eagle(copy.deepcopy(draft).round_to_blocks()),
            "log": result.log,
        }
        draft.to(torch.bfloat16).save_pretrained(out / "drafter")
        draft.float()
        atomic_write_json(out / "training.json", record, indent=1)
        _write_beside_drafter(out / "drafter", record, cfg.tree_nodes)
    accelerator.wait_for_everyone()
    return record


def _initial_draft(cfg: EagleTrainConfig, model, layers: list[int]) -> tuple[EagleDraftModel, list]:
    """The layer to train, float32: a new one (from the target's last layer) or cfg.init_from's weights,
    with the rounds that trained them (from the `training.json` beside them, if any)."""
    if not cfg.init_from:
        draft_vocab = draft_vocabulary(cfg.data, cfg.draft_vocab_size, model.config.vocab_size)
        return EagleDraftModel.for_model(model, draft_vocab, feature_layers=layers).float(), []
    folder = Path(cfg.init_from)
    draft = EagleDraftModel.from_pretrained(folder, model, dtype=torch.float32)  # checks the model
    if list(draft.feature_layers) != layers or draft.draft_vocab_size != cfg.draft_vocab_size:
        raise ValueError(
            f"{folder} fuses layers {list(draft.feature_layers)} over {draft.draft_vocab_size} draft tokens, "
            f"but this run asks for {layers} and {cfg.draft_vocab_size}: pass the same --feature-layers "
            "and --draft-vocab-size to continue it"
        )
    record = folder / "training.json"
    rounds = []
    if record.is_file():
        earlier = json.loads(record.read_text())
        rounds = earlier.get("rounds") or [
            {
                "init_from": None,
                "steps": earlier.get("steps"),
                "seconds": earlier.get("seconds_this_run"),
                "eval": earlier.get("eval"),
            }
        ]
    return draft, rounds


def _write_beside_drafter(folder: Path, record: dict, tree_nodes: int) -> None:
    """training.json (the record), acceptance.json (held-out rank acceptance per chain step, the heads'
    format) and tree.json (the `tree_nodes`-node tree with the most expected accepted tokens under it)."""
    from ..core.tree import Tree

    table = record["eval"]["rank_acceptance"]
    atomic_write_json(folder / "training.json", record, indent=1)
    atomic_write_json(folder / "acceptance.json", {"acceptance": table}, indent=1)
    capacity = sum(len(table[0]) ** d for d in range(len(table) + 1))
    Tree.from_acceptance(table, min(tree_nodes, capacity)).save(folder / "tree.json")


def _describe(result: dict) -> str:
    return (
        f"held-out acceptance {' '.join(f'{a:.3f}' for a in result['acceptance'])}, "
        f"expected accepted length {result['expected_accept_length']:.2f}"
    )
