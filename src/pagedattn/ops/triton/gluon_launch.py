"""A planned Gluon prefill launch run per layer: the layer's pointers and strides, a fast launch.

`GluonPrefillLaunch` holds what `attention_gluon.plan_gluon_prefill` fixed for a batch (the
schedule, the metadata tensors, the global scratch the producer builds its tensor descriptors
in) and `run(q, k, v, out, ...)` assembles the kernel's arguments from the layer's tensors
(no tensor op unless a layout must be copied for TMA; the cache's row view is
`tma_views.paged_rows`) and launches through `fast_launch`. `plan_layer` fixes one layer's
caches and per-layer tensors for a plan the layer runs again (steps of one size share their
plans): its `GluonLayerPlan` reads only a call's query, output and new rows. Triton's allocator is
pointed at the plan's scratch inside a copy of the caller's context, so the caller's own
allocator is untouched. Launches of one plan on one stream share the scratch (each program
writes its descriptors before its first load) and its work area (a dynamic launch's item
counter, batch-invariant mode's fold rows at head 256); a plan is not for concurrent streams.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedattn.ops.triton.fast_launch import KernelLaunch, aligned, tensor_key
from pagedattn.ops.triton.tma_views import INT32_MAX, NO_CACHE, paged_rows, tma_rows

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
# The head of a dynamic launch's work area: its two int32 item counters, padded to 128 bytes so
# that the fold rows after them keep the allocation's alignment (a row on whole 128-byte lines).
QUEUE_WORDS = 32


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
        # The kernel's kv_index: where each request's keys are (its pages, or its first row)
        kv_index = self.block_table if s.paged else self.cu_seqlens_k
        self.metadata = (cu_seqlens_q, seqused_k, kv_index)
        self.stride_bt = block_table.stride(0) if s.paged else 0
        self.batch_args = s.batch_args()  # made once: run() passes them per layer
        c = s.constexprs
        self.optional = (c["WRITE_LSE"], c["USE_ALIBI"], c["USE_SINKS"])  # lse, slopes, sinks
        self.scratch = torch.empty(max(s.grid, 1) * SCRATCH_PER_PROGRAM, dtype=torch.uint8,
                                   device=cu_seqlens_q.device)
        # The kernel's Work (`work_words`; None where the launch needs neither part): a
        # dynamic launch's item counters, zero, and zero again after each launch (its last
        # program resets them), so launches of this plan in one stream order share them; the
        # fold rows are written before they are read (`gluon_invariant.py`), left unset.
        words = work_words(s)
        self.work = torch.empty(words, dtype=torch.float32, device=cu_seqlens_q.device) \
            if words else None
        if c["DYNAMIC"]:
            self.work[:QUEUE_WORDS].zero_()
        # The descale of a missing q, k or v descale (the kernel reads k and v, or neither)
        self.descaled = (c["Q_DESCALE"], c["KV_DESCALE"])  # (q, k and v)
        self.ones = torch.ones((), dtype=torch.float32, device=cu_seqlens_q.device) \
            if any(self.descaled) else None
        present = tuple(t for t in self.metadata if t is not None)
        plan_key = (tensor_key(present), s.dense_new_kv) if aligned(*present) else None
        self.launcher = launcher or _Launch(plan_key, s, cu_seqlens_q.device)

    @property
    def queue(self) -> Optional[torch.Tensor]:
        """A dynamic launch's item counters in Work (int32 [next item, programs done]), or
        None."""
        return self.work[:2].view(torch.int32) if self.schedule.constexprs["DYNAMIC"] else None

    @property
    def fold(self) -> Optional[torch.Tensor]:
        """Batch-invariant mode's fold state in Work (`fold_shape`, from word FOLD_AT), or
        None (also for an empty grid: no rows, no Work)."""
        shape = fold_shape(self.schedule)
        if shape is None or self.work is None:
            return None
        at = self.schedule.constexprs["FOLD_AT"]
        return self.work[at:at + math.prod(shape)].view(shape)

    def allocate(self, size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
        """Triton's global scratch allocator for this plan's launches: the plan's scratch (the
        programs write their descriptors there first thing, so launches in one stream
        order share it), or a fresh buffer should a compile ask for more."""
        return scratch_or_fresh(self.scratch, size, alignment)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
            sinks: Optional[torch.Tensor] = None, k_new: Optional[torch.Tensor] = None,
            v_new: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
            v_descale: Optional[torch.Tensor] = None,
            q_descale: Optional[torch.Tensor] = None) -> None:
        """q [total_q, H, D]; k / v: the paged cache [num_blocks, PAGE, H_kv, D(v)] (logical
        view) or dense keys [total_k, H_kv, D(v)]; out [total_q, H, Dv]; lse [H, total_q]
        float32 (planned with write_lse); alibi_slopes / sinks [H] float32 (planned with
        them); k_new / v_new the new tokens' keys and values [total_q, H_kv, D(v)] for a plan
        made with dense_new_kv (an fp8 plan reads them from the cache instead); q_descale /
        k_descale / v_descale float32 [batch, H_kv] or one value, for a plan made with
        use_q_descale / use_kv_descale (a missing one is 1)."""
        if self.schedule.grid == 0:
            return
        args, call_key = self.kernel_args(q, k, v, out, lse, alibi_slopes, sinks, k_new, v_new,
                                          k_descale, v_descale, q_descale)
        launch_with_scratch(self.allocate, self.launcher, args, call_key)

    def kernel_args(self, q, k, v, out, lse=None, alibi_slopes=None, sinks=None, k_new=None,
                    v_new=None, k_descale=None, v_descale=None, q_descale=None
                    ) -> tuple[tuple, Optional[tuple]]:
        """(the kernel's runtime arguments in signature order, the fast launch's call key or
        None for Triton's own launch): what `run` launches, for a caller timing the bare
        launch of the same arguments. One pass over the call's tensors, each stride read
        once: it runs once per layer of every prefill step."""
        s = self.schedule
        if (lse is not None, alibi_slopes is not None, sinks is not None) != self.optional:
            raise ValueError(f"lse / alibi_slopes / sinks given: {lse is not None} / "
                             f"{alibi_slopes is not None} / {sinks is not None}; the plan was "
                             "made for {} / {} / {}".format(*self.optional))
        ptrs = out.data_ptr()  # the optional tensors' alignment (Triton specialises on it)
        dtypes = [q.dtype, out.dtype]
        if lse is not None:
            if lse.stride() != (s.total_q, 1):
                raise ValueError(f"lse must be a contiguous [num_heads, total_q], got strides "
                                 f"{lse.stride()}")
            ptrs |= lse.data_ptr()
            dtypes.append(lse.dtype)
        if alibi_slopes is not None:
            if alibi_slopes.dtype != torch.float32:
                alibi_slopes = alibi_slopes.float()
            ptrs |= alibi_slopes.data_ptr()
        if sinks is not None:
            if sinks.dtype != torch.float32:
                sinks = sinks.float()
            ptrs |= sinks.data_ptr()
        unplanned = _unplanned_descale(self.descaled, q_descale, k_descale, v_descale)
        if unplanned:
            raise ValueError(unplanned)
        ds_strides = (0, 0)
        if self.ones is not None:
            q_descale, k_descale, v_descale, ds_strides = self._descales(
                q_descale, k_descale, v_descale)
            for d in (q_descale, k_descale, v_descale):
                ptrs |= 0 if d is None else d.data_ptr()
        out_strides = out.stride()
        if len(out_strides) == 2:  # the layer's rows [total_q, H * Dv]: heads packed
            (stride_ot, stride_od), stride_oh = out_strides, s.head_size_v
        else:
            stride_ot, stride_oh, stride_od = out_strides
        if stride_od != 1:
            raise ValueError(f"out must have unit stride on head_size_v, got {out_strides}")
        q, stride_q = tma_rows(q)
        if s.paged:
            cache = paged_rows(k, v)
            k_cache, v_cache = k, v
            dtypes += (k.dtype, v.dtype)
            if s.dense_new_kv:
                if k_new is None or v_new is None:
                    raise ValueError("this plan reads the new tokens' keys and values as dense "
                                     "rows: pass k_new and v_new to run()")
                k_rows, stride_k = tma_rows(k_new)
                v_rows, stride_v = tma_rows(v_new)
                _check_new_rows(k_rows, v_rows, s.total_q)
            else:
                k_rows = v_rows = None
                stride_k = stride_v = 0
            kv_rows = cache.rows
        else:
            cache = NO_CACHE
            k_cache = v_cache = None
            k_rows, stride_k = tma_rows(k)
            v_rows, stride_v = tma_rows(v)
            kv_rows = k_rows.shape[0]
            if kv_rows > INT32_MAX:
                raise ValueError(f"{kv_rows} key rows exceed TMA's int32 coordinates")
        if k_rows is not None:
            dtypes += (k_rows.dtype, v_rows.dtype)
        args = (q, k_rows, v_rows, k_cache, v_cache, out, lse, *self.metadata, alibi_slopes,
                sinks, q_descale, k_descale, v_descale, self.work, *self.batch_args, stride_q,
                kv_rows, stride_k, stride_v, cache.stride_k, cache.stride_v, cache.page_rows,
                cache.head_rows, cache.cols_k, cache.cols_v, self.stride_bt, stride_ot,
                stride_oh, *ds_strides)
        # Triton specialises pointers on dtype and 16-byte alignment (which of them are None
        # the plan fixes; slopes, sinks and descales are float32 here), and the output strides
        # are the only unplanned ints it sees. q and the dense rows are aligned by tma_rows,
        # the caches by paged_rows.
        call_key = (tuple(dtypes), stride_ot, stride_oh) if ptrs % 16 == 0 else None
        return args, call_key

    def plan_layer(self, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                   alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                   k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor],
                   q_dtype: torch.dtype, rows_dtype: torch.dtype, out_dtype: torch.dtype,
                   q_descale: Optional[torch.Tensor] = None) -> Optional[GluonLayerPlan]:
        """This launch for one layer: its paged caches k / v (None for a dense plan) and
        per-layer tensors as `run` takes them (float32 slopes, sinks and descales), read
        once, for calls with q [T, H * D] of q_dtype, new rows [T, H_kv * D(v)] of
        rows_dtype (where the plan reads them) and a contiguous out [T, H * Dv] of
        out_dtype (`GluonLayerPlan`). None where `run` must take every call: an LSE, tensors
        `run` would convert, or pointers Triton would specialise on."""
        s = self.schedule
        extras = (alibi_slopes, sinks, q_descale, k_descale, v_descale)
        if self.optional != (False, alibi_slopes is not None, sinks is not None) or \
                any(x is not None and x.dtype != torch.float32 for x in extras) or \
                not aligned(k, v, *extras):
            return None
        if _unplanned_descale(self.descaled, q_descale, k_descale, v_descale):
            return None
        ds_strides = (0, 0)
        if self.ones is not None:
            q_descale, k_descale, v_descale, ds_strides = self._descales(
                q_descale, k_descale, v_descale)
        dtypes = [q_dtype, out_dtype]
        if s.paged:
            cache = paged_rows(k, v)
            dtypes += (k.dtype, v.dtype)
        else:
            cache, k, v = NO_CACHE, None, None
        reads_rows = s.dense_new_kv or not s.paged
        if reads_rows:
            dtypes += (rows_dtype, rows_dtype)
        stride_ot, stride_oh = s.num_heads * s.head_size_v, s.head_size_v  # contiguous rows
        layer = (None, *self.metadata, alibi_slopes, sinks, q_descale, k_descale, v_descale,
                 self.work, *self.batch_args)  # Lse, then cu_seqlens_q ... skip_q_len
        tail = (cache.stride_k, cache.stride_v, cache.page_rows, cache.head_rows, cache.cols_k,
                cache.cols_v, self.stride_bt, stride_ot, stride_oh, *ds_strides)
        return GluonLayerPlan(self, (k, v), layer, tail, (tuple(dtypes), stride_ot, stride_oh),
                          q_dtype, rows_dtype if reads_rows else None, out_dtype,
                          cache.rows if s.paged else None)

    def _descales(self, q_descale, k_descale, v_descale) -> tuple:
        """(q, k and v descales, their (batch, KV head) strides) of a plan with descales: per
        (sequence, KV head), or one value broadcast (strides 0); a planned one not given is
        1, one not planned stays None. The kernel indexes all three with one pair of strides:
        where they differ, each is made contiguous."""
        use_q, use_kv = self.descaled
        given = []
        if use_q:
            q_descale = self.ones if q_descale is None else q_descale.float()
            given.append(q_descale)
        if use_kv:
            k_descale = self.ones if k_descale is None else k_descale.float()
            v_descale = self.ones if v_descale is None else v_descale.float()
            given += (k_descale, v_descale)
        strides = {_descale_strides(d) for d in given}
        if len(strides) > 1:
            s = self.schedule

            def contiguous(d):
                return None if d is None else d.expand(s.batch, s.num_kv_heads).contiguous()
            q_descale, k_descale, v_descale = map(contiguous, (q_descale, k_descale, v_descale))
            strides = {(s.num_kv_heads, 1)}
        return q_descale, k_descale, v_descale, strides.pop()


class GluonLayerPlan:
    """A Gluon launch for one layer (`GluonPrefillLaunch.plan_layer`): `call_args` checks a
    call's own tensors (the query, the output, the new rows) and reads their row strides,
    `run` sends them with everything else as planned. What `run` would hand the kernel
    for the same tensors, without reading the caches and per-layer tensors again: a plan
    reused step after step (same-sized steps share their plans) pays its checks once."""

    def __init__(self, plan: GluonPrefillLaunch, caches: tuple, layer: tuple, tail: tuple,
                 call_key: tuple, q_dtype: torch.dtype, rows_dtype: Optional[torch.dtype],
                 out_dtype: torch.dtype, cache_rows: Optional[int]):
        s = plan.schedule
        self.plan, self.caches, self.layer, self.tail, self.call_key = (
            plan, caches, layer, tail, call_key)
        self.q_dtype, self.rows_dtype, self.out_dtype = q_dtype, rows_dtype, out_dtype
        self.cache_rows, self.total_q = cache_rows, s.total_q  # None: dense keys
        self.out_width = s.num_heads * s.head_size_v
        self.empty = s.grid == 0

    def call_args(self, q: torch.Tensor, out: torch.Tensor, k_new: Optional[torch.Tensor],
                  v_new: Optional[torch.Tensor]) -> Optional[tuple]:
        """The call's part of the arguments where q [T, H * D] and the new rows are unit-
        stride rows of the bound dtypes with 16-byte rows and bases and out is contiguous
        [T, H * Dv] of its dtype; else None (the plan's `run` takes the call)."""
        qs = q.stride()
        if len(qs) != 2 or qs[1] != 1 or q.dtype is not self.q_dtype or \
                out.dtype is not self.out_dtype or out.dim() != 2 or \
                out.shape[1] != self.out_width or not out.is_contiguous():
            return None
        ptrs = q.data_ptr() | out.data_ptr() | qs[0] * q.element_size()
        if self.rows_dtype is None:  # a paged cache alone
            return None if ptrs % 16 else (q, None, None, out, qs[0], self.cache_rows, 0, 0)
        if k_new is None or v_new is None or k_new.dtype is not self.rows_dtype or \
                v_new.dtype is not self.rows_dtype:
            return None
        ks, vs = k_new.stride(), v_new.stride()
        size = k_new.element_size()
        if len(ks) != 2 or len(vs) != 2 or ks[1] != 1 or vs[1] != 1 or \
                (ptrs | k_new.data_ptr() | v_new.data_ptr() | ks[0] * size | vs[0] * size) \
                % 16:
            return None
        if self.cache_rows is None:  # dense keys: their rows bound the descriptors
            kv_rows = k_new.shape[0]
            if kv_rows > INT32_MAX:
                return None
        else:  # the new tokens' rows beside the cache: the kernel reads total_q of them
            kv_rows = self.cache_rows
            if min(k_new.shape[0], v_new.shape[0]) < self.total_q:
                return None
        return (q, k_new, v_new, out, qs[0], kv_rows, ks[0], vs[0])

    def run(self, call_args: tuple) -> None:
        """Launch with a call's part of the arguments (`call_args`)."""
        if self.empty:
            return
        q, k_rows, v_rows, out, stride_q, kv_rows, stride_k, stride_v = call_args
        args = (q, k_rows, v_rows, *self.caches, out, *self.layer, stride_q, kv_rows,
                stride_k, stride_v, *self.tail)
        plan = self.plan
        launch_with_scratch(plan.allocate, plan.launcher, args, self.call_key)


def fold_at(*, invariant_split: int, dynamic: bool, head_size: int, head_size_v: int,
            block_n: int, tiles_128: bool) -> int:
    """Where a launch keeps batch-invariant mode's fold state in its Work (float32 words, the
    kernel's FOLD_AT), or -1 where it keeps none. The invariant consumer (invariant_split
    > 0) keeps it in memory where O and a second float32 state do not fit its registers
    beside a tile's S and P (`gluon_invariant.py`'s FOLD): above head 128, and at head 128
    over the 128-key tiles of `SWITCHES.invariant_tiles_128` (tiles_128: the switch gives
    the layer its tiles; in registers ptxas spilled 215-337 words at the split edges,
    KERNEL_NOTES v50), as the decode kernel's FOLD_MEM. The same 128-key tiles named by
    `SWITCHES.invariant_tiles` alone keep the fold in registers, as they do in the decode
    kernel: the one form to measure the other against. The fold's operations are the same
    in memory, so the rows' bits are too. After the item counters (QUEUE_WORDS) of a
    dynamic launch, else from word 0."""
    widest = max(head_size, head_size_v)
    in_memory = widest > 128 or (widest == 128 and block_n == 128 and tiles_128)
    if not invariant_split or not in_memory:
        return -1
    return QUEUE_WORDS if dynamic else 0


def fold_shape(schedule: GluonSchedule) -> Optional[tuple[int, int, int]]:
    """The fold state of a launch that keeps one in memory (FOLD_AT >= 0, `fold_at`), else
    None: [grid, BLOCK_M, Dv] float32, a persistent program's rows. A program folds an
    item's splits and writes its rows before it takes the next item, so the state lives one
    item at a time and a program's rows hold it, whatever the step's token count."""
    c = schedule.constexprs
    if c["FOLD_AT"] < 0:
        return None
    return (schedule.grid, c["BLOCK_M"], schedule.head_size_v)


def work_words(schedule: GluonSchedule) -> int:
    """The float32 words of a launch's Work, the kernel's one argument for its two plan-owned
    buffers: a dynamic launch's item counters (QUEUE_WORDS from word 0), then the fold
    state (`fold_shape`) from FOLD_AT; 0 where the launch needs neither (it passes None)."""
    fold = fold_shape(schedule)
    if fold is not None:
        return schedule.constexprs["FOLD_AT"] + math.prod(fold)
    return QUEUE_WORDS if schedule.constexprs["DYNAMIC"] else 0


def _check_new_rows(k_rows: torch.Tensor, v_rows: torch.Tensor, total_q: int) -> None:
    """The new tokens' rows beside a paged cache: the kernel reads rows [0, total_q) of each
    (rows past them are not read: padding rows may hold anything)."""
    if min(k_rows.shape[0], v_rows.shape[0]) < total_q:
        raise ValueError(f"k_new / v_new have {k_rows.shape[0]} / {v_rows.shape[0]} rows; "
                         f"the plan's {total_q} query tokens need one row each")


def _descale_strides(d: torch.Tensor) -> tuple[int, int]:
    """Per (sequence, KV head) descales [batch, H_kv]; one value broadcasts (strides 0)."""
    if d.numel() == 1:
        return (0, 0)
    if d.dim() != 2:
        raise ValueError(f"descales must be [batch, num_kv_heads] or one value, got shape "
                         f"{tuple(d.shape)}")
    return (d.stride(0), d.stride(1))


def _unplanned_descale(descaled: tuple[bool, bool], q_descale, k_descale,
                       v_descale) -> Optional[str]:
    """Why a descale given is one the plan (`descaled`: q's, k's and v's) was made without,
    or None: `run` raises it (an error, not a silent 1), `plan_layer` leaves the call to `run`."""
    use_q, use_kv = descaled
    if q_descale is not None and not use_q:
        return "q_descale given to a plan made without use_q_descale (an fp8 q's plan takes it)"
    if (k_descale is not None or v_descale is not None) and not use_kv:
        return ("k_descale / v_descale given to a plan made without use_kv_descale (an fp8 "
                "cache's plan takes them)")
    return None


def scratch_or_fresh(scratch: torch.Tensor, size: int, alignment: int) -> torch.Tensor:
    """What a launch's Triton global-scratch allocator returns: its planned `scratch` (the
    programs write their descriptors there first thing, so launches in one stream order
    share it), or a fresh buffer should a compile ask for more or other alignment."""
    if size <= scratch.numel() and scratch.data_ptr() % alignment == 0:
        return scratch
    return torch.empty(size, dtype=torch.uint8, device=scratch.device)


def launch_with_scratch(allocate: Callable, launcher: Callable, args: tuple, call_key) -> None:
    """`launcher(args, call_key)` with Triton's global-scratch allocator set to `allocate`,
    in a copy of the caller's context, so the caller's own allocator stays as it was."""
    contextvars.copy_context().run(_set_allocator_and_launch, allocate, launcher, args,
                                   call_key)


def _set_allocator_and_launch(allocate, launcher, args, call_key) -> None:
    triton.set_allocator(allocate)
    launcher(args, call_key)


class _Launch(KernelLaunch):
    """The kernel on the schedule's grid (4 warps: the default partition, consumer 0)."""

    def __init__(self, plan_key: Optional[tuple], schedule: GluonSchedule,
                 device: torch.device):
        # The invariant consumer rounds as the `tl` invariant pass: no fused multiply-adds.
        options = dict(enable_fp_fusion=False) if schedule.constexprs.get("INVARIANT_SPLIT") \
            else None
        super().__init__(gluon_prefill.gluon_prefill_kernel, (schedule.grid,),
                         schedule.constexprs, num_warps=4, num_stages=3,
                         plan_key=plan_key or (), device=device, options=options)
        self.unkeyed = plan_key is None

    def __call__(self, args: tuple, call_key: Optional[tuple]) -> None:
        super().__call__(args, None if self.unkeyed else call_key)
