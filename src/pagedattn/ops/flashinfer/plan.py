"""Planning for the FlashInfer-style wrappers: a CSR page table becomes the device tensors,
Python ints and the provider's plan of one call (`WrapperPlan`; `run.launch` makes that call).

All host work happens in `plan_paged_batch` (checks, lengths, the padded block table, one
copy to the device, the provider's plan), so running a plan only checks host ints and
launches: CUDA-graph safe. The provider's plan serves every run() of the plan: with or
without sinks and an LSE (planned for either), and in CUDA-graph mode any rows up to the
capacity (its launches find each request's rows on the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from pagedattn.ops.plan import VarlenAttentionPlan, plan_varlen_attention

LOG2E = 1.4426950408889634  # FlashInfer's LSE is base 2: log2(sum exp(s)) = lse * log2(e)
KV_LAYOUTS = ("NHD", "HND")
_DTYPE_NAMES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
                "float32": torch.float32, "float": torch.float32,
                "fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2, "float8_e5m2": torch.float8_e5m2}
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_DTYPES = Q_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)
Cache = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Launch:
    """The provider's plan of a `WrapperPlan` (CUDA-graph mode: of every plan with the same
    parameters), and whether a CUDA graph captured a run of it: its scratch then lives as long
    as the wrapper, whose later plans with new parameters leave the graph its launch."""

    plan: VarlenAttentionPlan
    captured: bool = False


@dataclass(frozen=True)
class WrapperPlan:
    """One batch as the provider takes it; device tensors are views of one int32 buffer."""

    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32: keys per request
    block_table: torch.Tensor  # [batch, max_pages] int32, unused entries 0 (never read)
    total_q: int  # rows the provider's launches are sized for (CUDA-graph mode: the capacity)
    batch_q: int  # qo_indptr[-1] of the planned batch: the rows run() takes (FlashInfer's)
    max_seqlen_q: int
    max_seqlen_k: int
    max_page: int  # the largest page id the table holds (-1: none), checked against the cache
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    causal: bool
    window_left: int  # keys with q_pos - k_pos <= window_left; -1: unbounded
    logits_soft_cap: float  # 0: off
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    lse: torch.Tensor  # [num_qo_heads, total_q] float32 scratch: the provider's natural-log LSE
    launch: Launch  # the provider's plan, made by plan()
    # CUDA-graph mode: the tensors above are fixed buffers of the captured capacity (total_q
    # query rows, cu_seqlens_q's requests, max_seqlen_k keys); the launch serves any batch in
    # it.
    cuda_graph: bool = False


def as_dtype(name: str, value: Union[str, torch.dtype], allowed: tuple) -> torch.dtype:
    dtype = _DTYPE_NAMES.get(value) if isinstance(value, str) else value
    if dtype not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {[str(d) for d in allowed]}")
    return dtype


def host_index(name: str, x: torch.Tensor, length: Optional[int] = None) -> np.ndarray:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor; got {x.dtype} {tuple(x.shape)}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} has {x.shape[0]} entries; expected {length}")
    return x.to("cpu", torch.int64).numpy()


@dataclass(frozen=True)
class HostBatch:
    """A checked CSR batch on the host (numpy int64), and the plan's static parameters."""

    qo: np.ndarray  # [batch + 1] query offsets
    kv_ptr: np.ndarray  # [batch + 1] page offsets
    indices: np.ndarray  # [len(paged_kv_indices)] page ids
    pages: np.ndarray  # [batch] pages per request
    seq_lens: np.ndarray  # [batch] keys per request
    static: tuple  # (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, causal,
    #                 window_left, logits_soft_cap, sm_scale, q_dtype, kv_dtype)

    @property
    def batch(self) -> int:
        return self.pages.shape[0]

    def table(self, width: int) -> np.ndarray:
        """[batch, width] page ids, unused entries 0 (never read: past each sequence's end)."""
        col = np.arange(width)
        used = col[None, :] < self.pages[:, None]
        table = np.zeros((self.batch, width), dtype=np.int64)
        table[used] = self.indices[(self.kv_ptr[:-1, None] + col[None, :])[used]]
        return table


