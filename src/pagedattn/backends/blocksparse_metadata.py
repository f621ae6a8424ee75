"""BLOCK_SPARSE_FLASH_ATTN's metadata (the seed's v0 fields: prefills first, then decodes) and
its builder, which writes every batch into persistent buffers, owns the decode's split-KV
scratch, so a decode step captured in a CUDA graph replays with later batches' lengths and
block tables, and plans the step (`BlocksparsePlans`: the cache write, each pattern's
decode), which every layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Optional

import torch

from pagedattn.config import EngineConfig, batch_invariant_mode, kv_cache_torch_dtype
from pagedattn.layer_registry import find_all_layers
from pagedattn.metadata import AttentionSpec, CommonAttentionMetadata
from pagedattn.ops.blocksparse import decode_workspace
from pagedattn.ops.blocksparse_plan import (
    BlocksparseDecodePlan,
    plan_blocksparse_paged_attention,
)
from pagedattn.ops.paged_attn import PagedAttention, PagedCacheWritePlan
from pagedattn.types import AttentionCGSupport, AttentionMetadata, AttentionMetadataBuilder


@dataclass
class BlocksparseFlashAttentionMetadata(AttentionMetadata):
    """The seed's v0 metadata: prefill requests first, then decodes."""

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64; negative = padding
    seq_lens: Optional[list[int]]  # per request, host (None for decode-only views)
    seq_lens_tensor: Optional[torch.Tensor]  # [num_reqs] int32
    max_query_len: Optional[int]
    max_prefill_seq_len: int
    max_decode_seq_len: int
    query_start_loc: Optional[torch.Tensor]  # [num_prefills + 1] int32
    seq_start_loc: Optional[torch.Tensor]  # [num_prefills + 1] int32 (= query_start_loc)
    context_lens_tensor: Optional[torch.Tensor]  # [num_reqs] int32: cached tokens before
    block_tables: Optional[torch.Tensor]  # [num_reqs, max_blocks] int32
    use_cuda_graph: bool = False
    max_decode_query_len: Optional[int] = None
    multi_modal_placeholder_index_maps: Optional[dict] = None
    enable_kv_scales_calculation: bool = False
    workspace: Optional[tuple] = None  # the builder's split-KV scratch for the decode kernel
    plans: Optional[BlocksparsePlans] = None  # the builder's plans of this batch
    _cached_prefill_metadata: Optional[BlocksparseFlashAttentionMetadata] = None
    _cached_decode_metadata: Optional[BlocksparseFlashAttentionMetadata] = None

    @property
    def prefill_metadata(self) -> Optional[BlocksparseFlashAttentionMetadata]:
        if self.num_prefills == 0:
            return None
        if self._cached_prefill_metadata is None:
            n, t = self.num_prefills, self.num_prefill_tokens
            self._cached_prefill_metadata = replace(
                self, num_decode_tokens=0, slot_mapping=self.slot_mapping[:t],
                seq_lens=self.seq_lens[:n], seq_lens_tensor=self.seq_lens_tensor[:n],
                max_decode_seq_len=0, query_start_loc=self.query_start_loc[:n + 1],
                seq_start_loc=self.seq_start_loc[:n + 1],
                context_lens_tensor=self.context_lens_tensor[:n],
                block_tables=self.block_tables[:n], use_cuda_graph=False,
                _cached_prefill_metadata=None, _cached_decode_metadata=None)
        return self._cached_prefill_metadata

    @property
    def decode_metadata(self) -> Optional[BlocksparseFlashAttentionMetadata]:
        if self.num_decode_tokens == 0:
            return None
        if self._cached_decode_metadata is None:
            n, t = self.num_prefills, self.num_prefill_tokens
            self._cached_decode_metadata = replace(
                self, num_prefills=0, num_prefill_tokens=0,
                slot_mapping=self.slot_mapping[t:t + self.num_decode_tokens], seq_lens=None,
                seq_lens_tensor=self.seq_lens_tensor[n:], max_query_len=None,
                max_prefill_seq_len=0, query_start_loc=None, seq_start_loc=None,
                context_lens_tensor=None, block_tables=self.block_tables[n:],
                multi_modal_placeholder_index_maps=None, enable_kv_scales_calculation=False,
                _cached_prefill_metadata=None, _cached_decode_metadata=None)
        return self._cached_decode_metadata


