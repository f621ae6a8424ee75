"""The Gluon decode pass on Hopper: plan once per batch, launch per layer.

`plan_gluon_decode(...)` decides whether the warp-specialised decode kernel of
`gluon_decode.py` can serve a batch's decodes (`why_not_decode`: sm_90 with Triton 3.6's
Gluon, a paged cache, a 16-bit q over a cache of its dtype or an e4m3 q over an e4m3 cache,
head sizes 64/128/256, no ALiBi) and returns a `GluonDecodeLaunch` (its P V and O rescale
by switch: `gluon_decode_tiles.fp8_pv`, `max_slack`), or None (the plan then keeps the `tl`
decode pass). The grid is the `tl` decode pass's, (batch, KV heads, splits), with its split
count (`launch.decode_config`): a split launch writes the plan's float32 partial states,
which the plan's reduce launch merges. With `SWITCHES.gluon_decode_persistent` the launch
is the persistent form's (`PersistentDecodeLaunch`: min(units, programs a SM x SMs)
programs walking the units), and a step of decodes alone takes that form's split count
(`persistent_decode_splits`).

`GluonDecodeLaunch.run(q, k, v, out, ...)` reads the layer's pointers and strides and
launches through `fast_launch` (the producer builds its tensor descriptors on the device, so
the host encodes none and a graph replays it with new lengths); it reads no device value.
`plan_layer` reads a layer's part of the arguments once for its eager calls
(`gluon_decode_layer.DecodeLayerPlan`), which then place only the query and the output.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from pagedattn.ops.triton import gluon_decode_tiles as tiles
from pagedattn.ops.triton import gluon_decode_units as units
from pagedattn.ops.triton.attention_gluon import gluon_available, score_floats
from pagedattn.ops.triton.fast_launch import KernelLaunch, aligned
from pagedattn.ops.triton.gluon_decode_layer import DecodeLayerArgs, DecodeLayerPlan
from pagedattn.ops.triton.gluon_launch import launch_with_scratch, scratch_or_fresh
from pagedattn.ops.triton.launch import SWITCHES, sm_count
from pagedattn.ops.triton.tma_views import paged_rows, tma_rows

try:
    import triton
except ImportError:  # a CPU install without Triton
    triton = None
try:  # Triton 3.6's Gluon (why_not_decode says where it cannot run)
    from pagedattn.ops.triton import gluon_decode, gluon_decode_persistent
except Exception:  # noqa: BLE001 - any import failure means "this install cannot serve"
    gluon_decode = gluon_decode_persistent = None

HEAD_SIZES = (64, 128, 256)
MAX_ROWS = tiles.ROWS  # the kernel's one wgmma tile of rows
# Global scratch per program: two device-built tensor descriptors of 128 bytes (K and V)
SCRATCH_PER_PROGRAM = 2 * 128
_16BIT = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=8)
def _sm90(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


def why_not_decode(*, device: torch.device, num_heads: int, num_kv_heads: int, head_size: int,
                   head_size_v: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                   out_dtype: torch.dtype, paged: bool, page_size: int, decode_queries: int,
                   use_alibi: bool, use_q_descale: bool, use_kv_descale: bool) -> list[str]:
    """Reasons the Gluon decode pass cannot serve these shapes and features ([] = it can);
    the `tl` decode pass serves what it refuses. decode_queries: the decode pass's query
    tokens a request at most (`tile_math.decode_query_count`)."""
    reasons = []
    if device.type != "cuda" or not _sm90(device):
        reasons.append(f"device {device} is not an sm_90 GPU")
    if not gluon_available() or gluon_decode is None:
        reasons.append(f"Triton {getattr(triton, '__version__', None)} has no Gluon 3.6 API")
    if not paged:
        reasons.append("dense keys: the pass reads a paged cache")
    if not ((q_dtype in _16BIT and kv_dtype == q_dtype) or
            (q_dtype == torch.float8_e4m3fn and kv_dtype == torch.float8_e4m3fn)):
        reasons.append(f"q {q_dtype} / kv {kv_dtype}: needs a 16-bit q over a cache of its "
                       "dtype, or an e4m3 q over an e4m3 cache (the `tl` pass keeps e5m2 and "
                       "a 16-bit q over an fp8 cache)")
    if q_dtype == torch.float8_e4m3fn and out_dtype not in (*_16BIT, torch.float32):
        reasons.append(f"out dtype {out_dtype}: an fp8 q needs a 16- or 32-bit output")
    if head_size != head_size_v or head_size not in HEAD_SIZES:
        reasons.append(f"head sizes {head_size}/{head_size_v}: needs one of {HEAD_SIZES} "
                       "for both")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        reasons.append(f"{num_heads} heads over {num_kv_heads} KV heads")
    else:
        group_pad = 1 << (num_heads // num_kv_heads - 1).bit_length()
        if group_pad * decode_queries > MAX_ROWS:
            reasons.append(f"{decode_queries} queries x GQA group {num_heads // num_kv_heads} "
                           f"(padded {group_pad}) exceed the kernel's {MAX_ROWS} rows")
    if page_size < 8 or page_size & (page_size - 1):
        reasons.append(f"page size {page_size} is not a power of 2 >= 8 (TMA boxes)")
    if use_alibi:
        reasons.append("ALiBi: the `tl` decode pass keeps it (its distances cost registers "
                       "the kernel has not been measured with)")
    if use_q_descale and q_dtype not in (torch.float8_e4m3fn,):
        reasons.append(f"q descale with a {q_dtype} q")
    if use_kv_descale and kv_dtype not in (torch.float8_e4m3fn,):
        reasons.append(f"k/v descales with a {kv_dtype} cache")
    return reasons


def decode_constexprs(*, num_heads: int, num_kv_heads: int, head_size: int, page_size: int,
                      decode_queries: int, kv_fp8: bool, causal: bool, window_left: int,
                      window_right: int, softcap: float, split: bool, write_lse: bool,
                      use_sinks: bool, per_sm: int = 1, fp8_pv: bool = False,
                      max_slack: int = -1) -> dict:
    """The kernel's constexprs (host ints alone); per_sm: programs a SM (`decode_tiles`)."""
    group = num_heads // num_kv_heads
    block_n, num_buf, stages, worker_regs = gluon_decode_tiles(head_size, kv_fp8, per_sm)
    return dict(
        NUM_KV=num_kv_heads, GROUP=group, GROUP_PAD=1 << (group - 1).bit_length(),
        QUERIES=decode_queries, HEAD_D=head_size, HEAD_DV=head_size, PAGE=page_size,
        BLOCK_N=block_n, NUM_BUF=num_buf, STAGES=stages, WINDOW_LEFT=window_left >= 0,
        WINDOW_RIGHT=causal or window_right >= 0, USE_SOFTCAP=softcap > 0,
        USE_SINKS=use_sinks, WRITE_LSE=write_lse and not split, SPLIT_KV=split,
        KV_FP8=kv_fp8, KV_DESCALE=kv_fp8, Q_DESCALE=kv_fp8, SCALE_IN_EXP=softcap <= 0,
        WORKER_REGS=worker_regs, PV_FP8=kv_fp8 and fp8_pv, MAX_SLACK=max_slack)


