"""FLASH_ATTN_DIFFKV: FLASH_ATTN for models whose values have another head size than keys.

One cache tensor (num_blocks, block_size, num_kv_heads, head_size + head_size_v) holds K in
[..., :head_size] and V in [..., head_size:]; the output is [num_tokens, num_heads *
head_size_v]. Everything else, cascade attention included, is FLASH_ATTN's: as in the seed,
these classes subclass FLASH_ATTN's, the one backend this module builds on.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedattn.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from pagedattn.config import get_kv_cache_layout
from pagedattn.types import AttentionRequest, BackendCapabilities


@dataclasses.dataclass(frozen=True)
class _DiffKVCapabilities(BackendCapabilities):
    """FLASH_ATTN's capabilities, for requests that ask for the configured head_size_v."""

    def why_not(self, request: AttentionRequest) -> list[str]:
        reasons = super().why_not(request)
        configured = FlashAttentionDiffKVBackend.head_size_v
        if request.head_size_v not in (None, configured):
            reasons.append(
                f"head_size_v={request.head_size_v} but FlashAttentionDiffKVBackend.head_size_v="
                f"{configured}; call FlashAttentionDiffKVBackend.set_head_size_v("
                f"{request.head_size_v}) first")
        return reasons

    def why_not_automatic(self, request: AttentionRequest) -> list[str]:
        # A user may still force it (PAGEDATTN_ATTENTION_BACKEND) for equal head sizes.
        reasons = super().why_not_automatic(request)
        if request.head_size_v is None:
            reasons.append("never chosen automatically for equal K and V head sizes")
        return reasons


class FlashAttentionDiffKVImpl(FlashAttentionImpl):
    """query [T, H, D], key [T, Hkv, D], value [T, Hkv, Dv] -> output [T, H, Dv]."""

    def split_kv_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[..., :self.head_size], kv_cache[..., self.head_size:]


class FlashAttentionDiffKVBackend(FlashAttentionBackend):
    # Default to 128 for this backend (the seed's); set it before building layers.
    head_size_v: int = 128
    capabilities = _DiffKVCapabilities(**{
        **{f.name: getattr(FlashAttentionBackend.capabilities, f.name)
           for f in dataclasses.fields(BackendCapabilities)},
        "different_kv_head_sizes": True, "block_size_multiple": 16})

    @classmethod
    def set_head_size_v(cls, head_size_v: int) -> None:
        if not isinstance(head_size_v, int) or head_size_v <= 0:
            raise ValueError(f"head_size_v={head_size_v!r} must be a positive int")
        cls.head_size_v = head_size_v

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN_DIFFKV"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionDiffKVImpl

    # The seed's interface, with head_size_v taken from the class.
    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if block_size % 16 != 0:
            raise ValueError(f"Block size must be a multiple of 16; got block_size={block_size}")
        return (num_blocks, block_size, num_kv_heads,
                head_size + FlashAttentionDiffKVBackend.head_size_v)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False
                                  ) -> tuple[int, ...]:
        """The seed's permutations from the logical shape to the memory layout."""
        layout = get_kv_cache_layout()
        if include_num_layers_dimension:
            # NHD: (num_blocks, num_layers, block_size, heads, D + Dv);
            # HND: (num_blocks, heads, num_layers, block_size, D + Dv)
            return (1, 0, 2, 3, 4) if layout == "NHD" else (1, 3, 0, 2, 4)
        return (0, 1, 2, 3) if layout == "NHD" else (0, 2, 1, 3)
