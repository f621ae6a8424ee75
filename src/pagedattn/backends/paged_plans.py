"""A step's plans: made once by the builder in `build()`, run by every layer of the step.

Layers that agree on everything planning reads share one set of plans: heads and head
sizes, scale, window, soft cap, whether ALiBi slopes and sinks exist, the attention type,
the dtypes of query, output and cache, and whether the layer writes its own cache. That is a
`LayerKind`. A builder finds its layers by name (`layer_registry.find_layers`) and groups
them into kinds once (`PlanLayout`). `build()` plans every kind for the batch
(`PlanLayout.plan`) and makes the frozen metadata with the result in it (`StepPlans`, through
`PlannedMetadata`'s planner). A layer's first call of the plans makes its entry
(`PlannedLayer`: its kind's plans and, where the provider has one, the provider's plan of its
own caches and tensors); every call then runs that entry.

Each kind's plans know what its calls do: `PagedPlans` (cache write, then attention over the
cache), `EncoderPlans` (bidirectional attention over the call's own keys, no cache),
`CascadePlans` (the cache write, then cascade attention); DCP steps have theirs in
`backends/dcp.py`, FLASHINFER's in `backends/flashinfer.py`.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedattn.backends.step_plans import StepPlans
from pagedattn.config import kv_cache_torch_dtype
from pagedattn.layer_registry import find_all_layers
from pagedattn.ops.cache import CacheWritePlan, plan_reshape_and_cache_flash
from pagedattn.ops.cascade_plan import plan_cascade_attention
from pagedattn.ops.plan import (
    LayerPlan,
    VarlenAttentionPlan,
    plan_layer,
    plan_varlen_attention,
)
from pagedattn.ops.providers import provider_name
from pagedattn.types import AttentionType

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ENCODER_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


@dataclass(frozen=True)
class LayerKind:
    """What a layer's plans depend on; layers equal in all of it share them."""

    attn_type: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    scale: float
    window: tuple[int, int]  # flash-attn's (left, right); (-1, -1): none
    softcap: float
    use_alibi: bool
    use_sinks: bool
    writes_cache: bool  # no KV sharing: the layer writes its own new keys and values
    q_dtype: torch.dtype  # as the impl gets the query: fp8 where the layer quantizes it
    out_dtype: torch.dtype
    cache_dtype: torch.dtype
    block_size: int
    ops_provider: Optional[str]  # the backend's pinned provider; None: by device at build

    @property
    def causal(self) -> bool:
        return self.attn_type == AttentionType.DECODER

    @property
    def cascade(self) -> bool:
        """Whether a cascade step can serve this kind (else it runs plain attention)."""
        return self.causal and not self.use_alibi and self.window == (-1, -1)


def layer_kind(layer: Any, spec: Any) -> LayerKind:
    """The kind of an Attention layer whose cache is described by `spec` (AttentionSpec):
    the model dtype and block size come from the spec, the rest from the layer."""
    impl = layer.impl
    dtype = spec.dtype
    encoder = impl.attn_type in ENCODER_TYPES
    return LayerKind(
        attn_type=impl.attn_type, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
        head_size=impl.head_size, head_size_v=layer.head_size_v, scale=impl.scale,
        window=tuple(impl.sliding_window), softcap=float(impl.logits_soft_cap or 0.0),
        use_alibi=impl.alibi_slopes is not None, use_sinks=impl.sinks is not None,
        writes_cache=impl.kv_sharing_target_layer_name is None and not encoder,
        q_dtype=layer.query_quant_dtype or dtype, out_dtype=dtype,
        cache_dtype=kv_cache_torch_dtype(impl.kv_cache_dtype, dtype),
        block_size=spec.block_size, ops_provider=impl.ops_provider)


