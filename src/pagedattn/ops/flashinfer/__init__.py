"""FlashInfer's attention API, on pagedattn's kernels (Triton on CUDA, PyTorch elsewhere):
`from pagedattn.ops.flashinfer import BatchDecodeWithPagedKVCacheWrapper` stands in for
`from flashinfer import ...`. LSEs follow FlashInfer: base 2, [rows, num_qo_heads]."""

from pagedattn.ops.flashinfer.cascade import MultiLevelCascadeAttentionWrapper
from pagedattn.ops.flashinfer.dense import (
    single_decode_with_kv_cache,
    single_prefill_with_kv_cache,
)
from pagedattn.ops.flashinfer.merge import merge_state, merge_state_in_place, merge_states
from pagedattn.ops.flashinfer.page import (
    append_paged_kv_cache,
    get_batch_indices_positions,
    get_seq_lens,
)
from pagedattn.ops.flashinfer.ragged import BatchPrefillWithRaggedKVCacheWrapper
from pagedattn.ops.flashinfer.wrappers import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
)

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
]
