"""A matmul whose rows do not depend on the other rows: batch-invariant model ops' CUDA path.

cuBLAS chooses its kernel (tile shape, split-K) from the problem's shape, M included, so a
row's low bits change with the rows in the call. Here one configuration serves every shape:
a program owns a [BLOCK_M, BLOCK_N] tile and walks K in BLOCK_K steps in order, and a row's
elements are the same tensor-core products wherever the row sits (`integrations/
batch_invariant_ops.py` registers it for aten's mm / addmm / bmm).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
def _matmul_kernel(A, B, C, Bias, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                   stride_cm, stride_cn, stride_bias_m, stride_bias_n, alpha, beta,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """C [M, N] = alpha * A [M, K] @ B [K, N] (+ beta * Bias, broadcast by its strides)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_a = rm.to(tl.int64)[:, None] * stride_am
    col_b = rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(A + row_a + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(B + kk[:, None] * stride_bk + col_b,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if Bias is not None:
        bias = tl.load(Bias + rm.to(tl.int64)[:, None] * stride_bias_m
                       + rn[None, :] * stride_bias_n, mask=ok, other=0.0)
        acc = acc * alpha + bias.to(tl.float32) * beta
    tl.store(C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn,
             acc.to(C.dtype.element_ty), mask=ok)


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """alpha * a [M, K] @ b [K, N] (+ beta * bias, broadcastable to [M, N]) in a's dtype,
    any strides; float32 multiplies exactly (no TF32)."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if bias is not None:
        bias = bias.expand(m, n)
    _matmul_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
        a, b, out, bias, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), bias.stride(0) if bias is not None else 0,
        bias.stride(1) if bias is not None else 0, float(alpha), float(beta),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3)
    return out
