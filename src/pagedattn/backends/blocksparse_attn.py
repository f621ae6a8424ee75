"""BLOCK_SPARSE_FLASH_ATTN: local + vertical-stride block-sparse attention (the seed's v0
backend) over the paged v0 cache layout (2, num_blocks, block_size * num_kv_heads * head_size).

Prompts run through `LocalStridedBlockSparseAttn` on the new tokens themselves (prompt-only:
no cached context, as the seed); decodes run `PagedAttention.forward_decode` with the same
pattern. A batch holds prefills first, then decodes (one new token each). The selector
picks this backend only for layers built with `use_sparse=True` (or when forced by
PAGEDATTN_ATTENTION_BACKEND). The builder writes every batch into persistent buffers and owns
the decode's split-KV scratch, so a decode step captured in a CUDA graph replays with the
lengths and block tables of any later decode batch of at most its size; prompts run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagedattn.backends.blocksparse_metadata import (
    BlocksparseFlashAttentionMetadata,
    BlocksparseFlashAttentionMetadataBuilder,
)
from pagedattn.config import KV_CACHE_DTYPE_STRINGS, kv_cache_torch_dtype
from pagedattn.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from pagedattn.layer_checks import check_step_tokens
from pagedattn.ops.blocksparse_prefill import LocalStridedBlockSparseAttn
from pagedattn.ops.paged_attn import PagedAttention
from pagedattn.types import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionType,
    BackendCapabilities,
)


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel (rank, world size): its TP group's, from
    `pagedattn.distributed.init_parallel_groups` (the default group may hold several TP
    groups), else (0, 1)."""
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def get_head_sliding_step(num_heads: int, vert_stride: int) -> int:
    return max(1, int(vert_stride / num_heads))


