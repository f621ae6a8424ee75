"""A planned Gluon prefill launch run per layer: the layer's pointers and strides, a fast launch.

`GluonPrefillLaunch` holds what `attention_gluon.plan_gluon_prefill` fixed for a batch (the
schedule, the metadata tensors, the global scratch the producer builds its tensor descriptors
in) and `run(q, k, v, out, ...)` assembles the kernel's arguments from the layer's tensors
(no tensor op unless a layout must be copied for TMA; the cache's row view comes from an
lru_cache on shapes and strides) and launches through `fast_launch`. Triton's allocator is
pointed at the plan's scratch inside a copy of the caller's context, so the caller's own
allocator is untouched. Launches of one plan on one stream share the scratch (each program
writes its descriptors before its first load); a plan is not for concurrent streams.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedattn.ops.triton.attention_args import tma_ready
from pagedattn.ops.triton.fast_launch import KernelLaunch, aligned, tensor_key

try:
    import triton
except ImportError:  # a CPU install without Triton
    triton = None
try:  # the kernel needs Triton 3.6's Gluon (attention_gluon.why_not says where it cannot run)
    from pagedattn.ops.triton import gluon_prefill
except Exception:  # noqa: BLE001 - any import failure means "this install cannot serve"
    gluon_prefill = None

# Global scratch per program: Triton's device-built tensor descriptors take 128 bytes each and
# the producer builds at most five (Q, dense K / V, paged K / V).
SCRATCH_PER_PROGRAM = 5 * 128
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class GluonSchedule:
    """A launch's schedule and switches, from host ints alone (`attention_gluon.launch_config`)."""

    grid: int  # persistent programs (0: nothing to do)
    num_items: int  # work items the programs walk: query blocks x heads (some may be empty)
    batch: int
    total_q: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    page_size: int
    paged: bool
    dense_new_kv: bool
    floats: tuple  # (qk_scale, softcap), log2(e) folded in as the kernel expects
    window: tuple  # (left, right): right already 0 for causal
    skip_q_len: int
    constexprs: dict

    def batch_args(self) -> tuple:
        """The kernel's arguments from qk_scale to skip_q_len, in signature order."""
        return (*self.floats, *self.window, self.batch, self.total_q, self.num_items,
                self.grid, self.skip_q_len)


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
    for name, x in (("k", k), ("v", v)):
        if x.data_ptr() % 16:
            raise ValueError(f"the {name} cache must start 16-byte aligned (TMA), got address "
                             f"{x.data_ptr():#x}")
    return _cache_rows(tuple(k.shape), k.stride(), tuple(v.shape), v.stride(), k.element_size())


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


