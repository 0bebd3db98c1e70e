"""Models of the decode loop: the P-EAGLE / EAGLE-3 drafter and the paged target runner."""

from peagle.models.drafter import Eagle3Drafter
from peagle.models.drafter_config import ARCHITECTURE, DrafterConfig
from peagle.models.loader import load_model_pair
from peagle.models.paged import NULL_BLOCK_ID, AttentionMetadata, PagedKVCache
from peagle.models.target import SUPPORTED_MODEL_TYPES, TargetRunner, default_aux_layer_ids

__all__ = [
    "ARCHITECTURE",
    "NULL_BLOCK_ID",
    "SUPPORTED_MODEL_TYPES",
    "AttentionMetadata",
    "DrafterConfig",
    "Eagle3Drafter",
    "PagedKVCache",
    "TargetRunner",
    "default_aux_layer_ids",
    "load_model_pair",
]
