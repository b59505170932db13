"""The EAGLE-style draft network: one decoder layer over the target's own hidden features.

At sequence position t the layer reads two things and guesses the token two places ahead:

    feature   f_t    the target's hidden states at t from a few of its layers (low, middle, high),
                     fused to one vector by `fc`: [3H] -> [H]; or, when drafting further ahead, the
                     layer's own output at the previous position of the same draft chain ([H], no fc)
    token     x_t+1  the token after t (its embedding, from the target's own embedding table)

    u = cat(input_norm(embed(x_t+1)), hidden_norm(f))          [2H]
    h = f + attention(u) ; h = h + mlp(post_norm(h))            [H]  (attention over the layer's own K/V)
    logits = lm_head(norm(h))                                   [V'] over the draft vocabulary

so from the target's features at the last committed position and the root token, the layer guesses
the token after the root, and running it on its own output h with the guessed token guesses the next
one, and so on (a chain or a tree, one layer call per level). The attention keys/values live in the
drafter's own small cache (`core.spec_cache.SpeculativeKVCache`, one layer).

The draft vocabulary (`draft_vocab`, token ids of the V' rows of lm_head, most frequent first) keeps
one drafted token's output read small; `token_ids` maps draft indices back to the full vocabulary.

The layout follows EAGLE-3 (Li et al., 2025: fused low/mid/high features, hidden_norm, a 2H-wide
attention input) so the export to serving engines is a renaming. Checkpoints are a folder with
`config.json` and `model.safetensors`; loading checks everything first and refuses what does not fit.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from ..core.cache import text_config
from ..io import atomic_write, atomic_write_text
from .checkpoint_files import CONFIG_NAME, WEIGHTS_NAME, check_tensors, draft_vocab_problem, read_checkpoint
from .heads import check_made_for, model_identity

FORMAT = "treespec.eagle_drafter"
VERSION = 1
_TRAIN_HINT = "train a drafter for this model with scripts/train_eagle.py"


class EagleLoadError(ValueError):
    """An EAGLE drafter folder is missing, corrupt, or does not fit the model."""


def default_feature_layers(num_layers: int) -> list[int]:
    """Which of the target's hidden states the drafter fuses: after layers 2, L/2 and L-3 (EAGLE-3's
    low, middle and high), as indices into transformers' `hidden_states` (0 = the embeddings)."""
    return [min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)  # [..., 1]
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """The rotary tables at `positions` [...]: cos, sin [..., head_dim] float32 (each half the same)."""
    d = head_dim
    half = torch.arange(0, d, 2, device=positions.device, dtype=torch.float32)  # [D/2]
    inv_freq = 1.0 / theta ** (half / d)  # [D/2]
    angles = positions.float()[..., None] * inv_freq  # [..., D/2]
    return torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)


