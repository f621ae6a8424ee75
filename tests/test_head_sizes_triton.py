"""Every head size FLASH_ATTN declares (multiples of 8 up to 256) runs on the Triton kernels:
the edges and the non-powers of two, on the interpreter (CPU) or the GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before pagedattn.ops.triton defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagedattn.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from test_triton_attention import check_paged  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_provider(_fresh_env, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")


@pytest.mark.parametrize("head_size", [8, 24, 112, 136, 200, 256])
def test_declared_head_sizes_run_on_the_kernels(head_size):
    assert head_size in FlashAttentionBackend.get_supported_head_sizes()
    check_paged([1, 6], [37, 6], num_heads=4, num_kv_heads=2, head_size=head_size)
