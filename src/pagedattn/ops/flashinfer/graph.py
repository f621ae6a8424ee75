"""CUDA-graph mode of the paged wrappers (`use_cuda_graph=True`): plans into fixed buffers.

FlashInfer's contract: the caller hands the wrapper fixed device buffers for the page table
(`paged_kv_indptr`, `paged_kv_indices`, `paged_kv_last_page_len`, and `qo_indptr` for
prefill); every `plan()` copies the new batch into them; a `run()` captured in a CUDA graph
replays with whatever batch was planned last. Here `plan()` also writes the provider's view
of the batch (query offsets, key counts, a dense block table) into one buffer of the wrapper's
own, and the provider's plan is made once per set of parameters, with grids for the
capacity, so a replay reads the new batch from the same addresses.

Capacity: the request count is the buffers' (a smaller batch is padded with empty requests,
where FlashInfer insists on the exact size); query rows are the first plan's (FlashInfer's
latch) for prefill, one per request for decode; keys per request are `max_kv_len` (a
pagedattn extension: the dense block table needs a width) or, by default, every page the
indices buffer can hold. A batch beyond any of them is refused with a ValueError.

Rows: run() takes q with the planned batch's qo_indptr[-1] rows (FlashInfer's contract) or
the capacity's, and runs the capacity's launch, whose programs find each request's rows
through the buffers' query offsets and touch only those. Where q and out are views of buffers
that hold the capacity's rows (how FlashInfer's callers cut fixed buffers to each plan), the
launch runs over the whole buffers, so a graph captured there replays every batch the wrapper
accepts, as FlashInfer's does (the PyTorch provider writes every row of its output, so it
keeps to q's rows); a graph captured over tensors of exactly the planned rows replays later
batches of at most those rows. A launch and buffers a graph captured are kept alive for as
long as the wrapper lives, even after a plan with new parameters replaces them (the old graph
then replays its old kernels over the buffers' new batch, as FlashInfer's does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedattn.ops.flashinfer.plan import (
    HostBatch,
    Launch,
    WrapperPlan,
    max_page,
    new_plan,
    plan_launch,
)


@dataclass
class GraphBuffers:
    """The caller's fixed buffers, the capacity they give, and what plans keep between them."""

    kv_indptr: torch.Tensor  # [batch + 1] int32
    kv_indices: torch.Tensor  # [max pages] int32
    last_page_len: torch.Tensor  # [batch] int32
    qo_indptr: Optional[torch.Tensor] = None  # [batch + 1] int32; prefill only
    max_kv_len: Optional[int] = None
    rows: Optional[int] = None  # query rows, latched by the first prefill plan
    static: Optional[tuple] = None  # the parameters the launch below was made for
    dev: Optional[torch.Tensor] = None  # [cu_seqlens_q | seq_lens | block table] int32
    width: int = 0  # pages per request the block table holds
    lse: Optional[torch.Tensor] = None
    launch: Optional[Launch] = None
    # (dev, lse, launch) of earlier parameters that a captured graph still reads
    retired: list = field(default_factory=list)

    @property
    def batch(self) -> int:
        return self.last_page_len.shape[0]


def graph_buffers(names: tuple, tensors: tuple, max_kv_len: Optional[int],
                  device: torch.device) -> GraphBuffers:
    """Check the buffers a wrapper was given for CUDA-graph mode (FlashInfer's order)."""
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode; got "
                             f"{type(t).__name__}")
        if t.dim() != 1 or t.dtype != torch.int32 or t.device != device:
            raise ValueError(f"{name} must be a 1-D int32 tensor on {device} (the workspace "
                             f"buffer's device); got {t.dtype} {tuple(t.shape)} on {t.device}")
    indptr, indices, last = tensors[:3]
    if indptr.shape[0] != last.shape[0] + 1:
        raise ValueError(f"The size of {names[0]} ({indptr.shape[0]}) should be batch_size + 1"
                         f" = len({names[2]}) + 1 = {last.shape[0] + 1}")
    qo = tensors[3] if len(tensors) > 3 else None
    if qo is not None and qo.shape[0] != indptr.shape[0]:
        raise ValueError(f"{names[3]} has {qo.shape[0]} entries; {names[0]} has "
                         f"{indptr.shape[0]}: both are batch_size + 1")
    if max_kv_len is not None and (not isinstance(max_kv_len, int) or max_kv_len <= 0):
        raise ValueError(f"max_kv_len={max_kv_len!r} must be a positive int or None")
    return GraphBuffers(indptr, indices, last, qo, max_kv_len)


