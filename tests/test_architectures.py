"""transformers architectures beyond Llama / Qwen2 / Mistral: each tiny random model decodes exactly as HF
greedy does (plain, and a tree whose wrong siblings come first), or is refused with a reason.

The tree test's drafter knows HF's continuation and drafts it behind a wrong sibling at every depth: a model
whose tree nodes saw their siblings (a layer attending without treespec's plan), whose attention lost an
architecture's terms (soft-capping, sinks, a sliding window) or whose layers kept a recurrent state would
differ from HF; accepted lengths of 4 show the tree was verified."""

from __future__ import annotations

import types

import pytest
import torch
import transformers
from conftest import TINY, hf_greedy, random_heads
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

import treespec
from treespec.core.attention import ScoreTerms, attention_with_terms
from treespec.core.drafting import BaseDrafter, Proposal
from treespec.core.support import UnsupportedModelError
from treespec.core.tree import Tree

GQA = {**TINY, "head_dim": 8}  # conftest's tiny shape (6 heads over 2 K/V heads), head_dim said outright
MHA = {k: v for k, v in GQA.items() if k not in ("num_key_value_heads", "head_dim")}
# (config class, model class, config): what a user's checkpoint of each family would bring, tiny
ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", GQA),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", GQA),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", GQA),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**GQA, "attn_logit_softcapping": 1.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GQA),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", GQA),
    "phi": ("PhiConfig", "PhiForCausalLM", MHA),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", GQA),
    "granite": ("GraniteConfig", "GraniteForCausalLM", GQA),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", GQA),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", GQA),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", GQA),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", GQA),  # attention sinks
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", MHA),
    "falcon": ("FalconConfig", "FalconForCausalLM", MHA),  # its layers do not pass keywords on
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=96, n_embd=48, n_layer=2, n_head=6)),
}
# families with sliding-window layers, their window set to 8 positions so a short sequence passes it
SLIDING = {
    "mistral": ("MistralConfig", "MistralForCausalLM", GQA),  # the native step gives way to HF's forward
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**GQA, "use_sliding_window": True, "max_window_layers": 1}),
    "gemma2": ARCHITECTURES["gemma2"],
    "gemma3": ARCHITECTURES["gemma3"],
    "gpt_oss": ARCHITECTURES["gpt_oss"],
    "cohere2": ARCHITECTURES["cohere2"],
}
PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 12, 13]


def build(spec, **overrides):
    config_name, model_name, settings = spec
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**settings, **overrides})
    config.pad_token_id = 0
    return getattr(transformers, model_name)(config).float().eval()  # float32: the MoE ops take no float64


class KnownContinuation(BaseDrafter):
    """Drafts HF's continuation as a tree of depth 3 whose first child at every depth is a wrong token."""

    def __init__(self, continuation: list[int], vocab: int, depth: int = 3):
        self.continuation, self.vocab = continuation + [0] * depth, vocab
        choices, path = [], []
        for _ in range(depth):
            choices += [path + [0], path + [1]]  # the wrong sibling first, then the right token
            path = path + [1]
        self.choices = choices
        self.tree = Tree.from_choices(choices)

    def start(self, sequence) -> None:
        self.done = 1  # tokens of the continuation committed: the root

    def observe(self, committed, features=None) -> None:
        self.done += len(committed[0])

    def propose(self, hidden, roots, max_depth=None) -> Proposal:
        tokens = [int(roots[0])]
        for choice in self.choices:
            right = self.continuation[self.done + len(choice) - 1]
            tokens.append(right if choice[-1] == 1 else (right + 1) % self.vocab)
        return Proposal(torch.tensor([tokens]))


def assert_decodes_as_hf(model, prompt=PROMPT, new=24) -> None:
    want = hf_greedy(model, prompt, new)
    plain = treespec.generate(model, prompt, None, max_new_tokens=new, eos_token_id=[])
    assert plain.token_ids == want
    tree = treespec.generate(model, prompt, KnownContinuation(want, 96), max_new_tokens=new, eos_token_id=[])
    assert tree.token_ids == want
    assert tree.stats.mean_accept_length > 3.5  # every step verified the whole depth-3 branch


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_decodes_as_hf_greedy(arch):
    assert_decodes_as_hf(build(ARCHITECTURES[arch]))


