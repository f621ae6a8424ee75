"""What every paged backend shares: the metadata's paged fields, the impl's argument checks
and its forward, which runs the plans the builder made for the layer's kind
(`paged_plans`).

Not a backend itself. Backends subclass `PagedAttentionImpl` and say how their cache tensor
splits into K and V views; their builders make the plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pagedattn.backends.dcp import DCPAttention, check_dcp_layer
from pagedattn.backends.step_plans import PlannedLayer, PlannedMetadata
from pagedattn.config import is_fp8_kv_cache, kv_cache_torch_dtype
from pagedattn.distributed import (
    get_decode_context_parallel_rank,
    get_decode_context_parallel_world_size,
    tp_shard_heads,
)
from pagedattn.layer_checks import check_step_tokens
from pagedattn.types import ALL_ATTN_TYPES, AttentionImpl, AttentionType


@dataclass(frozen=True)
class PagedAttentionMetadata(PlannedMetadata):
    """The per-batch fields a paged impl reads (backends extend it), and the builder's plans
    (`PlannedMetadata`): frozen, as the plans are made for exactly these values."""

    num_actual_tokens: int  # tokens in the batch, padding excluded
    max_query_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    max_seq_len: int
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    causal: bool = True
    # Captured in a CUDA graph: plans serve any batch up to this one's token and request
    # counts and max_seq_len (both passes launched, grids for the bucket).
    cuda_graph: bool = False


class PagedAttentionImpl(AttentionImpl):
    """Writes K/V into a paged cache and attends over it with the step's plans, which the
    backend's builder made (`paged_plans`); metadata without plans is refused."""

    # Pin the ops to one provider ("torch" for the pure-PyTorch backend); None = by device.
    ops_provider: ClassVar[Optional[str]] = None
    # Whether the backend runs decode context parallelism (backends/dcp.py).
    supports_dcp: ClassVar[bool] = False
    # forward() takes the layer's 2-D rows as they come (views only where a plan needs them).
    forward_takes_rows: ClassVar[bool] = True
    # forward() refuses a call without the output buffer (as the seed's FLASHINFER impl).
    requires_output: ClassVar[bool] = False

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
        # The cache last seen and its K/V views (made once per cache).
        self._cache: Optional[torch.Tensor] = None
        self._key_cache = self._value_cache = None
        self._ready_on: Optional[torch.device] = None  # where alibi_slopes/sinks were moved

    def split_kv_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical [num_blocks, block_size, num_kv_heads, head_size] K and V views (the
        backend's cache layout decides)."""
        return kv_cache[0], kv_cache[1]

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: Optional[torch.Tensor],
                value: Optional[torch.Tensor], kv_cache: torch.Tensor,
                attn_metadata: Optional[PlannedMetadata],
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
            if self.requires_output:
                raise ValueError("Output tensor must be provided.")
            query, key, value, _ = self._heads(query, key, value, None)
            output = torch.empty(query.shape[0], self.num_heads, value.shape[-1] if value is
                                 not None else self.head_size, dtype=_out_dtype(query),
                                 device=query.device)
        if attn_metadata is None:  # profiling run: no cache, no attention
            return output.fill_(0)
        # The layer's entry in the step's plans, made at its first call (`plan_layer`) and
        # valid while the layer keeps the cache and the tensors it was made with.
        planned = attn_metadata.plans.layers.get(self) if attn_metadata.plans else None
        if planned is None or planned.kv_cache is not kv_cache or \
                planned.k_scale is not layer._k_scale or planned.v_scale is not layer._v_scale \
                or planned.q_scale is not layer._q_scale or \
                planned.alibi_slopes is not self.alibi_slopes or planned.sinks is not self.sinks:
            planned = self.plan_layer(layer, attn_metadata, kv_cache)
        # The provider's plan for this layer takes the usual call (the planned token count,
        # 2-D rows, aligned) with only the call's tensors read; `run` takes any call.
        if planned.run is None or not planned.run(query, key, value, output):
            check_step_tokens(layer, query, key, attn_metadata)
            plans = planned.plans
            if query.dtype is not plans.q_dtype or output.dtype is not plans.out_dtype:
                raise TypeError(
                    f"{_layer_name(layer)}: query {query.dtype} and output {output.dtype}; "
                    f"the step was planned for {plans.q_dtype} and {plans.out_dtype} (the "
                    "builder's AttentionSpec.dtype, and the layer's fp8 query where it "
                    "quantizes it)")
            if not plans.takes_rows:
                query, key, value, output = self._heads(query, key, value, output)
            plans.run(self, layer, query, key, value, planned.key_cache, planned.value_cache,
                      output)
        return output

    def plan_layer(self, layer: torch.nn.Module, attn_metadata: PlannedMetadata,
                   kv_cache: torch.Tensor) -> PlannedLayer:
        """This layer's entry in the step's plans: its kind's plans (the builder's index for
        it), checked against the layer and its cache, with the provider's plan for the
        layer's own caches and tensors where the provider has one. Made at the layer's first
        call of the plans, and again when it has another cache or tensor."""
        step = attn_metadata.plans
        if step is None:
            raise ValueError(_unplanned(layer, attn_metadata, self.dcp_world_size))
        if kv_cache is not self._cache:
            self._bind_cache(kv_cache, layer)
        plans = step.kinds[step.layout.index_of(self, layer)]
        if self.dcp_world_size > 1 and not plans.dcp and self.attn_type == AttentionType.DECODER:
            raise ValueError(
                f"{_layer_name(layer)} runs with decode context parallelism (DCP world size "
                f"{self.dcp_world_size}) but the metadata has no DCP plan: build it with "
                f"EngineConfig(decode_context_parallel_size={self.dcp_world_size}, ...)")
        planned = PlannedLayer(
            plans, kv_cache, self._key_cache, self._value_cache, layer._k_scale,
            layer._v_scale, layer._q_scale, self.alibi_slopes, self.sinks,
            plans.plan_layer(self, layer, self._key_cache, self._value_cache))
        step.layers[self] = planned
        return planned

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
        self._key_cache, self._value_cache = self.cache_views(kv_cache) \
            if kv_cache.numel() else (None, None)
        self._cache = kv_cache

    def cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's K and V views in its storage dtype (fp8 kept as uint8 bytes is viewed
        as the fp8 dtype its kv_cache_dtype names)."""
        key_cache, value_cache = self.split_kv_cache(kv_cache)
        if is_fp8_kv_cache(self.kv_cache_dtype) and key_cache.dtype == torch.uint8:
            fp8 = kv_cache_torch_dtype(self.kv_cache_dtype, torch.float16)
            key_cache, value_cache = key_cache.view(fp8), value_cache.view(fp8)
        return key_cache, value_cache

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


def _layer_name(layer) -> str:
    name = getattr(layer, "layer_name", "")
    return f"layer {name!r}" if name else "Attention layer (no prefix)"


def _unplanned(layer, attn_metadata, dcp_world_size: int) -> str:
    """Why metadata without plans is refused, and what makes it."""
    backend = getattr(layer, "attn_backend", None)
    builder = backend.get_builder_cls().__name__ if backend is not None else "the builder"
    hint = (f" (decode context parallelism also needs an EngineConfig with "
            f"decode_context_parallel_size={dcp_world_size})") if dcp_world_size > 1 else ""
    return (f"{_layer_name(layer)}: this {type(attn_metadata).__name__} carries no plans: "
            f"make it with {builder}(...).build(){hint}, or plan metadata made or changed by "
            "hand (a dataclasses.replace copy drops the plans) with that builder's "
            "plan(attn_metadata)")
