"""Batch-invariant model ops: matmuls and means whose rows do not depend on the other rows.

pagedattn's batch-invariant mode gives a request's attention rows the same bits in any
batch; a model's logits are the same only if its other ops are too, and matmuls are not:
cuBLAS and MKL choose a kernel (tiles, split-K) from M, the rows in the call, so a token's
hidden state moves in its low bits with the batch around it. Inside `batch_invariant_ops()`
aten's mm, addmm, bmm and mean.dim run implementations with one arithmetic per row:
`ops/triton/matmul.py` (tiles from the weight's shape, K in order) and `ops/triton/row_mean.py`
on CUDA, halving-tree sums of elementwise products on the CPU; and silu on the CPU, whose
vectorised sigmoid rounds a vector's tail elements apart from its body (its CUDA kernel
treats every element alike). Other elementwise ops already give an element its own bits.
This is what vLLM's VLLM_BATCH_INVARIANT does with the same overrides (`torch.library`),
scoped to a block and to Llama-style models' ops.

    with batch_invariant_ops():
        logits = model(input_ids)   # each row's logits the same bits in any batch

The overrides hold for the whole process while the block is open (other threads included).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
import torch.nn.functional as F

_CHUNK_ELEMENTS = 1 << 24  # float32 products per chunk of a CPU matmul (64 MiB)


@contextlib.contextmanager
def batch_invariant_ops() -> Iterator[None]:
    """Run aten's mm, addmm, bmm and mean.dim (and silu on the CPU) batch-invariant inside
    the block; the usual kernels come back when it ends."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": meant
        warnings.simplefilter("ignore")
        for key in ("CPU", "CUDA"):
            lib.impl("mm", _mm, key)
            lib.impl("addmm", _addmm, key)
            lib.impl("bmm", _bmm, key)
            lib.impl("mean.dim", _mean, key)
        lib.impl("silu", _silu, "CPU")
    try:
        yield
    finally:
        del lib  # its finalizer takes the registrations back


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
            alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    if a.is_cuda:
        from pagedattn.ops.triton.matmul import invariant_matmul

        return invariant_matmul(a, b, bias, alpha, beta)
    out = _tree_matmul(a, b)
    if alpha != 1:
        out = out * alpha
    if bias is not None:
        out = out + (bias.float() if beta == 1 else bias.float() * beta)
    return out.to(a.dtype)


def _tree_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] in float32 (float64 for float64): products summed over K by
    halving (K zero-padded to a power of two), chunks of rows."""
    dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    m, k = a.shape
    width = 1 << max(k - 1, 0).bit_length()
    bt = F.pad(b.to(dtype).T, (0, width - k))  # [N, width]
    out = torch.empty((m, b.shape[1]), dtype=dtype, device=a.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, bt.numel()))
    for r0 in range(0, m, step):
        x = F.pad(a[r0:r0 + step].to(dtype), (0, width - k))[:, None, :] * bt[None]
        n = width
        while n > 1:
            n //= 2
            x = x[..., :n] + x[..., n:]
        out[r0:r0 + step] = x[..., 0]
    return out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _matmul(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1
           ) -> torch.Tensor:
    return _matmul(a, b, bias, alpha, beta)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack([_matmul(a[i], b[i]) for i in range(a.shape[0])]) if a.shape[0] else \
        a.new_empty((0, a.shape[1], b.shape[2]))


def _mean(x: torch.Tensor, dim: Optional[Sequence[int]] = None, keepdim: bool = False, *,
          dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The mean over `dim` (None or []: every dimension) by a halving-tree sum."""
    dims = list(range(x.dim())) if not dim else sorted(d % x.dim() for d in dim)
    kept = [d for d in range(x.dim()) if d not in dims]
    out_dtype = dtype or x.dtype
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    y = x.permute(kept + dims).reshape(*[x.shape[d] for d in kept], -1)
    count = y.shape[-1]
    if y.is_cuda and work == torch.float32:  # one launch, not a tree of them
        from pagedattn.ops.triton.row_mean import invariant_row_mean

        rows = y.reshape(-1, count)
        if count > 1 and rows.stride(1) != 1:
            rows = rows.contiguous()
        y = invariant_row_mean(rows).reshape(y.shape[:-1]).to(out_dtype)
    else:
        y = y.to(work)
        n = 1 << max(count - 1, 0).bit_length()
        y = F.pad(y, (0, n - count))
        while n > 1:
            n //= 2
            y = y[..., :n] + y[..., n:]
        y = (y[..., 0] / count).to(out_dtype)
    if keepdim:
        for d in dims:
            y = y.unsqueeze(d)
    return y


def _silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + e^-x): `exp` rounds an element alike wherever it sits."""
    y = x.float()
    return (y / (1.0 + torch.exp(-y))).to(x.dtype)