class BlocksparsePlans:
    """A step's plans, made by the builder: the cache write, and the decodes' block-sparse
    attention for each pattern of the builder's layers (`decode_pattern`: the impl's heads,
    scale, sparse pattern and tensor-parallel rank); `batch_invariant`: the builder's mode,
    which its decodes were planned in and its prompts (not planned) run in."""

    def __init__(self, write: PagedCacheWritePlan, decodes: dict, layer_names: list[str],
                 batch_invariant: bool = False):
        self.write, self.decodes, self.layer_names = write, decodes, layer_names
        self.batch_invariant = batch_invariant

    def decode_for(self, impl: Any, layer: Any) -> BlocksparseDecodePlan:
        plan = self.decodes.get(impl.decode_pattern)
        if plan is None:
            name = getattr(layer, "layer_name", "") or "an unnamed layer"
            raise ValueError(
                f"layer {name!r} is not among the layers this step was planned for (its "
                f"pattern is none of theirs): the builder's layer_names are "
                f"{self.layer_names}; make the builder with this layer's name among them")
        return plan


class BlocksparseFlashAttentionMetadataBuilder(
        AttentionMetadataBuilder[BlocksparseFlashAttentionMetadata]):
    """Splits a batch into whole prompts (no cached context) followed by single-token decodes;
    anything else (chunked prefill, prefix caching, decodes before prefills) is refused. A
    batch of single-token queries is all decodes (a one-token prompt then attends to the key
    it has just written, the same result), so every decode step has one shape.

    Buffers are sized at construction (max_num_seqs, max_num_batched_tokens, max_model_len)
    and `build` returns views of them, as FLASH_ATTN's builder does; padded requests of a
    captured decode step get seq_len 0 and padded tokens slot -1.
    """

    _metadata_cls = BlocksparseFlashAttentionMetadata
    # Decode steps replay (one program grid per batch size; split counts follow max_seqlen).
    cudagraph_support: ClassVar[AttentionCGSupport] = \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # The metadata tensors a captured decode step reads (the seed's names; a graph runner
    # checks that later builds still hand out these buffers).
    graph_inputs: ClassVar[tuple[str, ...]] = ("seq_lens_tensor", "block_tables", "slot_mapping")

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: Optional[EngineConfig], device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = vllm_config or EngineConfig()
        self.max_num_seqs = config.max_num_seqs
        self.batch_invariant = batch_invariant_mode(vllm_config)
        int32 = dict(dtype=torch.int32, device=self.device)
        self.query_start_loc = torch.zeros(config.max_num_seqs + 1, **int32)
        self.seq_lens = torch.zeros(config.max_num_seqs, **int32)
        self.block_table = torch.zeros(
            config.max_num_seqs, -(-config.max_model_len // kv_cache_spec.block_size), **int32)
        self.slot_mapping = torch.full((config.max_num_batched_tokens,), -1,
                                       dtype=torch.int64, device=self.device)
        self._graph_reqs = self._graph_tokens = 0  # the largest captured batch
        self.patterns: set = set()  # the decode patterns of the layers found (`_find`)
        self.missing = list(layer_names)
        self._find()
        # Without the layers (a bare builder), GQA groups up to 8 fit; a larger layer's split
        # decode would allocate its own scratch (eagerly only).
        num_heads = max((p[0] for p in self.patterns), default=8 * kv_cache_spec.num_kv_heads)
        self.workspace = decode_workspace(self.device, config.max_num_seqs, num_heads,
                                          kv_cache_spec.num_kv_heads, kv_cache_spec.head_size)

    def _find(self) -> None:
        """Take in the named layers that exist now (those still missing are looked up again
        by the next build): their decode patterns."""
        found = find_all_layers(self.missing, lambda layer: hasattr(layer.impl,
                                                                     "decode_pattern"))
        self.patterns.update(layer.impl.decode_pattern for layers in found.values()
                             for layer in layers)
        self.missing = [name for name in self.missing if name not in found]

    def _plan(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor) -> BlocksparsePlans:
        """The step's plans: the cache write of its slots, and the decode of each layer
        pattern over the decodes' block tables and lengths (empty without decodes)."""
        if self.missing:
            self._find()
        spec = self.kv_cache_spec
        cache_dtype = kv_cache_torch_dtype(spec.kv_cache_dtype, spec.dtype)
        write = PagedAttention.plan_write_to_paged_cache(
            slot_mapping, spec.num_kv_heads, spec.head_size, spec.block_size, cache_dtype)
        decodes = {}
        if block_tables.shape[0]:
            for pattern in self.patterns:
                (num_heads, num_kv_heads, _, scale, max_seqlen, local, vert, block_size, step,
                 tp_rank) = pattern
                decodes[pattern] = plan_blocksparse_paged_attention(
                    block_tables=block_tables, seq_lens=seq_lens, max_seq_len=max_seqlen,
                    num_heads=num_heads, num_kv_heads=num_kv_heads,
                    page_size=spec.block_size, kv_dtype=cache_dtype, scale=scale,
                    blocksparse_local_blocks=local, blocksparse_vert_stride=vert,
                    blocksparse_block_size=block_size, blocksparse_head_sliding_step=step,
                    tp_rank=tp_rank, workspace=self.workspace,
                    batch_invariant=self.batch_invariant, head_size=spec.head_size)
        return BlocksparsePlans(write, decodes, list(self.layer_names), self.batch_invariant)

    def plan(self, attn_metadata: BlocksparseFlashAttentionMetadata
             ) -> BlocksparseFlashAttentionMetadata:
        """Metadata made or changed by hand with this builder's plans for it."""
        m, n = attn_metadata, attn_metadata.num_prefills
        return replace(m, plans=self._plan(m.slot_mapping, m.block_tables[n:],
                                           m.seq_lens_tensor[n:]),
                       _cached_prefill_metadata=None, _cached_decode_metadata=None)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> BlocksparseFlashAttentionMetadata:
        m = common_attn_metadata
        self.check_batch(m)
        n, num_tokens = m.num_reqs, m.slot_mapping.shape[0]
        q_lens = m.query_lens_cpu[:n].tolist()
        seq_lens = m.seq_lens_cpu[:n].tolist()
        prefill = [q == s and q > 0 and m.max_query_len > 1 for q, s in zip(q_lens, seq_lens)]
        num_prefills = sum(prefill)
        for r, (q, s, p) in enumerate(zip(q_lens, seq_lens, prefill)):
            if not p and q != 1:
                raise ValueError(
                    f"request {r}: query_len={q}, seq_len={s}; BLOCK_SPARSE_FLASH_ATTN serves "
                    "whole prompts (query_len == seq_len) and single-token decodes only (no "
                    "chunked prefill or prefix caching)")
            if p != (r < num_prefills):
                raise ValueError(f"request {r} is a {'prefill' if p else 'decode'} out of "
                                 "order; BLOCK_SPARSE_FLASH_ATTN needs prefills before decodes")
        width = m.block_table_tensor.shape[1]
        if n > self.max_num_seqs or num_tokens > self.slot_mapping.shape[0] \
                or width > self.block_table.shape[1]:
            raise ValueError(
                f"batch of {n} requests, {num_tokens} tokens, {width} blocks per request "
                f"exceeds the builder's buffers ({self.max_num_seqs}, "
                f"{self.slot_mapping.shape[0]}, {self.block_table.shape[1]}): raise "
                "EngineConfig's max_num_seqs / max_num_batched_tokens / max_model_len")
        self.query_start_loc[:n + 1].copy_(m.query_start_loc, non_blocking=True)
        self.seq_lens[:n].copy_(m.seq_lens, non_blocking=True)
        self.block_table[:n, :width].copy_(m.block_table_tensor, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(m.slot_mapping, non_blocking=True)
        if n < self._graph_reqs:  # a captured step reads these as empty requests
            self.seq_lens[n:self._graph_reqs].fill_(0)
        if num_tokens < self._graph_tokens:
            self.slot_mapping[num_tokens:self._graph_tokens].fill_(-1)
        qsl = self.query_start_loc[:num_prefills + 1]
        num_prefill_tokens = int(m.query_start_loc_cpu[num_prefills])
        seq_lens_tensor = self.seq_lens[:n]
        return BlocksparseFlashAttentionMetadata(
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=m.num_actual_tokens - num_prefill_tokens,
            slot_mapping=self.slot_mapping[:num_tokens], seq_lens=seq_lens,
            seq_lens_tensor=seq_lens_tensor, max_query_len=m.max_query_len,
            max_prefill_seq_len=max(seq_lens[:num_prefills], default=0),
            max_decode_seq_len=max(seq_lens[num_prefills:], default=0),
            query_start_loc=qsl, seq_start_loc=qsl,
            context_lens_tensor=seq_lens_tensor - (self.query_start_loc[1:n + 1]
                                                   - self.query_start_loc[:n]),
            block_tables=self.block_table[:n], use_cuda_graph=False,
            max_decode_query_len=1 if num_prefills < n else None, workspace=self.workspace,
            plans=self._plan(self.slot_mapping[:num_tokens],
                             self.block_table[num_prefills:n], seq_lens_tensor[num_prefills:]))

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> BlocksparseFlashAttentionMetadata:
        """Metadata for capturing a decode step of this batch size; later decode batches of
        at most as many requests replay into the same buffers."""
        m = common_attn_metadata
        if m.max_query_len != 1:
            raise ValueError(f"max_query_len={m.max_query_len}: BLOCK_SPARSE_FLASH_ATTN "
                             "captures decode steps (one query token per request) only; "
                             "prompts run eagerly")
        self._graph_reqs = max(self._graph_reqs, m.num_reqs)
        self._graph_tokens = max(self._graph_tokens, m.slot_mapping.shape[0])
        return replace(self.build(0, m), use_cuda_graph=True)