def gluon_decode_tiles(head_size: int, kv_fp8: bool, per_sm: int = 1) -> tuple[int, ...]:
    """(BLOCK_N, NUM_BUF, STAGES, WORKER_REGS): `gluon_decode_tiles.decode_tiles`."""
    return tiles.decode_tiles(head_size, kv_fp8, per_sm)


def programs_per_sm(head_size: int, kv_fp8: bool) -> int:
    """`SWITCHES.gluon_decode_per_sm` (1 or 2; None: 2) where tiles for it exist, else 1."""
    wanted = SWITCHES.gluon_decode_per_sm
    if wanted not in (None, 1, 2):
        raise ValueError(f"SWITCHES.gluon_decode_per_sm must be None, 1 or 2, got {wanted!r}")
    return tiles.per_sm_served(head_size, kv_fp8, 2 if wanted is None else wanted)


# The keys a split must stream before the Gluon decode pass beats the `tl` one: its programs'
# start-up (descriptors, barriers, the ring's fill) is longer (H200, e4m3: 0.87x at B1 L32k's
# 668-key splits, 1.02-1.17x from 1,024; KERNEL_NOTES v29).
GLUON_DECODE_MIN_KEYS = units.MIN_KEYS


def takes_decodes(*, q_dtype: torch.dtype, kv_dtype: torch.dtype, max_seqlen_k: int,
           num_splits: int) -> bool:
    """Whether a plan should take the Gluon decode pass where it serves:
    `SWITCHES.gluon_decode`, or with None where it measured faster than the `tl` pass, in
    splits of GLUON_DECODE_MIN_KEYS keys or more: an e4m3 q over an e4m3 cache (H200: the
    grid form 1.02-1.17x, the persistent one 1.16-1.29x), and with the persistent form a
    16-bit q over its own cache too (1.00-1.05x; the grid form 0.96-1.01x keeps the `tl`
    pass there). KERNEL_NOTES v29, v33."""
    switch = SWITCHES.gluon_decode
    if switch is not None:
        return bool(switch)
    fp8 = q_dtype == kv_dtype == torch.float8_e4m3fn
    sixteen = SWITCHES.gluon_decode_persistent and q_dtype == kv_dtype and \
        q_dtype in (torch.float16, torch.bfloat16)
    return (fp8 or sixteen) and max_seqlen_k >= GLUON_DECODE_MIN_KEYS * max(num_splits, 1)


