"""treespec: tree-speculative decoding for Hugging Face causal LMs (same output, fewer forward passes)."""

from .attention import tree_attention_enabled, tree_attention_reference, tree_attention_sdpa
from .cache import CacheCapacityError, TreeKVCache
from .draft_model import DraftModelDrafter
from .drafters import MedusaDrafter, RootOnlyDrafter, SequentialDrafter, make_drafter
from .generate import GenerationResult, encode_prompt, generate, generate_baseline
from .heads import HeadsLoadError, MedusaHeads
from .lookup import LookupDrafter
from .models import load_model
from .self_spec import SelfSpeculativeDrafter
from .spec_cache import SpeculativeKVCache
from .stats import GenerationStats
from .trace import Trace
from .tree import DEFAULT_TREE_SIZES, Tree, default_tree
from .verify import SamplingConfig

__version__ = "0.1.0"

__all__ = [
    "CacheCapacityError",
    "DEFAULT_TREE_SIZES",
    "DraftModelDrafter",
    "GenerationResult",
    "GenerationStats",
    "HeadsLoadError",
    "LookupDrafter",
    "MedusaDrafter",
    "MedusaHeads",
    "RootOnlyDrafter",
    "SamplingConfig",
    "SelfSpeculativeDrafter",
    "SequentialDrafter",
    "SpeculativeKVCache",
    "Trace",
    "Tree",
    "TreeKVCache",
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