@pytest.mark.parametrize("arch", sorted(SLIDING))
def test_sliding_window_layers_past_the_window(arch):
    """Prompt 12 + 24 new tokens over a window of 8: one prompt, and a batch whose rows have their own
    lengths (plain, heads and prompt lookup drafting), each row as HF generates it alone."""
    model = build(SLIDING[arch], sliding_window=8)
    assert_decodes_as_hf(model)
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:] + PROMPT]
    want = [hf_greedy(model, p, 16) for p in prompts]
    for drafter in (None, random_heads(model), treespec.PromptLookup(3)):
        got = treespec.generate(model, prompts, drafter, max_new_tokens=16, eos_token_id=[])
        assert [r.token_ids for r in got] == want


def test_mistral_window_leaves_the_native_step_only_past_it():
    model = build(SLIDING["mistral"], sliding_window=16)
    short = treespec.Decoder(model, treespec.PromptLookup(3))
    short.prefill(PROMPT[:4], max_new_tokens=12)
    assert short.step_kind == "native"  # 16 positions: the window changes nothing
    long = treespec.Decoder(model, treespec.PromptLookup(3))
    long.prefill(PROMPT, max_new_tokens=12)
    assert long.step_kind == "hf"
    with pytest.raises(ValueError, match="sliding-window layers see only the last 16"):
        treespec.Decoder(model, step="native").prefill(PROMPT, max_new_tokens=12)


@pytest.mark.parametrize("numerics", ["bitwise", "int8"])
def test_row_invariant_numerics_refuse_a_passed_window(numerics):
    int8_blocks = dict(
        hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )
    model = build(SLIDING["mistral"], sliding_window=8, **int8_blocks)
    decoder = treespec.Decoder(model, numerics=numerics)
    with pytest.raises(ValueError, match="sliding-window layers see only the last 8"):
        decoder.prefill(PROMPT, max_new_tokens=4)
    decoder.prefill(PROMPT[:4], max_new_tokens=4)  # within the window: runs


def test_bitwise_numerics_refuse_score_terms():
    model = build(ARCHITECTURES["gemma2"])
    with pytest.raises(ValueError, match="no row-invariant kernel for attention with soft-capped"):
        treespec.generate(
            model, PROMPT, None, max_new_tokens=2, options=treespec.DecodeOptions(numerics="bitwise")
        )


def test_model_attending_on_its_own_decodes_plain_and_refuses_trees():
    """Bloom computes attention itself (not through transformers' AttentionInterface): one token a step
    is right on treespec's cache, a tree would let nodes see their siblings."""
    config = transformers.BloomConfig(vocab_size=96, hidden_size=48, n_layer=2, n_head=6)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).eval()
    want = hf_greedy(model, PROMPT, 12)
    assert treespec.generate(model, PROMPT, None, max_new_tokens=12, eos_token_id=[]).token_ids == want
    with pytest.raises(UnsupportedModelError, match="computes attention in 2 of its 2 layers without"):
        treespec.generate(model, PROMPT, KnownContinuation(want, 96), max_new_tokens=12, eos_token_id=[])


@pytest.mark.parametrize(
    "spec",
    [
        (
            "FalconMambaConfig",
            "FalconMambaForCausalLM",
            dict(vocab_size=96, hidden_size=32, num_hidden_layers=2),
        ),
        ("JambaConfig", "JambaForCausalLM", {**GQA, "attn_layer_period": 2, "attn_layer_offset": 1}),
    ],
    ids=["falcon_mamba", "jamba"],
)
def test_recurrent_layers_are_refused_before_anything_runs(spec):
    model = build(spec)
    with pytest.raises(UnsupportedModelError, match="has layers of kind .*linear_attention"):
        treespec.generate(model, PROMPT, None, max_new_tokens=4, eos_token_id=[])


def _tree_sequences(tree: Tree, prefix: int):
    """For each node: the key indices it sees in a block after `prefix` keys, and their positions."""
    depth = tree.depth.tolist()
    for i in range(tree.num_nodes):
        ancestors = torch.nonzero(tree.ancestor_mask[i]).flatten().tolist()
        keys = list(range(prefix)) + [prefix + a for a in ancestors]
        yield i, keys, list(range(prefix)) + [prefix + depth[a] for a in ancestors], prefix + depth[i]