def plan_graph(buf: GraphBuffers, host: HostBatch, device: torch.device,
               decode: bool) -> WrapperPlan:
    """Copy a checked batch into the fixed buffers; the plan a captured run() replays."""
    batch, total_q = host.batch, int(host.qo[-1])
    if batch > buf.batch:
        raise ValueError(f"The batch size {batch} exceeds the batch size of the cudagraph "
                         f"buffers ({buf.batch}) set during initialization")
    num_pages = host.indices.shape[0]
    if num_pages > buf.kv_indices.shape[0]:
        raise ValueError(f"The size of indices ({num_pages}) should be less than or equal to "
                         f"the allocated buffer ({buf.kv_indices.shape[0]})")
    if decode:
        rows = buf.batch
    else:
        if buf.rows is None:
            buf.rows = total_q
        rows = buf.rows
        if total_q > rows:
            raise ValueError(f"The total number of rows in qo_indptr {total_q} in cuda graph "
                             f"mode cannot exceed the number of rows set during "
                             f"initialization (the first plan) {rows}")
    page_size = host.static[4]
    if host.static != buf.static:  # new parameters: a new launch and scratch
        if buf.launch is not None and buf.launch.captured:
            buf.retired.append((buf.dev, buf.lse, buf.launch))
        buf.static, buf.launch = host.static, None
        buf.width = -(-buf.max_kv_len // page_size) if buf.max_kv_len else \
            max(buf.kv_indices.shape[0], 1)
        slots = buf.batch + 1
        buf.dev = torch.zeros(2 * slots + 1 + slots * buf.width, dtype=torch.int32,
                              device=device)
        buf.lse = torch.empty(host.static[0], rows, dtype=torch.float32, device=device)
    longest = int(host.pages.max()) if batch else 0
    if longest > buf.width:
        raise ValueError(f"a request holds {longest} pages but the cudagraph block table holds "
                         f"{buf.width} per request (max_kv_len={buf.max_kv_len}); raise "
                         "max_kv_len")
    _copy_csr(buf, host)
    # The provider sees one request more than the buffers hold, always empty: its kernels map
    # a program of a row past the batch (the grids are the capacity's) to the last request,
    # and an empty one makes it exit instead of writing that row.
    pad = buf.batch + 1 - batch
    qo = np.concatenate([host.qo, np.full(pad, total_q)])  # padded requests: no queries
    seq_lens = np.concatenate([host.seq_lens, np.zeros(pad, dtype=np.int64)])
    table = np.zeros((buf.batch + 1, buf.width), dtype=np.int64)
    table[:batch] = host.table(buf.width)
    buf.dev.copy_(torch.from_numpy(np.concatenate([qo, seq_lens, table.ravel()])
                                   .astype(np.int32)), non_blocking=True)
    max_q, max_k = 1 if decode else rows, buf.width * page_size
    if buf.launch is None:  # the capacity's launch serves every later plan of these parameters
        buf.launch = plan_launch(host, buf.dev, buf.width, rows, max_q, max_k, True)
    return new_plan(host, buf.dev, buf.width, rows, max_q, max_k, max_page(host), buf.lse,
                    buf.launch, True)


def _copy_csr(buf: GraphBuffers, host: HostBatch) -> None:
    """FlashInfer's copies into the caller's buffers, padded to their batch size."""
    pad = buf.batch - host.batch
    indptr = np.concatenate([host.kv_ptr, np.full(pad, host.kv_ptr[-1])])
    last = np.concatenate([(host.seq_lens - 1) % host.static[4] + 1, np.zeros(pad, np.int64)])
    pieces = [indptr, last, host.indices]
    if buf.qo_indptr is not None:
        pieces.append(np.concatenate([host.qo, np.full(pad, host.qo[-1])]))
    for dst, src in zip((buf.kv_indptr, buf.last_page_len, buf.kv_indices, buf.qo_indptr),
                        pieces):
        dst[:src.shape[0]].copy_(torch.from_numpy(src.astype(np.int32)), non_blocking=True)
