"""`BatchDecodeWithPagedKVCacheWrapper` and `BatchPrefillWithPagedKVCacheWrapper`: FlashInfer's
plan/run API over pagedattn's kernels. Code written against `flashinfer` runs by changing the
import. `plan()` does the host work once per batch (one plan serves every layer; planning
again replaces it); `run()` launches. LSEs are FlashInfer's: base 2, [total_q, num_qo_heads].
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops.flashinfer.graph import GraphBuffers, graph_buffers, plan_graph
from pagedattn.ops.flashinfer.plan import (
    KV_LAYOUTS,
    Cache,
    WrapperPlan,
    check_batch,
    plan_paged_batch,
)
from pagedattn.ops.flashinfer.run import Scale, base2_lse, cache_views, descales, launch

BACKENDS = ("auto", "fa2", "fa3")  # FlashInfer's kernel choices; all run our kernels


def check_wrapper_args(float_workspace_buffer, kv_layout: str, backend: str, jit_args) -> None:
    if not isinstance(float_workspace_buffer, torch.Tensor):
        raise TypeError("float_workspace_buffer must be a torch.Tensor, got "
                        f"{type(float_workspace_buffer).__name__}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r} is not supported; choose one of "
                         f"{KV_LAYOUTS}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {BACKENDS}")
    if jit_args is not None:
        raise ValueError("jit_args (custom JIT attention variants) are not supported; use "
                         "causal, window_left, logits_soft_cap and sinks")


class _PagedWrapper:
    """What both wrappers share: the workspace's device, the layout, the plan and run()."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 graph: Optional[tuple] = None, backend: str = "auto",
                 jit_args=None, max_kv_len: Optional[int] = None) -> None:
        check_wrapper_args(float_workspace_buffer, kv_layout, backend, jit_args)
        # CUDA-graph mode: (names, buffers) the caller gave, checked (graph.py).
        self._graph: Optional[GraphBuffers] = None if graph is None else graph_buffers(
            *graph, max_kv_len, float_workspace_buffer.device)
        # Kept for API compatibility; plans allocate their own (small) device buffers.
        self._float_workspace_buffer = float_workspace_buffer
        self._kv_layout = kv_layout
        self.device = float_workspace_buffer.device
        self._plan_value: Optional[WrapperPlan] = None
        self._scales: dict = {}  # host scale value -> device scalar, made once
        self._memo: dict = {}  # cache views and scale views of the current plan

    @property
    def _plan(self) -> Optional[WrapperPlan]:
        return self._plan_value

    @_plan.setter
    def _plan(self, plan: Optional[WrapperPlan]) -> None:
        """Planning replaces the plan and forgets what runs of the previous one remembered."""
        self._plan_value, self._memo = plan, {}

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._graph is not None

    @property
    def kv_layout(self) -> str:
        """The layout of the caches run() takes: "NHD" or "HND"."""
        return self._kv_layout

    @property
    def cuda_graph_batch_size(self) -> Optional[int]:
        """The requests the CUDA-graph buffers hold (every plan is padded to them); None
        outside CUDA-graph mode."""
        return None if self._graph is None else self._graph.batch

    def _plan_batch(self, *args, decode: bool, **kwargs) -> None:
        host = check_batch(*args, **kwargs)
        self._plan = plan_graph(self._graph, host, self.device, decode) \
            if self._graph is not None else plan_paged_batch(host, self.device)

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor,
                               int_workspace_buffer: Optional[torch.Tensor] = None) -> None:
        self._float_workspace_buffer = float_workspace_buffer
        if float_workspace_buffer.device != self.device:
            self.device, self._plan, self._scales = float_workspace_buffer.device, None, {}

    # The planned hyper-parameters, under FlashInfer's attribute names.
    @property
    def _causal(self) -> bool:
        return self.planned().causal

    @property
    def _window_left(self) -> int:
        return self.planned().window_left

    @property
    def _logits_soft_cap(self) -> float:
        return self.planned().logits_soft_cap

    @property
    def _sm_scale(self) -> float:
        return self.planned().sm_scale

    def planned(self) -> WrapperPlan:
        """The current plan (raises before the first plan())."""
        if self._plan is None:
            raise RuntimeError(f"{type(self).__name__}.run() was called before plan(): plan "
                               "each batch once, then run it for every layer")
        return self._plan

    def forget_plan(self) -> None:
        """Drop the current plan (a caller that found it unusable); run() raises until the
        next plan(). CUDA-graph buffers keep what they hold."""
        self._plan = None

    def run(self, q: torch.Tensor, paged_kv_cache: Cache, *, k_scale: Scale = None,
            v_scale: Scale = None, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, return_lse: bool = False,
            sinks: Optional[torch.Tensor] = None):
        """Attention of the planned batch.

        Args:
            q: [qo_indptr[-1], num_qo_heads, head_dim] in the planned q_data_type (decode:
                qo_indptr[-1] is the batch size). In CUDA-graph mode, after any plan() within
                the buffers, the same rows, or the buffers' capacity (the batch size for
                decode, the first plan's rows for prefill) whose rows past the batch no
                request reads.
            paged_kv_cache: (num_pages, 2, page_size, num_kv_heads, head_dim) (NHD) or
                (num_pages, 2, num_kv_heads, page_size, head_dim) (HND), or a (k_cache,
                v_cache) tuple of the 4-D halves; any strides.
            k_scale, v_scale: dequantization scales of an fp8 cache (x = x8 * scale).
            out: [rows of q, num_qo_heads, head_dim_vo] output, allocated when None; rows
                past the planned batch's hold no result (the PyTorch provider overwrites
                them, the Triton kernels leave them).
            lse, return_lse: also return float32 [rows of q, num_qo_heads], base 2.
            sinks: [num_qo_heads] sink logits (one more term in each softmax denominator).
        Returns out, or (out, lse) with return_lse.
        """
        out, natural = self.run_state(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale,
                                      out=out, sinks=sinks, with_lse=return_lse)
        return (out, base2_lse(natural, lse)) if return_lse else out

    def run_state(self, q: torch.Tensor, paged_kv_cache: Cache, *, k_scale: Scale = None,
                  v_scale: Scale = None, out: Optional[torch.Tensor] = None,
                  sinks: Optional[torch.Tensor] = None, with_lse: bool = True
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`run`, returning the partial state pagedattn's merges take: (out, natural-log LSE
        [num_qo_heads, rows of q] float32, a view of the plan's scratch valid until its next
        run; None without with_lse)."""
        plan = self.planned()
        k, v = cache_views(paged_kv_cache, self._kv_layout, plan, self._memo)
        k_descale, v_descale = descales(k_scale, v_scale, plan, self.device, self._scales,
                                        self._memo)
        return launch(plan, q, k, v, out, k_descale, v_descale, sinks, with_lse)


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    """One query token per request over its pages (the request's last position)."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
                 paged_kv_indices_buffer: Optional[torch.Tensor] = None,
                 paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None,
                 backend: str = "auto", jit_args=None, *,
                 max_kv_len: Optional[int] = None) -> None:
        """With use_cuda_graph, plan() copies each batch into the three int32 buffers
        ([batch_size + 1], [max pages], [batch_size]) and a captured run() replays later
        batches of at most batch_size requests (at most R if its q and out were tensors of
        exactly R rows, not views of batch_size-row buffers; module graph.py); max_kv_len
        (pagedattn's) bounds keys per request, default every page of the indices buffer."""
        graph = None
        if use_cuda_graph:
            graph = (("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                      "paged_kv_last_page_len_buffer"),
                     (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                      paged_kv_last_page_len_buffer))
        super().__init__(float_workspace_buffer, kv_layout, graph, backend, jit_args,
                         max_kv_len)
        # Our kernels run every decode on tensor cores (GQA groups share each K/V tile);
        # the flag is kept for API compatibility.
        self.use_tensor_cores = bool(use_tensor_cores)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: Optional[float] = None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             non_blocking: bool = True) -> None:
        """Plan a decode batch: request i owns pages indices[indptr[i]:indptr[i+1]], the last
        holding last_page_len[i] (1..page_size) tokens. `data_type` (deprecated) sets both
        q_data_type and kv_data_type. sm_scale defaults to 1/sqrt(head_dim)."""
        if data_type is not None:
            q_data_type = kv_data_type = data_type
        qo_indptr = torch.arange(indptr.shape[0] if isinstance(indptr, torch.Tensor) else 0)
        self._plan_batch(
            qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
            head_dim, page_size, causal=True, pos_encoding_mode=pos_encoding_mode,
            window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
            q_data_type=q_data_type, kv_data_type=kv_data_type, decode=True)


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    """Any number of query tokens per request (prefill, chunked prefill, append, verify)."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: Optional[torch.Tensor] = None,
                 paged_kv_indptr_buf: Optional[torch.Tensor] = None,
                 paged_kv_indices_buf: Optional[torch.Tensor] = None,
                 paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
                 custom_mask_buf: Optional[torch.Tensor] = None,
                 mask_indptr_buf: Optional[torch.Tensor] = None, backend: str = "auto",
                 jit_args=None, *, max_kv_len: Optional[int] = None) -> None:
        """With use_cuda_graph, plan() copies each batch into the four int32 buffers (qo and
        kv indptr [batch_size + 1], indices [max pages], last page lengths [batch_size]); the
        first plan's qo_indptr[-1] bounds the rows of every later one (FlashInfer's latch),
        and a captured run() replays later batches of at most batch_size requests within
        the latch (within R rows if its q and out were tensors of exactly R rows, not views
        of buffers holding the latch's; graph.py). Custom masks are not supported (so
        neither are their buffers)."""
        if custom_mask_buf is not None or mask_indptr_buf is not None:
            raise ValueError("custom_mask_buf / mask_indptr_buf: custom masks are not "
                             "supported; use causal, window_left and logits_soft_cap")
        graph = None
        if use_cuda_graph:
            graph = (("paged_kv_indptr_buf", "paged_kv_indices_buf",
                      "paged_kv_last_page_len_buf", "qo_indptr_buf"),
                     (paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf,
                      qo_indptr_buf))
        super().__init__(float_workspace_buffer, kv_layout, graph, backend, jit_args,
                         max_kv_len)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: Optional[int] = None, custom_mask: Optional[torch.Tensor] = None,
             packed_custom_mask: Optional[torch.Tensor] = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, q_data_type="float16", kv_data_type=None,
             non_blocking: bool = True) -> None:
        """Plan a batch: request i's queries are rows qo_indptr[i]:qo_indptr[i+1] of q, its
        pages paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]]. Causal aligns the
        queries with the last positions of the sequence. use_fp16_qk_reduction is a speed
        hint (scores are always accumulated in float32)."""
        if custom_mask is not None or packed_custom_mask is not None:
            raise ValueError("custom_mask / packed_custom_mask are not supported; use causal, "
                             "window_left and logits_soft_cap")
        self._plan_batch(
            qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
            num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo or head_dim_qk, page_size,
            causal=causal, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, q_data_type=q_data_type,
            kv_data_type=kv_data_type, decode=False)