class GluonDecodeLaunch:
    """One batch's launch of the Gluon decode kernel; `run` takes a layer's tensors.

    grid (batch, KV heads, splits); floats (qk_scale, softcap) with log2(e) folded in;
    window (left, right; right 0 for causal); partials: the plan's split scratch (PartOut
    [splits, total_q, H, Dv], PartLse [splits, total_q, H] float32) where splits > 1, which
    the plan's reduce launch then merges. The kernel is compiled per (LSE given, sinks
    given) as run() is called (a plan may be made before it knows either). options: compile
    options (maxnreg for two programs a SM). num_splits: the launch's split count where the
    grid does not say it (the persistent form's; None: grid[2])."""

    def __init__(self, *, grid: tuple, constexprs: dict, floats: tuple, window: tuple,
                 total_q: int, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                 block_table: torch.Tensor, partials: Optional[tuple] = None,
                 options: Optional[dict] = None, num_splits: Optional[int] = None):
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k),
                        ("block_table", block_table)):
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        self.grid, self.constexprs = grid, dict(constexprs)
        self.options = dict(options or {})
        self.floats, self.window, self.total_q = floats, window, total_q
        self.metadata = (cu_seqlens_q, seqused_k, block_table)
        self.partials = partials
        self.num_splits = grid[2] if num_splits is None else num_splits
        self.split = self.num_splits > 1
        if self.split != (partials is not None):
            raise ValueError("a split launch writes partials, an unsplit one the outputs")
        device = cu_seqlens_q.device
        self.device = device
        self.scratch = torch.empty(max(math.prod(grid), 1) * SCRATCH_PER_PROGRAM,
                                   dtype=torch.uint8, device=device)
        self.ones = torch.ones((), dtype=torch.float32, device=device)
        self._launches: dict[tuple, KernelLaunch] = {}

    def allocate(self, size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
        """Triton's global scratch allocator for this launch (each program writes its two
        descriptors first thing; launches in one stream order share the scratch)."""
        return scratch_or_fresh(self.scratch, size, alignment)

    def kernel(self):
        """The Gluon kernel this launch compiles (a subclass may launch another of the same
        arguments)."""
        return gluon_decode.gluon_decode_kernel

    def launch_for(self, write_lse: bool, sinks: bool) -> KernelLaunch:
        """The kernel launch of these choices (made once each)."""
        key = (write_lse and not self.split, sinks)
        launch = self._launches.get(key)
        if launch is None:
            c = dict(self.constexprs, WRITE_LSE=key[0], USE_SINKS=sinks)
            plan_key = tuple((t.dtype, t.data_ptr() % 16 == 0) for t in self.metadata)
            launch = KernelLaunch(self.kernel(), self.grid, c, num_warps=4, num_stages=1,
                                  plan_key=plan_key, device=self.device, options=self.options)
            self._launches[key] = launch
        return launch

    def layer_args(self, k, v, sinks=None, q_descale=None, k_descale=None, v_descale=None,
                   descale_head: int = 0) -> DecodeLayerArgs:
        """The arguments a layer's tensors fix (`DecodeLayerArgs`): k / v the paged cache,
        sinks [H] float32 or None, descales as `kernel_args` takes them."""
        c = self.constexprs
        if c["KV_FP8"]:
            q_descale = self.ones if q_descale is None else q_descale
            k_descale = self.ones if k_descale is None else k_descale
            v_descale = self.ones if v_descale is None else v_descale
            if q_descale.numel() == 1 or k_descale.numel() == 1 or v_descale.numel() == 1:
                if descale_head:  # a one-value descale beside per-head ones: expand it
                    shape = (self.metadata[1].shape[0], c["NUM_KV"])
                    q_descale, k_descale, v_descale = (
                        d.reshape(1, 1).expand(shape).contiguous() if d.numel() == 1 else d
                        for d in (q_descale, k_descale, v_descale))
        else:
            q_descale = k_descale = v_descale = None
        cache = paged_rows(k, v)
        ptrs = 0
        for t in (sinks, q_descale, k_descale, v_descale):
            ptrs |= 0 if t is None else t.data_ptr()
        return DecodeLayerArgs(
            caches=(k, v),
            batch=(*self.metadata, sinks, q_descale, k_descale, v_descale, *self.floats,
                   *self.window, self.total_q, self.num_splits),
            cache_rows=(cache.rows, cache.stride_k, cache.stride_v, cache.page_rows,
                        cache.head_rows, cache.cols_k, cache.cols_v,
                        self.metadata[2].stride(0)),
            tail=(c["NUM_KV"] * descale_head, descale_head, *self.form_args()),
            kv_dtypes=(k.dtype, v.dtype), no_q_descale=q_descale is None, ptrs=ptrs)

    def form_args(self) -> tuple:
        """The runtime arguments after the descale strides: none in this form."""
        return ()

    def kernel_args(self, q, k, v, out, lse=None, sinks=None, q_descale=None,
                    k_descale=None, v_descale=None, descale_head: int = 0) -> tuple:
        """(the kernel's runtime arguments in signature order, the fast launch's call key or
        None): descales [batch, H_kv] contiguous (descale_head 1) or one value (0), as the
        plan's `_descales` hands them; a missing one of an fp8 launch is 1."""
        layer = self.layer_args(k, v, sinks, q_descale, k_descale, v_descale, descale_head)
        q, stride_qt = tma_rows(q)
        if self.split:
            target, target_lse = self.partials
            stride_ot = stride_oh = 0
        else:
            os_ = out.stride()
            if os_[-1] != 1:
                raise ValueError(f"out must have unit stride on head_size_v, got {os_}")
            stride_ot, stride_oh = (os_[0], self.constexprs["HEAD_DV"]) if len(os_) == 2 \
                else os_[:2]
            target, target_lse = out, lse
        ptrs = target.data_ptr() | (0 if target_lse is None else target_lse.data_ptr())
        return (layer.args(q, stride_qt, target, target_lse, stride_ot, stride_oh),
                layer.call_key(q.dtype, target.dtype, ptrs, stride_ot, stride_oh))

    def plan_layer(self, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                   q_descale: Optional[torch.Tensor], k_descale: Optional[torch.Tensor],
                   v_descale: Optional[torch.Tensor], *, q_dtype: torch.dtype,
                   out_dtype: torch.dtype) -> Optional[DecodeLayerPlan]:
        """This launch for one layer: its paged caches k / v and per-layer tensors as `run`
        takes them without an LSE, read once, for calls with q [T, H * D] of q_dtype and a
        contiguous out [T, H * Dv] of out_dtype (`DecodeLayerPlan`). None where `run` must
        take every call: sinks it would convert, descales other than one value each (float32;
        the plan lays out per-head ones each call), unaligned tensors, a cache without a TMA
        row view."""
        extras = (sinks, q_descale, k_descale, v_descale)
        if any(x is not None and x.dtype != torch.float32 for x in extras) or \
                any(d is not None and d.numel() != 1 and any(d.stride())
                    for d in extras[1:]) or not aligned(k, v, *extras):
            return None
        try:
            layer = self.layer_args(k, v, sinks, q_descale, k_descale, v_descale)
        except ValueError:  # no row view of this cache: `run` raises it for each call
            return None
        c = self.constexprs
        return DecodeLayerPlan(layer, self.launch_for(False, sinks is not None), self.allocate,
                               self.partials, q_dtype, out_dtype,
                               c["NUM_KV"] * c["GROUP"] * c["HEAD_DV"], c["HEAD_DV"])

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
            q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
            v_descale: Optional[torch.Tensor] = None, descale_head: int = 0) -> None:
        """q [total_q, H, D] (or rows [total_q, H * D]); k / v: the paged cache [blocks,
        PAGE, H_kv, D] (NHD or HND strides); out [total_q, H, Dv]; lse [H, total_q] float32
        or None (a split launch leaves both to the reduce); sinks [H] float32 or None;
        descales float32 as `kernel_args` takes them."""
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        args, call_key = self.kernel_args(q, k, v, out, lse, sinks, q_descale, k_descale,
                                          v_descale, descale_head)
        launch = self.launch_for(lse is not None, sinks is not None)
        launch_with_scratch(self.allocate, launch, args, call_key)


