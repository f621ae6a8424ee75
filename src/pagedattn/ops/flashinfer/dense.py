"""Attention over contiguous (non-paged) K/V, FlashInfer's way: `single_decode_with_kv_cache`,
`single_prefill_with_kv_cache` (one request) and `BatchPrefillWithRaggedKVCacheWrapper`
(a batch whose K/V rows are packed by `kv_indptr`), all on `flash_attn_varlen_func`'s dense
path (Triton on CUDA, PyTorch elsewhere). LSEs are FlashInfer's: base 2, [rows, heads].
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from pagedattn.ops.attention import flash_attn_varlen_func
from pagedattn.ops.flashinfer.plan import KV_DTYPES, KV_LAYOUTS, LOG2E, Q_DTYPES

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def nhd(name: str, x: torch.Tensor, layout: str) -> torch.Tensor:
    """K or V as [kv_len, num_kv_heads, head_dim] (a view; HND is [heads, kv_len, dim])."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={layout!r} is not supported; choose one of {KV_LAYOUTS}")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"{name} must be a 3-D tensor ({layout}); got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in KV_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; allowed: {[str(d) for d in KV_DTYPES]}")
    return x if layout == "NHD" else x.transpose(0, 1)


def check_plain_args(pos_encoding_mode: str, custom_mask, packed_custom_mask) -> None:
    if pos_encoding_mode != "NONE":
        raise ValueError(f"pos_encoding_mode={pos_encoding_mode!r} is not supported; apply "
                         "RoPE/ALiBi outside attention and pass 'NONE'")
    if custom_mask is not None or packed_custom_mask is not None:
        raise ValueError("custom_mask / packed_custom_mask are not supported; use causal, "
                         "window_left and logits_soft_cap")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, *,
                    causal: bool, sm_scale: Optional[float], window_left: int,
                    logits_soft_cap: Optional[float], k_descale=None, v_descale=None,
                    return_lse: bool):
    """q [rows, H, D] over NHD k/v rows (cu_k offsets) -> out, lse [rows, H] base 2."""
    if not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left={window_left!r} must be an int >= -1 (-1: no window)")
    if logits_soft_cap is not None and logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap} must be >= 0 (None or 0: off)")
    res = flash_attn_varlen_func(
        q, k, v, max_q, cu_q, max_k, cu_seqlens_k=cu_k, softmax_scale=sm_scale, causal=causal,
        window_size=(window_left, -1), softcap=float(logits_soft_cap or 0.0),
        return_softmax_lse=return_lse, k_descale=k_descale, v_descale=v_descale)
    if not return_lse:
        return res, None
    out, lse = res
    return out, (lse * LOG2E).T


def _cu(n: int, device) -> torch.Tensor:
    return torch.tensor([0, n], dtype=torch.int32, device=device)


def _kv_descales(k: torch.Tensor, scale_k, scale_v, num_kv_heads: int):
    """fp8 K/V: per-KV-head (or one) dequantization scales as flash-attn's [1, Hkv]."""
    if k.dtype not in _FP8:
        return None, None
    out = []
    for name, s in (("k_scale", scale_k), ("v_scale", scale_v)):
        t = torch.as_tensor(1.0 if s is None else s, dtype=torch.float32, device=k.device)
        if t.numel() not in (1, num_kv_heads):
            raise ValueError(f"{name} must be one value or [num_kv_heads={num_kv_heads}]; got "
                             f"{tuple(t.shape)}")
        out.append(t.reshape(1, -1).expand(1, num_kv_heads))
    return out[0], out[1]


