"""The decoding loop: draft a tree, verify it in one forward pass, commit the longest accepted branch.

    prefill(prompt) -> hidden at the last prompt token -> root token (the base model's own choice)
    loop:
        tokens = drafter.draft(hidden, root)                      # [N] candidate tree
        hidden = base(tokens, positions c + depth, tree_mask)     # [N, H], K/V written at [c, c+N)
        path, bonus = verify(tokens, logits = lm_head(hidden))    # accepted nodes, base's next token
        cache.commit(path)                                        # c += len(path), rest rolled back
        emit tokens[path][1:] + [bonus]; root = bonus; hidden = hidden[path[-1]]

With heads=None the tree is the root alone: the same loop is plain one-token-at-a-time decoding
on the same cache and attention (the baseline that benchmarks compare against).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..drafters.heads import MedusaHeads
from ..drafters.lookup import LookupDrafter
from ..drafters.medusa import Drafter, RootOnlyDrafter, make_drafter
from .acceptance import RULES, SamplingConfig, verify
from .attention import KERNELS, auto_kernel, tree_attention_enabled
from .cache import CacheCapacityError, TreeKVCache
from .stats import GenerationStats
from .tree import Tree, default_tree


@dataclass
class GenerationResult:
    """What `generate` returns: the new token ids, their text, and per-step statistics."""

    token_ids: list[int]
    text: str | None
    prompt_ids: list[int]
    stats: GenerationStats
    tree: Tree | None = None  # the candidate tree used (root-only for plain decoding)
    trace: list[dict] = field(
        default_factory=list
    )  # with trace=True: per step tokens, draft_probs, path, bonus


def encode_prompt(prompt, tokenizer=None, chat: bool | None = None) -> list[int]:
    """A prompt as token ids. A string goes through the chat template when the tokenizer has one
    (chat=None: auto) or through the plain tokenizer otherwise."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty: pass some text or token ids")
        if tokenizer is None:
            raise ValueError("a string prompt needs tokenizer=: pass the model's tokenizer, or token ids")
        use_chat = getattr(tokenizer, "chat_template", None) is not None if chat is None else chat
        if use_chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(prompt)["input_ids"]
        return [int(t) for t in ids]
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2:
            if prompt.shape[0] != 1:
                raise ValueError(
                    f"treespec.generate decodes one sequence at a time; got a batch of {prompt.shape[0]}"
                )
            prompt = prompt[0]
        ids = [int(t) for t in prompt.tolist()]
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty: pass some text or token ids")
    return ids


def _eos_ids(eos_token_id, model, tokenizer) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return set()
    return {int(e) for e in (eos_token_id if isinstance(eos_token_id, Sequence) else [eos_token_id])}