class PersistentDecodeLaunch(GluonDecodeLaunch):
    """The persistent form's launch (`gluon_decode_persistent.py`): grid (programs,), each
    program walking units of the batch x KV heads x num_splits; the same runtime arguments
    as the other form's plus the batch and the grid, the same partials and reduce."""

    def __init__(self, *, batch: int, programs: int, num_splits: int, **kw):
        if batch <= 0 or programs <= 0 or num_splits <= 0:
            raise ValueError(f"batch={batch}, programs={programs} and num_splits={num_splits} "
                             "must be > 0")
        super().__init__(grid=(programs,), num_splits=num_splits, **kw)
        self.batch, self.programs = batch, programs

    def kernel(self):
        """The persistent kernel."""
        return gluon_decode_persistent.gluon_decode_persistent_kernel

    def form_args(self) -> tuple:
        """The other form's arguments are followed by batch and programs."""
        return self.batch, self.programs


def persistent_decode_splits(*, max_seqlen_k: int, num_splits: int, batch: int,
                             **why) -> int:
    """The split count of a step of decodes alone: with `SWITCHES.gluon_decode_persistent`,
    where the Gluon decode pass serves (`why_not_decode(**why)`) and takes the step at that
    count (`takes_decodes`), the persistent form's (`gluon_decode_units.persistent_splits`
    over the SMs and this head's programs a SM); else num_splits (the `tl` pass's)."""
    if not SWITCHES.gluon_decode_persistent or why_not_decode(**why):
        return num_splits
    fp8 = why["kv_dtype"] == torch.float8_e4m3fn
    splits = units.persistent_splits(
        sm_count(why["device"]), programs_per_sm(why["head_size"], fp8),
        batch * why["num_kv_heads"], max_seqlen_k, GLUON_DECODE_MIN_KEYS)
    if takes_decodes(q_dtype=why["q_dtype"], kv_dtype=why["kv_dtype"],
                     max_seqlen_k=max_seqlen_k, num_splits=splits):
        return splits
    return num_splits


