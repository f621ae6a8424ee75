"""FlashInfer's paged-cache writes: `append_paged_kv_cache`, with `get_batch_indices_positions`
and `get_seq_lens` to describe where each appended row goes.

The write is `reshape_and_cache_flash` (Triton on CUDA, PyTorch elsewhere) over the slots the
CSR page table gives: row t goes to page kv_indices[kv_indptr[b] + p // page_size], offset
p % page_size, for b = batch_indices[t], p = positions[t]. All index math stays on the device
(no host sync), so the calls can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from pagedattn.ops.cache import reshape_and_cache_flash
from pagedattn.ops.checks import check_tensor
from pagedattn.ops.flashinfer.plan import KV_LAYOUTS

_INDEX = (torch.int32, torch.int64)
_FP8_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """Keys per request from a page table: (pages - 1) * page_size + last page's tokens
    (kv_indptr [batch + 1], kv_last_page_len [batch]) -> [batch]."""
    pages = kv_indptr[1:] - kv_indptr[:-1]
    return torch.clamp(pages - 1, min=0) * page_size + kv_last_page_len * (pages > 0)


def get_batch_indices_positions(
        append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int,
        batch_indices: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of nnz appended rows (request b's rows are append_indptr[b]:append_indptr[b+1],
    the last ones of its seq_lens[b] keys): its request and its position in the sequence,
    both int32 [nnz]. Rows past append_indptr[-1] get request -1, position 0."""
    check_tensor("append_indptr", append_indptr, 1, _INDEX)
    check_tensor("seq_lens", seq_lens, 1, _INDEX, append_indptr.device)
    if seq_lens.shape[0] != append_indptr.shape[0] - 1:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries; append_indptr has "
                         f"{append_indptr.shape[0]}: need batch_size and batch_size + 1")
    device = append_indptr.device
    for name, t in (("batch_indices", batch_indices), ("positions", positions)):
        if t is not None and (tuple(t.shape) != (nnz,) or t.dtype != torch.int32
                              or t.device != device):
            raise ValueError(f"{name} must be int32 [{nnz}] on {device}; got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    rows = torch.arange(nnz, device=device, dtype=append_indptr.dtype)
    req = torch.searchsorted(append_indptr[1:].contiguous(), rows, right=True)
    valid = req < seq_lens.shape[0]
    safe = req.clamp(max=max(seq_lens.shape[0] - 1, 0))
    # A request's rows end at its last key: row t sits end - t positions before seq_len.
    pos = (seq_lens[safe] - (append_indptr[1:][safe] - rows)) if seq_lens.numel() else rows
    b = torch.where(valid, req, -1).to(torch.int32)
    p = torch.where(valid, pos, 0).to(torch.int32)
    if batch_indices is None:
        return b, p if positions is None else positions.copy_(p)
    return batch_indices.copy_(b), p if positions is None else positions.copy_(p)


def unpack_cache(paged_kv_cache, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's cache (one (pages, 2, ...) tensor or a (k, v) tuple, NHD or HND) as
    logical [pages, page_size, num_kv_heads, head_dim] K and V views."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={layout!r} is not supported; choose one of {KV_LAYOUTS}")
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        k, v = paged_kv_cache
    elif isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 5 \
            and paged_kv_cache.shape[1] == 2:
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    else:
        raise ValueError("paged_kv_cache must be a (num_pages, 2, ...) tensor or a (k_cache, "
                         "v_cache) tuple")
    for name, x in (("k_cache", k), ("v_cache", v)):
        check_tensor(name, x, 4)
    return (k, v) if layout == "NHD" else (k.transpose(1, 2), v.transpose(1, 2))


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor,
                          batch_indices: torch.Tensor, positions: torch.Tensor,
                          paged_kv_cache: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
                          kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_last_page_len: torch.Tensor, kv_layout: str = "NHD") -> None:
    """Write rows into a paged cache whose page table already covers them.

    append_key, append_value: [nnz, num_kv_heads, head_dim] in the cache's dtype (FlashInfer
    copies rows as they are: quantize to fp8 first for an fp8 cache). batch_indices,
    positions: [nnz] int (`get_batch_indices_positions`; a negative request skips the row).
    kv_indices [pages], kv_indptr [batch + 1], kv_last_page_len [batch]: the page table."""
    k_cache, v_cache = unpack_cache(paged_kv_cache, kv_layout)
    device = k_cache.device
    for name, t in (("batch_indices", batch_indices), ("positions", positions),
                    ("kv_indices", kv_indices), ("kv_indptr", kv_indptr),
                    ("kv_last_page_len", kv_last_page_len)):
        check_tensor(name, t, 1, _INDEX, device)
    for name, x in (("append_key", append_key), ("append_value", append_value)):
        check_tensor(name, x, 3, None, device)
        if x.dtype != k_cache.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but the cache holds {k_cache.dtype}; "
                             "append_paged_kv_cache copies rows as they are (convert or "
                             "quantize them first)")
    if batch_indices.shape[0] != append_key.shape[0] or positions.shape[0] != \
            append_key.shape[0]:
        raise ValueError(f"batch_indices ({batch_indices.shape[0]}) and positions "
                         f"({positions.shape[0]}) need one entry per row of append_key "
                         f"({append_key.shape[0]})")
    page_size = k_cache.shape[1]
    req = batch_indices.long().clamp(min=0)
    pos = positions.long()
    page = kv_indices.long()[kv_indptr.long()[req] + pos // page_size]
    slots = torch.where(batch_indices >= 0, page * page_size + pos % page_size, -1)
    fp8 = _FP8_NAMES.get(k_cache.dtype)
    if fp8 is not None:  # fp8 -> float32 -> fp8 is exact: the rows land as they are
        append_key, append_value = append_key.float(), append_value.float()
    reshape_and_cache_flash(append_key, append_value, k_cache, v_cache, slots, fp8 or "auto")