class _Timer:
    """Accumulates wall time per phase; synchronises CUDA so phases are not mis-attributed."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _base_forward(model, ids: torch.Tensor, positions: torch.Tensor, cache, tree_mask, kernel):
    """Run the decoder (no lm_head): ids [1, n] -> last hidden states [n, H]."""
    out = model.base_model(
        input_ids=ids,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        tree_mask=tree_mask,
        tree_kernel=kernel,
    )
    return out.last_hidden_state[0]  # [n, H]


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Base model logits for hidden states [n, H] -> [n, V]."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.inference_mode()
def generate(
    model,
    heads: MedusaHeads | None,
    prompt_or_input_ids,
    tokenizer=None,
    tree: Tree | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    streamer=None,
    acceptance: str = "sampling",
    seed: int | None = None,
    kernel: str = "auto",
    chat: bool | None = None,
    max_length: int | None = None,
    drafter: Drafter | None = None,
    trace: bool = False,
    lookup: int = 0,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens with tree speculation.

    model: a transformers causal LM; heads: MedusaHeads for it (None = plain decoding, see
    `generate_baseline`); prompt_or_input_ids: a string (chat template applied when the tokenizer
    has one), a list of ids or a [1, T] tensor; tree: candidate tree (default: 32 nodes for the
    heads' depth). temperature 0 is greedy (output == the base model's greedy output);
    temperature > 0 samples losslessly (acceptance="sampling") or with Medusa's typical rule
    (acceptance="typical", faster, not lossless). top_k/top_p warp the distribution as in HF.
    eos_token_id: default from the model's generation config. stop: strings that end generation.
    streamer: HF-style (`put`, `end`), e.g. transformers.TextStreamer. kernel: tree attention
    implementation: "auto" (default: "compiled" when treespec's extension builds and takes the
    model's dtype and device, else "sdpa"), "compiled" (with the fused KV commit), "sdpa" or
    "reference" (torch attention and the torch commit). max_length: cache capacity (default: the
    model's max_position_embeddings). lookup: length of an extra prompt-lookup branch under the root
    (`treespec.drafters.lookup`; 0 = none); with heads=None it is plain prompt-lookup decoding. drafter: any
    other drafter instead of heads (pass heads=None), e.g. `DraftModelDrafter` (a small model with its
    own speculative cache) or `SelfSpeculativeDrafter` (the model's first layers and an exit head).
    """
    if acceptance not in RULES:
        raise ValueError(f"unknown acceptance rule {acceptance!r}; choose one of {RULES}")
    if kernel not in KERNELS and kernel != "auto":
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {['auto', *sorted(KERNELS)]}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if stops and tokenizer is None:
        raise ValueError("stop strings need tokenizer= to decode the text")
    prompt_ids = encode_prompt(prompt_or_input_ids, tokenizer, chat)

    if drafter is None:
        if heads is None:
            drafter = RootOnlyDrafter()
        else:
            heads.check_compatible(model)
            tree = tree or default_tree(32, heads.num_heads)
            drafter = make_drafter(heads, tree, model)
    if lookup:
        drafter = LookupDrafter(drafter, lookup)
    tree = drafter.tree
    param = next(model.parameters())
    device = param.device
    if kernel == "auto":
        kernel = auto_kernel(device, param.dtype)
    children = [tree.children(i) for i in range(tree.num_nodes)]
    tree_mask = tree.ancestor_mask.to(device)  # [N, N]
    depth = tree.depth.to(device)  # [N]

    # Capacity: prompt + new tokens + one tree block must fit in the cache and the position range.
    limit = max_length or getattr(model.config, "max_position_embeddings", None) or 1 << 30
    needed = len(prompt_ids) + max_new_tokens + tree.num_nodes
    if needed > limit:
        raise CacheCapacityError(
            f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens={max_new_tokens} and a "
            f"{tree.num_nodes}-node tree the cache needs {needed} positions but the limit is {limit}: "
            "shorten the prompt or lower max_new_tokens"
        )
    sliding = getattr(model.config, "sliding_window", None)
    if sliding and getattr(model.config, "use_sliding_window", True) and needed > sliding:
        raise ValueError(
            f"this model uses sliding-window attention ({sliding} tokens) and treespec attends to the whole "
            f"prefix; keep prompt + max_new_tokens under {sliding - tree.num_nodes}"
        )
    cache = TreeKVCache.for_model(model, needed, spec_reserve=tree.num_nodes)
    # "compiled" includes the fused commit (when the extension is there); the torch kernels use torch's
    cache.fused_commit = None if kernel == "compiled" else False
    generator = None
    if seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
    eos = _eos_ids(eos_token_id, model, tokenizer)
    stats = GenerationStats(prompt_tokens=len(prompt_ids), max_depth=tree.max_depth)
    timer = _Timer(device)
    steps_trace: list[dict] = []
    if streamer is not None:
        streamer.put(torch.tensor([prompt_ids]))

    with tree_attention_enabled(model):
        t_start = timer.now()
        ids = torch.tensor([prompt_ids], device=device)  # [1, P]
        positions = torch.arange(len(prompt_ids), device=device)[None]  # [1, P]
        hidden = _base_forward(model, ids, positions, cache, None, kernel)[-1]  # [H]
        cache.commit_all()
        root = sampling.sample(_logits(model, hidden[None])[0], generator)
        out = [root]
        if hasattr(drafter, "reset"):  # stateful drafters: a draft model's cache, the lookup index
            drafter.reset(prompt_ids + [root], capacity=needed, target_cache=cache, kernel=kernel)
        stats.time_prefill = timer.now() - t_start
        if streamer is not None:
            streamer.put(torch.tensor([root]))

        finished = root in eos or _hits_stop(out, stops, tokenizer)
        while not finished and len(out) < max_new_tokens:
            t0 = timer.now()
            tokens = drafter.draft(hidden, root)  # [N]
            t1 = timer.now()
            c = cache.committed
            # a self-speculative drafter has run the lower layers already and verifies with the rest
            forward = getattr(drafter, "verify_forward", _base_forward)
            hidden_tree = forward(
                model,
                tokens[None],
                (c + depth)[None],
                cache,
                tree_mask if tree.num_nodes > 1 else None,
                kernel,
            )  # [N, H]
            logits = _logits(model, hidden_tree)  # [N, V]
            token_list = tokens.tolist()
            path, root = verify(acceptance, token_list, children, logits, sampling, generator)
            t2 = timer.now()
            cache.commit(path)
            hidden = hidden_tree[path[-1]]  # [H]
            t3 = timer.now()

            new = [token_list[i] for i in path[1:]] + [root]
            if hasattr(drafter, "observe"):
                drafter.observe(new)
            stats.record_step(len(path), t1 - t0, t2 - t1, t3 - t2)
            if trace:
                probs = getattr(drafter, "last_probs", None)
                steps_trace.append(
                    {
                        "tokens": token_list,
                        "draft_probs": None if probs is None else probs.tolist(),
                        "path": path,
                        "bonus": root,
                    }
                )
            # Stop conditions, applied to the tokens this step emitted, in order.
            for i, tok in enumerate(new):
                out.append(tok)
                if tok in eos or len(out) >= max_new_tokens or (stops and _hits_stop(out, stops, tokenizer)):
                    finished = True
                    new = new[: i + 1]
                    break
            if streamer is not None:
                streamer.put(torch.tensor(new))
        stats.time_total = timer.now() - t_start

    if streamer is not None:
        streamer.end()
    stats.new_tokens = len(out)
    stats.cache_memory = cache.memory_bytes()
    own = getattr(drafter, "inner", drafter)  # a lookup branch wraps the drafter that has a cache
    if hasattr(getattr(own, "cache", None), "memory_bytes"):
        stats.draft_cache_memory = own.cache.memory_bytes()
    if hasattr(getattr(own, "stats", None), "as_dict"):
        stats.drafter = own.stats.as_dict()
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(out, skip_special_tokens=True)
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
    return GenerationResult(
        token_ids=out, text=text, prompt_ids=prompt_ids, stats=stats, tree=tree, trace=steps_trace
    )


def _hits_stop(out: list[int], stops: list[str], tokenizer) -> bool:
    if not stops:
        return False
    text = tokenizer.decode(out[-64:], skip_special_tokens=True)
    return any(s in text for s in stops)


def generate_baseline(model, prompt_or_input_ids, tokenizer=None, **kwargs) -> GenerationResult:
    """Plain one-token-at-a-time decoding through the same cache, attention and loop (no drafting)."""
    return generate(model, None, prompt_or_input_ids, tokenizer=tokenizer, **kwargs)
