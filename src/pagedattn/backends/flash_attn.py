"""FLASH_ATTN: the paged backend with flash-attn's API, on Triton kernels (CUDA) or PyTorch (CPU).

Cache layout (2, num_blocks, block_size, num_kv_heads, head_size), NHD or HND physical order.
Beyond the shared paged impl it adds cascade attention: when every request of a batch starts
with the same long prefix, the builder plans one pass over that prefix for the whole batch
(`pagedattn.ops.cascade`). Its builder keeps persistent device buffers, so a step captured in
a CUDA graph replays with the lengths and block tables of any later `build`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pagedattn.backends.common import (
    PagedAttentionImpl,
    PagedAttentionMetadata,
    is_paged_layer,
)
from pagedattn.backends.dcp import DCPMetadata, DCPPlans, dcp_planner
from pagedattn.backends.paged_layout import PagedKVCacheLayout
from pagedattn.backends.paged_plans import (
    CascadePlans,
    LayerKind,
    PagedPlans,
    PlanLayout,
    plan_paged,
)
from pagedattn.config import KV_CACHE_DTYPE_STRINGS, EngineConfig, batch_invariant_mode
from pagedattn.metadata import AttentionSpec, CommonAttentionMetadata
from pagedattn.metadata_persistent import PersistentBatch, held_in
from pagedattn.ops.batch_copy import plan_batch_copy
from pagedattn.ops.cache import CacheWritePlan
from pagedattn.ops.cascade import cascade_attention, use_cascade_attention
from pagedattn.ops.providers import provider_name
from pagedattn.types import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    BackendCapabilities,
)

__all__ = [
    "FlashAttentionBackend", "FlashAttentionImpl", "FlashAttentionMetadata",
    "FlashAttentionMetadataBuilder", "cascade_attention", "use_cascade_attention",
]


@dataclass(frozen=True)
class FlashAttentionMetadata(PagedAttentionMetadata):
    """The paged fields plus the cascade plan (the seed's fields; the new ones by keyword)."""

    _: dataclasses.KW_ONLY
    use_cascade: bool
    common_prefix_len: int  # a multiple of block_size; 0 without cascade
    cu_prefix_query_lens: Optional[torch.Tensor]  # [2] int32: [0, num_actual_tokens]
    prefix_kv_lens: Optional[torch.Tensor]  # [1] int32: [common_prefix_len]
    suffix_kv_lens: Optional[torch.Tensor]  # [num_reqs] int32: seq_lens - common_prefix_len
    scheduler_metadata: Optional[torch.Tensor] = None  # flash-attn 3's AOT schedule: unused
    prefix_scheduler_metadata: Optional[torch.Tensor] = None
    max_num_splits: int = 0  # 0: the kernel chooses its split-KV count
    # Prompts alone (no cached context, not a capture): the new rows are every key.
    new_keys_only: bool = False
    dcp: Optional[DCPMetadata] = None  # this rank's context lengths under DCP


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Copies each batch into persistent buffers and decides cascade attention.

    Buffers are sized at construction for max_num_seqs requests, max_num_batched_tokens tokens
    and max_model_len keys per request; `build` returns views of them. A CUDA graph captured
    over one build's metadata therefore reads the next build's values at replay, as long as the
    batch keeps its request and token counts (padded requests: query_len 0, seq_len 0; padded
    tokens: slot -1, which `build` fills in when a batch is smaller than a captured one).
    """

    # Any batch replays: a captured plan launches both kernel passes with grids for the
    # captured token and request counts, and each program finds its work on the device
    # (`ops/triton/attention_plan.py`), so decodes, chunks and mixes of them all fit.
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    reorder_batch_threshold: ClassVar[Optional[int]] = 1

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: Optional[EngineConfig], device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = vllm_config or EngineConfig()
        self.block_size = kv_cache_spec.block_size
        self.max_num_seqs, self.max_model_len = config.max_num_seqs, config.max_model_len
        self.enable_cascade = config.enable_cascade
        self.batch_invariant = batch_invariant_mode(vllm_config)  # (then no cascade)
        max_blocks = -(-config.max_model_len // self.block_size)
        # One allocation, which a stager given it uploads each step into (then `build`
        # copies nothing); pads: the largest captured batch
        self.persistent_batch = p = PersistentBatch(
            config.max_num_seqs, max_blocks, config.max_num_batched_tokens, self.device)
        self.query_start_loc, self.seq_lens = p.query_start_loc, p.seq_lens
        self.block_table, self.slot_mapping = p.block_table, p.slot_mapping
        self._view_cache: dict[tuple, tuple] = {}
        self.layout = PlanLayout(kv_cache_spec, layer_names, accept=is_paged_layer)
        self._layer_features = self._find_layer_features(kv_cache_spec, self.layout)
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else os.cpu_count() or 1)
        self.dcp = dcp_planner(vllm_config, config.max_num_seqs, self.device)

    @staticmethod
    def _find_layer_features(spec: AttentionSpec, layout: PlanLayout) -> dict:
        """What the cascade decision must know of the layers; without them, plain defaults
        (a kind that cascade cannot serve is planned as plain attention anyway)."""
        kinds = layout.kinds
        return dict(
            num_query_heads=max((k.num_heads for k in kinds), default=spec.num_kv_heads),
            use_alibi=any(k.use_alibi for k in kinds),
            use_sliding_window=spec.sliding_window is not None or any(
                k.window != (-1, -1) for k in kinds))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashAttentionMetadata:
        m = common_attn_metadata
        self.check_batch(m)
        return self._build(m, self._cascade_prefix_len(common_prefix_len, m), capture=False)

    def _build(self, m: CommonAttentionMetadata, prefix_len: int, capture: bool
               ) -> FlashAttentionMetadata:
        """The batch into the persistent buffers, then the metadata and its plans."""
        num_reqs, num_tokens = m.num_reqs, m.slot_mapping.shape[0]
        width = m.block_table_tensor.shape[1]
        qsl, seq_lens, table, slots, copies, writes, steps = self._views(
            num_reqs, num_tokens, width, m.max_seq_len)
        # The batch into the buffers, padded for the largest captured batch (a captured graph
        # reads the padding as empty requests and skipped slots): there already where a
        # stager uploaded it into them, else one launch on CUDA.
        if m.staged_into is None or held_in(m) is not self.persistent_batch:
            pads = self.persistent_batch.pads
            copy = copies.get(pads)
            if copy is None:
                copy = copies[pads] = plan_batch_copy(
                    self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping,
                    num_reqs=num_reqs, num_tokens=num_tokens, width=width, pad_reqs=pads[0],
                    pad_tokens=pads[1])
            copy.run(m.query_start_loc, m.seq_lens, m.block_table_tensor, m.slot_mapping,
                     m.num_actual_tokens)
            self.persistent_batch.written = None
        max_query_len, max_seq_len = m.max_query_len, m.max_seq_len
        if capture:  # bounds any later batch of at most these tokens and requests fits
            max_seq_len = self.max_model_len
            if max_query_len > 1:
                max_query_len = min(m.num_actual_tokens, self.max_model_len)
        elif self.device.type == "cuda":  # a key bound that many steps share (see below)
            max_seq_len = min(key_bound(max_seq_len), self.max_model_len)
        cascade = prefix_len > 0
        # Prompts alone, on the host lengths (a decode-sized step always has a context)
        new_keys_only = not capture and max_query_len > 1 and m.num_reqs > 0 and \
            not m.num_computed_tokens_cpu[:m.num_reqs].any()
        md = FlashAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=max_query_len,
            query_start_loc=qsl, max_seq_len=max_seq_len, seq_lens=seq_lens,
            block_table=table, slot_mapping=slots, causal=m.causal, cuda_graph=capture,
            use_cascade=cascade, common_prefix_len=prefix_len,
            cu_prefix_query_lens=self._tensor([0, m.num_actual_tokens]) if cascade else None,
            prefix_kv_lens=self._tensor([prefix_len]) if cascade else None,
            suffix_kv_lens=(m.seq_lens_cpu[:num_reqs] - prefix_len).to(
                self.device, non_blocking=True) if cascade else None,
            dcp=self.dcp.plan(m) if self.dcp else None, new_keys_only=new_keys_only,
            planner=lambda md: self._plans(md, writes, steps, capture or cascade))
        return md

    def plan(self, attn_metadata: FlashAttentionMetadata) -> FlashAttentionMetadata:
        """Metadata made or changed by hand (a `dataclasses.replace` copy carries no plans)
        with this builder's plans for it, made afresh; the batch is taken as it is,
        unchecked."""
        return dataclasses.replace(attn_metadata, planner=lambda md: self.layout.plan(
            md, self.device, plan_flash_kind, batch_invariant=self.batch_invariant))

    def _plans(self, md: FlashAttentionMetadata, writes: dict, steps: dict, fresh: bool):
        """The step's plans. Plans read the batch's tensors when they launch, never their
        values at planning time, and this size's views are the same tensors every step: so
        a step whose planning ints equal an earlier step's (same token count, longest query
        and key bound; `key_bound` keeps the bound for many decode steps) reuses its plans,
        and `build()` then costs copies and checks, no planning. Captures, cascade and DCP
        steps plan afresh, and so does every step with a kind on the PyTorch provider, whose
        plans (attention and cache write) read the lengths, block table and slots when they
        are made (`TorchAttentionPlan`, `TorchCacheWritePlan`)."""
        provider = provider_name(self.device)
        triton = all((kind.ops_provider or provider) == "triton" for kind in self.layout.kinds)
        if not triton:
            writes = None
        if fresh or md.dcp is not None or self.layout.missing or not triton:
            return self.layout.plan(md, self.device, plan_flash_kind, writes,
                                    self.batch_invariant)
        key = (md.num_actual_tokens, md.max_query_len, md.max_seq_len, md.causal,
               md.new_keys_only, provider, len(self.layout.kinds))
        plans = steps.get(key)
        if plans is None:
            if len(steps) >= 8:  # plans may hold split-KV scratch: keep this size's last few
                steps.clear()
            plans = steps[key] = self.layout.plan(md, self.device, plan_flash_kind, writes,
                                                  self.batch_invariant)
        return plans

    def _views(self, num_reqs: int, num_tokens: int, width: int, max_seq_len: int) -> tuple:
        """The persistent buffers' views for a batch of this size, made once per size (a
        slice is a few microseconds of host time, and steps repeat their sizes), after
        `_check_fits` (a size seen before fits: only its max_seq_len is compared again)."""
        key = (num_reqs, num_tokens, width)
        views = self._view_cache.get(key)
        if views is None or max_seq_len > self.max_model_len:
            self._check_fits(num_reqs, num_tokens, width, max_seq_len)
        if views is None:
            if len(self._view_cache) > 4096:  # many sizes seen: start over
                self._view_cache.clear()
            views = self._view_cache[key] = (
                self.query_start_loc[:num_reqs + 1], self.seq_lens[:num_reqs],
                self.block_table[:num_reqs], self.slot_mapping[:num_tokens],
                {}, {}, {})  # this size's copy (per padding), write and step plans
        return views

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> FlashAttentionMetadata:
        """Metadata for capture: no cascade, a key bound of max_model_len, and (for a batch
        with any query longer than one token) a query bound of all its tokens, so the graph
        serves any later batch of at most its tokens and requests whose sequences fit the
        model. A capture of single-token queries serves pure-decode batches only."""
        m = common_attn_metadata
        self.check_batch(m)
        pads = self.persistent_batch.pads
        self.persistent_batch.pads = (max(pads[0], m.num_reqs),
                                      max(pads[1], m.slot_mapping.shape[0]))
        return self._build(m, 0, capture=True)

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return use_cascade_attention(*args, **kwargs)

    def _cascade_prefix_len(self, common_prefix_len: int, m: CommonAttentionMetadata) -> int:
        """The prefix cascade attends to, or 0: only the part every request has already
        computed (so it precedes every query), whole blocks, and only where it pays off."""
        if not (self.enable_cascade and m.causal and common_prefix_len > 0 and m.num_reqs) \
                or self.batch_invariant:  # a prefix merged apart is not a request's own sum
            return 0
        computed = int(m.num_computed_tokens_cpu[:m.num_reqs].min())
        prefix = min(common_prefix_len, computed) // self.block_size * self.block_size
        if prefix == 0:
            return 0
        f = self._layer_features
        if not self.use_cascade_attention(
                prefix, m.query_lens_cpu.tolist(), f["num_query_heads"],
                self.kv_cache_spec.num_kv_heads, f["use_alibi"], f["use_sliding_window"],
                False, self.num_sms):
            return 0
        return prefix

    def _check_fits(self, num_reqs: int, num_tokens: int, width: int, max_seq_len: int) -> None:
        limits = (("num_reqs", num_reqs, self.seq_lens.shape[0], "max_num_seqs"),
                  ("num_tokens", num_tokens, self.slot_mapping.shape[0],
                   "max_num_batched_tokens"),
                  ("block_table columns", width, self.block_table.shape[1],
                   "max_model_len // block_size"),
                  ("max_seq_len", max_seq_len, self.max_model_len, "max_model_len"))
        for what, value, limit, knob in limits:
            if value > limit:
                raise ValueError(f"batch has {what}={value} > {limit}, the builder's buffer "
                                 f"size; raise EngineConfig.{knob}")

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True)


def key_bound(max_seq_len: int) -> int:
    """max_seq_len rounded up to 4 significant bits (1024 -> 1024, 1025 -> 1152): the
    kernels read each request's length on the device and take the host bound only for split
    counts and grids, so a bound up to 12.5% high costs little and stays the same for
    hundreds of decode steps, which then share their plans."""
    if max_seq_len <= 16:
        return max_seq_len
    step = 1 << (max_seq_len.bit_length() - 4)
    return -(-max_seq_len // step) * step


def plan_flash_kind(kind: LayerKind, m: FlashAttentionMetadata, provider: str,
                    write: Optional[CacheWritePlan], batch_invariant: bool = False
                    ) -> PagedPlans:
    """A kind's plans for a FLASH_ATTN batch: the DCP step for decoders when the builder
    plans DCP, cascade where the batch has a common prefix and the kind allows it, else
    plain paged (or encoder) attention. In batch-invariant mode (never with DCP: the
    EngineConfig refuses it) always plain attention: a prefix merged apart is not a
    request's own sum, so even metadata that asks for cascade is planned without it."""
    if m.dcp is not None and kind.causal:
        return DCPPlans(kind, m, provider, write)
    if m.use_cascade and kind.cascade and not batch_invariant:
        return CascadePlans(kind, write, m, provider)
    return plan_paged(kind, m, provider, write, batch_invariant)