def check_batch(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
                head_dim_qk: int, head_dim_vo: int, page_size: int, *, causal: bool,
                pos_encoding_mode: str, window_left: int, logits_soft_cap: Optional[float],
                sm_scale: Optional[float], q_data_type, kv_data_type) -> HostBatch:
    """Check a CSR page table and the plan's parameters; the host copy of the batch.
    Request i owns pages kv_indices[kv_indptr[i]:kv_indptr[i+1]], the last holding
    last_page_len[i] tokens; its queries are rows qo_indptr[i]:qo_indptr[i+1] of q."""
    for name, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim_qk), ("head_dim_vo", head_dim_vo),
                    ("page_size", page_size)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive int")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if pos_encoding_mode != "NONE":
        raise ValueError(f"pos_encoding_mode={pos_encoding_mode!r} is not supported; apply "
                         "RoPE/ALiBi outside attention and pass 'NONE'")
    if not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left={window_left!r} must be an int >= -1 (-1: no window)")
    if logits_soft_cap is not None and logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap} must be >= 0 (None or 0: off)")
    q_dtype = as_dtype("q_data_type", q_data_type, Q_DTYPES)
    kv_dtype = as_dtype("kv_data_type", q_dtype if kv_data_type is None else kv_data_type,
                        KV_DTYPES)
    kv_ptr = host_index("paged_kv_indptr", kv_indptr)
    batch = kv_ptr.shape[0] - 1
    if batch < 0:
        raise ValueError("paged_kv_indptr must have batch_size + 1 >= 1 entries")
    qo = host_index("qo_indptr", qo_indptr, batch + 1)
    last = host_index("paged_kv_last_page_len", last_page_len, batch)
    indices = host_index("paged_kv_indices", kv_indices)
    # Host work in numpy: small torch ops on the CPU cost tens of microseconds each (and
    # milliseconds where they go multi-threaded on a busy host).
    pages, q_lens = np.diff(kv_ptr), np.diff(qo)
    if qo[0] != 0 or (q_lens < 0).any():
        raise ValueError(f"qo_indptr={qo.tolist()} must start at 0 and never decrease")
    if kv_ptr[0] < 0 or (pages < 0).any() or kv_ptr[-1] > indices.shape[0]:
        raise ValueError(f"paged_kv_indptr={kv_ptr.tolist()} must be non-decreasing within "
                         f"[0, len(paged_kv_indices)={indices.shape[0]}]")
    bad = np.flatnonzero((pages > 0) & ((last < 1) | (last > page_size)))
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"paged_kv_last_page_len[{r}]={int(last[r])} must be in "
                         f"1..page_size={page_size}")
    if (indices[kv_ptr[0]:kv_ptr[-1]] < 0).any():
        raise ValueError("paged_kv_indices holds negative page ids")
    static = (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, bool(causal),
              window_left, float(logits_soft_cap or 0.0),
              float(head_dim_qk ** -0.5 if sm_scale is None else sm_scale), q_dtype, kv_dtype)
    return HostBatch(qo, kv_ptr, indices, pages,
                     np.where(pages > 0, (pages - 1) * page_size + last, 0), static)


def batch_views(dev: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """(cu_seqlens_q, seq_lens, block_table) over `dev` = [cu_seqlens_q | seq_lens | block
    table], a batch of (len(dev) - 1) // (width + 2) requests."""
    batch = (dev.shape[0] - 1) // (width + 2)
    return dev[:batch + 1], dev[batch + 1:2 * batch + 1], dev[2 * batch + 1:].view(batch, width)


def plan_launch(host: HostBatch, dev: torch.Tensor, width: int, rows: int, max_seqlen_q: int,
                max_seqlen_k: int, cuda_graph: bool) -> Launch:
    """The provider's plan of `rows` query rows over the batch in `dev`: with or without sinks
    and an LSE (each run() says), fp8 caches with their descales."""
    (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, causal, window_left,
     soft_cap, sm_scale, q_dtype, kv_dtype) = host.static
    cu_seqlens_q, seq_lens, block_table = batch_views(dev, width)
    return Launch(plan_varlen_attention(
        cu_seqlens_q=cu_seqlens_q, num_tokens=rows, max_seqlen_q=min(max_seqlen_q, rows),
        max_seqlen_k=max_seqlen_k, num_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_size=head_dim_qk, head_size_v=head_dim_vo, q_dtype=q_dtype, kv_dtype=kv_dtype,
        seqused_k=seq_lens, block_table=block_table, page_size=page_size,
        softmax_scale=sm_scale, causal=causal, window_size=(window_left, -1),
        softcap=soft_cap, use_sinks=None, use_kv_descale=kv_dtype.itemsize == 1,
        return_softmax_lse=None, cuda_graph=cuda_graph))


def new_plan(host: HostBatch, dev: torch.Tensor, width: int, total_q: int, max_seqlen_q: int,
             max_seqlen_k: int, max_page: int, lse: torch.Tensor, launch: Launch,
             cuda_graph: bool) -> WrapperPlan:
    """A `WrapperPlan` over `dev` = [cu_seqlens_q | seq_lens | block table] and its launch."""
    (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, causal, window_left,
     soft_cap, sm_scale, q_dtype, kv_dtype) = host.static
    cu_seqlens_q, seq_lens, block_table = batch_views(dev, width)
    return WrapperPlan(
        cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_table=block_table, total_q=total_q,
        batch_q=int(host.qo[-1]),
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, max_page=max_page,
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo, page_size=page_size, causal=causal, window_left=window_left,
        logits_soft_cap=soft_cap, sm_scale=sm_scale, q_dtype=q_dtype, kv_dtype=kv_dtype,
        lse=lse, launch=launch, cuda_graph=cuda_graph)


def plan_paged_batch(host: HostBatch, device: torch.device) -> WrapperPlan:
    """An eager plan of a checked batch on `device` (one host-to-device copy)."""
    batch = host.batch
    width = max(int(host.pages.max()) if batch else 0, 1)
    table = host.table(width)
    # One copy to the device: [cu_seqlens_q | seq_lens | block table]
    dev = torch.from_numpy(np.concatenate([host.qo, host.seq_lens, table.ravel()])
                           .astype(np.int32)).to(device, non_blocking=True)
    total_q = int(host.qo[-1])
    max_q = int(np.diff(host.qo).max()) if batch else 0
    max_k = int(host.seq_lens.max()) if batch else 0
    return new_plan(
        host, dev, width, total_q, max_q, max_k, max_page(host),
        torch.empty(host.static[0], total_q, dtype=torch.float32, device=device),
        plan_launch(host, dev, width, total_q, max_q, max_k, False), False)


def max_page(host: HostBatch) -> int:
    """The largest page id the batch reads (-1: none), checked against the cache at run."""
    used = host.indices[host.kv_ptr[0]:host.kv_ptr[-1]]
    return int(used.max()) if used.size else -1
