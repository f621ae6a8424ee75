"""`BatchPrefillWithRaggedKVCacheWrapper`: FlashInfer's plan/run over contiguous K/V.

Request i's queries are rows qo_indptr[i]:qo_indptr[i+1] of q and its keys/values rows
kv_indptr[i]:kv_indptr[i+1] of k and v (the prompt's own keys before they are paged, or any
packed K/V). `plan()` checks the offsets and plans the provider once; `run()` launches, for
every layer.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedattn.ops.flashinfer.dense import check_plain_args, nhd
from pagedattn.ops.flashinfer.plan import Q_DTYPES, as_dtype, host_index
from pagedattn.ops.flashinfer.run import base2_lse
from pagedattn.ops.flashinfer.wrappers import check_wrapper_args
from pagedattn.ops.plan import VarlenAttentionPlan, plan_varlen_attention


class BatchPrefillWithRaggedKVCacheWrapper:
    """Prefill/append attention of a batch over ragged (packed, non-paged) K/V."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: Optional[torch.Tensor] = None,
                 kv_indptr_buf: Optional[torch.Tensor] = None,
                 custom_mask_buf: Optional[torch.Tensor] = None,
                 mask_indptr_buf: Optional[torch.Tensor] = None, backend: str = "auto",
                 jit_args=None) -> None:
        check_wrapper_args(float_workspace_buffer, kv_layout, backend, jit_args)
        if use_cuda_graph:
            raise ValueError("use_cuda_graph=True is not supported by the ragged wrapper; "
                             "capture the paged wrappers (their CUDA-graph mode) instead")
        check_plain_args("NONE", custom_mask_buf, mask_indptr_buf)
        self._kv_layout, self.device = kv_layout, float_workspace_buffer.device
        self._float_workspace_buffer = float_workspace_buffer
        self._launch: Optional[VarlenAttentionPlan] = None
        self._rows: tuple = ()  # (total_q, total_kv, num_qo_heads, num_kv_heads, dims)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, head_dim_vo: Optional[int] = None,
             custom_mask: Optional[torch.Tensor] = None,
             packed_custom_mask: Optional[torch.Tensor] = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             window_left: int = -1, logits_soft_cap: Optional[float] = None,
             sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, q_data_type="float16", kv_data_type=None,
             non_blocking: bool = True) -> None:
        """Plan a batch: qo_indptr, kv_indptr [batch + 1] int offsets (host or device).
        Causal aligns each request's queries with its last keys."""
        check_plain_args(pos_encoding_mode, custom_mask, packed_custom_mask)
        for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                          ("head_dim_qk", head_dim_qk)):
            if not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name}={val!r} must be a positive int")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if not isinstance(window_left, int) or window_left < -1:
            raise ValueError(f"window_left={window_left!r} must be an int >= -1 (-1: no window)")
        if logits_soft_cap is not None and logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap} must be >= 0 (None or 0: off)")
        q_dtype = as_dtype("q_data_type", q_data_type, Q_DTYPES)
        kv_dtype = as_dtype("kv_data_type", kv_data_type or q_dtype, Q_DTYPES)
        kv = host_index("kv_indptr", kv_indptr)
        qo = host_index("qo_indptr", qo_indptr, kv.shape[0])
        q_lens, kv_lens = np.diff(qo), np.diff(kv)
        if kv.shape[0] < 1 or qo[0] != 0 or kv[0] != 0 or (q_lens < 0).any() or \
                (kv_lens < 0).any():
            raise ValueError(f"qo_indptr={qo.tolist()} and kv_indptr={kv.tolist()} must start "
                             "at 0 and never decrease")
        dim_vo = head_dim_vo or head_dim_qk
        dev = torch.from_numpy(np.concatenate([qo, kv]).astype(np.int32)).to(
            self.device, non_blocking=True)
        batch = qo.shape[0] - 1
        self._rows = (int(qo[-1]), int(kv[-1]), num_qo_heads, num_kv_heads, head_dim_qk, dim_vo,
                      q_dtype, kv_dtype)
        self._lse = torch.empty(num_qo_heads, int(qo[-1]), dtype=torch.float32,
                                device=self.device)
        # One plan for runs with and without an LSE (each run() says).
        self._launch = plan_varlen_attention(
            cu_seqlens_q=dev[:batch + 1], cu_seqlens_k=dev[batch + 1:], num_tokens=int(qo[-1]),
            max_seqlen_q=int(q_lens.max(initial=0)), max_seqlen_k=int(kv_lens.max(initial=0)),
            num_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_size=head_dim_qk,
            head_size_v=dim_vo, q_dtype=q_dtype, kv_dtype=kv_dtype, causal=causal,
            softmax_scale=sm_scale, window_size=(window_left, -1),
            softcap=float(logits_soft_cap or 0.0), return_softmax_lse=None)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            return_lse: bool = False):
        """q [qo_indptr[-1], num_qo_heads, head_dim_qk]; k, v [kv_indptr[-1], num_kv_heads,
        head_dim] (NHD; HND: [num_kv_heads, kv_indptr[-1], head_dim]) in the planned dtypes.
        Returns out [qo_indptr[-1], num_qo_heads, head_dim_vo], and with return_lse the
        base-2 LSE [qo_indptr[-1], num_qo_heads] float32."""
        if self._launch is None:
            raise RuntimeError("BatchPrefillWithRaggedKVCacheWrapper.run() was called before "
                               "plan()")
        total_q, total_kv, h, hkv, d, dv, q_dtype, kv_dtype = self._rows
        k, v = nhd("k", k, self._kv_layout), nhd("v", v, self._kv_layout)
        for name, x, shape, dtype in (("q", q, (total_q, h, d), q_dtype),
                                      ("k", k, (total_kv, hkv, d), kv_dtype),
                                      ("v", v, (total_kv, hkv, dv), kv_dtype)):
            if tuple(x.shape) != shape or x.dtype != dtype or x.device != self.device:
                raise ValueError(f"{name} is {x.dtype} {tuple(x.shape)} on {x.device}; the "
                                 f"plan expects {dtype} {shape} on {self.device}")
        out = self._launch.run(q, k, v, out, softmax_lse=self._lse if return_lse else None)
        return (out, base2_lse(self._lse, lse)) if return_lse else out