class GluonPrefillLaunch:
    """One batch's launch of the Gluon prefill kernel; `run` takes a layer's tensors.

    schedule: `launch_config`'s. The metadata tensors are the batch's (int32, on the GPU):
    cu_seqlens_q [batch + 1], seqused_k [batch], cu_seqlens_k [batch + 1] for dense keys,
    block_table [batch, pages] for a paged cache. launcher: what runs the kernel's arguments
    (default a `fast_launch.KernelLaunch` of `gluon_prefill_kernel`; a stub times the host
    side on a CPU)."""

    def __init__(self, schedule: GluonSchedule, *, cu_seqlens_q: torch.Tensor,
                 seqused_k: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor] = None,
                 block_table: Optional[torch.Tensor] = None,
                 launcher: Optional[Callable[[tuple, Optional[tuple]], Any]] = None):
        s = schedule
        if s.paged and block_table is None:
            raise ValueError("a paged plan needs block_table [batch, pages] int32")
        if not s.paged and cu_seqlens_k is None:
            raise ValueError("dense keys need cu_seqlens_k [batch + 1] int32")
        metadata = {"cu_seqlens_q": cu_seqlens_q, "seqused_k": seqused_k,
                    "cu_seqlens_k": cu_seqlens_k, "block_table": block_table}
        for name, t in metadata.items():
            if t is not None and t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        self.schedule = s
        self.cu_seqlens_k = None if s.paged else cu_seqlens_k
        self.block_table = block_table if s.paged else None
        self.metadata = (cu_seqlens_q, seqused_k, self.cu_seqlens_k, self.block_table)
        self.stride_bt = block_table.stride(0) if s.paged else 0
        self.batch_args = s.batch_args()  # made once: run() passes them per layer
        self.scratch = torch.empty(max(s.grid, 1) * SCRATCH_PER_PROGRAM, dtype=torch.uint8,
                                   device=cu_seqlens_q.device)
        # The descale of a missing k or v descale (the kernel reads both or neither).
        self.ones = torch.ones((), dtype=torch.float32, device=cu_seqlens_q.device) \
            if s.constexprs["KV_DESCALE"] else None
        present = tuple(t for t in self.metadata if t is not None)
        plan_key = (tensor_key(present), s.dense_new_kv) if aligned(*present) else None
        self._launcher = launcher or _Launch(plan_key, s, cu_seqlens_q.device)

    def allocate(self, size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
        """Triton's global scratch allocator for this plan's launches: the plan's scratch (the
        programs write their descriptors there first thing, so launches in one stream
        order share it), or a fresh buffer should a compile ask for more."""
        if size <= self.scratch.numel() and self.scratch.data_ptr() % alignment == 0:
            return self.scratch
        return torch.empty(size, dtype=torch.uint8, device=self.scratch.device)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
            sinks: Optional[torch.Tensor] = None, k_new: Optional[torch.Tensor] = None,
            v_new: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
            v_descale: Optional[torch.Tensor] = None) -> None:
        """q [total_q, H, D]; k / v: the paged cache [num_blocks, PAGE, H_kv, D(v)] (logical
        view) or dense keys [total_k, H_kv, D(v)]; out [total_q, H, Dv]; lse [H, total_q]
        float32 (planned with write_lse); alibi_slopes / sinks [H] float32 (planned with
        them); k_new / v_new the new tokens' keys and values [total_q, H_kv, D(v)] for a plan
        made with dense_new_kv (an fp8 plan reads them from the cache instead); k_descale /
        v_descale float32 [batch, H_kv] or one value, for a plan made with use_kv_descale
        (a missing one is 1)."""
        if self.schedule.grid == 0:
            return
        args, call_key = self.kernel_args(q, k, v, out, lse, alibi_slopes, sinks, k_new, v_new,
                                          k_descale, v_descale)
        contextvars.copy_context().run(_launch_with_scratch, self.allocate, self._launcher,
                                       args, call_key)

    def kernel_args(self, q, k, v, out, lse=None, alibi_slopes=None, sinks=None, k_new=None,
                    v_new=None, k_descale=None, v_descale=None
                    ) -> tuple[tuple, Optional[tuple]]:
        """(the kernel's runtime arguments in signature order, the fast launch's call key or
        None for Triton's own launch): what `run` launches, for a caller timing the bare
        launch of the same arguments."""
        s = self.schedule
        c = s.constexprs
        if (lse is not None) != c["WRITE_LSE"] or (alibi_slopes is not None) != \
                c["USE_ALIBI"] or (sinks is not None) != c["USE_SINKS"]:
            raise ValueError(f"lse / alibi_slopes / sinks given: {lse is not None} / "
                             f"{alibi_slopes is not None} / {sinks is not None}; the plan was "
                             f"made for {c['WRITE_LSE']} / {c['USE_ALIBI']} / {c['USE_SINKS']}")
        if lse is not None and lse.stride() != (s.total_q, 1):
            raise ValueError(f"lse must be a contiguous [num_heads, total_q], got strides "
                             f"{lse.stride()}")
        if alibi_slopes is not None and alibi_slopes.dtype != torch.float32:
            alibi_slopes = alibi_slopes.float()
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        k_descale, v_descale, ds_strides = self._descales(k_descale, v_descale)
        if out.dim() == 2:  # the layer's rows [total_q, H * Dv]: heads packed
            (stride_ot, stride_od), stride_oh = out.stride(), s.head_size_v
        else:
            stride_ot, stride_oh, stride_od = out.stride()
        if stride_od != 1:
            raise ValueError(f"out must have unit stride on head_size_v, got {out.stride()}")
        q = tma_ready(q)
        if s.paged:
            cache = paged_rows(k, v)
            k_cache, v_cache = k, v
            if s.dense_new_kv:
                if k_new is None or v_new is None:
                    raise ValueError("this plan reads the new tokens' keys and values as dense "
                                     "rows: pass k_new and v_new to run()")
                k_rows, v_rows = tma_ready(k_new), tma_ready(v_new)
            else:
                k_rows = v_rows = None
        else:
            cache = _NO_CACHE
            k_cache = v_cache = None
            k_rows, v_rows = tma_ready(k), tma_ready(v)
        kv_rows = 0 if k_rows is None else k_rows.shape[0]
        if kv_rows > INT32_MAX:
            raise ValueError(f"{kv_rows} key rows exceed TMA's int32 coordinates")
        cu_seqlens_q, seqused_k, cu_seqlens_k, block_table = self.metadata
        args = (q, k_rows, v_rows, k_cache, v_cache, out, lse, cu_seqlens_q, seqused_k,
                cu_seqlens_k, block_table, alibi_slopes, sinks, k_descale, v_descale,
                *self.batch_args, q.stride(0), kv_rows,
                0 if k_rows is None else k_rows.stride(0),
                0 if v_rows is None else v_rows.stride(0), cache.rows, cache.stride_k,
                cache.stride_v, cache.page_rows, cache.head_rows, cache.cols_k, cache.cols_v,
                self.stride_bt, stride_ot, stride_oh, *ds_strides)
        # Triton specialises pointers on dtype and 16-byte alignment (which of them are None
        # the plan fixes), and the output strides are the only unplanned ints it sees. q and
        # the dense rows are aligned by tma_ready, the caches by paged_rows.
        dtypes = tuple([t.dtype for t in (q, k_rows, v_rows, k_cache, v_cache, out, lse,
                                          alibi_slopes, sinks, k_descale, v_descale)
                        if t is not None])
        ptrs = out.data_ptr()
        for t in (lse, alibi_slopes, sinks, k_descale, v_descale):
            if t is not None:
                ptrs |= t.data_ptr()
        call_key = (dtypes, stride_ot, stride_oh) if ptrs % 16 == 0 else None
        return args, call_key

    def _descales(self, k_descale, v_descale) -> tuple:
        """(k descale, v descale, their (batch, KV head) strides): per (sequence, KV head), or
        one value broadcast (strides 0); None, None, (0, 0) for a plan without them."""
        if not self.schedule.constexprs["KV_DESCALE"]:
            if k_descale is not None or v_descale is not None:
                raise ValueError("k_descale / v_descale given to a plan made without "
                                 "use_kv_descale (an fp8 cache's plan takes them)")
            return None, None, (0, 0)
        k_descale = self.ones if k_descale is None else k_descale.float()
        v_descale = self.ones if v_descale is None else v_descale.float()
        strides = [_descale_strides(d) for d in (k_descale, v_descale)]
        if strides[0] != strides[1]:  # one pair of strides in the kernel
            k_descale, v_descale = (d.expand(self.schedule.batch, self.schedule.num_kv_heads)
                                    .contiguous() for d in (k_descale, v_descale))
            strides = [_descale_strides(k_descale)]
        return k_descale, v_descale, strides[0]


