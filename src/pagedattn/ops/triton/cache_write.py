"""KV-cache write (`reshape_and_cache_flash` and DiffKV) as one Triton kernel.

One program writes one token's keys and values for a block of KV heads. Caches are logical
[num_blocks, block_size, num_kv_heads, head_size] views: NHD and HND physical layouts and the
DiffKV slices all differ only in strides, so the kernel takes strides and never copies.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedattn.config import FP8_MAX
from pagedattn.ops.triton.fast_launch import KernelLaunch, aligned, tensor_key
from pagedattn.ops.triton.tile_math import pow2_at_least

_TILE_ELEMENTS = 2048  # heads x head_size elements one program moves per tensor
_F32 = torch.float32


@triton.jit
def _write_one(X, Cache, token, block, offset, scale, head0, stride_xt, stride_xh,
               stride_cb, stride_cs, stride_ch, NUM_KV_HEADS: tl.constexpr,
               HEAD_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
               QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    offs_h = head0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_D)
    x = tl.load(X + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :],
                mask=mask, other=0.0)
    if QUANT:
        # Saturate before the cast: fp8 conversion of an out-of-range value is not a clamp.
        x = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    dst = (Cache + block * stride_cb + offset * stride_cs
           + offs_h[:, None] * stride_ch + offs_d[None, :])
    tl.store(dst, x.to(Cache.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    Key, Value, KeyCache, ValueCache, SlotMapping, KScale, VScale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    slot = tl.load(SlotMapping + token).to(tl.int64)  # int64: blocks * block_size may pass 2^31
    if slot < 0:  # padding token
        return
    block = slot // PAGE
    offset = slot % PAGE
    k_scale = 1.0
    v_scale = 1.0
    if QUANT:
        k_scale = tl.load(KScale)
        v_scale = tl.load(VScale)
    _write_one(Key, KeyCache, token, block, offset, k_scale, head0, stride_kt, stride_kh,
               stride_kcb, stride_kcs, stride_kch, NUM_KV_HEADS, HEAD_D, BLOCK_H, BLOCK_D,
               QUANT, FP8_MAX)
    _write_one(Value, ValueCache, token, block, offset, v_scale, head0, stride_vt, stride_vh,
               stride_vcb, stride_vcs, stride_vch, NUM_KV_HEADS, HEAD_DV, BLOCK_H, BLOCK_DV,
               QUANT, FP8_MAX)


class TritonCacheWritePlan:
    """The write of one batch's `num_slots` tokens: grid and tiles fixed, per-call tensors.
    It also takes 2-D rows [tokens, num_kv_heads * head_size(_v)] (heads packed)."""

    takes_rows = True

    def __init__(self, slot_mapping: torch.Tensor, num_kv_heads: int, head_size: int,
                 head_size_v: int, page_size: int, cache_dtype: torch.dtype):
        self.slot_mapping, self.cache_dtype = slot_mapping, cache_dtype
        self.head_size, self.head_size_v = head_size, head_size_v
        block_d = pow2_at_least(head_size)
        block_dv = pow2_at_least(head_size_v)
        block_h = min(pow2_at_least(num_kv_heads),
                      max(1, _TILE_ELEMENTS // max(block_d, block_dv)))
        grid = (slot_mapping.shape[0], triton.cdiv(num_kv_heads, block_h))
        constexprs = dict(NUM_KV_HEADS=num_kv_heads, HEAD_D=head_size, HEAD_DV=head_size_v,
                          PAGE=page_size, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv,
                          QUANT=cache_dtype in FP8_MAX, FP8_MAX=FP8_MAX.get(cache_dtype, 0.0))
        # The cache dtype and the slots' dtype and alignment are fixed here (the static key):
        # run() keys a call by the rest, the keys' dtype and every stride.
        plan_key = (tensor_key([slot_mapping]), str(slot_mapping.device), cache_dtype)
        self.launch = KernelLaunch(_reshape_and_cache_kernel, grid, constexprs, 4, 1, plan_key,
                                   slot_mapping.device)
        self.empty = slot_mapping.shape[0] == 0
        self._slots_ptr = slot_mapping.data_ptr()

    def run(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """key / value [tokens, num_kv_heads, head_size(_v)], or the layer's 2-D rows
        [tokens, num_kv_heads * head_size(_v)] (heads packed in a row)."""
        if self.empty:
            return
        ks, vs = key.stride(), value.stride()
        if ks[-1] != 1:  # the kernel reads each head's row with unit stride
            key = key.contiguous()
            ks = key.stride()
        if vs[-1] != 1:
            value = value.contiguous()
            vs = value.stride()
        if len(ks) == 2:  # a row's heads are packed: the head stride is the head size
            ks = (ks[0], self.head_size, 1)
        if len(vs) == 2:
            vs = (vs[0], self.head_size_v, 1)
        kcs, vcs = key_cache.stride(), value_cache.stride()
        if kcs[-1] != 1 or vcs[-1] != 1:
            raise ValueError("Triton cache write needs caches whose head_size dimension has "
                             f"stride 1; got strides {kcs} and {vcs}")
        # Keyed only with the planned cache dtype, float32 scales, key and value of one
        # dtype and every pointer 16-byte aligned; else Triton's launch specialises.
        call_key = None
        if key_cache.dtype is self.cache_dtype and value_cache.dtype is self.cache_dtype and \
                value.dtype is key.dtype and k_scale.dtype is _F32 and v_scale.dtype is _F32 \
                and (key.data_ptr() | value.data_ptr() | key_cache.data_ptr()
                     | value_cache.data_ptr() | k_scale.data_ptr() | v_scale.data_ptr()
                     | self._slots_ptr) % 16 == 0:
            call_key = (key.dtype, ks, vs, kcs, vcs)
        self.launch((key, value, key_cache, value_cache, self.slot_mapping, k_scale, v_scale,
                     ks[0], ks[1], vs[0], vs[1], kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2]),
                    call_key)

    def plan_layer(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   k_scale: torch.Tensor, v_scale: torch.Tensor) -> Optional[LayerWrite]:
        """This write for one layer's caches and scales, whose strides, dtypes and alignment
        are read here once (`layer_plan.TritonLayerPlan` launches it); None where they need
        `run`'s path (another dtype than planned, an unaligned pointer, a cache without unit
        head stride, nothing to write)."""
        kcs, vcs = key_cache.stride(), value_cache.stride()
        if self.empty or kcs[-1] != 1 or vcs[-1] != 1 or \
                key_cache.dtype is not self.cache_dtype or \
                value_cache.dtype is not self.cache_dtype or k_scale.dtype is not _F32 or \
                v_scale.dtype is not _F32 or not aligned(key_cache, value_cache, k_scale,
                                                          v_scale, self.slot_mapping):
            return None
        return LayerWrite(self, key_cache, value_cache, k_scale, v_scale)


class LayerWrite:
    """A `TritonCacheWritePlan` for one layer's caches and scales (`plan_layer`): `run`'s
    arguments around the keys' and values' strides, and its call key's tail. A call of 2-D
    rows key / value [tokens, num_kv_heads * head_size(_v)] reads only their strides, dtype
    and pointers (`layer_plan.TritonLayerPlan.run`)."""

    def __init__(self, plan: TritonCacheWritePlan, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor):
        kcs, vcs = key_cache.stride(), value_cache.stride()
        self.launch, self.head_size, self.head_size_v = plan.launch, plan.head_size, \
            plan.head_size_v
        self.num_slots = plan.slot_mapping.shape[0]  # key rows a call needs, at least
        self.tensors = (key_cache, value_cache, plan.slot_mapping, k_scale, v_scale)
        self.cache_strides = (kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2])
        self.key_tail = (kcs, vcs)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Same contract as `pagedattn.ops.torch.reshape_and_cache` (plans and runs at once)."""
    plan = TritonCacheWritePlan(slot_mapping, key.shape[1], key.shape[2], value.shape[2],
                                key_cache.shape[1], key_cache.dtype)
    plan.run(key, value, key_cache, value_cache, k_scale, v_scale)
