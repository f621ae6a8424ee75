"""Public ops with stable signatures; each dispatches to a provider (triton/ or torch/)."""

from pagedattn.ops.attention import flash_attn_varlen_func
from pagedattn.ops.blocksparse import blocksparse_paged_attention
from pagedattn.ops.blocksparse_prefill import LocalStridedBlockSparseAttn
from pagedattn.ops.cache import reshape_and_cache_flash, reshape_and_cache_flash_diffkv
from pagedattn.ops.cascade import cascade_attention, use_cascade_attention
from pagedattn.ops.flashinfer import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
    append_paged_kv_cache,
    get_batch_indices_positions,
    merge_state,
    merge_state_in_place,
    merge_states,
    single_decode_with_kv_cache,
    single_prefill_with_kv_cache,
)
from pagedattn.ops.merge import merge_attn_states

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "LocalStridedBlockSparseAttn",
    "append_paged_kv_cache",
    "blocksparse_paged_attention",
    "cascade_attention",
    "flash_attn_varlen_func",
    "get_batch_indices_positions",
    "merge_attn_states",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "reshape_and_cache_flash",
    "reshape_and_cache_flash_diffkv",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "use_cascade_attention",
]