def plan_gluon_decode(*, device: torch.device, cu_seqlens_q: torch.Tensor,
                      seqused_k: torch.Tensor, block_table: Optional[torch.Tensor],
                      batch: int, total_q: int, num_heads: int, num_kv_heads: int,
                      head_size: int, head_size_v: int, page_size: int, q_dtype: torch.dtype,
                      kv_dtype: torch.dtype, out_dtype: torch.dtype, softmax_scale: float,
                      causal: bool, window_left: int, window_right: int, softcap: float,
                      use_alibi: bool, use_q_descale: bool, use_kv_descale: bool,
                      decode_queries: int, num_splits: int,
                      partials: Optional[tuple] = None,
                      persistent: Optional[bool] = None) -> Optional[GluonDecodeLaunch]:
    """The Gluon decode launch for a batch's decodes (requests of at most decode_queries
    queries), or None where it cannot serve (`why_not_decode`). num_splits: the plan's count
    (`launch.decode_config`, or `persistent_decode_splits`); partials (PartOut, PartLse): the
    plan's split scratch, given where num_splits > 1. persistent: the persistent form
    (None: `SWITCHES.gluon_decode_persistent`), on min(units, programs a SM x SMs)
    programs."""
    if why_not_decode(device=device, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_size=head_size, head_size_v=head_size_v, q_dtype=q_dtype,
                      kv_dtype=kv_dtype, out_dtype=out_dtype, paged=block_table is not None,
                      page_size=page_size, decode_queries=decode_queries,
                      use_alibi=use_alibi, use_q_descale=use_q_descale,
                      use_kv_descale=use_kv_descale):
        return None
    kv_fp8 = kv_dtype == torch.float8_e4m3fn
    per_sm = programs_per_sm(head_size, kv_fp8)
    if SWITCHES.gluon_decode_persistent if persistent is None else persistent:
        count = batch * num_kv_heads * num_splits
        make = functools.partial(
            PersistentDecodeLaunch, batch=batch, num_splits=num_splits,
            programs=units.persistent_programs(count, sm_count(device), per_sm))
    else:
        make = functools.partial(GluonDecodeLaunch, grid=(batch, num_kv_heads, num_splits))
    return make(
        options={"maxnreg": tiles.TWO_PER_SM_MAXNREG} if per_sm == 2 else None,
        constexprs=decode_constexprs(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            page_size=page_size, decode_queries=decode_queries, kv_fp8=kv_fp8, causal=causal,
            window_left=window_left, window_right=window_right, softcap=softcap,
            split=num_splits > 1, write_lse=False, use_sinks=False, per_sm=per_sm,
            fp8_pv=tiles.fp8_pv(SWITCHES.gluon_decode_fp8_pv),
            max_slack=tiles.max_slack(SWITCHES.gluon_decode_max_slack)),
        floats=score_floats(softmax_scale, softcap),
        window=decode_window(causal, window_left, window_right), total_q=total_q,
        cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table,
        partials=partials if num_splits > 1 else None)


def decode_window(causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """(left, right) windows; causality is a right window of 0 (a wider one changes nothing)."""
    right = (min(window_right, 0) if window_right >= 0 else 0) if causal else window_right
    return max(window_left, 0), max(right, 0)
