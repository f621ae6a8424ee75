"""The batch-invariant model ops' CUDA kernels (issue 44): `ops/triton/matmul.py` and
`ops/triton/row_mean.py`. A row's result must not depend on the other rows of the call:
on the CPU under Triton's interpreter the values against float64 (the interpreter's tl.dot
is numpy's, whose BLAS rounds a row by its position, so row bits are checked on the GPU
only, where they are the contract); on the GPU (`cuda`) rows bit-equal for every row count,
with the tiles the matmul picks for SmolLM2-135M's linears."""

from __future__ import annotations

import pytest
import torch

from pagedattn.integrations.batch_invariant_ops import batch_invariant_ops
from pagedattn.ops.triton import launch
from pagedattn.ops.triton.matmul import MatmulTiles, invariant_matmul, matmul_tiles
from pagedattn.ops.triton.row_mean import invariant_row_mean


def test_matmul_tiles_follow_the_weight_and_the_switch(monkeypatch):
    assert matmul_tiles(1536, 576) == MatmulTiles(64, 32, 128, 4, 3)
    assert matmul_tiles(49152, 576) == MatmulTiles(64, 128, 64, 4, 3)  # an LM head
    monkeypatch.setattr(launch.SWITCHES, "invariant_matmul_tiles", (16, 16, 16, 1, 1))
    assert matmul_tiles(49152, 576) == MatmulTiles(16, 16, 16, 1, 1)


@pytest.mark.parametrize("bias", [False, True])
def test_invariant_matmul_values(bias, monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_matmul_tiles", (16, 16, 16, 1, 1))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(21, 40, generator=g)
    w = torch.randn(24, 40, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    out = invariant_matmul(a, w.t(), b, alpha=0.5, beta=2.0)
    want = 0.5 * a.double() @ w.double().t() + (2.0 * b.double() if bias else 0.0)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_invariant_row_mean_values_and_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2500, generator=g) + 3.0  # three strips of 1,024, the last partial
    out = invariant_row_mean(x)
    torch.testing.assert_close(out.double(), x.double().mean(1), rtol=1e-6, atol=1e-6)
    for first, end in ((0, 1), (3, 7), (8, 9)):
        assert torch.equal(invariant_row_mean(x[first:end]), out[first:end])
    assert invariant_row_mean(x[:0]).shape == (0,)


def test_invariant_row_mean_refuses_strided_rows():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="contiguous rows"):
        invariant_row_mean(x.t())


# --- GPU: the row bits -------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n, k", [(576, 576), (192, 576), (1536, 576), (576, 1536),
                                  (49152, 576)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matmul_rows_are_the_same_bits_for_every_row_count(n, k, dtype):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(700, k, generator=g).to(dtype).cuda()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).cuda()
    full = invariant_matmul(x, w.t())
    want = x.double() @ w.double().t()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.double(), want, rtol=tol, atol=tol)
    for first, m in ((0, 1), (5, 3), (0, 32), (100, 63), (64, 65), (1, 512)):
        assert torch.equal(invariant_matmul(x[first:first + m], w.t()),
                           full[first:first + m]), (first, m)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_means_are_the_same_bits_for_every_row_count():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 576, generator=g).to(torch.bfloat16).cuda()
    with batch_invariant_ops():
        full = x.float().pow(2).mean(-1, keepdim=True)
        parts = [x[a:b].float().pow(2).mean(-1, keepdim=True)
                 for a, b in ((0, 1), (7, 40), (299, 300))]
    torch.testing.assert_close(full.double(), x.double().pow(2).mean(-1, keepdim=True),
                               rtol=1e-5, atol=1e-6)
    for (a, b), part in zip(((0, 1), (7, 40), (299, 300)), parts):
        assert torch.equal(part, full[a:b])

