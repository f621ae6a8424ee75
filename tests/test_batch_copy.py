"""`plan_batch_copy`: a batch's metadata into a builder's persistent buffers, padded for a
larger captured batch. The torch path, the Triton kernel (under the interpreter on a CPU)
and, on a GPU, the public op's one launch all give the same buffers."""

from __future__ import annotations

import pytest
import torch

from pagedattn.ops.batch_copy import plan_batch_copy
from pagedattn.ops.triton.batch_copy import TritonBatchCopyPlan as TritonBatchCopy

POISON = 12345
R, W, T = 9, 7, 40  # buffer capacities: requests, block-table columns, slots


def buffers(device: str = "cpu"):
    int32 = dict(dtype=torch.int32, device=device)
    return (torch.full((R + 1,), POISON, **int32), torch.full((R,), POISON, **int32),
            torch.full((R, W), POISON, **int32),
            torch.full((T,), POISON, dtype=torch.int64, device=device))


def batch(num_reqs: int, width: int, num_tokens: int, dtype: torch.dtype, device="cpu"):
    g = torch.Generator().manual_seed(num_reqs * 100 + width)
    qsl = torch.sort(torch.randint(0, num_tokens + 1, (num_reqs + 1,), generator=g)).values
    qsl[0], qsl[-1] = 0, num_tokens
    seq = torch.randint(1, 500, (num_reqs,), generator=g)
    table = torch.randint(0, 1000, (num_reqs, width), generator=g)
    slots = torch.randint(-1, 5000, (num_tokens,), generator=g)
    return tuple(t.to(device=device, dtype=dtype if i < 3 else torch.int64)
                 for i, t in enumerate((qsl, seq, table, slots)))


def expected(src, num_reqs, width, num_tokens, pad_reqs, pad_tokens, end_tokens):
    qsl, seq, table, slots = (t.cpu() for t in buffers())
    qsl[:num_reqs + 1] = src[0].cpu()
    seq[:num_reqs] = src[1].cpu()
    table[:num_reqs, :width] = src[2].cpu()
    slots[:num_tokens] = src[3].cpu()
    if pad_reqs > num_reqs:
        qsl[num_reqs + 1:pad_reqs + 1] = end_tokens
        seq[num_reqs:pad_reqs] = 0
    if pad_tokens > num_tokens:
        slots[num_tokens:pad_tokens] = -1
    return qsl, seq, table, slots


CASES = [  # num_reqs, width, num_tokens, pad_reqs, pad_tokens, source dtype
    (3, 4, 11, 0, 0, torch.int32),
    (3, 4, 11, 8, 30, torch.int32),  # padded for a larger captured batch
    (9, 7, 40, 0, 0, torch.int64),  # the whole buffers, int64 sources
    (1, 1, 1, 5, 17, torch.int64),
    (0, 0, 0, 4, 9, torch.int32),  # an empty batch padded
]


@pytest.mark.parametrize("num_reqs, width, num_tokens, pad_reqs, pad_tokens, dtype", CASES)
def test_torch_path_copies_and_pads(num_reqs, width, num_tokens, pad_reqs, pad_tokens, dtype):
    out = buffers()
    src = batch(num_reqs, width, num_tokens, dtype)
    plan_batch_copy(*out, num_reqs=num_reqs, num_tokens=num_tokens, width=width,
                    pad_reqs=pad_reqs, pad_tokens=pad_tokens).run(*src, num_tokens)
    for got, want in zip(out, expected(src, num_reqs, width, num_tokens, pad_reqs,
                                       pad_tokens, num_tokens)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("num_reqs, width, num_tokens, pad_reqs, pad_tokens, dtype", CASES)
def test_triton_kernel_copies_and_pads(num_reqs, width, num_tokens, pad_reqs, pad_tokens,
                                       dtype):
    out = buffers()
    src = batch(num_reqs, width, num_tokens, dtype)
    TritonBatchCopy(num_reqs, width, num_tokens, pad_reqs, pad_tokens,
                    torch.device("cpu")).run(*src, *out, num_tokens)
    for got, want in zip(out, expected(src, num_reqs, width, num_tokens, pad_reqs,
                                       pad_tokens, num_tokens)):
        assert torch.equal(got, want)


def test_a_batch_past_the_buffers_is_refused():
    with pytest.raises(ValueError, match="block_table columns"):
        plan_batch_copy(*buffers(), num_reqs=2, num_tokens=3, width=W + 1)
    with pytest.raises(ValueError, match="slot_mapping rows"):
        plan_batch_copy(*buffers(), num_reqs=2, num_tokens=3, width=2, pad_tokens=T + 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_reqs, width, num_tokens, pad_reqs, pad_tokens, dtype", CASES)
def test_gpu_one_launch_matches_the_copies(num_reqs, width, num_tokens, pad_reqs,
                                           pad_tokens, dtype):
    out = buffers("cuda")
    src = batch(num_reqs, width, num_tokens, dtype, "cuda")
    plan = plan_batch_copy(*out, num_reqs=num_reqs, num_tokens=num_tokens, width=width,
                           pad_reqs=pad_reqs, pad_tokens=pad_tokens, provider="triton")
    assert plan.impl is not None
    for _ in range(2):  # the second call takes the direct launch
        plan.run(*src, num_tokens)
        for got, want in zip(out, expected(src, num_reqs, width, num_tokens, pad_reqs,
                                           pad_tokens, num_tokens)):
            assert torch.equal(got.cpu(), want)
    wide = torch.zeros(max(num_reqs, 1), width * 2, dtype=dtype, device="cuda")[:num_reqs, ::2]
    plan.run(src[0], src[1], wide, src[3], num_tokens)  # columns not unit-stride: copies
    assert torch.equal(out[2][:num_reqs, :width].cpu(), wide.cpu().to(torch.int32))
