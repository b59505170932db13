"""treespec: tree-speculative decoding for Hugging Face causal LMs (same output, fewer forward passes)."""

from .api import as_drafter, generate, generate_baseline
from .chat import Chat
from .core.acceptance import SamplingConfig
from .core.attention import (
    AttentionPlan,
    tree_attention_enabled,
    tree_attention_reference,
    tree_attention_sdpa,
)
from .core.cache import CacheCapacityError, KVCacheBase, TreeKVCache
from .core.decoder import Decoder, DecodeStep
from .core.drafting import BaseDrafter, Drafter, DrafterReport, Proposal, RootOnlyDrafter, SequenceStart
from .core.generate import DecodeOptions, GenerationResult, encode_prompt
from .core.planner import TreePlanner
from .core.pricing import AcceptanceCalibration, StepPricer
from .core.runtime import TargetRuntime
from .core.spec_cache import SpeculativeKVCache
from .core.stats import GenerationStats
from .core.support import UnsupportedModelError
from .core.tree import DEFAULT_TREE_SIZES, Tree, default_tree
from .drafters.draft_model import DraftModelDrafter
from .drafters.eagle import EagleDrafter
from .drafters.eagle_model import EagleDraftModel, EagleLoadError
from .drafters.heads import ExitHead, HeadsLoadError, MedusaHeads
from .drafters.lookup import PromptLookup
from .drafters.medusa import MedusaDrafter, SequentialDrafter, make_drafter
from .drafters.recycling import RecyclingDrafter
from .drafters.self_spec import SelfSpeculativeDrafter
from .drafters.suffix import SuffixCache, SuffixDrafter
from .recipes import RECIPES, Recipe
from .tools.models import load_model
from .tools.trace import Trace

__version__ = "0.1.0"

__all__ = [
    "AttentionPlan",
    "BaseDrafter",
    "DecodeOptions",
    "DecodeStep",
    "Decoder",
    "Drafter",
    "DrafterReport",
    "ExitHead",
    "KVCacheBase",
    "Proposal",
    "RECIPES",
    "Recipe",
    "SequenceStart",
    "StepPricer",
    "TargetRuntime",
    "CacheCapacityError",
    "Chat",
    "DEFAULT_TREE_SIZES",
    "DraftModelDrafter",
    "AcceptanceCalibration",
    "EagleDraftModel",
    "EagleDrafter",
    "as_drafter",
    "EagleLoadError",
    "GenerationResult",
    "GenerationStats",
    "HeadsLoadError",
    "PromptLookup",
    "MedusaDrafter",
    "MedusaHeads",
    "RecyclingDrafter",
    "RootOnlyDrafter",
    "SamplingConfig",
    "SelfSpeculativeDrafter",
    "SequentialDrafter",
    "SpeculativeKVCache",
    "SuffixCache",
    "SuffixDrafter",
    "Trace",
    "Tree",
    "TreeKVCache",
    "TreePlanner",
    "UnsupportedModelError",
    "default_tree",
    "encode_prompt",
    "generate",
    "generate_baseline",
    "load_model",
    "make_drafter",
    "tree_attention_enabled",
    "tree_attention_reference",
    "tree_attention_sdpa",
]
