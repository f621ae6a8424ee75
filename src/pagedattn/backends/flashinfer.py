"""FLASHINFER: vLLM's FlashInfer backend (v1) on pagedattn's FlashInfer-style wrappers.

Cache layout (num_blocks, 2, block_size, num_kv_heads, head_size), NHD or HND physical order.
The builder turns each batch into FlashInfer's CSR page table and plans the wrappers once per
step: decodes (one scheduled token, at the front after `reorder_batch`) through the decode
wrapper, the rest through the prefill wrapper, or everything through a two-level cascade when
the batch shares a prefix; the step's plans (`FlashInferPlans`) hold them. Layers run them on
the paged impl every cache-writing backend shares (`backends/common.py`: the same argument
checks, step checks and plan lookup as FLASH_ATTN). All layers must share sm_scale, sliding
window and soft cap, since one plan serves them all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from pagedattn import envs
from pagedattn.backends.common import PagedAttentionImpl
from pagedattn.backends.flashinfer_graphs import FlashInferGraphs
from pagedattn.backends.flashinfer_layers import (
    PerLayerParameters,
    csr_indices,
    find_layers,
    get_per_layer_parameters,
    infer_global_hyperparameters,
)
from pagedattn.backends.step_plans import ONE_KIND, PlannedMetadata, StepPlans
from pagedattn.config import (
    KV_CACHE_DTYPE_STRINGS,
    EngineConfig,
    batch_invariant_mode,
    get_kv_cache_layout,
    kv_cache_torch_dtype,
)
from pagedattn.metadata import AttentionSpec, CommonAttentionMetadata
from pagedattn.ops.cache import CacheWritePlan, plan_reshape_and_cache_flash
from pagedattn.ops.cascade import use_cascade_attention
from pagedattn.ops.flashinfer import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from pagedattn.types import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    AttentionType,
    BackendCapabilities,
)

__all__ = ["FlashInferBackend", "FlashInferImpl", "FlashInferMetadata",
           "FlashInferMetadataBuilder", "PerLayerParameters", "get_per_layer_parameters",
           "infer_global_hyperparameters"]


class FlashInferBackend(AttentionBackend):
    accept_output_buffer = True
    supports_quant_query_input = False
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda", "cpu"}),  # never auto-chosen on cpu (selector.PREFERENCE)
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        kv_cache_dtypes=frozenset(KV_CACHE_DTYPE_STRINGS),
        head_sizes=(64, 128, 256),
        attn_types=frozenset({AttentionType.DECODER}),
        alibi=False,  # FlashInfer's wrappers take no slopes; refused rather than ignored
        cascade=True,
        # Decode steps replay through a CUDA-graph decode wrapper, any other step through a
        # CUDA-graph prefill wrapper over all its tokens; cascade steps run eagerly.
        cudagraph=AttentionCGSupport.ALWAYS,
    )

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64, 128, 256]

    @classmethod
    def validate_head_size(cls, head_size: int) -> None:
        supported = cls.get_supported_head_sizes()
        if head_size not in supported:
            attn_type = cls.__name__.removesuffix("Backend")
            raise ValueError(
                f"Head size {head_size} is not supported by {attn_type}. Supported head sizes "
                f"are: {supported}. Set PAGEDATTN_ATTENTION_BACKEND=TORCH_SDPA to use the "
                "backend that supports all head sizes.")

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls() -> type[FlashInferImpl]:
        return FlashInferImpl

    @staticmethod
    def get_metadata_cls() -> type[FlashInferMetadata]:
        return FlashInferMetadata

    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be positive")
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False
                                  ) -> tuple[int, ...]:
        """NHD keeps the logical order; HND puts heads before tokens within a page. With a
        leading layers dimension, blocks go first so one block of every layer is contiguous."""
        hnd = get_kv_cache_layout() == "HND"
        if include_num_layers_dimension:
            return (1, 0, 2, 4, 3, 5) if hnd else (1, 0, 2, 3, 4, 5)
        return (0, 1, 3, 2, 4) if hnd else (0, 1, 2, 3, 4)


# --- metadata and builder ----------------------------------------------------------------------
@dataclass(frozen=True)
class FlashInferMetadata(PlannedMetadata):
    """One batch, planned (frozen: its wrappers are planned for exactly these fields, and its
    `plans` run them). Decodes come first, prefills after them (`reorder_batch`)."""

    num_actual_tokens: int  # tokens excluding padding
    qo_indptr: torch.Tensor  # [num_reqs + 1] int32 query offsets: lengths [4, 6] -> [0, 4, 10]
    # Pages in CSR form: request i owns paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]]
    # (pages [0, 5, 8], [1, 6, 7], [3, 4] -> indices [0, 5, 8, 1, 6, 7, 3, 4], indptr [0, 3, 6, 8])
    paged_kv_indptr: torch.Tensor  # [num_reqs + 1] int32
    paged_kv_indices: torch.Tensor  # [total pages] int32
    paged_kv_last_page_len: torch.Tensor  # [num_reqs] int32: tokens in each last page
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    data_type: torch.dtype  # of the paged cache
    q_data_type: torch.dtype
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    use_cascade: bool
    shared_qo_indptr: Optional[torch.Tensor] = None  # [2]: every query is one "request"
    shared_kv_page_indptr: Optional[torch.Tensor] = None  # [2]
    shared_kv_page_indices: Optional[torch.Tensor] = None  # the shared prefix's pages
    shared_kv_last_page_len: Optional[torch.Tensor] = None  # [1]: page_size
    prefill_wrapper: Optional[BatchPrefillWithPagedKVCacheWrapper] = None
    decode_wrapper: Optional[BatchDecodeWithPagedKVCacheWrapper] = None
    cascade_wrapper: Optional[MultiLevelCascadeAttentionWrapper] = None
    cache_write: Optional[CacheWritePlan] = None  # the step's cache write, planned once
    cuda_graph: bool = False  # planned into a CUDA-graph wrapper (capture / replay)

    # What a captured graph reads: views of the builder's buffers, the same for every build.
    cuda_graph_inputs: ClassVar[tuple] = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices",
                                          "paged_kv_last_page_len", "slot_mapping")

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self.qo_indptr

    def __post_init__(self, planner) -> None:
        if self.head_dim is not None:
            FlashInferBackend.validate_head_size(self.head_dim)
        super().__post_init__(planner)


class FlashInferMetadataBuilder(FlashInferGraphs, AttentionMetadataBuilder[FlashInferMetadata]):
    """Makes the CSR page table of each batch and plans the wrappers once for every layer.

    Every build writes the batch's page table into persistent buffers sized from the
    EngineConfig (max_num_seqs requests of max_model_len keys, max_num_batched_tokens tokens).
    For CUDA graphs it keeps one wrapper in FlashInfer's CUDA-graph mode per captured shape,
    planned into those buffers: `build_for_cudagraph_capture` makes it, and
    `build_for_cudagraph_replay` plans a later batch into it before its graph replays.
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    reorder_batch_threshold: ClassVar[Optional[int]] = 1

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: Optional[EngineConfig], device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = vllm_config or EngineConfig()
        self.enable_cascade, self.max_model_len = config.enable_cascade, config.max_model_len
        self.batch_invariant = batch_invariant_mode(vllm_config)  # (then no cascade)
        max_pages = -(-config.max_model_len // kv_cache_spec.block_size)
        int32 = dict(dtype=torch.int32, device=self.device)
        self.qo_indptr = torch.zeros(config.max_num_seqs + 1, **int32)
        self.paged_kv_indptr = torch.zeros(config.max_num_seqs + 1, **int32)
        self.paged_kv_indices = torch.zeros(config.max_num_seqs * max_pages, **int32)
        self.paged_kv_last_page_len = torch.zeros(config.max_num_seqs, **int32)
        self.slot_mapping = torch.full((config.max_num_batched_tokens,), -1,
                                       dtype=torch.int64, device=self.device)
        self.graph_wrappers: dict = {}  # (tokens, requests, decode only) -> wrapper
        self._workspace_buffer: Optional[torch.Tensor] = None
        self._prefill_wrapper: Optional[BatchPrefillWithPagedKVCacheWrapper] = None
        self._decode_wrapper: Optional[BatchDecodeWithPagedKVCacheWrapper] = None
        self._cascade_wrapper: Optional[MultiLevelCascadeAttentionWrapper] = None
        self.global_hyperparameters: Optional[PerLayerParameters] = None
        self.num_qo_heads: Optional[int] = None
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_spec.kv_cache_dtype, kv_cache_spec.dtype)
        if find_layers(list(layer_names)):  # else the first build looks again
            self.hyperparameters()

    def plan(self, attn_metadata: FlashInferMetadata) -> FlashInferMetadata:
        """Metadata made or changed by hand (a `dataclasses.replace` copy carries no plans)
        with the step's plans over its wrappers, as planned now."""
        return dataclasses.replace(attn_metadata, planner=plan_step)

    def reorder_batch(self, input_batch, scheduler_output) -> bool:
        """Move decodes (1 scheduled token) to the front with the fewest swaps: each swap
        trades the last decode behind the decode region for the first prefill inside it."""
        decodes, prefills = [], []
        for i, req_id in enumerate(input_batch.req_ids):
            (decodes if scheduler_output.num_scheduled_tokens[req_id] == 1 else prefills).append(i)
        num_decodes, modified = len(decodes), False
        for i in range(1, min(num_decodes, len(prefills)) + 1):
            decode_idx = decodes[num_decodes - i]
            if decode_idx < num_decodes:
                break
            input_batch.swap_states(prefills[i - 1], decode_idx)
            modified = True
        return modified

    # --- wrappers, made once and planned every step ------------------------------------------
    def get_workspace_buffer(self) -> torch.Tensor:
        if self._workspace_buffer is None:  # our wrappers keep their own small buffers
            self._workspace_buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        return self._workspace_buffer

    def _get_prefill_wrapper(self) -> BatchPrefillWithPagedKVCacheWrapper:
        if self._prefill_wrapper is None:
            self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(
                self.get_workspace_buffer(), get_kv_cache_layout())
        return self._prefill_wrapper

    def _get_decode_wrapper(self) -> BatchDecodeWithPagedKVCacheWrapper:
        if self._decode_wrapper is None:
            tensor_cores = (envs.PAGEDATTN_FLASHINFER_FORCE_TENSOR_CORES
                            or self.num_qo_heads // self.kv_cache_spec.num_kv_heads > 4)
            self._decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(
                self.get_workspace_buffer(), get_kv_cache_layout(),
                use_tensor_cores=tensor_cores)
        return self._decode_wrapper

    def _get_cascade_wrapper(self) -> MultiLevelCascadeAttentionWrapper:
        if self._cascade_wrapper is None:
            self._cascade_wrapper = MultiLevelCascadeAttentionWrapper(
                2, self.get_workspace_buffer(), get_kv_cache_layout())
        return self._cascade_wrapper

    def hyperparameters(self) -> PerLayerParameters:
        """The (window, soft cap, scale) every layer shares, from the layers named in
        layer_names, found once."""
        if self.global_hyperparameters is None:
            layers = find_layers(list(self.layer_names))
            if not layers:
                raise ValueError(
                    f"FLASHINFER plans once for all its layers and must know them, but none of "
                    f"layer_names={list(self.layer_names)} is a live Attention layer")
            heads = {layer.num_heads for layer in layers.values()}
            if len(heads) > 1:
                raise ValueError(f"FLASHINFER layers must share num_heads; got {sorted(heads)}")
            self.global_hyperparameters = infer_global_hyperparameters(
                get_per_layer_parameters(layers))
            self.num_qo_heads = heads.pop()
        return self.global_hyperparameters

    def _plan(self, host: dict, num_decodes: int, use_cascade: bool, causal: bool) -> dict:
        """Plan the wrappers this batch needs, from host copies of its page table; the
        metadata's wrapper fields, by name."""
        hp, spec = self.hyperparameters(), self.kv_cache_spec
        common = dict(sm_scale=hp.sm_scale, logits_soft_cap=hp.logits_soft_cap,
                      q_data_type=spec.dtype, window_left=hp.window_left,
                      kv_data_type=self.kv_dtype)
        shape = (self.num_qo_heads, spec.num_kv_heads, spec.head_size, spec.block_size)
        if use_cascade:
            cascade = self._get_cascade_wrapper()
            cascade.plan(
                [host["shared_qo_indptr"], host["qo_indptr"]],
                [host["shared_kv_page_indptr"], host["paged_kv_indptr"]],
                [host["shared_kv_page_indices"], host["paged_kv_indices"]],
                [host["shared_kv_last_page_len"], host["paged_kv_last_page_len"]], *shape,
                causal=causal, **common)
            return dict(cascade_wrapper=cascade)
        # Never cascade in batch-invariant mode (`_cascade_prefix_len`); the wrappers' plans
        # keep the builder's mode for every run.
        d, wrappers = num_decodes, {}
        common["batch_invariant"] = self.batch_invariant
        if host["qo_indptr"].shape[0] - 1 > d:  # prefills follow the decodes: rebase offsets
            prefill = wrappers["prefill_wrapper"] = self._get_prefill_wrapper()
            prefill.plan(
                host["qo_indptr"][d:] - host["qo_indptr"][d], host["paged_kv_indptr"][d:],
                host["paged_kv_indices"], host["paged_kv_last_page_len"][d:], *shape,
                causal=causal, **common)
        if d > 0:
            decode = wrappers["decode_wrapper"] = self._get_decode_wrapper()
            decode.plan(
                host["paged_kv_indptr"][:d + 1], host["paged_kv_indices"],
                host["paged_kv_last_page_len"][:d], *shape, pos_encoding_mode="NONE",
                **common)
        return wrappers

    def host_csr(self, m: CommonAttentionMetadata, prefix: int = 0) -> dict:
        """The batch's CSR page table on the host; with a cascade prefix, also the shared
        level (the prefix's pages) and each request's own pages after it."""
        num_reqs, page_size = m.num_reqs, self.kv_cache_spec.block_size
        seq_lens = m.seq_lens_cpu[:num_reqs].long()
        table = m.block_table_cpu[:num_reqs] if m.block_table_cpu is not None else \
            m.block_table_tensor[:num_reqs].cpu()
        bounds = (seq_lens + page_size - 1) // page_size
        host: dict[str, torch.Tensor] = {"qo_indptr": m.query_start_loc_cpu[:num_reqs + 1]}
        if prefix:
            blocks = prefix // page_size
            host.update(
                shared_qo_indptr=torch.tensor([0, m.num_actual_tokens], dtype=torch.int32),
                shared_kv_page_indptr=torch.tensor([0, blocks], dtype=torch.int32),
                shared_kv_page_indices=table[0, :blocks].clone(),
                shared_kv_last_page_len=torch.tensor([page_size], dtype=torch.int32))
            table, bounds = table[:, blocks:], bounds - blocks
        last = seq_lens % page_size
        host.update(
            paged_kv_indices=csr_indices(table, bounds),
            paged_kv_indptr=torch.cat([torch.zeros(1, dtype=torch.int64), bounds.cumsum(0)])
            .to(torch.int32),
            paged_kv_last_page_len=torch.where(last == 0, page_size, last).to(torch.int32))
        return host

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashInferMetadata:
        m = common_attn_metadata
        self.check_batch(m)
        hp = self.hyperparameters()
        num_reqs, num_tokens = m.num_reqs, m.slot_mapping.shape[0]
        q_lens = m.query_lens_cpu[:num_reqs]
        # Decodes are the leading one-token requests (all of them after reorder_batch; a batch
        # that was not reordered runs its later one-token requests as prefills).
        not_decode = (q_lens != 1).nonzero()
        num_decodes = int(not_decode[0, 0]) if not_decode.numel() else num_reqs
        prefix = self._cascade_prefix_len(common_prefix_len, m, hp)
        host = self.host_csr(m, prefix)
        self.check_fits(num_reqs, num_tokens, host["paged_kv_indices"].shape[0])
        # The batch in the persistent buffers (the metadata's views); the wrappers plan from
        # the host copies.
        dev = self._store(m, host)
        dev.update({k: v.to(self.device, non_blocking=True) for k, v in host.items()
                    if k.startswith("shared_")})
        return self.metadata_for(m, dev, num_decodes, num_tokens, prefix > 0,
                              **self._plan(host, num_decodes, prefix > 0, m.causal))

    def _store(self, m: CommonAttentionMetadata, host: dict) -> dict:
        """Copy the batch into the persistent buffers; their views, by field name."""
        num_reqs, num_tokens = m.num_reqs, m.slot_mapping.shape[0]
        num_pages = host["paged_kv_indices"].shape[0]
        views = dict(qo_indptr=self.qo_indptr[:num_reqs + 1],
                     paged_kv_indptr=self.paged_kv_indptr[:num_reqs + 1],
                     paged_kv_indices=self.paged_kv_indices[:num_pages],
                     paged_kv_last_page_len=self.paged_kv_last_page_len[:num_reqs],
                     slot_mapping=self.slot_mapping[:num_tokens])
        views["qo_indptr"].copy_(m.query_start_loc[:num_reqs + 1], non_blocking=True)
        views["slot_mapping"].copy_(m.slot_mapping, non_blocking=True)
        for name in ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
            views[name].copy_(host[name], non_blocking=True)
        return views

    def metadata_for(self, m: CommonAttentionMetadata, dev: dict, num_decodes: int,
                  num_tokens: int, use_cascade: bool, **planned: Any) -> FlashInferMetadata:
        """The batch's metadata; `planned`: its wrappers (and a graph step's counts)."""
        page_size, spec = self.kv_cache_spec.block_size, self.kv_cache_spec
        n = m.num_actual_tokens if num_tokens == m.slot_mapping.shape[0] else num_tokens
        fields = dict(
            num_actual_tokens=n, qo_indptr=dev["qo_indptr"],
            paged_kv_indptr=dev["paged_kv_indptr"], paged_kv_indices=dev["paged_kv_indices"],
            paged_kv_last_page_len=dev["paged_kv_last_page_len"],
            num_qo_heads=self.num_qo_heads, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size, page_size=page_size, data_type=self.kv_dtype,
            q_data_type=spec.dtype, slot_mapping=dev["slot_mapping"], num_decodes=num_decodes,
            num_decode_tokens=num_decodes, num_prefills=m.num_reqs - num_decodes,
            num_prefill_tokens=n - num_decodes, use_cascade=use_cascade,
            shared_qo_indptr=dev.get("shared_qo_indptr"),
            shared_kv_page_indptr=dev.get("shared_kv_page_indptr"),
            shared_kv_page_indices=dev.get("shared_kv_page_indices"),
            shared_kv_last_page_len=dev.get("shared_kv_last_page_len"),
            cache_write=plan_reshape_and_cache_flash(
                dev["slot_mapping"], num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                page_size=page_size, cache_dtype=self.kv_dtype,
                cuda_graph=planned.get("cuda_graph", False)))
        return FlashInferMetadata(**{**fields, **planned}, planner=plan_step)

    def _cascade_prefix_len(self, common_prefix_len: int, m: CommonAttentionMetadata,
                            hp: PerLayerParameters) -> int:
        """The shared prefix the cascade wrapper reads once, or 0: whole pages every request
        has already computed (so no query needs a causal mask over it), never with a sliding
        window or a cache dtype other than the model's."""
        if not (self.enable_cascade and m.causal and common_prefix_len > 0 and m.num_reqs
                and hp.window_left == -1 and self.kv_dtype == self.kv_cache_spec.dtype
                and not self.batch_invariant):
            return 0
        computed = int(m.num_computed_tokens_cpu[:m.num_reqs].min())
        page_size = self.kv_cache_spec.block_size
        return min(common_prefix_len, computed) // page_size * page_size

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        if self.kv_dtype != self.kv_cache_spec.dtype:
            return False  # the cascade wrapper plans one dtype for queries and cache
        return use_cascade_attention(*args, **kwargs)


# --- the step's plans and the impl ------------------------------------------------------------
def plan_step(m: FlashInferMetadata) -> StepPlans:
    """The step's plans: one `FlashInferPlans` for every layer."""
    return StepPlans(ONE_KIND, (FlashInferPlans(m),))


class FlashInferPlans:
    """A step's cache write and planned wrappers (decode and prefill, or cascade), which one
    plan of (window, soft cap, scale) serves for every layer."""

    dcp = False
    takes_rows = False  # the wrappers take [T, heads, D]

    def __init__(self, m: FlashInferMetadata):
        self.write, self.num_tokens = m.cache_write, m.num_actual_tokens
        self.num_decode_tokens = m.num_decode_tokens
        self.q_dtype = self.out_dtype = m.q_data_type
        self.fp8 = m.data_type.itemsize == 1
        self.decode, self.prefill, self.cascade = (m.decode_wrapper, m.prefill_wrapper,
                                                   m.cascade_wrapper)
        wrappers = [w for w in (self.decode, self.prefill, self.cascade) if w is not None]
        self.hnd = any(w.kv_layout == "HND" for w in wrappers)

    def plan_layer(self, impl, layer, key_cache, value_cache) -> None:
        """ValueError where the step was planned with another (window, soft cap, scale) than
        the layer's (a layer outside the builder's layer_names); `run` takes every call."""
        mine = (impl.sliding_window[0], float(impl.logits_soft_cap or 0.0), impl.scale)
        plans = [w.planned() for w in (self.decode, self.prefill) if w is not None]
        if self.cascade is not None:
            plans.append(self.cascade.planned()[-1])
        for plan in plans:
            planned = (plan.window_left, plan.logits_soft_cap, plan.sm_scale)
            if planned != mine:
                raise ValueError(
                    f"the step was planned with (window_left, logits_soft_cap, sm_scale)="
                    f"{planned} but layer {getattr(layer, 'layer_name', '')!r} needs {mine}: "
                    "build the FLASHINFER metadata builder with this layer among its "
                    "layer_names")
        return None

    def run(self, impl, layer, query, key, value, key_cache, value_cache, output) -> None:
        """query [T, H, D], key/value [T, Hkv, D] (written unless the layer shares another's
        cache), caches the logical [num_blocks, block_size, Hkv, D] halves -> output."""
        if impl.kv_sharing_target_layer_name is None and key is not None:
            # slot_mapping's length bounds the write: padded keys are never stored.
            self.write.run(key, value, key_cache, value_cache, layer._k_scale, layer._v_scale)
        n = self.num_tokens
        if query.shape[0] != n:
            output[n:].zero_()  # padding rows: nothing else writes them
        # The wrappers take the halves in FlashInfer's physical order (HND: heads first).
        cache = (key_cache.transpose(1, 2), value_cache.transpose(1, 2)) if self.hnd else \
            (key_cache, value_cache)
        kw: dict[str, Any] = {}
        if self.fp8:
            kw.update(k_scale=layer._k_scale_float, v_scale=layer._v_scale_float)
        if impl.sinks is not None:
            kw["sinks"] = impl.sinks
        if self.cascade is not None:
            self.cascade.run(query[:n], cache, out=output[:n], **kw)
            return
        d = self.num_decode_tokens
        if self.prefill is not None:
            self.prefill.run(query[d:n], cache, out=output[d:n], **kw)
        if self.decode is not None:
            self.decode.run(query[:d], cache, out=output[:d], **kw)


class FlashInferImpl(PagedAttentionImpl):
    """The shared paged impl over FLASHINFER's cache (num_blocks, 2, block_size, num_kv_heads,
    head_size); the builder plans the wrappers each step."""

    requires_output = True  # the seed's: the layer passes its output buffer

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[list[float]], sliding_window: Optional[int],
                 kv_cache_dtype: str, logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None) -> None:
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("Encoder self-attention and encoder/decoder "
                                      "cross-attention are not implemented for FlashInferImpl")
        if alibi_slopes is not None:
            raise ValueError("alibi_slopes are not supported by FLASHINFER (its wrappers take "
                             "no per-head slopes); use FLASH_ATTN")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks)

    def split_kv_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[:, 0], kv_cache[:, 1]
