"""A matmul whose rows do not depend on the other rows: batch-invariant model ops' CUDA path.

cuBLAS chooses its kernel (tile shape, split-K) from the problem's shape, M included, so a
row's low bits change with the rows in the call. Here one configuration serves every shape:
a program owns a [BLOCK_M, BLOCK_N] tile and walks K in BLOCK_K steps in order, and a row's
elements are the same tensor-core products wherever the row sits (`integrations/
batch_invariant_ops.py` registers it for aten's mm / addmm / bmm).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from pagedattn.ops.triton import launch


class MatmulTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def matmul_tiles(n: int, k: int) -> MatmulTiles:
    """The tiles of every [M, k] @ [k, n] call: a function of the weight's shape alone, never
    of M, so a row's products and their order are the same in any batch
    (`launch.SWITCHES.invariant_matmul_tiles` overrides it for sweeps)."""
    tiles = launch.SWITCHES.invariant_matmul_tiles
    if tiles is not None:
        return MatmulTiles(*tiles)
    # H200 (tools/sweep_invariant_matmul.py, docs/PERFORMANCE.md): a weight of fewer columns
    # than ~128 SMs x 128 runs narrow tiles, enough programs to fill the GPU at 64 rows,
    # and long K steps, few trips of the serial K loop (SmolLM2-135M's linears at 32 rows:
    # 0.95-1.08x cuBLAS, 1.3-1.9x with 64 x 64 x 32 tiles); a wide one (an LM head) wide tiles.
    if n >= 16384:
        return MatmulTiles(64, 128, 64, 4, 3)
    return MatmulTiles(64, 32, 128, 4, 3)


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
    acc = acc * alpha  # exact for alpha = 1
    if Bias is not None:
        bias = tl.load(Bias + rm.to(tl.int64)[:, None] * stride_bias_m
                       + rn[None, :] * stride_bias_n, mask=ok, other=0.0)
        acc = acc + bias.to(tl.float32) * beta
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
    t = matmul_tiles(n, k)
    _matmul_kernel[(triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))](
        a, b, out, bias, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), bias.stride(0) if bias is not None else 0,
        bias.stride(1) if bias is not None else 0, float(alpha), float(beta),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=t.num_warps,
        num_stages=t.num_stages)
    return out