_NO_CACHE = CacheRows(0, 0, 0, 0, 0, 0, 0)


def _descale_strides(d: torch.Tensor) -> tuple[int, int]:
    """Per (sequence, KV head) descales [batch, H_kv]; one value broadcasts (strides 0)."""
    if d.numel() == 1:
        return (0, 0)
    if d.dim() != 2:
        raise ValueError(f"descales must be [batch, num_kv_heads] or one value, got shape "
                         f"{tuple(d.shape)}")
    return (d.stride(0), d.stride(1))


def _launch_with_scratch(allocate, launcher, args, call_key) -> None:
    """Run in a copy of the caller's context: Triton's allocator is set there only."""
    triton.set_allocator(allocate)
    launcher(args, call_key)


class _Launch(KernelLaunch):
    """The kernel on the schedule's grid (4 warps: the default partition, consumer 0)."""

    def __init__(self, plan_key: Optional[tuple], schedule: GluonSchedule,
                 device: torch.device):
        super().__init__(gluon_prefill.gluon_prefill_kernel, (schedule.grid,),
                         schedule.constexprs, num_warps=4, num_stages=3,
                         plan_key=plan_key or (), device=device)
        self.unkeyed = plan_key is None

    def __call__(self, args: tuple, call_key: Optional[tuple]) -> None:
        super().__call__(args, None if self.unkeyed else call_key)
