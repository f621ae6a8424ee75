"""pagedattn: paged attention for LLM inference, with vLLM's attention API."""

from pagedattn.config import CacheConfig, EngineConfig
from pagedattn.forward_context import get_forward_context, model_scope, set_forward_context
from pagedattn.layer import Attention
from pagedattn.metadata import (
    AttentionSpec,
    BlockAllocator,
    BlockTable,
    CommonAttentionMetadata,
    OutOfBlocksError,
)
from pagedattn.selector import get_attn_backend
from pagedattn.types import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    BackendCapabilities,
)

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionType",
    "BackendCapabilities",
    "BlockAllocator",
    "BlockTable",
    "CacheConfig",
    "CommonAttentionMetadata",
    "EngineConfig",
    "OutOfBlocksError",
    "get_attn_backend",
    "get_forward_context",
    "model_scope",
    "set_forward_context",
]