class PagedPlans:
    """One kind's cache write and paged attention for one batch."""

    dcp = False  # a layer in a DCP group needs DCP plans (backends/dcp.py)
    # Whether run() also takes the layer's 2-D rows (query [T, H * D], key / value
    # [T, H_kv * D(v)], output [T, H * Dv]); else the impl views them as [T, heads, D].
    takes_rows = False

    def __init__(self, kind: LayerKind, write: Optional[CacheWritePlan],
                 attend: VarlenAttentionPlan, num_tokens: int, dense_new_kv: bool):
        self.kind, self.write, self.attend, self.num_tokens = kind, write, attend, num_tokens
        # The provider's runs: these plans hand them exactly the tensors they were made for.
        self.write_run = None if write is None else write.provider_plan.run
        self.attend_run = attend.provider_plan.run
        self.takes_rows = attend.takes_rows and (write is None or write.takes_rows)
        self.q_dtype, self.out_dtype = kind.q_dtype, kind.out_dtype
        self.q_descale = kind.q_dtype in _FP8
        self.kv_descale = kind.cache_dtype in _FP8
        self.dense_new_kv = dense_new_kv

    def run(self, impl: Any, layer: Any, query: torch.Tensor, key: Optional[torch.Tensor],
            value: Optional[torch.Tensor], key_cache: torch.Tensor, value_cache: torch.Tensor,
            output: torch.Tensor) -> None:
        """query [T, H, D], key/value [T, Hkv, D(v)] or None (cross-attention after its first
        step), caches [num_blocks, block_size, Hkv, D(v)]; output [T, H, Dv] written, rows
        past the batch's tokens zeroed. With `takes_rows`, query, key, value and output may
        be 2-D rows ([T, H * D] ...) instead."""
        if self.write_run is not None and key is not None:
            self.write_run(key, value, key_cache, value_cache, layer._k_scale, layer._v_scale)
        n = self.num_tokens
        if query.shape[0] != n:  # padded: the write's slots skip the padding already
            output[n:].zero_()  # padding rows (the output buffer is torch.empty)
            query, output = query[:n], output[:n]
            if self.dense_new_kv and key is not None:
                key, value = key[:n], value[:n]
        if self.dense_new_kv and key is not None:  # the prefill pass reads the new K/V densely
            self.attend_run(query, key_cache, value_cache, output, None, impl.alibi_slopes,
                            impl.sinks, None, None, None, key, value)
        elif self.q_descale or self.kv_descale:
            self.attend_run(query, key_cache, value_cache, output, None, impl.alibi_slopes,
                            impl.sinks, layer._q_scale if self.q_descale else None,
                            layer._k_scale if self.kv_descale else None,
                            layer._v_scale if self.kv_descale else None)
        else:
            self.attend_run(query, key_cache, value_cache, output, None, impl.alibi_slopes,
                            impl.sinks)

    def plan_layer(self, impl: Any, layer: Any, key_cache: Optional[torch.Tensor],
                   value_cache: Optional[torch.Tensor]) -> Optional[LayerPlan]:
        """These plans for one layer: ValueError where its cache is not the one they were
        planned for; the provider's plan of its caches, scales, ALiBi slopes and sinks
        (`ops.plan.plan_layer`: a call then reads only its own tensors) where the provider
        has one, else None (`run` takes every call)."""
        check_cache(self.kind, layer, key_cache, value_cache)
        if not self.takes_rows:
            return None
        return plan_layer(self.attend, self.write, key_cache, value_cache, layer._k_scale,
                          layer._v_scale, impl.alibi_slopes, impl.sinks,
                          layer._q_scale if self.q_descale else None,
                          layer._k_scale if self.kv_descale else None,
                          layer._v_scale if self.kv_descale else None, self.num_tokens)


def check_cache(kind: LayerKind, layer: Any, key_cache: Optional[torch.Tensor],
                value_cache: Optional[torch.Tensor]) -> None:
    """ValueError where a layer's cache (its K and V views; None: no cache) differs from the
    one the builder's AttentionSpec describes, which the plans were made for."""
    if key_cache is None:
        return
    have = (key_cache.shape[1], key_cache.dtype, value_cache.shape[-1])
    planned = (kind.block_size, kind.cache_dtype, kind.head_size_v)
    if have != planned:
        name = getattr(layer, "layer_name", "") or "an unnamed layer"
        raise ValueError(
            f"layer {name!r} has a cache of block size {have[0]}, dtype {have[1]} and V head "
            f"size {have[2]}, but the step was planned for {planned[0]}, {planned[1]} and "
            f"{planned[2]}: make the builder with the AttentionSpec of the layers' caches")


class EncoderPlans(PagedPlans):
    """Bidirectional attention of each request's tokens over their own keys: no cache (so a
    model-wide fp8 cache dtype does not apply; keys and values stay in the model dtype)."""

    def run(self, impl, layer, query, key, value, key_cache, value_cache, output) -> None:
        n = self.num_tokens
        if query.shape[0] != n:
            output[n:].zero_()
            query, key, value, output = query[:n], key[:n], value[:n], output[:n]
        self.attend_run(query, key, value, output, None, impl.alibi_slopes, impl.sinks)

    def plan_layer(self, impl, layer, key_cache, value_cache) -> None:
        return None  # no cache to check; `run` reads the call's own keys


