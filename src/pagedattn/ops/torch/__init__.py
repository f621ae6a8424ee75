"""The pure-PyTorch provider: runs on any device."""

from pagedattn.ops.torch.attention import varlen_attention
from pagedattn.ops.torch.cache import reshape_and_cache
from pagedattn.ops.torch.merge import merge_attn_states

__all__ = ["merge_attn_states", "reshape_and_cache", "varlen_attention"]