class FlashAttentionImpl(PagedAttentionImpl):
    """The shared paged impl (the builder plans cascade and DCP steps for it)."""

    # Ops dispatch by device: Triton on CUDA, PyTorch on CPU.
    ops_provider: ClassVar[Optional[str]] = None
    supports_dcp: ClassVar[bool] = True
    vllm_flash_attn_version: Optional[int] = None  # our kernels, not a flash-attn build


class FlashAttentionBackend(PagedKVCacheLayout, AttentionBackend):
    accept_output_buffer = True
    supports_quant_query_input = True
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda", "cpu"}),  # auto-chosen on CUDA only (selector.PREFERENCE)
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        kv_cache_dtypes=frozenset(KV_CACHE_DTYPE_STRINGS),
        head_sizes=tuple(range(8, 257, 8)),
        cascade=True,
        different_kv_head_sizes=False,
        cudagraph=AttentionCGSupport.ALWAYS,
    )

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[FlashAttentionMetadata]:
        return FlashAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_fp8_dtype_for_flashattn(kv_cache_dtype: str) -> torch.dtype:
        if kv_cache_dtype in ("fp8", "fp8_e4m3"):
            return torch.float8_e4m3fn
        if kv_cache_dtype == "fp8_e5m2":
            return torch.float8_e5m2
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not an fp8 cache dtype")