class CascadePlans(PagedPlans):
    """The cache write, then cascade attention over the batch's common prefix
    (`plan_cascade_attention`)."""

    def __init__(self, kind: LayerKind, write: Optional[CacheWritePlan], m: Any,
                 provider: str):
        self.kind, self.write, self.num_tokens = kind, write, m.num_actual_tokens
        self.write_run = None if write is None else write.provider_plan.run
        self.q_dtype, self.out_dtype = kind.q_dtype, kind.out_dtype
        self.q_descale, self.kv_descale = kind.q_dtype in _FP8, kind.cache_dtype in _FP8
        self.attend = plan_cascade_attention(
            cu_query_lens=m.query_start_loc, max_query_len=m.max_query_len,
            cu_prefix_query_lens=m.cu_prefix_query_lens, prefix_kv_lens=m.prefix_kv_lens,
            suffix_kv_lens=m.suffix_kv_lens, max_kv_len=m.max_seq_len,
            block_table=m.block_table, common_prefix_len=m.common_prefix_len,
            num_tokens=m.num_actual_tokens, num_heads=kind.num_heads,
            num_kv_heads=kind.num_kv_heads, head_size=kind.head_size,
            head_size_v=kind.head_size_v, page_size=kind.block_size, q_dtype=kind.q_dtype,
            kv_dtype=kind.cache_dtype, out_dtype=kind.out_dtype, softmax_scale=kind.scale,
            logits_soft_cap=kind.softcap, use_sinks=kind.use_sinks,
            use_q_descale=self.q_descale, use_kv_descale=self.kv_descale,
            max_num_splits=m.max_num_splits, provider=provider)

    def run(self, impl, layer, query, key, value, key_cache, value_cache, output) -> None:
        if self.write_run is not None and key is not None:
            self.write_run(key, value, key_cache, value_cache, layer._k_scale, layer._v_scale)
        n = self.num_tokens
        if query.shape[0] != n:
            output[n:].zero_()
            query, output = query[:n], output[:n]
        self.attend.run(
            output, query, key_cache, value_cache,
            q_descale=layer._q_scale if self.q_descale else None,
            k_descale=layer._k_scale if self.kv_descale else None,
            v_descale=layer._v_scale if self.kv_descale else None, s_aux=impl.sinks)


def plan_write(kind: LayerKind, m: Any, provider: str) -> Optional[CacheWritePlan]:
    if not kind.writes_cache:
        return None
    return plan_reshape_and_cache_flash(
        m.slot_mapping, num_kv_heads=kind.num_kv_heads, head_size=kind.head_size,
        head_size_v=kind.head_size_v, page_size=kind.block_size, cache_dtype=kind.cache_dtype,
        provider=provider, cuda_graph=getattr(m, "cuda_graph", False))


def plan_paged(kind: LayerKind, m: Any, provider: str, write: Optional[CacheWritePlan],
               batch_invariant: bool = False) -> PagedPlans:
    """The plain plans of a kind for batch `m` (paged metadata fields), with its cache write
    (None: the kind writes nothing): decoders and cross-attention over the cache, encoders
    over their own keys. batch_invariant: the builder's mode (`ops.batch_invariant`)."""
    n = m.num_actual_tokens
    heads = dict(num_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads,
                 head_size=kind.head_size, head_size_v=kind.head_size_v,
                 softmax_scale=kind.scale, window_size=kind.window, softcap=kind.softcap,
                 use_alibi=kind.use_alibi, use_sinks=kind.use_sinks, q_dtype=kind.q_dtype,
                 out_dtype=kind.out_dtype, cuda_graph=m.cuda_graph, provider=provider,
                 batch_invariant=batch_invariant)
    if kind.attn_type in ENCODER_TYPES:
        attend = plan_varlen_attention(
            **heads, cu_seqlens_q=m.query_start_loc, cu_seqlens_k=m.query_start_loc,
            num_tokens=n, max_seqlen_q=m.max_query_len, max_seqlen_k=m.max_query_len,
            kv_dtype=kind.out_dtype, causal=False)
        return EncoderPlans(kind, None, attend, n, False)
    # A decoder that writes its own new K/V in the model dtype: the Triton prefill pass may
    # read them densely instead of gathering them back from the pages.
    dense_new_kv = (provider == "triton" and kind.causal and kind.writes_cache
                    and kind.q_dtype not in _FP8 and kind.cache_dtype not in _FP8)
    attend = plan_varlen_attention(
        **heads, cu_seqlens_q=m.query_start_loc, num_tokens=n, max_seqlen_q=m.max_query_len,
        max_seqlen_k=m.max_seq_len, kv_dtype=kind.cache_dtype, seqused_k=m.seq_lens,
        block_table=m.block_table, page_size=kind.block_size,
        causal=m.causal and kind.causal, use_q_descale=kind.q_dtype in _FP8,
        use_kv_descale=kind.cache_dtype in _FP8, dense_new_kv=dense_new_kv,
        new_keys_only=getattr(m, "new_keys_only", False))
    return PagedPlans(kind, write, attend, n, dense_new_kv)


