"""The 2-D row views a TMA descriptor walks: a layer's tensors and a paged cache.

Both TMA passes (the Hopper `tl` pass and the Gluon pass) read the query and dense keys as
rows [rows, heads * d] (`tma_ready`, `tma_rows`), and the Gluon pass reads a paged cache as
rows in which the slots of one block and KV head are consecutive (`paged_rows`). A layout
no descriptor can walk is copied (a layer's tensor) or refused (a cache).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

INT32_MAX = 2**31 - 1  # TMA coordinates are int32


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, d] (or the layer's 2-D rows [rows, heads * d]) with the layout a
    [rows, heads * d] TMA descriptor walks (heads packed, unit stride, 16-byte aligned rows
    and base); another layout is copied (once per call). Used by both TMA passes: the Hopper
    `tl` pass and the Gluon pass."""
    return tma_rows(x)[0]


def tma_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(`tma_ready(x)`, its row stride), reading x's strides once."""
    strides = x.stride()
    if strides[-1] == 1 and (len(strides) == 2 or strides[1] == x.shape[2]) and \
            not (strides[0] * x.element_size()) % 16 and not x.data_ptr() % 16:
        return x, strides[0]
    x = x.contiguous()
    return x, x.stride(0)


@dataclass(frozen=True)
class CacheRows:
    """A paged cache [num_blocks, PAGE, H_kv, D] (logical view) as 2-D rows in which the PAGE
    slots of one block and KV head are consecutive rows: an NHD row is one slot of every head
    (head h at column h * cols), an HND row one slot of one head (head h at h * head_rows
    rows). K and V share the rows; their row strides and widths may differ (D != Dv)."""

    rows: int  # num_blocks * page_rows
    page_rows: int  # rows per block
    head_rows: int
    cols_k: int
    cols_v: int
    stride_k: int  # elements between consecutive rows
    stride_v: int


def paged_rows(k: torch.Tensor, v: torch.Tensor) -> CacheRows:
    """The 2-D row view of the caches k / v (ValueError where their strides have none)."""
    if (k.data_ptr() | v.data_ptr()) % 16:
        name, x = ("k", k) if k.data_ptr() % 16 else ("v", v)
        raise ValueError(f"the {name} cache must start 16-byte aligned (TMA), got address "
                         f"{x.data_ptr():#x}")
    # (torch.Size is a tuple: it keys the cache as it is)
    return _cache_rows(k.shape, k.stride(), v.shape, v.stride(), k.element_size())


@functools.lru_cache(maxsize=64)
def _cache_rows(k_shape, k_stride, v_shape, v_stride, itemsize) -> CacheRows:
    views = []
    for shape, stride in ((k_shape, k_stride), (v_shape, v_stride)):
        num_blocks, _, heads, _ = shape
        sb, ss, sh, sd = stride
        nhd = sh < ss or heads == 1
        if sd != 1 or sb % ss or (not nhd and sh % ss) or (ss * itemsize) % 16:
            raise ValueError(f"cache strides {stride} do not view as rows of consecutive "
                             "slots per block and KV head (NHD or HND, 16-byte aligned rows)")
        views.append((num_blocks * (sb // ss), sb // ss, 0 if nhd else sh // ss,
                      sh if nhd else 0, ss))
    (rows, page_rows, head_rows, cols_k, stride_k), (*v_rows, cols_v, stride_v) = views
    if [rows, page_rows, head_rows] != v_rows or k_shape[:3] != v_shape[:3]:
        raise ValueError(f"k and v caches need one layout of blocks and heads: shapes "
                         f"{k_shape} / {v_shape}, strides {k_stride} / {v_stride}")
    if rows > INT32_MAX:
        raise ValueError(f"a cache of {rows} rows of slots exceeds TMA's int32 coordinates")
    return CacheRows(rows, page_rows, head_rows, cols_k, cols_v, stride_k, stride_v)


NO_CACHE = CacheRows(0, 0, 0, 0, 0, 0, 0)  # a dense plan's: no cache rows
