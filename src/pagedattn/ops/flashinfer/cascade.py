"""`MultiLevelCascadeAttentionWrapper` (FlashInfer's API).

Level k of a cascade is a batch of its own over the same queries: level 0 typically holds one
"request" of every query over a prefix all requests share, the last level each request over
its own pages. Every level but the last attends non-causally (its keys precede every query),
the last causally when asked; the partial states merge exactly by their LSEs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from pagedattn.ops.flashinfer.plan import Cache, WrapperPlan
from pagedattn.ops.flashinfer.run import Scale, base2_lse
from pagedattn.ops.flashinfer.wrappers import BatchPrefillWithPagedKVCacheWrapper
from pagedattn.ops.merge import merge_attn_states


class MultiLevelCascadeAttentionWrapper:
    """Attention over num_levels page tables per query, merged into one result."""

    def __init__(self, num_levels: int, float_workspace_buffer: torch.Tensor,
                 kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf_arr: Optional[Sequence[torch.Tensor]] = None,
                 paged_kv_indptr_buf_arr: Optional[Sequence[torch.Tensor]] = None,
                 paged_kv_indices_buf_arr: Optional[Sequence[torch.Tensor]] = None,
                 paged_kv_last_page_len_buf_arr: Optional[Sequence[torch.Tensor]] = None
                 ) -> None:
        """With use_cuda_graph, each level is a prefill wrapper in CUDA-graph mode over its
        entry of the four buffer lists (one per level)."""
        if not isinstance(num_levels, int) or num_levels < 1:
            raise ValueError(f"num_levels={num_levels!r} must be an int >= 1")
        self.num_levels = num_levels
        bufs = [[None] * 4] * num_levels
        if use_cuda_graph:
            arrs = (qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr,
                    paged_kv_last_page_len_buf_arr)
            if any(not isinstance(a, (list, tuple)) or len(a) != num_levels for a in arrs):
                raise ValueError(f"use_cuda_graph=True needs the four *_buf_arr lists of "
                                 f"num_levels={num_levels} buffers each")
            bufs = list(zip(*arrs))
        self._batch_prefill_wrappers = [
            BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf=b[0],
                paged_kv_indptr_buf=b[1], paged_kv_indices_buf=b[2],
                paged_kv_last_page_len_buf=b[3]) for b in bufs]
        self._kv_layout = kv_layout

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._batch_prefill_wrappers[0].is_cuda_graph_enabled

    @property
    def kv_layout(self) -> str:
        """The layout of the caches run() takes: "NHD" or "HND"."""
        return self._kv_layout

    def planned(self) -> list[WrapperPlan]:
        """Each level's current plan, level 0 first (raises before the first plan())."""
        return [w.planned() for w in self._batch_prefill_wrappers]

    def plan(self, qo_indptr_arr: Sequence[torch.Tensor],
             paged_kv_indptr_arr: Sequence[torch.Tensor],
             paged_kv_indices_arr: Sequence[torch.Tensor],
             paged_kv_last_page_len: Sequence[torch.Tensor], num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, q_data_type="float16",
             kv_data_type=None) -> None:
        """Plan every level; each argument list holds one entry per level (level 0 first)."""
        lists = {"qo_indptr_arr": qo_indptr_arr, "paged_kv_indptr_arr": paged_kv_indptr_arr,
                 "paged_kv_indices_arr": paged_kv_indices_arr,
                 "paged_kv_last_page_len": paged_kv_last_page_len}
        for name, arr in lists.items():
            if not isinstance(arr, (list, tuple)) or len(arr) != self.num_levels:
                raise ValueError(f"{name} must be a list of num_levels={self.num_levels} "
                                 f"tensors; got {type(arr).__name__} of "
                                 f"{len(arr) if isinstance(arr, (list, tuple)) else '?'}")
        if window_left != -1:
            raise ValueError(f"window_left={window_left}: a sliding window needs each query's "
                             "absolute position, which cascade levels do not share; use the "
                             "prefill wrapper")
        for i, w in enumerate(self._batch_prefill_wrappers):
            w.plan(qo_indptr_arr[i], paged_kv_indptr_arr[i], paged_kv_indices_arr[i],
                   paged_kv_last_page_len[i], num_qo_heads, num_kv_heads, head_dim, page_size,
                   causal=causal and i == self.num_levels - 1,
                   pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                   logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                   kv_data_type=kv_data_type)
        totals = [w.planned().batch_q for w in self._batch_prefill_wrappers]
        if len(set(totals)) > 1:
            for w in self._batch_prefill_wrappers:
                w.forget_plan()
            raise ValueError(f"every level must cover the same queries; qo_indptr_arr[i][-1] "
                             f"are {totals}")

    def run(self, q: torch.Tensor, paged_kv_cache: Cache, *, k_scale: Scale = None,
            v_scale: Scale = None, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, return_lse: bool = False,
            sinks: Optional[torch.Tensor] = None):
        """Like `BatchPrefillWithPagedKVCacheWrapper.run`, over all levels (sinks join the
        first level's softmax only, which keeps the merge exact)."""
        wrappers = self._batch_prefill_wrappers
        if len(wrappers) == 1:
            return wrappers[0].run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale,
                                   out=out, lse=lse, return_lse=return_lse, sinks=sinks)
        acc, acc_lse = None, None
        for i, w in enumerate(wrappers):
            last = i == len(wrappers) - 1
            part, part_lse = w.run_state(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale,
                                         sinks=sinks if i == 0 else None)
            if acc is None:
                acc, acc_lse = part, part_lse
                continue
            dst = out if last and out is not None else torch.empty_like(part)
            if tuple(dst.shape) != tuple(part.shape) or dst.dtype != part.dtype:
                raise ValueError(f"out is {dst.dtype} {tuple(dst.shape)}; expected "
                                 f"{part.dtype} {tuple(part.shape)}")
            dst_lse = torch.empty_like(acc_lse) if (return_lse or not last) else None
            merge_attn_states(dst, acc, acc_lse, part, part_lse, dst_lse)
            acc, acc_lse = dst, dst_lse
        return (acc, base2_lse(acc_lse, lse)) if return_lse else acc
