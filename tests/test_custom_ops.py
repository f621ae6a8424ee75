"""The ops as torch.library custom ops: opaque to torch.compile, no graph break."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before pagedattn.ops.triton defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import assert_close, make_paged_batch  # noqa: E402
from pagedattn.ops import (  # noqa: E402
    flash_attn_varlen_func,
    merge_attn_states,
    reshape_and_cache_flash,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class TinyAttentionModel(torch.nn.Module):
    """qkv projection -> cache write -> paged attention -> merge with a second state -> out."""

    def __init__(self, num_heads=4, num_kv_heads=2, head_size=32):
        super().__init__()
        self.h, self.hkv, self.d = num_heads, num_kv_heads, head_size
        width = num_heads * head_size
        self.qkv = torch.nn.Linear(width, (num_heads + 2 * num_kv_heads) * head_size)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x, k_cache, v_cache, slot_mapping, cu_seqlens_q, seqused_k, block_table,
                max_seqlen_q: int, max_seqlen_k: int):
        n = x.shape[0]
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q = q.reshape(n, self.h, self.d)
        reshape_and_cache_flash(k.reshape(n, self.hkv, self.d), v.reshape(n, self.hkv, self.d),
                                k_cache, v_cache, slot_mapping, "auto")
        out, lse = flash_attn_varlen_func(
            q, k_cache, v_cache, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=seqused_k,
            block_table=block_table, causal=True, return_softmax_lse=True)
        merged = torch.empty_like(out)
        merge_attn_states(merged, out, lse, torch.zeros_like(out), lse - 1.0)
        return self.proj(merged.reshape(n, -1))


def _run_eager_and_compiled(device, backend):
    torch.manual_seed(0)
    query_lens, seq_lens = [1, 6, 3], [20, 6, 17]
    b = make_paged_batch(query_lens, seq_lens, 4, 2, 32, device=device)
    model = TinyAttentionModel().to(device)
    x = torch.randn(b.total_q, 4 * 32, device=device)
    # the new tokens are the last query_len positions of each sequence
    slots = []
    for r, (lq, lk) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(lk - lq, lk):
            slots.append(int(b.block_table[r, pos // 16]) * 16 + pos % 16)
    slot_mapping = torch.tensor(slots, device=device)
    args = (b.cu_seqlens_q, b.seqused_k, b.block_table, b.max_seqlen_q, b.max_seqlen_k)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    with torch.no_grad():
        eager = model(x, kc, vc, slot_mapping, *args)
        compiled_model = torch.compile(model, backend=backend, fullgraph=True)
        kc2, vc2 = b.k_cache.clone(), b.v_cache.clone()
        compiled = compiled_model(x, kc2, vc2, slot_mapping, *args)
    assert_close(compiled, eager.double(), atol=1e-4, rtol=1e-4)
    assert_close(kc2, kc.double(), atol=0, rtol=0)  # the cache write happened in the graph


def test_ops_are_registered_with_fake_impls():
    for name in ("varlen_attention", "reshape_and_cache", "merge_attn_states"):
        assert hasattr(torch.ops.pagedattn, name)


def test_compiles_without_graph_break_on_cpu(_fresh_env, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "torch")
    if torch.cuda.is_available():
        pytest.skip("the CUDA test covers compilation")
    _run_eager_and_compiled("cpu", "aot_eager")


@cuda
@pytest.mark.cuda
def test_compiled_model_matches_eager_on_gpu():
    _run_eager_and_compiled("cuda", "inductor")