@dataclass
class BlocksparseParams:
    max_seqlen: int
    num_heads: int  # query heads of this tensor-parallel rank
    num_kv_heads: int  # KV heads of this rank
    block_size: int  # sparse block size (tokens), the unit of local_blocks and vert_stride
    local_blocks: int  # blocks of local attention, the query's own included
    vert_stride: int  # beyond the window, one block in every vert_stride is attended
    # Every head attends the same vertical blocks (else they slide with the head index).
    homo_head: bool = False
    # The heads of one KV group attend the same vertical blocks (they slide per KV head).
    homo_head_group: bool = False
    head_sliding_step: int = field(init=False)  # < 0: sliding per KV head
    active_head_range: tuple[int, int] = field(init=False)  # this rank's global query heads

    def __post_init__(self) -> None:
        for name, low in (("max_seqlen", 1), ("num_heads", 1), ("num_kv_heads", 1),
                          ("block_size", 1), ("local_blocks", 0), ("vert_stride", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"blocksparse_params {name}={value!r} must be an int >= {low}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"blocksparse_params num_heads={self.num_heads} must be a "
                             f"multiple of num_kv_heads={self.num_kv_heads}")
        tp_rank, tp_size = tensor_parallel_rank_and_size()
        if self.homo_head:
            self.head_sliding_step = 0
        elif self.homo_head_group:
            self.head_sliding_step = -get_head_sliding_step(tp_size * self.num_kv_heads,
                                                            self.vert_stride)
        else:
            self.head_sliding_step = get_head_sliding_step(tp_size * self.num_heads,
                                                           self.vert_stride)
        self.active_head_range = (tp_rank * self.num_heads, (tp_rank + 1) * self.num_heads)


class BlocksparseFlashAttentionImpl(AttentionImpl):
    """Prompt tokens: |<-- prompt_0 -->|<-- prompt_1 -->|...; then one token per decode.
    Prefills read the new K/V directly; decodes read the paged cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[list[float]], sliding_window: Optional[int],
                 kv_cache_dtype: str, blocksparse_params: Optional[dict[str, Any]] = None,
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None) -> None:
        refused = (("KV sharing (kv_sharing_target_layer_name)", kv_sharing_target_layer_name),
                   ("ALiBi (alibi_slopes)", alibi_slopes),
                   ("sliding window (sliding_window)", sliding_window),
                   ("logits soft cap (logits_soft_cap)", logits_soft_cap or None))
        for feature, value in refused:
            if value is not None:
                raise ValueError(f"{feature} is not supported by BLOCK_SPARSE_FLASH_ATTN; got "
                                 f"{value!r}")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"attn_type={attn_type!r}: BLOCK_SPARSE_FLASH_ATTN serves decoder "
                             "self-attention only (no encoder or encoder/decoder attention)")
        if blocksparse_params is None:
            raise ValueError("BLOCK_SPARSE_FLASH_ATTN needs blocksparse_params (max_seqlen, "
                             "block_size, local_blocks, vert_stride, ...)")
        num_kv_heads = num_kv_heads or num_heads
        params = dict(blocksparse_params)
        params.setdefault("num_heads", num_heads)
        params.setdefault("num_kv_heads", num_kv_heads)
        self.blocksparse_params = BlocksparseParams(**params)
        kv_cache_torch_dtype(kv_cache_dtype, torch.float16)  # validates the string
        if head_size not in PagedAttention.get_supported_head_sizes():
            raise ValueError(f"Head size {head_size} is not supported by PagedAttention. "
                             f"Supported head sizes are: "
                             f"{PagedAttention.get_supported_head_sizes()}.")
        self.kv_cache_dtype = kv_cache_dtype
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.alibi_slopes = None
        self.num_queries_per_kv = num_heads // num_kv_heads
        p = self.blocksparse_params
        self.local_blocks, self.vert_stride = p.local_blocks, p.vert_stride
        self.sparse_block_size, self.head_sliding_step = p.block_size, p.head_sliding_step
        self.tp_rank, self.tp_size = tensor_parallel_rank_and_size()
        # What the builder's decode plans depend on: one plan per distinct pattern.
        self.decode_pattern = (num_heads, num_kv_heads, head_size, self.scale, p.max_seqlen,
                               p.local_blocks, p.vert_stride, p.block_size,
                               p.head_sliding_step, self.tp_rank)
        self.bs_attn = LocalStridedBlockSparseAttn(
            num_heads * self.tp_size, p.max_seqlen, p.local_blocks, p.vert_stride, p.block_size,
            homo_head=p.homo_head, active_head_range=p.active_head_range,
            head_sliding_step=p.head_sliding_step)

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[BlocksparseFlashAttentionMetadata],
                output: Optional[torch.Tensor] = None,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query [T, H, D] (or [T, H * D]), key/value [T, Hkv, D]; kv_cache (2, num_blocks,
        block_size * Hkv * D), empty in a profiling run -> output [T, H, D]."""
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("fused output quantization is not supported by "
                             "BLOCK_SPARSE_FLASH_ATTN; pass output_scale=None")
        query = query.view(-1, self.num_heads, self.head_size)
        if output is None:
            output = torch.zeros_like(query)
        if attn_metadata is None:  # profiling run: no cache, no attention
            return output.fill_(0)
        check_step_tokens(layer, query, key, attn_metadata)
        plans = attn_metadata.plans
        if plans is None:
            raise ValueError(
                f"layer {getattr(layer, 'layer_name', '')!r}: this "
                f"{type(attn_metadata).__name__} carries no plans: make it with "
                "BlocksparseFlashAttentionMetadataBuilder(...).build(), or plan metadata made "
                "or changed by hand with that builder's plan(attn_metadata)")
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)
        key_cache = value_cache = None
        if kv_cache.numel() > 0:
            key_cache, value_cache = PagedAttention.split_kv_cache(
                kv_cache, self.num_kv_heads, self.head_size)
            n = attn_metadata.slot_mapping.shape[0]
            plans.write.run(key[:n], value[:n], key_cache, value_cache, layer._k_scale,
                            layer._v_scale)
        num_prefill = attn_metadata.num_prefill_tokens
        if prefill_meta := attn_metadata.prefill_metadata:  # the layer's pattern, as a module
            self.bs_attn(query[:num_prefill], key[:num_prefill], value[:num_prefill],
                         cu_seqlens_k=prefill_meta.seq_start_loc,
                         cu_seqlens_q=prefill_meta.seq_start_loc, sm_scale=self.scale,
                         out=output[:num_prefill])
        if attn_metadata.num_decode_tokens:
            if key_cache is None:
                raise ValueError("decode tokens need the KV cache; kv_cache is empty")
            end = num_prefill + attn_metadata.num_decode_tokens
            plans.decode_for(self, layer).run(
                query[num_prefill:end], key_cache, value_cache, output[num_prefill:end],
                layer._k_scale, layer._v_scale)
        return output


class BlocksparseFlashAttentionBackend(AttentionBackend):
    accept_output_buffer = True
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        kv_cache_dtypes=frozenset(KV_CACHE_DTYPE_STRINGS),
        head_sizes=tuple(PagedAttention.get_supported_head_sizes()),
        attn_types=frozenset({AttentionType.DECODER}),
        sliding_window=False, alibi=False, softcap=False, sinks=False,
        sparse=True, sparse_only=True,
        cudagraph=AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)

    @staticmethod
    def get_name() -> str:
        return "BLOCK_SPARSE_FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type[BlocksparseFlashAttentionImpl]:
        return BlocksparseFlashAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[BlocksparseFlashAttentionMetadata]:
        return BlocksparseFlashAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[BlocksparseFlashAttentionMetadataBuilder]:
        return BlocksparseFlashAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return PagedAttention.get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                                 head_size)

    @staticmethod
    def swap_blocks(src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor,
                    src_to_dst) -> None:
        PagedAttention.swap_blocks(src_kv_cache, dst_kv_cache, src_to_dst)

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], src_to_dists) -> None:
        PagedAttention.copy_blocks(kv_caches, src_to_dists)