# (kind, batch, provider, the kind's cache write plan or None, batch-invariant mode) -> the
# kind's plans
PlanKind = Callable[[LayerKind, Any, str, Optional[CacheWritePlan], bool], PagedPlans]


class PlanLayout:
    """A builder's layers grouped into kinds, and each layer impl's index among them.

    Layers are looked up by name when the builder is made, and again at each build while some
    are missing (a builder made before its model). A name outside the current model scope
    takes every live layer of that name (a reference model and its copy may share names)."""

    def __init__(self, spec: Any, layer_names: list[str],
                 accept: Callable[[Any], bool] = lambda layer: True):
        self.spec, self.layer_names, self.accept = spec, list(layer_names), accept
        self.kinds: list[LayerKind] = []
        self._index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # impl -> kind
        self.missing = list(self.layer_names)
        self.find()

    def find(self) -> None:
        """Take in the named layers that exist now (those still missing are looked up again
        by the next build)."""
        found = find_all_layers(self.missing, self.accept)
        for layers in found.values():
            for layer in layers:
                self._index[layer.impl] = self._kind_index(layer_kind(layer, self.spec))
        self.missing = [name for name in self.missing if name not in found]

    def _kind_index(self, kind: LayerKind) -> int:
        if kind not in self.kinds:
            self.kinds.append(kind)
        return self.kinds.index(kind)

    def index_of(self, impl: Any, layer: Any) -> int:
        """The kind index of `layer` (whose impl is `impl`); a layer made after the builder
        under one of its names is served when its kind was planned. ValueError otherwise."""
        index = self._index.get(impl)
        if index is not None:
            return index
        name = getattr(layer, "layer_name", "") or "an unnamed layer"
        if name not in self.layer_names:
            raise ValueError(
                f"layer {name!r} is not among the layers this step was planned for: the "
                f"builder's layer_names are {self.layer_names}; make the builder with this "
                "layer's name (its prefix) among them")
        kind = layer_kind(layer, self.spec)
        if kind not in self.kinds:
            raise ValueError(
                f"layer {name!r} was made after the builder and differs from the layers it "
                f"plans for ({kind} is not among {self.kinds}); make the builder after the "
                "model")
        index = self._index[impl] = self.kinds.index(kind)
        return index

    def plan(self, m: Any, device: torch.device, plan_kind: PlanKind = plan_paged,
             writes: Optional[dict] = None, batch_invariant: bool = False) -> StepPlans:
        """Every kind's plans for batch `m` (the backend's metadata, plans not yet set).
        The provider is read now: the backend's pinned one, else the device's. `writes`: the
        builder's cache-write plans for this batch size, reused (a Triton write plan reads
        only the slot mapping, at launch, which a builder with persistent buffers hands out
        as one view per size; PyTorch's read it when made: pass None), filled on a miss.
        batch_invariant: the builder's mode (its EngineConfig's or
        PAGEDATTN_BATCH_INVARIANT's), which every kind's attention is planned in."""
        if self.missing:
            self.find()
        provider = provider_name(device)
        plans = []
        for index, kind in enumerate(self.kinds):
            kind_provider = kind.ops_provider or provider
            write = None
            if kind.writes_cache:
                key = (index, kind_provider)
                write = writes.get(key) if writes is not None else None
                if write is None:
                    write = plan_write(kind, m, kind_provider)
                    if writes is not None:
                        writes[key] = write
            plans.append(plan_kind(kind, m, kind_provider, write, batch_invariant))
        return StepPlans(self, tuple(plans))
