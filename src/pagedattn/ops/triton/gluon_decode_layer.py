"""The Gluon decode kernel's runtime arguments in two parts, and a layer's plan made of them.

A decode launch's arguments are what a layer fixes (its caches' row view, sinks, descales,
and the batch's metadata, scales and windows: `DecodeLayerArgs`, made by
`GluonDecodeLaunch.layer_args`) and what a call brings (the query and its row stride, and
the output with its strides, or the plan's partial states when split). `DecodeLayerArgs.args`
puts the two together in the kernel's order, for `GluonDecodeLaunch.kernel_args` (every
call of `run`) and for a layer's `DecodeLayerPlan` (`GluonDecodeLaunch.plan_layer`), which
reads the layer's part once and per call only checks and places the query and the output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Optional

import torch

from pagedattn.ops.triton.fast_launch import KernelLaunch
from pagedattn.ops.triton.gluon_launch import launch_with_scratch


class DecodeLayerArgs(NamedTuple):
    """The arguments a layer fixes, in the kernel's order around the call's own: the caches
    (K, V); cu_seqlens_q to num_splits (after the output and LSE); kv_rows to stride_bt
    (after the query's row stride); the descale strides and what the launch's form adds
    (after the output strides). kv_dtypes, no_q_descale and ptrs (the bitwise or of the
    sinks' and descales' addresses) make their part of the call key. (A tuple: `run` makes
    one each call.)"""

    caches: tuple
    batch: tuple
    cache_rows: tuple
    tail: tuple
    kv_dtypes: tuple
    no_q_descale: bool
    ptrs: int

    def args(self, q: torch.Tensor, stride_qt: int, target: torch.Tensor,
             target_lse: Optional[torch.Tensor], stride_ot: int, stride_oh: int) -> tuple:
        """The kernel's runtime arguments in signature order: q [T, H * D] rows (TMA-ready,
        `tma_views.tma_rows`) and the output (or the plan's partial states) with its
        strides."""
        return (q, *self.caches, target, target_lse, *self.batch, stride_qt, *self.cache_rows,
                stride_ot, stride_oh, *self.tail)

    def call_key(self, q_dtype: torch.dtype, target_dtype: torch.dtype, target_ptrs: int,
                 stride_ot: int, stride_oh: int) -> Optional[tuple]:
        """The fast launch's call key: what Triton specialises on beyond the plan (dtypes,
        the output strides, which descales are None), or None where a pointer is not 16-byte
        aligned (Triton's own launch then specialises on it). target_ptrs: the bitwise or of
        the output's (or partial states') and LSE's addresses; q and the caches are aligned
        (`tma_rows`, `paged_rows`)."""
        if (self.ptrs | target_ptrs) % 16:
            return None
        return (q_dtype, *self.kv_dtypes, target_dtype, stride_ot, stride_oh, self.no_q_descale)


class DecodeLayerPlan:
    """A Gluon decode launch for one layer (`GluonDecodeLaunch.plan_layer`): `call_args`
    checks a call's query and output, `run` launches with them and the layer's part as
    planned: what the launch's `run` would hand the kernel for the same tensors (no LSE).

    layer: the layer's `DecodeLayerArgs`; launch: the kernel launch (no LSE, sinks given or
    not); allocate: the launch's scratch allocator; partials: (PartOut, PartLse) of a split
    launch, else None; out_width: H * Dv."""

    def __init__(self, layer: DecodeLayerArgs, launch: KernelLaunch, allocate: Callable,
                 partials: Optional[tuple], q_dtype: torch.dtype, out_dtype: torch.dtype,
                 out_width: int, head_size_v: int):
        self.layer, self.launch, self.allocate = layer, launch, allocate
        self.q_dtype, self.out_dtype = q_dtype, out_dtype
        self.row_strides = (out_width, 1)  # of contiguous rows [T, H * Dv]
        self.out_strides = (out_width, head_size_v)  # the kernel's (token, head) strides
        # The output's place in the arguments (target, LSE, strides), split: the partial
        # states and strides 0 (the kernel ignores them there), as kernel_args gives them;
        # else the call's output (call_args checks its alignment), no LSE, its strides
        self.targets = None if partials is None else (*partials, 0, 0)
        if partials is None:
            self.call_key = layer.call_key(q_dtype, out_dtype, 0, *self.out_strides)
        else:
            self.call_key = layer.call_key(q_dtype, partials[0].dtype,
                                           partials[0].data_ptr() | partials[1].data_ptr(), 0, 0)

    def call_args(self, q: torch.Tensor, out: torch.Tensor, key: Optional[torch.Tensor] = None,
                  value: Optional[torch.Tensor] = None) -> Optional[tuple]:
        """(q, its row stride, out) where q [T, H * D] is unit-stride rows of the planned
        dtype with 16-byte rows and base and out is contiguous rows [T, H * Dv] of its
        dtype, 16-byte aligned; else None (the plan's `run` takes the call). The new rows
        key / value are not read (the cache holds them)."""
        qs = q.stride()
        if len(qs) != 2 or qs[1] != 1 or q.dtype is not self.q_dtype or \
                out.dtype is not self.out_dtype or out.stride() != self.row_strides or \
                out.shape[1] != self.row_strides[0] or \
                (q.data_ptr() | out.data_ptr() | qs[0] * q.element_size()) % 16:
            return None
        return q, qs[0], out

    def run(self, call_args: tuple) -> None:
        """Launch with a call's part of the arguments (`call_args`)."""
        q, stride_qt, out = call_args
        targets = self.targets or (out, None, *self.out_strides)
        launch_with_scratch(self.allocate, self.launch, self.layer.args(q, stride_qt, *targets),
                            self.call_key)
