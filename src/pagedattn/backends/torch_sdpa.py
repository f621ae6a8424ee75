"""TORCH_SDPA: the pure-PyTorch backend. Every feature, any device; the CPU default.

Its ops run on the PyTorch provider on every device, which makes it the baseline the
faster backends are measured against. Cache layout is FLASH_ATTN's:
(2, num_blocks, block_size, num_kv_heads, head_size), NHD or HND physical order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pagedattn.backends.common import (
    PagedAttentionImpl,
    PagedAttentionMetadata,
    is_paged_layer,
)
from pagedattn.backends.paged_layout import PagedKVCacheLayout
from pagedattn.backends.paged_plans import PlanLayout
from pagedattn.backends.step_plans import StepPlans
from pagedattn.config import KV_CACHE_DTYPE_STRINGS, EngineConfig
from pagedattn.metadata import AttentionSpec, CommonAttentionMetadata
from pagedattn.types import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    BackendCapabilities,
)


@dataclass(frozen=True)
class TorchSDPAMetadata(PagedAttentionMetadata):
    pass


class TorchSDPAMetadataBuilder(AttentionMetadataBuilder[TorchSDPAMetadata]):
    # Not capturable: build() hands each batch's own tensors through (no persistent buffers
    # for a graph to re-read), and the PyTorch cache write syncs on its padding mask.
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: Optional[EngineConfig], device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.layout = PlanLayout(kv_cache_spec, layer_names, accept=is_paged_layer)

    def plan(self, attn_metadata: TorchSDPAMetadata) -> TorchSDPAMetadata:
        """Metadata made or changed by hand (a `dataclasses.replace` copy carries no plans)
        with this builder's plans for it; the batch is taken as it is, unchecked."""
        return dataclasses.replace(attn_metadata, planner=self._plan)

    def _plan(self, md: TorchSDPAMetadata) -> StepPlans:
        return self.layout.plan(md, self.device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TorchSDPAMetadata:
        m = common_attn_metadata
        self.check_batch(m)
        return TorchSDPAMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc, max_seq_len=m.max_seq_len, seq_lens=m.seq_lens,
            block_table=m.block_table_tensor, slot_mapping=m.slot_mapping, causal=m.causal,
            planner=self._plan)


class TorchSDPAImpl(PagedAttentionImpl):
    ops_provider = "torch"


class TorchSDPABackend(PagedKVCacheLayout, AttentionBackend):
    accept_output_buffer = True
    supports_quant_query_input = False
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        kv_cache_dtypes=frozenset(KV_CACHE_DTYPE_STRINGS),
        head_sizes=None,
        cudagraph=AttentionCGSupport.NEVER,
    )

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[TorchSDPAImpl]:
        return TorchSDPAImpl

    @staticmethod
    def get_metadata_cls() -> type[TorchSDPAMetadata]:
        return TorchSDPAMetadata

    @staticmethod
    def get_builder_cls() -> type[TorchSDPAMetadataBuilder]:
        return TorchSDPAMetadataBuilder
