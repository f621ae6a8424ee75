"""What every paged backend built on `flash_attn_varlen_func` shares: the impl's argument
checks and its forward (cache write, then paged, dense-encoder or cross attention).

Not a backend itself. Backends subclass `PagedAttentionImpl` and say how their cache tensor
splits into K and V views and how the cache is written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from pagedattn.backends import dcp
from pagedattn.config import get_kv_cache_layout, is_fp8_kv_cache, kv_cache_torch_dtype
from pagedattn.distributed import (
    get_decode_context_parallel_rank,
    get_decode_context_parallel_world_size,
    tp_shard_heads,
)
from pagedattn.ops import flash_attn_varlen_func, reshape_and_cache_flash
from pagedattn.ops._dispatch import provider_name, use_provider
from pagedattn.ops.cache import plan_reshape_and_cache_flash
from pagedattn.ops.plan import plan_varlen_attention
from pagedattn.types import ALL_ATTN_TYPES, AttentionImpl, AttentionMetadata, AttentionType


@dataclass
class PagedAttentionMetadata(AttentionMetadata):
    """The per-batch fields a paged impl reads (backends extend it)."""

    num_actual_tokens: int  # tokens in the batch, padding excluded
    max_query_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    max_seq_len: int
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    causal: bool = True
    # Plans of this batch's cache write and attention, one per kind of layer (heads, scale,
    # features, dtypes): made by the first layer that runs, reused by the others.
    plans: dict = field(default_factory=dict, repr=False, compare=False)
    # Captured in a CUDA graph: plans serve any batch up to this one's token and request
    # counts and max_seq_len (both passes launched, grids for the bucket).
    cuda_graph: bool = False


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


class PagedAttentionImpl(AttentionImpl):
    """Writes K/V into a paged cache and runs `flash_attn_varlen_func` over it."""

    # Pin the ops to one provider ("torch" for the pure-PyTorch backend); None = by device.
    ops_provider: ClassVar[Optional[str]] = None
    # Whether `_forward_with_dcp` serves this backend (backends/dcp.py).
    supports_dcp: ClassVar[bool] = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[list[float]], sliding_window: Optional[int],
                 kv_cache_dtype: str, logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None) -> None:
        if attn_type not in ALL_ATTN_TYPES:
            raise ValueError(f"attn_type={attn_type!r} is not one of {ALL_ATTN_TYPES}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) is not divisible by num_kv_heads "
                             f"({num_kv_heads})")
        kv_cache_torch_dtype(kv_cache_dtype, torch.float16)  # validates the string
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.scale = float(scale)
        self.alibi_slopes = _per_head("alibi_slopes", alibi_slopes, num_heads)
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window={sliding_window} must be a positive int or None")
        # flash-attn's (left, right) window: a window of W keys ends at the query itself.
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        if logits_soft_cap is not None and logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap} must be >= 0 (0/None: off)")
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = _per_head("sinks", sinks, num_heads)
        self.dcp_world_size = get_decode_context_parallel_world_size()
        self.dcp_rank = get_decode_context_parallel_rank()
        if self.dcp_world_size > 1:
            if not self.supports_dcp:
                raise ValueError(f"{type(self).__name__} does not support decode context "
                                 "parallelism; use FLASH_ATTN or FLASH_ATTN_DIFFKV")
            dcp.check_dcp_layer(self)
        # (kv_cache, key view, value view, plan id) of the last cache seen
        self._views: tuple = (None,) * 4
        self._ready_on: Optional[torch.device] = None  # where alibi_slopes/sinks were moved
        self._planned = attn_type in _PLANNED_TYPES and self.dcp_world_size == 1

    # --- what a backend's cache layout decides -------------------------------------------
    def split_kv_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical [num_blocks, block_size, num_kv_heads, head_size] K and V views."""
        return kv_cache[0], kv_cache[1]

    def write_kv_cache(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = self.split_kv_cache(kv_cache)
        reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                self.kv_cache_dtype, layer._k_scale, layer._v_scale)

    # --- forward ---------------------------------------------------------------------------
    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: Optional[torch.Tensor],
                value: Optional[torch.Tensor], kv_cache: torch.Tensor,
                attn_metadata: Optional[PagedAttentionMetadata],
                output: Optional[torch.Tensor] = None,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D(v)] (None: cross-attention reads the cache),
        kv_cache in the backend's layout -> output [T, H, Dv]."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                f"fused output quantization is not supported by {type(self).__name__}")
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads, value.shape[-1] if value is
                                 not None else self.head_size, dtype=_out_dtype(query),
                                 device=query.device)
        if attn_metadata is None:  # profiling run: no cache, no attention
            return output.fill_(0)
        if self._planned and not getattr(attn_metadata, "use_cascade", False) and getattr(
                attn_metadata, "dcp", None) is None:
            self._forward_planned(layer, query, key, value, kv_cache, attn_metadata, output)
            return output
        if self._ready_on != query.device:
            self.to_device(query.device)
        n = attn_metadata.num_actual_tokens
        if self.dcp_world_size > 1 or getattr(attn_metadata, "dcp", None) is not None:
            dcp.run_dcp_step(self, layer, query, key, value, kv_cache, attn_metadata, output)
        elif self.ops_provider is None:
            self._forward(layer, query, key, value, kv_cache, attn_metadata, output, n)
        else:
            with use_provider(self.ops_provider):
                self._forward(layer, query, key, value, kv_cache, attn_metadata, output, n)
        return output

    def _forward_planned(self, layer, query, key, value, kv_cache, m, output) -> None:
        """The hot path: the batch's plans (made once per step and kind of layer), two runs.
        Every per-call tensor already sits on the cache's device (`_bind_cache`), so nothing
        is copied or moved here."""
        views = self._views
        if views[0] is not kv_cache:
            views = self._views = self._bind_cache(kv_cache, layer)
        _, key_cache, value_cache, plan_id = views
        # Metadata is built per batch and not changed after; the batch fields in the key still
        # catch a caller that edits it in place (the plans hold those tensors, so ids stay),
        # and a `dataclasses.replace` copy, which shares the `plans` dict.
        full_key = (plan_id, query.dtype, output.dtype, m.num_actual_tokens, m.max_query_len,
                    m.max_seq_len, m.causal, id(m.query_start_loc), id(m.seq_lens),
                    id(m.block_table), id(m.slot_mapping))
        plans = m.plans.get(full_key)
        if plans is None:
            plans = m.plans[full_key] = self._make_plans(m, query, output, key_cache,
                                                         value_cache)
        write, attend, fp8_query, fp8_cache, dense_new_kv = plans
        if key is not None and value is not None and self.kv_sharing_target_layer_name is None:
            write(key, value, key_cache, value_cache, layer._k_scale, layer._v_scale)
        n = m.num_actual_tokens
        if query.shape[0] != n:
            output[n:].zero_()  # padding rows (the output buffer is torch.empty)
            query, output = query[:n], output[:n]
        if dense_new_kv and key is not None:  # the prefill pass reads the new K/V densely
            attend(query, key_cache, value_cache, output, None, self.alibi_slopes, self.sinks,
                   None, None, None, key[:n], value[:n])
        elif fp8_query or fp8_cache:
            attend(query, key_cache, value_cache, output, None, self.alibi_slopes, self.sinks,
                   layer._q_scale if fp8_query else None,
                   layer._k_scale if fp8_cache else None, layer._v_scale if fp8_cache else None)
        else:
            attend(query, key_cache, value_cache, output, None, self.alibi_slopes, self.sinks,
                   None, None, None)

    def _bind_cache(self, kv_cache: torch.Tensor, layer: torch.nn.Module) -> tuple:
        """Views of a newly seen cache, and the per-call tensors of the layer and the impl
        placed on its device (once per cache: a cache assigned without `bind_kv_cache`)."""
        place_on = getattr(layer, "place_on", None)
        if place_on is not None:
            place_on(kv_cache.device)  # also calls self.to_device
        elif self._ready_on != kv_cache.device:
            self.to_device(kv_cache.device)
        key_cache, value_cache = self._cache_views(kv_cache)
        plan_key = (type(self), self.num_heads, self.head_size, self.num_kv_heads, self.scale,
                    self.sliding_window, self.logits_soft_cap, self.alibi_slopes is not None,
                    self.sinks is not None, self.attn_type, key_cache.dtype,
                    self.kv_sharing_target_layer_name is None,
                    tuple(key_cache.shape[1:]), value_cache.shape[-1])
        # Layers of one kind share their plans; a small int hashes faster than the tuple.
        return kv_cache, key_cache, value_cache, _PLAN_IDS.setdefault(plan_key, len(_PLAN_IDS))

    def _make_plans(self, m, query, output, key_cache, value_cache) -> tuple:
        fp8_query = query.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        fp8_cache = key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        provider = self.ops_provider or provider_name(query.device)
        # This layer writes its own new K/V (no KV sharing) in the model dtype: the Triton
        # prefill pass may read them densely instead of gathering them back from the pages.
        dense_new_kv = (provider == "triton" and self.kv_sharing_target_layer_name is None
                        and not (fp8_query or fp8_cache))
        n, block_size = m.num_actual_tokens, key_cache.shape[1]
        write = plan_reshape_and_cache_flash(
            m.slot_mapping, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            head_size_v=value_cache.shape[-1], page_size=block_size,
            cache_dtype=key_cache.dtype, provider=provider)
        attend = plan_varlen_attention(
            cu_seqlens_q=m.query_start_loc, num_tokens=n, max_seqlen_q=m.max_query_len,
            max_seqlen_k=m.max_seq_len, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_size=self.head_size, head_size_v=value_cache.shape[-1], q_dtype=query.dtype,
            kv_dtype=key_cache.dtype, out_dtype=output.dtype, seqused_k=m.seq_lens,
            block_table=m.block_table, page_size=block_size, softmax_scale=self.scale,
            causal=self._causal(m), window_size=self.sliding_window,
            softcap=self.logits_soft_cap, use_alibi=self.alibi_slopes is not None,
            use_sinks=self.sinks is not None, use_q_descale=fp8_query,
            use_kv_descale=fp8_cache, cuda_graph=m.cuda_graph, provider=provider,
            dense_new_kv=dense_new_kv)
        # The impl made these plans for exactly its tensors: run the provider's plans directly
        # (the public `run`s' checks would only repeat what planning established).
        write_run = write._impl.run if write._impl is not None else write.run
        attend_run = attend._impl.run if attend._impl is not None else functools.partial(
            _run_public, attend)
        return write_run, attend_run, fp8_query, fp8_cache, dense_new_kv

    def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output, n) -> None:
        if query.shape[0] != n:
            output[n:].zero_()  # padding rows (the output buffer is torch.empty)
        if self.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            self._forward_encoder_attention(query[:n], key[:n], value[:n], output[:n],
                                            attn_metadata, layer)
            return
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            self.write_kv_cache(layer, key, value, kv_cache, attn_metadata.slot_mapping)
        key_cache, value_cache = self._cache_views(kv_cache)
        self._paged_attention(layer, query[:n], key_cache, value_cache, output[:n],
                              attn_metadata)

    def _paged_attention(self, layer, query, key_cache, value_cache, output,
                         attn_metadata) -> None:
        num_reqs = attn_metadata.seq_lens.shape[0]
        flash_attn_varlen_func(
            q=query, k=key_cache, v=value_cache, out=output,
            cu_seqlens_q=attn_metadata.query_start_loc, max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=attn_metadata.seq_lens, max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale, causal=self._causal(attn_metadata),
            alibi_slopes=self.alibi_slopes, window_size=self.sliding_window,
            block_table=attn_metadata.block_table, softcap=self.logits_soft_cap,
            s_aux=self.sinks, **self._descales(layer, query, num_reqs))

    def _forward_encoder_attention(self, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, output: torch.Tensor,
                                   attn_metadata: PagedAttentionMetadata,
                                   layer: torch.nn.Module) -> torch.Tensor:
        """Bidirectional attention of each request's tokens over themselves, no cache (so a
        model-wide fp8 kv_cache_dtype does not apply: K/V stay in the model dtype)."""
        cu = attn_metadata.query_start_loc
        flash_attn_varlen_func(
            q=query, k=key, v=value, out=output, cu_seqlens_q=cu, cu_seqlens_k=cu,
            max_seqlen_q=attn_metadata.max_query_len, max_seqlen_k=attn_metadata.max_query_len,
            softmax_scale=self.scale, causal=False, alibi_slopes=self.alibi_slopes,
            window_size=self.sliding_window, softcap=self.logits_soft_cap, s_aux=self.sinks)
        return output

    def _forward_with_dcp(self, layer, query, key, value, key_cache, value_cache, output,
                          attn_metadata) -> None:
        dcp.forward_with_dcp(self, layer, query, key, value, key_cache, value_cache, output,
                             attn_metadata)

    # --- helpers ---------------------------------------------------------------------------
    def _causal(self, attn_metadata: PagedAttentionMetadata) -> bool:
        return attn_metadata.causal and self.attn_type == AttentionType.DECODER

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key_cache, value_cache = self.split_kv_cache(kv_cache)
        if is_fp8_kv_cache(self.kv_cache_dtype) and key_cache.dtype == torch.uint8:
            fp8 = kv_cache_torch_dtype(self.kv_cache_dtype, torch.float16)
            key_cache, value_cache = key_cache.view(fp8), value_cache.view(fp8)
        return key_cache, value_cache

    def _descales(self, layer, query: torch.Tensor, num_reqs: int) -> dict:
        """flash-attn wants [num_seqs, num_kv_heads] descales: expanded scalars, no copies."""
        shape = (num_reqs, self.num_kv_heads)
        descales = {}
        if query.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            descales["q_descale"] = layer._q_scale.expand(shape)
        if is_fp8_kv_cache(self.kv_cache_dtype):
            descales["k_descale"] = layer._k_scale.expand(shape)
            descales["v_descale"] = layer._v_scale.expand(shape)
        return descales

    def to_device(self, device: torch.device) -> None:
        """Put the per-head tensors a call reads (ALiBi slopes, sinks) on `device`."""
        for name in ("alibi_slopes", "sinks"):
            t = getattr(self, name)
            if t is not None and t.device != device:
                setattr(self, name, t.to(device))
        self._ready_on = device


def _run_public(plan, q, k, v, out, lse, alibi_slopes, sinks, q_descale, k_descale, v_descale):
    plan.run(q, k, v, out, softmax_lse=lse, alibi_slopes=alibi_slopes, s_aux=sinks,
             q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


_PLAN_IDS: dict[tuple, int] = {}  # kind of layer (what its plans depend on) -> id
_PLANNED_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_DECODER)


def _per_head(name: str, values, num_heads: int) -> Optional[torch.Tensor]:
    """A tensor is kept by reference (sinks are often a parameter loaded after construction)."""
    if values is None:
        return None
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float32)
    t = tp_shard_heads(t, num_heads)  # given for every head: this TP rank's slice
    if t.dim() != 1 or t.shape[0] != num_heads:
        raise ValueError(f"{name} must have one value per query head ({num_heads}); got shape "
                         f"{tuple(t.shape)}")
    return t


def _out_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if query.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) \
        else query.dtype
