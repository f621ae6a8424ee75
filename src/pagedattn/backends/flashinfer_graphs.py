"""FLASHINFER's CUDA graphs: the builder's wrappers in FlashInfer's CUDA-graph mode.

A pure-decode step is captured over a CUDA-graph decode wrapper, any other step over a
CUDA-graph prefill wrapper that runs all its tokens (decodes among them: the provider's plan
launches both kernel passes, and each program finds its work on the device). One wrapper per
captured shape, all planning into the builder's persistent buffers. Cascade steps are never
captured (the graph runner builds replays without a common prefix).
"""

from __future__ import annotations

from typing import Any

from pagedattn.config import get_kv_cache_layout
from pagedattn.metadata import CommonAttentionMetadata
from pagedattn.ops.flashinfer import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
)


class FlashInferGraphs:
    """Mixed into FlashInferMetadataBuilder: capture and replay builds."""

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> Any:
        """Metadata for capturing a step of this batch's shape (no cascade): a pure-decode
        batch plans a CUDA-graph decode wrapper, any other a CUDA-graph prefill wrapper over
        all its tokens; either serves later batches of at most its tokens and requests."""
        m = common_attn_metadata
        self.check_batch(m)
        num_reqs, num_tokens = m.num_reqs, m.slot_mapping.shape[0]
        decode = m.max_query_len == 1 and num_tokens == num_reqs
        key = (num_tokens, num_reqs, decode)
        wrapper = self.graph_wrappers.get(key)
        if wrapper is None:
            wrapper = self.graph_wrappers[key] = self._graph_wrapper(num_reqs, decode)
        return self._replan_graph(m, wrapper, decode, num_tokens)

    def build_for_cudagraph_replay(self, common_attn_metadata: CommonAttentionMetadata,
                                   captured: Any) -> Any:
        """Plan a batch into the CUDA-graph wrapper of `captured` (a capture's metadata), so
        that replaying its graph attends over this batch; returns metadata over the same
        buffers."""
        m = common_attn_metadata
        self.check_batch(m)
        decode = captured.decode_wrapper is not None
        wrapper = captured.decode_wrapper if decode else captured.prefill_wrapper
        num_tokens, num_reqs = m.slot_mapping.shape[0], m.num_reqs
        cap_reqs = captured.num_decodes + captured.num_prefills
        if not captured.cuda_graph or num_tokens > captured.num_actual_tokens or \
                num_reqs > cap_reqs or (decode and m.max_query_len > 1):
            raise ValueError(
                f"a batch of {num_tokens} tokens over {num_reqs} requests (longest query "
                f"{m.max_query_len}) does not fit the captured step of "
                f"{captured.num_actual_tokens} tokens over {cap_reqs} requests"
                f"{' (decodes only)' if decode else ''}")
        return self._replan_graph(m, wrapper, decode, captured.num_actual_tokens)

    def _graph_wrapper(self, num_reqs: int, decode: bool):
        """A wrapper in FlashInfer's CUDA-graph mode over the builder's buffers."""
        bufs = (self.paged_kv_indptr[:num_reqs + 1], self.paged_kv_indices,
                self.paged_kv_last_page_len[:num_reqs])
        if decode:
            return BatchDecodeWithPagedKVCacheWrapper(
                self.get_workspace_buffer(), get_kv_cache_layout(), use_cuda_graph=True,
                paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
                paged_kv_last_page_len_buffer=bufs[2], max_kv_len=self.max_model_len)
        return BatchPrefillWithPagedKVCacheWrapper(
            self.get_workspace_buffer(), get_kv_cache_layout(), use_cuda_graph=True,
            qo_indptr_buf=self.qo_indptr[:num_reqs + 1], paged_kv_indptr_buf=bufs[0],
            paged_kv_indices_buf=bufs[1], paged_kv_last_page_len_buf=bufs[2],
            max_kv_len=self.max_model_len)

    def _replan_graph(self, m: CommonAttentionMetadata, wrapper, decode: bool,
                      capacity: int) -> Any:
        """Plan `m` into a CUDA-graph wrapper of `capacity` tokens; padded tokens write
        nothing (slot -1), padded requests are empty (the wrapper pads them)."""
        hp = self.hyperparameters()
        num_reqs, num_tokens = m.num_reqs, m.slot_mapping.shape[0]
        host = self.host_csr(m)
        self.check_fits(num_reqs, num_tokens, host["paged_kv_indices"].shape[0])
        spec = self.kv_cache_spec
        shape = (self.num_qo_heads, spec.num_kv_heads, spec.head_size, spec.block_size)
        common = dict(window_left=hp.window_left, logits_soft_cap=hp.logits_soft_cap,
                      sm_scale=hp.sm_scale, q_data_type=spec.dtype, kv_data_type=self.kv_dtype)
        if decode:
            wrapper.plan(host["paged_kv_indptr"], host["paged_kv_indices"],
                         host["paged_kv_last_page_len"], *shape, **common)
            self.qo_indptr[:num_reqs + 1].copy_(host["qo_indptr"], non_blocking=True)
        else:
            wrapper.plan(host["qo_indptr"], host["paged_kv_indptr"], host["paged_kv_indices"],
                         host["paged_kv_last_page_len"], *shape, causal=m.causal, **common)
        self.slot_mapping[:num_tokens].copy_(m.slot_mapping, non_blocking=True)
        self.slot_mapping[num_tokens:capacity].fill_(-1)
        rows = wrapper.cuda_graph_batch_size
        dev = dict(qo_indptr=self.qo_indptr[:rows + 1],
                   paged_kv_indptr=self.paged_kv_indptr[:rows + 1],
                   paged_kv_indices=self.paged_kv_indices,
                   paged_kv_last_page_len=self.paged_kv_last_page_len[:rows],
                   slot_mapping=self.slot_mapping[:capacity])
        return self.metadata_for(
            m, dev, rows if decode else 0, capacity, False, cuda_graph=True,
            num_prefills=0 if decode else rows, num_prefill_tokens=0 if decode else capacity,
            num_decode_tokens=rows if decode else 0,
            decode_wrapper=wrapper if decode else None,
            prefill_wrapper=None if decode else wrapper)

    def check_fits(self, num_reqs: int, num_tokens: int, num_pages: int = 0) -> None:
        for what, value, limit, knob in (
                ("num_reqs", num_reqs, self.paged_kv_last_page_len.shape[0], "max_num_seqs"),
                ("num_tokens", num_tokens, self.slot_mapping.shape[0],
                 "max_num_batched_tokens"),
                ("pages", num_pages, self.paged_kv_indices.shape[0],
                 "max_num_seqs or max_model_len")):
            if value > limit:
                raise ValueError(f"batch has {what}={value} > {limit}, the builder's buffer "
                                 f"size; raise EngineConfig.{knob}")
