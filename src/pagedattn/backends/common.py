"""What every paged backend shares: the metadata's paged fields, the impl's argument checks
and its forward, which launches the plans the builder made for the layer's kind
(`paged_plans`), or runs the public ops for metadata made without a builder.

Not a backend itself. Backends subclass `PagedAttentionImpl` and say how their cache tensor
splits into K and V views and how the cache is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from pagedattn.backends.dcp import DCPAttention, check_dcp_layer
from pagedattn.backends.paged_plans import ENCODER_TYPES, PlanLayout, StepPlans
from pagedattn.config import is_fp8_kv_cache, kv_cache_torch_dtype
from pagedattn.distributed import (
    get_decode_context_parallel_rank,
    get_decode_context_parallel_world_size,
    tp_shard_heads,
)
from pagedattn.ops import flash_attn_varlen_func, reshape_and_cache_flash
from pagedattn.ops.providers import use_provider
from pagedattn.types import ALL_ATTN_TYPES, AttentionImpl, AttentionMetadata, AttentionType


@dataclass(frozen=True)
class PagedAttentionMetadata(AttentionMetadata):
    """The per-batch fields a paged impl reads (backends extend it). Frozen: the builder's
    plans are made for exactly these values; a `dataclasses.replace` copy is another batch
    and carries no plans (its layers run the public ops)."""

    num_actual_tokens: int  # tokens in the batch, padding excluded
    max_query_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    max_seq_len: int
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    causal: bool = True
    # The builder's plans of this batch, one per kind of layer it serves (heads, scale,
    # features, dtypes; backends/paged_plans.py); set by `build()`, never by a caller.
    plans: Optional[StepPlans] = field(default=None, init=False, repr=False, compare=False)
    # Captured in a CUDA graph: plans serve any batch up to this one's token and request
    # counts and max_seq_len (both passes launched, grids for the bucket).
    cuda_graph: bool = False


class PagedAttentionImpl(AttentionImpl):
    """Writes K/V into a paged cache and attends over it with the step's plans (made by the
    backend's builder); metadata without plans runs the public ops."""

    # Pin the ops to one provider ("torch" for the pure-PyTorch backend); None = by device.
    ops_provider: ClassVar[Optional[str]] = None
    # Whether the backend runs decode context parallelism (backends/dcp.py).
    supports_dcp: ClassVar[bool] = False
    # forward() takes the layer's 2-D rows as they come (views only where a plan needs them).
    forward_takes_rows: ClassVar[bool] = True

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
            check_dcp_layer(self)
        # The layer's side of a DCP step (a builder may plan DCP for a group of one too).
        self.dcp = DCPAttention(kv_cache_dtype, self.scale, self.sliding_window[0],
                                self.logits_soft_cap) if self.supports_dcp else None
        # The cache last seen and its K/V views (bound once per cache).
        self._cache: Optional[torch.Tensor] = None
        self._key_cache = self._value_cache = None
        # The plan layout last seen (a builder's) and this impl's kind index in it.
        self._layout: Optional[PlanLayout] = None
        self._plan_index = 0
        self._ready_on: Optional[torch.device] = None  # where alibi_slopes/sinks were moved
        # The plans last run and this layer's binding of them (`_bind`).
        self._seen: object = None
        self._bound: tuple = (None, None)

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
        kv_cache in the backend's layout -> output [T, H, Dv]. Each of query, key, value and
        output may also be 2-D rows ([T, H * D] ...; `forward_takes_rows`): the layer's
        tensors as they come, viewed here only for plans that do not take rows."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                f"fused output quantization is not supported by {type(self).__name__}")
        if output is None:
            query, key, value, _ = self._heads(query, key, value, None)
            output = torch.empty(query.shape[0], self.num_heads, value.shape[-1] if value is
                                 not None else self.head_size, dtype=_out_dtype(query),
                                 device=query.device)
        if attn_metadata is None:  # profiling run: no cache, no attention
            return output.fill_(0)
        if kv_cache is not self._cache:
            self._bind_cache(kv_cache, layer)
        # The hot path: this impl's plans are the entry of its kind, an index it learnt the
        # first time it saw the builder's layout.
        step = attn_metadata.plans
        if step is not None and step.layout is self._layout:
            plans = step.kinds[self._plan_index]
        else:
            plans = self._find_plans(layer, attn_metadata)
        if plans is not None and query.dtype is plans.q_dtype and \
                output.dtype is plans.out_dtype:
            if plans.takes_rows:
                bound = self._bound if self._bound[0] is plans else self._bind(plans, layer)
                if bound[1] is None or not bound[1](layer, self, query, key, value, output):
                    plans.run(self, layer, query, key, value, self._key_cache,
                              self._value_cache, output)
            else:
                query, key, value, out = self._heads(query, key, value, output)
                plans.run(self, layer, query, key, value, self._key_cache, self._value_cache,
                          out)
        else:
            query, key, value, out = self._heads(query, key, value, output)
            self._forward_unplanned(layer, query, key, value, kv_cache, attn_metadata, out)
        return output

    def _bind(self, plans, layer) -> tuple:
        """(plans, their binding to this layer or None), made the second time this layer
        runs the same plans (decode steps share theirs): a binding reads the layer's caches
        and tensors once, so that a call reads only its own; plans run once cost no binding."""
        if plans is not self._seen:
            self._seen = plans
            return None, None
        self._bound = (plans, plans.bind(self, layer, self._key_cache, self._value_cache))
        return self._bound

    def _heads(self, query, key, value, output) -> tuple:
        """2-D rows (the layer's [T, heads * D]) as [T, heads, D]; 3-D tensors and None as
        they are. Inputs are reshaped (a row layout no view can split, such as a transposed
        key, is copied, as the row path's kernels copy it); the output is viewed (written)."""
        if query.dim() == 2:
            query = query.reshape(query.shape[0], self.num_heads, -1)
        if key is not None and key.dim() == 2:
            key = key.reshape(key.shape[0], self.num_kv_heads, -1)
        if value is not None and value.dim() == 2:
            value = value.reshape(value.shape[0], self.num_kv_heads, -1)
        if output is not None and output.dim() == 2:
            output = output.view(output.shape[0], self.num_heads, -1)
        return query, key, value, output

    def _bind_cache(self, kv_cache: torch.Tensor, layer: torch.nn.Module) -> None:
        """A newly seen cache: its K/V views, and the layer's per-call tensors (and this
        impl's) placed on its device (a cache assigned without `bind_kv_cache`)."""
        place_on = getattr(layer, "place_on", None)
        if place_on is not None:
            place_on(kv_cache.device)  # also calls self.to_device
        elif self._ready_on != kv_cache.device:
            self.to_device(kv_cache.device)
        # Encoder-only models have no cache (an empty tensor): their plans never read it.
        self._key_cache, self._value_cache = self._cache_views(kv_cache) \
            if kv_cache.numel() else (None, None)
        self._cache, self._layout = kv_cache, None  # plans are checked against the new cache
        self._seen, self._bound = None, (None, None)  # bindings hold the old cache's views

    def _find_plans(self, layer, m):
        """This impl's plans in metadata whose layout it has not seen (or after a new cache):
        the builder's index for it, checked once against the cache. None: run the public ops
        (metadata made without a builder, or plans that do not fit the bound cache)."""
        step = m.plans
        name = getattr(layer, "layer_name", "") or "an unnamed layer"
        if step is None:
            if self.dcp_world_size > 1 or getattr(m, "dcp", None) is not None:
                raise ValueError(
                    f"layer {name!r} runs with decode context parallelism, which needs the "
                    "builder's plans: build the metadata with the FLASH_ATTN builder and an "
                    "EngineConfig with decode_context_parallel_size (a dataclasses.replace "
                    "copy of built metadata carries no plans)")
            return None
        index = step.layout.index_of(self, layer)
        plans = step.kinds[index]
        if self.dcp_world_size > 1 and not plans.dcp and self.attn_type == AttentionType.DECODER:
            raise ValueError(
                f"layer {name!r} runs with decode context parallelism (DCP world size "
                f"{self.dcp_world_size}) but the metadata has no DCP plan: build it with "
                f"EngineConfig(decode_context_parallel_size={self.dcp_world_size}, ...)")
        kind, key_cache = plans.kind, self._key_cache
        if key_cache is not None and (kind.block_size, kind.cache_dtype, kind.head_size_v) != (
                key_cache.shape[1], key_cache.dtype, self._value_cache.shape[-1]):
            return None  # another cache than the builder's spec describes
        self._layout, self._plan_index = step.layout, index
        return plans

    def _forward_unplanned(self, layer, query, key, value, kv_cache, attn_metadata,
                           output) -> None:
        """The public ops, for metadata without the builder's plans."""
        if getattr(attn_metadata, "dcp", None) is not None:
            raise ValueError("a DCP step runs on the builder's plans; this metadata has none "
                             "for this layer (another dtype than the builder's spec?)")
        if self._ready_on != query.device:
            self.to_device(query.device)
        if self.ops_provider is None:
            self._forward(layer, query, key, value, kv_cache, attn_metadata, output)
        else:
            with use_provider(self.ops_provider):
                self._forward(layer, query, key, value, kv_cache, attn_metadata, output)

    def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output) -> None:
        n = attn_metadata.num_actual_tokens
        if query.shape[0] != n:
            output[n:].zero_()  # padding rows (the output buffer is torch.empty)
        if self.attn_type in ENCODER_TYPES:
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
            softmax_scale=self.scale, causal=self.causal_for(attn_metadata),
            alibi_slopes=self.alibi_slopes, window_size=self.sliding_window,
            block_table=attn_metadata.block_table, softcap=self.logits_soft_cap,
            s_aux=self.sinks, **self.descales_for(layer, query, num_reqs))

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

    # --- helpers ---------------------------------------------------------------------------
    def causal_for(self, attn_metadata: PagedAttentionMetadata) -> bool:
        return attn_metadata.causal and self.attn_type == AttentionType.DECODER

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key_cache, value_cache = self.split_kv_cache(kv_cache)
        if is_fp8_kv_cache(self.kv_cache_dtype) and key_cache.dtype == torch.uint8:
            fp8 = kv_cache_torch_dtype(self.kv_cache_dtype, torch.float16)
            key_cache, value_cache = key_cache.view(fp8), value_cache.view(fp8)
        return key_cache, value_cache

    def descales_for(self, layer, query: torch.Tensor, num_reqs: int) -> dict:
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


def is_paged_layer(layer) -> bool:
    """Whether a layer runs a paged impl (what the paged builders plan for)."""
    return isinstance(layer.impl, PagedAttentionImpl)


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
