"""Public ops with stable signatures; each dispatches to a provider (triton/ or torch/)."""

from pagedattn.ops.attention import flash_attn_varlen_func
from pagedattn.ops.blocksparse import blocksparse_paged_attention
from pagedattn.ops.blocksparse_prefill import LocalStridedBlockSparseAttn
from pagedattn.ops.cache import reshape_and_cache_flash, reshape_and_cache_flash_diffkv
from pagedattn.ops.cascade import cascade_attention, use_cascade_attention
from pagedattn.ops.flashinfer import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from pagedattn.ops.merge import merge_attn_states

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "LocalStridedBlockSparseAttn",
    "blocksparse_paged_attention",
    "cascade_attention",
    "flash_attn_varlen_func",
    "merge_attn_states",
    "reshape_and_cache_flash",
    "reshape_and_cache_flash_diffkv",
    "use_cascade_attention",
]
