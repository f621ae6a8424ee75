"""FlashInfer's plan/run attention wrappers, on pagedattn's kernels (Triton on CUDA, PyTorch
elsewhere): `from pagedattn.ops.flashinfer import BatchDecodeWithPagedKVCacheWrapper` stands in
for `from flashinfer import ...`. LSEs follow FlashInfer: base 2, [total_q, num_qo_heads]."""

from pagedattn.ops.flashinfer.cascade import MultiLevelCascadeAttentionWrapper, merge_state
from pagedattn.ops.flashinfer.wrappers import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
)

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "merge_state",
]
