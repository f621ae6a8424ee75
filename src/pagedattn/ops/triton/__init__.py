"""The Triton provider: CUDA kernels (and the CPU under TRITON_INTERPRET=1, for tests).

One kernel family per op, each beside its launcher; the launchers have the signatures of
`pagedattn.ops.torch`.
"""

from pagedattn.ops.triton.attention_plan import varlen_attention
from pagedattn.ops.triton.cache_write import reshape_and_cache
from pagedattn.ops.triton.merge import merge_attn_states

__all__ = ["merge_attn_states", "reshape_and_cache", "varlen_attention"]
