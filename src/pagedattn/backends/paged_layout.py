"""The paged cache layout FLASH_ATTN and TORCH_SDPA share: one tensor (2, num_blocks,
block_size, num_kv_heads, head_size) and its memory order (NHD or HND, with or without a
leading layers dimension). One reason to change: where a cache's bytes go.
"""

from __future__ import annotations

from pagedattn.config import get_kv_cache_layout


class PagedKVCacheLayout:
    """The cache of FLASH_ATTN and TORCH_SDPA: (2, num_blocks, block_size, num_kv_heads,
    head_size), K at [0] and V at [1]. Mixed into those backends ahead of AttentionBackend."""

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be positive")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False
                                  ) -> tuple[int, ...]:
        """Permutation from the logical shape to memory order: HND puts heads before tokens
        within a block. With a leading layers dimension (num_layers, 2, num_blocks, ...),
        blocks go first in memory, then layers, so one block of every layer is contiguous."""
        layout = get_kv_cache_layout()
        if include_num_layers_dimension:
            return (2, 0, 1, 3, 4, 5) if layout == "NHD" else (2, 4, 0, 1, 3, 5)
        return (0, 1, 2, 3, 4) if layout == "NHD" else (0, 1, 3, 2, 4)
