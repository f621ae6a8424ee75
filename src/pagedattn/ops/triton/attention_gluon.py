"""The Gluon prefill pass on Hopper: plan once from host ints, launch per layer.

`plan_gluon_prefill(...)` decides whether the warp-specialised kernel of `gluon_prefill.py`
can serve a batch (sm_90, Triton 3.6's Gluon API, 16-bit q and K/V of one dtype, head sizes
64/128/256, no fp8 descales) and fixes its schedule: a persistent grid of at most one program
per SM walking (query block, head) work items, heaviest causal block first. It returns None
where the kernel cannot serve; the caller then keeps the `tl` passes.

`GluonPrefillLaunch.run(...)` builds five tensor descriptors (Q; dense K/V rows; the paged
cache as 2-D rows) and launches once: O(1) host work, about 5 x (a Python descriptor object
and the driver's tensor-map encoding, a few microseconds each) plus Triton's launch path.
It reads no device value on the host, so a step's plan runs for every layer and under CUDA
graphs (descriptors are encoded at launch, i.e. once per capture).

Keys: `cu_seqlens_k` rows for a dense varlen batch; for a paged batch the context comes from
the cache page by page and, with `dense_new_kv`, the new tokens from `k_new` / `v_new`
([total_q, num_kv_heads, head_size(_v)], the rows the layer just wrote). Caches in NHD or
HND order both work: a page of one KV head must be PAGE rows of the cache viewed 2-D.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

try:
    import triton
except ImportError:  # a CPU install without Triton
    triton = None
try:  # Gluon ships with Triton 3.5+; its Hopper API as used here is Triton 3.6's
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from pagedattn.ops.triton import gluon_prefill
    from pagedattn.ops.triton.gluon_schedule import BLOCK_M, config_for
except Exception:  # noqa: BLE001 - any import failure means "this install cannot serve"
    gluon_prefill = None

LOG2E = 1.4426950408889634
GLUON_TRITON = "3.6."  # the Gluon API the kernel is written for (later releases rename it)
HEAD_SIZES = (64, 128, 256)


def gluon_available() -> bool:
    """True where this install can compile the kernel: Triton 3.6 with Gluon importable."""
    return gluon_prefill is not None and triton.__version__.startswith(GLUON_TRITON)


@functools.lru_cache(maxsize=8)
def _sm90(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class GluonPrefillLaunch:
    """One batch's launch of the Gluon prefill kernel; `run` takes the layer's tensors."""

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

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
            sinks: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
            seqused_k: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor] = None,
            block_table: Optional[torch.Tensor] = None, k_new: Optional[torch.Tensor] = None,
            v_new: Optional[torch.Tensor] = None) -> None:
        """q [total_q, H, D]; k / v: the paged cache [num_blocks, PAGE, H_kv, D(v)] (logical
        view) or dense keys [total_k, H_kv, D(v)]; out [total_q, H, Dv]; lse [H, total_q]
        float32 (planned with write_lse); alibi_slopes / sinks [H] float32; cu_seqlens_q
        [batch + 1], seqused_k [batch] int32; cu_seqlens_k [batch + 1] for dense keys;
        block_table [batch, pages] int32 for a paged cache; k_new / v_new the new tokens'
        keys and values [total_q, H_kv, D(v)] for a plan made with dense_new_kv."""
        if self.grid == 0:
            return
        if self.paged and block_table is None:
            raise ValueError("a paged plan needs block_table [batch, pages] int32")
        if not self.paged and cu_seqlens_k is None:
            raise ValueError("dense keys need cu_seqlens_k [batch + 1] int32")
        bn = self.constexprs["BLOCK_N"]
        d, dv = self.head_size, self.head_size_v
        desc_q = _descriptor(_rows(q), [BLOCK_M // 2, d])
        if self.paged:
            box = min(self.page_size, bn)
            kc, vc, cache_rows, page_rows, head_rows, cols_k, cols_v = paged_rows(k, v)
            desc_kc = _descriptor(kc, [box, d])
            desc_vc = _descriptor(vc, [box, dv])
            if self.dense_new_kv:
                if k_new is None or v_new is None:
                    raise ValueError("this plan reads the new tokens' keys and values as dense "
                                     "rows: pass k_new and v_new to run()")
                k_rows, v_rows = _rows(k_new), _rows(v_new)
            else:  # never read (one phase of pages), but the kernel takes their box shape
                k_rows, v_rows = kc, vc
            table = block_table
            stride_bt = block_table.stride(0)
        else:
            k_rows, v_rows = _rows(k), _rows(v)
            cache_rows, page_rows, head_rows, cols_k, cols_v = 0, 0, 0, d, dv
            table, stride_bt = cu_seqlens_q, 0
        desc_k = _descriptor(k_rows, [bn, d])
        desc_v = _descriptor(v_rows, [bn, dv])
        if not self.paged:
            desc_kc, desc_vc = desc_k, desc_v
        if out.stride(-1) != 1:
            raise ValueError(f"out must have unit stride on head_size_v, got {out.stride()}")
        if lse is not None and lse.stride() != (self.total_q, 1):
            raise ValueError(f"lse must be a contiguous [num_heads, total_q], got strides "
                             f"{lse.stride()}")
        if alibi_slopes is not None and alibi_slopes.dtype != torch.float32:
            alibi_slopes = alibi_slopes.float()
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        gluon_prefill.gluon_prefill_kernel[(self.grid,)](
            desc_q, desc_k, desc_v, desc_kc, desc_vc, out,
            lse if lse is not None else cu_seqlens_q,
            cu_seqlens_q, seqused_k, cu_seqlens_k if cu_seqlens_k is not None else cu_seqlens_q,
            table, alibi_slopes if alibi_slopes is not None else cu_seqlens_q,
            sinks if sinks is not None else cu_seqlens_q,
            *self.floats, *self.window, self.batch, self.total_q, self.num_items, self.grid,
            self.skip_q_len, out.stride(0), out.stride(1), stride_bt, cache_rows, page_rows,
            head_rows, cols_k, cols_v, **self.constexprs, num_warps=4)


def plan_gluon_prefill(*, device: torch.device, batch: int, total_q: int, max_seqlen_q: int,
                       max_seqlen_k: int, num_heads: int, num_kv_heads: int, head_size: int,
                       head_size_v: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                       causal: bool, window_left: int, window_right: int, softcap: float,
                       use_alibi: bool, use_sinks: bool, write_lse: bool, paged: bool,
                       page_size: int, dense_new_kv: bool, softmax_scale: float,
                       out_dtype: Optional[torch.dtype] = None, use_q_descale: bool = False,
                       use_kv_descale: bool = False, skip_q_len: int = 0,
                       cuda_graph: bool = False) -> Optional[GluonPrefillLaunch]:
    """The Gluon pass's launch for a batch, or None where it cannot serve (`why_not`).

    skip_q_len: requests of at most this many queries are left to another pass (the plan's
    decode pass). cuda_graph: the launch serves any later batch of at most `batch` requests
    of at most `max_seqlen_q` queries (grid and items are bounds from these ints and each
    program finds its work on the device), so the flag changes nothing here; it is accepted
    so the caller can pass its planning keywords through.
    """
    if why_not(device=device, num_heads=num_heads, num_kv_heads=num_kv_heads,
               head_size=head_size, head_size_v=head_size_v, q_dtype=q_dtype,
               kv_dtype=kv_dtype, out_dtype=out_dtype, paged=paged, page_size=page_size,
               use_q_descale=use_q_descale, use_kv_descale=use_kv_descale):
        return None
    return launch_config(
        sm_count=_sm_count(device), batch=batch, total_q=total_q, max_seqlen_q=max_seqlen_q,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        head_size_v=head_size_v, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, use_alibi=use_alibi, use_sinks=use_sinks,
        write_lse=write_lse, paged=paged, page_size=page_size, dense_new_kv=dense_new_kv,
        softmax_scale=softmax_scale, skip_q_len=skip_q_len)


def launch_config(*, sm_count: int, batch: int, total_q: int, max_seqlen_q: int,
                  num_heads: int, num_kv_heads: int, head_size: int, head_size_v: int,
                  causal: bool, window_left: int, window_right: int, softcap: float,
                  use_alibi: bool, use_sinks: bool, write_lse: bool, paged: bool,
                  page_size: int, dense_new_kv: bool, softmax_scale: float,
                  skip_q_len: int = 0) -> GluonPrefillLaunch:
    """The schedule and switches of a launch, from host ints alone (no device query)."""
    block_m = BLOCK_M
    block_n, num_buf, consumer_regs, producer_regs = config_for(max(head_size, head_size_v))
    # Work items: (slot, head). LPT across requests: slot = (r, request), block r of every
    # request before block r + 1 of any (exact longest-first for equal lengths). It spans
    # batch x max blocks slots, most of them empty when one long request rides with many
    # short ones; then the compact slots of the `tl` pass (total_q / 128 + batch).
    compact = total_q // block_m + batch
    lpt_slots = batch * math.ceil(max_seqlen_q / block_m)
    lpt_across = lpt_slots <= 2 * compact
    num_items = num_heads * (lpt_slots if lpt_across else compact)
    if batch == 0 or total_q == 0 or max_seqlen_q <= skip_q_len:
        num_items = 0
    scale_in_exp = softcap <= 0 and not use_alibi and softmax_scale > 0
    if softcap > 0:  # scores become softcap * tanh(scale * qk / softcap), in log2 units
        floats = (softmax_scale / softcap, softcap * LOG2E)
    else:
        floats = (softmax_scale * LOG2E, 0.0)
    # Causality is a right window of 0 (a wider right window changes nothing then).
    right = (min(window_right, 0) if window_right >= 0 else 0) if causal else window_right
    constexprs = dict(
        NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_D=head_size,
        HEAD_DV=head_size_v, PAGE=page_size if paged else block_n, BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_BUF=num_buf, WINDOW_LEFT=window_left >= 0,
        WINDOW_RIGHT=causal or window_right >= 0, USE_ALIBI=use_alibi,
        USE_SOFTCAP=softcap > 0, USE_SINKS=use_sinks, WRITE_LSE=write_lse, PAGED=paged,
        SPLIT_AT_CONTEXT=not paged or dense_new_kv, LPT_ACROSS=lpt_across,
        SCALE_IN_EXP=scale_in_exp, PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs)
    return GluonPrefillLaunch(
        grid=min(num_items, sm_count), num_items=num_items, batch=batch, total_q=total_q,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        head_size_v=head_size_v, page_size=page_size, paged=paged,
        dense_new_kv=paged and dense_new_kv, floats=floats, window=(window_left, right),
        skip_q_len=skip_q_len, constexprs=constexprs)


def why_not(*, device: torch.device, num_heads: int, num_kv_heads: int, head_size: int,
            head_size_v: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
            out_dtype: Optional[torch.dtype], paged: bool, page_size: int,
            use_q_descale: bool, use_kv_descale: bool) -> list[str]:
    """Reasons the Gluon pass cannot serve these shapes and features ([] = it can)."""
    reasons = []
    if device.type != "cuda" or not _sm90(device):
        reasons.append(f"device {device} is not an sm_90 GPU")
    if not gluon_available():
        reasons.append(f"Triton {getattr(triton, '__version__', None)} has no Gluon "
                       f"{GLUON_TRITON}x API")
    if q_dtype not in (torch.float16, torch.bfloat16) or kv_dtype != q_dtype:
        reasons.append(f"q {q_dtype} / kv {kv_dtype}: needs one 16-bit dtype")
    if out_dtype is not None and not out_dtype.is_floating_point:
        reasons.append(f"out dtype {out_dtype} is not a float type")
    if head_size not in HEAD_SIZES or head_size_v not in HEAD_SIZES:
        reasons.append(f"head sizes {head_size}/{head_size_v} not in {HEAD_SIZES}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        reasons.append(f"{num_heads} heads over {num_kv_heads} KV heads")
    if paged and (page_size < 8 or page_size & (page_size - 1)):
        reasons.append(f"page size {page_size} is not a power of 2 >= 8 (TMA boxes)")
    if use_q_descale or use_kv_descale:
        reasons.append("fp8 descales")
    return reasons


def _descriptor(x2: torch.Tensor, block: list[int]):
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[x2.dtype])
    return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), block, layout)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, d] as the 2-D [rows, heads * d] a descriptor walks; a layout TMA cannot
    take (heads not packed, rows not 16-byte aligned) is copied once."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2] or \
            (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous()
    return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))


def paged_rows(k: torch.Tensor, v: torch.Tensor):
    """The paged caches [num_blocks, PAGE, H_kv, D] (logical view) as 2-D rows in which the
    PAGE slots of one block and KV head are consecutive rows: an NHD row is one slot of every
    head (head h at column h * stride_h), an HND row one slot of one head (head h at
    stride_h / stride_slot rows). Returns (k rows, v rows, rows, rows per block, rows per
    head, columns per head of k, of v)."""
    views = []
    for x in (k, v):
        num_blocks, _, heads, d = x.shape
        sb, ss, sh, sd = x.stride()
        nhd = sh < ss or heads == 1
        head_rows, head_cols = (0, sh) if nhd else (sh // ss, 0)
        if sd != 1 or sb % ss or (not nhd and sh % ss) or (ss * x.element_size()) % 16 \
                or x.data_ptr() % 16:
            raise ValueError(f"cache strides {x.stride()} do not view as rows of consecutive "
                             "slots per block and KV head (NHD or HND, 16-byte aligned rows)")
        rows = num_blocks * (sb // ss)
        views.append((x.as_strided((rows, (heads - 1) * head_cols + d), (ss, 1)), rows,
                      sb // ss, head_rows, head_cols))
    (kc, rows, page_rows, head_rows, cols_k), (vc, *v_rows, cols_v) = views
    if [rows, page_rows, head_rows] != v_rows or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v caches need one layout of blocks and heads: shapes "
                         f"{tuple(k.shape)} / {tuple(v.shape)}, strides {k.stride()} / "
                         f"{v.stride()}")
    return kc, vc, rows, page_rows, head_rows, cols_k, cols_v


_GL_DTYPES = {} if gluon_prefill is None else {torch.float16: gl.float16,
                                                torch.bfloat16: gl.bfloat16}