def rotate(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary position embedding (half-split, as Llama): x [B, heads, n, D], positions [B, n]."""
    d = x.shape[-1]
    cos, sin = (t[:, None] for t in rotary_cos_sin(positions, d, theta))  # [B, 1, n, D]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)  # [B, heads, n, D]
    return (x.float() * cos + rotated * sin).to(x.dtype)


class EagleDraftModel(nn.Module):
    """One decoder layer over [token embedding, fused target features]; see the module docstring."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        vocab_size: int,
        draft_vocab_size: int,
        feature_layers: list[int],
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        base_model: dict | None = None,
        *,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        for field, value in (
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("intermediate_size", intermediate_size),
            ("vocab_size", vocab_size),
            ("draft_vocab_size", draft_vocab_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if draft_vocab_size > vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the vocabulary ({vocab_size})")
        if not feature_layers or any(not isinstance(i, int) or i < 0 for i in feature_layers):
            raise ValueError(
                f"feature_layers must be a non-empty list of layer indices, got {feature_layers!r}"
            )
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim, self.intermediate_size = head_dim, intermediate_size
        self.vocab_size, self.draft_vocab_size = vocab_size, draft_vocab_size
        self.feature_layers = list(feature_layers)
        self.rms_norm_eps, self.rope_theta = float(rms_norm_eps), float(rope_theta)
        self.base_model = dict(base_model) if base_model is not None else None
        h, kw = hidden_size, {"device": device, "dtype": dtype}
        self.fc = nn.Linear(len(feature_layers) * h, h, bias=False, **kw)
        self.input_norm = RMSNorm(h, rms_norm_eps, **kw)
        self.hidden_norm = RMSNorm(h, rms_norm_eps, **kw)
        self.q_proj = nn.Linear(2 * h, num_heads * head_dim, bias=False, **kw)
        self.k_proj = nn.Linear(2 * h, num_kv_heads * head_dim, bias=False, **kw)
        self.v_proj = nn.Linear(2 * h, num_kv_heads * head_dim, bias=False, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, h, bias=False, **kw)
        self.post_norm = RMSNorm(h, rms_norm_eps, **kw)
        self.gate_proj = nn.Linear(h, intermediate_size, bias=False, **kw)
        self.up_proj = nn.Linear(h, intermediate_size, bias=False, **kw)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False, **kw)
        self.norm = RMSNorm(h, rms_norm_eps, **kw)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False, **kw)
        # draft index i -> token id draft_vocab[i] (most frequent first)
        self.register_buffer("draft_vocab", torch.arange(draft_vocab_size, device=device, dtype=torch.long))
        self.tree = None  # the drafting tree shipped with the weights (from_pretrained: tree.json), if any

    # -- building -----------------------------------------------------------------------------------
    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        draft_vocab: Tensor,
        feature_layers: list[int] | None = None,
        intermediate_size: int | None = None,
    ) -> EagleDraftModel:
        """A drafter shaped like one of `model`'s decoder layers, initialised from its last layer's
        attention and MLP (q/k/v take the 2H input: the layer's weights on both halves, halved) and
        from its output rows for the draft vocabulary. draft_vocab: token ids [V'] (most frequent first)."""
        config = text_config(model)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long)
        problem = draft_vocab_problem(draft_vocab, config.vocab_size)
        if problem:
            raise ValueError(f"draft_vocab {problem}")
        ref = model.get_output_embeddings().weight
        drafter = cls(
            config.hidden_size,
            num_heads,
            getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim,
            intermediate_size or config.intermediate_size,
            config.vocab_size,
            len(draft_vocab),
            feature_layers or default_feature_layers(config.num_hidden_layers),
            getattr(config, "rms_norm_eps", 1e-5),
            _rope_theta(config),
            model_identity(model),
            device=ref.device,
            dtype=ref.dtype,
        )
        drafter.draft_vocab.copy_(draft_vocab.to(ref.device))
        drafter._init_from(model)
        return drafter

    @torch.no_grad()
    def _init_from(self, model: nn.Module) -> None:
        """Start from the target's last decoder layer (with its norms), its final norm and output rows; fc
        averages the feature layers."""
        last = model.base_model.layers[-1]
        pairs = [
            (self.o_proj, last.self_attn.o_proj),
            (self.gate_proj, getattr(last.mlp, "gate_proj", None)),
            (self.up_proj, getattr(last.mlp, "up_proj", None)),
            (self.down_proj, getattr(last.mlp, "down_proj", None)),
        ]
        for mine, theirs in pairs:
            if theirs is not None and theirs.weight.shape == mine.weight.shape:
                mine.weight.copy_(theirs.weight)
        for mine, name in ((self.q_proj, "q_proj"), (self.k_proj, "k_proj"), (self.v_proj, "v_proj")):
            theirs = getattr(last.self_attn, name, None)
            if theirs is not None and theirs.weight.shape[0] == mine.weight.shape[0]:
                mine.weight.copy_(torch.cat([theirs.weight, theirs.weight], dim=1) / 2)  # [out, 2H]
        # the norms too: the layer's weights expect inputs at the target's scale, lm_head the final norm's
        final = getattr(model.base_model, "norm", None)
        for mine, theirs in (
            (self.input_norm, getattr(last, "input_layernorm", None)),
            (self.hidden_norm, getattr(last, "input_layernorm", None)),
            (self.post_norm, getattr(last, "post_attention_layernorm", None)),
            (self.norm, final),
        ):
            weight = getattr(theirs, "weight", None)
            if weight is not None and weight.shape == mine.weight.shape:
                mine.weight.copy_(weight)
        h, n = self.hidden_size, len(self.feature_layers)
        self.fc.weight.copy_(torch.eye(h).repeat(1, n) / n)  # [H, nH]: the mean of the feature layers
        self.lm_head.weight.copy_(model.get_output_embeddings().weight[self.draft_vocab])  # [V', H]

    def linear_layers(self) -> list[nn.Linear]:
        return [self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj] + [
            self.gate_proj,
            self.up_proj,
            self.down_proj,
            self.lm_head,
        ]

    @torch.no_grad()
    def round_to_blocks(self) -> EagleDraftModel:
        """Round every linear weight to the nearest Q8_0 value (`core.blocks.round_to_q8_0`), in place:
        on CPU in float32 the drafter then reads ~1.1 bytes per weight through treespec's block kernel
        (`core.packed`, linears="auto") instead of 4. Measure the acceptance it costs before shipping."""
        from ..core.blocks import round_to_q8_0

        for linear in self.linear_layers():
            if linear.weight.shape[1] % 32 == 0:  # (widths that are not whole blocks stay as they are)
                linear.weight.copy_(round_to_q8_0(linear.weight.float()).to(linear.weight.dtype))
        return self

    # -- the layer ------------------------------------------------------------------------------------
    def fuse(self, features: Tensor) -> Tensor:
        """The target's features at some positions [..., len(feature_layers) * H] -> [..., H]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def qkv(self, hidden: Tensor, emb: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """hidden, emb [B, n, H], positions [B, n] -> q [B, heads, n, D], k, v [B, kv heads, n, D]
        (rotated)."""
        b, n, _ = hidden.shape
        u = torch.cat([self.input_norm(emb.to(hidden.dtype)), self.hidden_norm(hidden)], dim=-1)  # [B, n, 2H]
        q = self.q_proj(u).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(u).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(u).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta), v

    def finish(self, hidden: Tensor, attended: Tensor) -> Tensor:
        """hidden [B, n, H] (the residual) and attention output [B, heads, n, D] -> the layer output h."""
        b, _, n, _ = attended.shape
        h = hidden + self.o_proj(attended.transpose(1, 2).reshape(b, n, -1))  # [B, n, H]
        m = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))  # [B, n, H]

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """q [B, heads, n, D] over keys/values [B, kv heads, L, D] where mask [n, L] (bool) allows."""
        # enable_gqa: each query head reads its key/value head in place (no copy of the cache per call)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def logits(self, h: Tensor) -> Tensor:
        """Draft-vocabulary logits of layer outputs: [..., H] -> [..., V']."""
        return self.lm_head(self.norm(h))

    def token_ids(self, index: Tensor) -> Tensor:
        """Draft-vocabulary indices -> token ids."""
        return self.draft_vocab.to(index.device)[index]

    def draft_index(self, token_ids: Tensor) -> Tensor:
        """Token ids -> draft indices, -100 for ids outside the draft vocabulary (and negative ids)."""
        table = torch.full((self.vocab_size,), -100, dtype=torch.long, device=token_ids.device)
        table[self.draft_vocab.to(token_ids.device)] = torch.arange(
            self.draft_vocab_size, device=token_ids.device
        )
        return torch.where(token_ids >= 0, table[token_ids.clamp(min=0)], torch.full_like(token_ids, -100))

    # -- training: the layer unrolled on its own outputs ----------------------------------------------
    def unrolled(self, features: Tensor, emb: Tensor, steps: int) -> list[Tensor]:
        """Training-time test: the layer run `steps` times over whole sequences, each step on the
        previous step's outputs, with the attention each drafted position sees at decoding time.

        features [B, T, F] (the target's, position t), emb [B, T, H] (embedding of x_t+1). Step j's output
        at position t is the chain anchored at position a = t - j (the last position with target features):
        it attends to step 0's keys at positions <= a and to step i's key at a + i for i = 1..j, and it
        guesses x_t+2. Returns the step outputs h [B, T, H] (positions t < j hold no chain; ignore them).
        """
        b, t_len, _ = emb.shape
        positions = torch.arange(t_len, device=emb.device).expand(b, t_len)  # [B, T]
        groups = self.num_heads // self.num_kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        hidden = self.fuse(features)  # [B, T, H]
        outputs, keys, values = [], [], []  # per step: h [B, T, H], k / v [B, heads, T, D]
        query_pos = torch.arange(t_len, device=emb.device)
        for j in range(steps):
            if j > 0:  # the previous step's output at t - 1 is this step's input at t
                hidden = torch.cat([torch.zeros_like(outputs[-1][:, :1]), outputs[-1][:, :-1]], dim=1)
            q, k, v = self.qkv(hidden, emb, positions)
            keys.append(k.repeat_interleave(groups, dim=1))
            values.append(v.repeat_interleave(groups, dim=1))
            # step 0's keys at s <= t - j (the committed prefix of the chain)
            scores = [q @ keys[0].transpose(-1, -2) * scale]  # [B, heads, T, T]
            allowed = query_pos[None, :] <= query_pos[:, None] - j  # [T, T]
            scores[0] = scores[0].masked_fill(~allowed, float("-inf"))
            # step i's key at t - j + i (the chain's own drafted entries), i = 1..j
            for i in range(1, j + 1):
                shift = j - i
                k_i = torch.cat(
                    [keys[i][:, :, :1].expand(-1, -1, shift, -1), keys[i][:, :, : t_len - shift]], 2
                )
                scores.append((q * k_i).sum(-1, keepdim=True) * scale)  # [B, heads, T, 1]
            # rows t < j allow no step-0 key but their own diagonal ones (finite; the loss ignores them)
            weights = torch.cat(scores, dim=-1).float().softmax(dim=-1).to(q.dtype)  # [B, heads, T, T + j]
            attended = weights[..., :t_len] @ values[0]  # [B, heads, T, D]
            for i in range(1, j + 1):
                shift = j - i
                v_i = torch.cat(
                    [values[i][:, :, :1].expand(-1, -1, shift, -1), values[i][:, :, : t_len - shift]], 2
                )
                attended = attended + weights[..., t_len + i - 1 : t_len + i] * v_i
            outputs.append(self.finish(hidden, attended))
        return outputs

    def forward(self, features: Tensor, emb: Tensor, steps: int) -> list[Tensor]:
        """Training: `unrolled` (what DDP wraps)."""
        return self.unrolled(features, emb, steps)

    # -- checkpoints -----------------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "feature_layers": self.feature_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "base_model": self.base_model,
            "dtype": str(self.fc.weight.dtype).removeprefix("torch."),
        }

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write config.json, model.safetensors (and tree.json when a tree is attached)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        atomic_write(folder / WEIGHTS_NAME, lambda path: save_file(tensors, str(path)))
        atomic_write_text(folder / CONFIG_NAME, json.dumps(self.config, indent=2))
        if self.tree is not None:
            self.tree.save(folder / "tree.json")

    @classmethod
    def from_pretrained(
        cls, folder: str | os.PathLike, model: nn.Module | None = None, dtype: torch.dtype | None = None
    ) -> EagleDraftModel:
        """Load a drafter folder; with `model`, check it was made for that model and follow its device
        and dtype. Everything is checked before any weight is used; a bad folder raises EagleLoadError."""
        folder = Path(folder)
        config, tensors = read_checkpoint(folder, "EAGLE drafter", FORMAT, VERSION, EagleLoadError)
        fields = {k: v for k, v in config.items() if k not in ("format", "version", "dtype")}
        try:
            drafter = cls(**fields, device="meta")
        except (TypeError, ValueError) as e:
            raise EagleLoadError(f"{folder / CONFIG_NAME} does not describe a drafter: {e}") from e
        check_tensors(
            folder / WEIGHTS_NAME, tensors, drafter.state_dict(), drafter.vocab_size, EagleLoadError
        )
        if model is not None and drafter.base_model is not None:
            try:
                check_made_for(drafter.base_model, model, "this drafter was made for", _TRAIN_HINT)
            except ValueError as error:
                raise EagleLoadError(f"cannot use the drafter in {folder}: {error}") from error
        ref = model.get_output_embeddings().weight if model is not None else None
        device = ref.device if ref is not None else "cpu"
        dtype = dtype or (ref.dtype if ref is not None else getattr(torch, config.get("dtype") or "float32"))
        drafter = cls(**fields, device=device, dtype=dtype)
        drafter.load_state_dict(tensors)
        if (folder / "tree.json").is_file():
            from ..core.tree import Tree

            drafter.tree = Tree.load(folder / "tree.json")
        return drafter


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)