@pytest.mark.parametrize("window", [None, 3, 6])
def test_attention_with_terms_matches_hf_eager_at_every_node(window):
    """Every node of a random tree, plain, with soft-capping (Gemma 2's eager attention) and with sinks
    (gpt-oss's), against HF's own function over that node's sequence (prefix + ancestors), a window as HF's
    mask."""
    torch.manual_seed(window or 0)
    tree = Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
    B, H, Hkv, D, c, n = 2, 6, 2, 8, 5, tree.num_nodes
    q = torch.randn(B, H, n, D, dtype=torch.float64)
    k, v = torch.randn(2, B, Hkv, c + n, D, dtype=torch.float64)
    sinks = torch.randn(H, dtype=torch.float64)
    module = types.SimpleNamespace(num_key_value_groups=H // Hkv, training=False, sinks=sinks)
    cases = (
        (ScoreTerms(window=window), gemma2_eager),  # a window alone (SDPA)
        (ScoreTerms(softcap=2.0, window=window), gemma2_eager),
        (ScoreTerms(sinks=sinks, window=window), gpt_oss_eager),
    )
    for terms, hf in cases:
        got = attention_with_terms(q, k, v, tree.ancestor_mask, 0.3, terms)  # [B, H, n, D]
        for i, keys, positions, position in _tree_sequences(tree, c):
            far = torch.tensor([window is not None and position - p >= window for p in positions])
            mask = torch.zeros(1, 1, 1, len(keys), dtype=torch.float64).masked_fill(far, float("-inf"))
            extra = {"softcap": terms.softcap} if terms.softcap else {}
            want, _ = hf(module, q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], mask, scaling=0.3, **extra)
            torch.testing.assert_close(
                got[:, :, i], want[:, 0], rtol=1e-5, atol=1e-6
            )  # HF: a float32 softmax


def test_config_that_misdescribes_the_kv_heads_is_refused_clearly():
    """GPT-NeoX has no grouped K/V: a stray num_key_value_heads in its config would size the cache wrong."""
    model = build(ARCHITECTURES["gpt_neox"], num_key_value_heads=2)
    with pytest.raises(
        ValueError, match="layers give 6 K/V heads of 8 dims, but its config describes 2 of 8"
    ):
        treespec.generate(model, PROMPT, None, max_new_tokens=2, eos_token_id=[])


@pytest.mark.parametrize(
    "spec",
    [
        ("GraniteConfig", "GraniteForCausalLM", {**GQA, "logits_scaling": 8.0}),
        ("CohereConfig", "CohereForCausalLM", {**GQA, "logit_scale": 0.25}),
        ARCHITECTURES["gemma2"],
    ],
    ids=["granite", "cohere", "gemma2"],
)
def test_sampling_reads_the_logits_the_model_gives(spec):
    """Granite divides its logits, Cohere scales them, Gemma 2 soft-caps them: greedy choices do not see it,
    sampling does. The decoder's first-token logits must be the model's own."""
    model = build(spec)
    decoder = treespec.Decoder(model)
    decoder.prefill(PROMPT, max_new_tokens=2)
    with torch.inference_mode():
        got = decoder.logits(decoder.hidden)[0]  # [V]
        want = model(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_logits_changed_some_other_way_are_refused():
    class ScaledLlama(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    torch.manual_seed(0)
    model = ScaledLlama(transformers.LlamaConfig(**GQA)).eval()
    with pytest.raises(UnsupportedModelError, match="turns its lm_head's output into other logits"):
        treespec.generate(model, PROMPT, None, max_new_tokens=2, eos_token_id=[])


def test_layers_that_drop_keywords_refuse_a_compiled_step():
    """Falcon's decoder layers call their attention without the caller's keywords: the eager forward
    takes the plan from the context (the tree test above), a compiled graph could not."""
    model = build(ARCHITECTURES["falcon"])
    options = treespec.DecodeOptions(compile=True)
    with pytest.raises(UnsupportedModelError, match="do not pass keyword arguments on"):
        treespec.generate(model, PROMPT, treespec.PromptLookup(3), max_new_tokens=4, options=options)


def test_a_window_the_layers_do_not_name_is_refused_past_it():
    """A stray sliding_window in a Llama config: transformers' own cache would apply it, Llama's layers do
    not name it to their attention. Within the window nothing changes; past it, a refusal."""
    model = build(("LlamaConfig", "LlamaForCausalLM", GQA), sliding_window=16)
    short = treespec.generate(model, PROMPT[:4], None, max_new_tokens=12, eos_token_id=[])
    assert short.token_ids == hf_greedy(model, PROMPT[:4], 12)
    with pytest.raises(UnsupportedModelError, match="do not pass a window to their attention"):
        treespec.generate(model, PROMPT, None, max_new_tokens=12, eos_token_id=[])