def single_decode_with_kv_cache(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str = "NHD",
        pos_encoding_mode: str = "NONE", use_tensor_cores: bool = False,
        q_scale: Optional[float] = None, k_scale: Optional[float] = None,
        v_scale: Optional[float] = None, window_left: int = -1,
        logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
        return_lse: bool = False) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One query token over one request's K/V (it sits at the last position).

    q: [num_qo_heads, head_dim] fp16/bf16/fp32; k, v: [kv_len, num_kv_heads, head_dim] (NHD)
    or [num_kv_heads, kv_len, head_dim] (HND), q's dtype or fp8 (read as x8 * k_scale /
    v_scale). q_scale multiplies the scores. Returns out [num_qo_heads, head_dim] (q's dtype),
    and with return_lse the base-2 LSE [num_qo_heads] float32."""
    check_plain_args(pos_encoding_mode, None, None)
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype not in Q_DTYPES:
        raise ValueError("q must be [num_qo_heads, head_dim] fp16/bf16/fp32; got "
                         f"{getattr(q, 'dtype', type(q).__name__)} "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else ''}")
    k, v = nhd("k", k, kv_layout), nhd("v", v, kv_layout)
    # FlashInfer's scales: q_scale and k_scale multiply the scores (before the soft cap),
    # v_scale the output; the same as reading dequantized q, k and v.
    scale = (q.shape[-1] ** -0.5 if sm_scale is None else sm_scale) * (q_scale or 1.0) * \
        (k_scale or 1.0)
    kd, vd = _kv_descales(k, None, None, k.shape[1])
    out, lse = dense_attention(q[None], k, v, _cu(1, q.device), _cu(k.shape[0], q.device), 1,
                               k.shape[0], causal=True, sm_scale=scale,
                               window_left=window_left, logits_soft_cap=logits_soft_cap,
                               k_descale=kd, v_descale=vd, return_lse=return_lse)
    out = out[0] if v_scale is None else out[0] * v_scale
    return (out, lse[0]) if return_lse else out


def single_prefill_with_kv_cache(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        scale_q: Optional[torch.Tensor] = None, scale_k: Optional[torch.Tensor] = None,
        scale_v: Optional[torch.Tensor] = None, o_dtype: Optional[torch.dtype] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None, causal: bool = False,
        kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None,
        window_left: int = -1, logits_soft_cap: Optional[float] = None,
        rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
        backend: str = "auto", return_lse: bool = False
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One request's queries over its K/V; causal aligns the queries with the last keys.

    q: [qo_len, num_qo_heads, head_dim_qk]; k: [kv_len, num_kv_heads, head_dim_qk], v:
    [kv_len, num_kv_heads, head_dim_vo] (NHD; HND puts heads first). fp8 inputs are read as
    x8 * scale with scale_q [num_qo_heads] and scale_k / scale_v [num_kv_heads] (or one
    value). Returns out [qo_len, num_qo_heads, head_dim_vo] in o_dtype (default: q's, bf16
    for fp8 q), and with return_lse the base-2 LSE [qo_len, num_qo_heads] float32."""
    check_plain_args(pos_encoding_mode, custom_mask, packed_custom_mask)
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in KV_DTYPES:
        raise ValueError("q must be [qo_len, num_qo_heads, head_dim] fp16/bf16/fp32/fp8; got "
                         f"{getattr(q, 'dtype', type(q).__name__)}")
    k, v = nhd("k", k, kv_layout), nhd("v", v, kv_layout)
    o_dtype = o_dtype or (torch.bfloat16 if q.dtype in _FP8 else q.dtype)
    if q.dtype in _FP8 or scale_q is not None:  # per query head: dequantize q up front
        s = torch.as_tensor(1.0 if scale_q is None else scale_q, dtype=torch.float32,
                            device=q.device)
        q = (q.float() * s.reshape(-1, 1)).to(o_dtype if o_dtype in Q_DTYPES else
                                              torch.float32)
    if k.dtype not in _FP8 and (scale_k is not None or scale_v is not None):
        raise ValueError("scale_k / scale_v dequantize fp8 K/V; k has dtype "
                         f"{k.dtype}")
    kd, vd = _kv_descales(k, scale_k, scale_v, k.shape[1])
    out, lse = dense_attention(q, k, v, _cu(q.shape[0], q.device), _cu(k.shape[0], q.device),
                               q.shape[0], k.shape[0], causal=causal, sm_scale=sm_scale,
                               window_left=window_left, logits_soft_cap=logits_soft_cap,
                               k_descale=kd, v_descale=vd, return_lse=return_lse)
    out = out.to(o_dtype)
    return (out, lse) if return_lse else out
