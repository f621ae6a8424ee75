"""Index checks of the public ops: with PAGEDATTN_CHECK_INDICES=1 a bad block id, slot or
length is a ValueError naming the argument (on every provider); without it the ops do no host
sync, and the PyTorch provider still turns its own IndexErrors into such ValueErrors."""

from __future__ import annotations

import re

import pytest
import torch

import reference as ref
from conftest import assert_close, make_paged_batch, poison
from pagedattn.ops import flash_attn_varlen_func, reshape_and_cache_flash

PROVIDERS = ["torch", "triton"]


def attend(b, **overrides):
    args = dict(q=b.q, k=b.k_cache, v=b.v_cache, cu_seqlens_q=b.cu_seqlens_q,
                max_seqlen_q=b.max_seqlen_q, seqused_k=b.seqused_k,
                max_seqlen_k=b.max_seqlen_k, block_table=b.block_table, causal=True,
                out=poison(b.q.shape, b.q.dtype))
    args.update(overrides)
    return flash_attn_varlen_func(**args)


def batch():
    return make_paged_batch([3, 1], [19, 7], num_heads=2, num_kv_heads=1, head_size=16,
                            block_size=8, seed=3)


def with_entry(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


BAD_ATTENTION = {
    "negative block id": (
        lambda b: dict(block_table=with_entry(b.block_table, (0, 1), -1)),
        "block_table[0, 1]=-1 (request 0) is not a block of the cache: allowed 0..6"),
    "block id past the cache": (
        lambda b: dict(block_table=with_entry(b.block_table, (1, 0), 8)),
        "block_table[1, 0]=8 (request 1)"),
    "non-monotone cu_seqlens_q": (
        lambda b: dict(cu_seqlens_q=torch.tensor([0, 3, 2], dtype=torch.int32)),
        "cu_seqlens_q is not monotone: cu_seqlens_q[1]=3 > cu_seqlens_q[2]=2"),
    "cu_seqlens_q past q": (
        lambda b: dict(cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32)),
        "cu_seqlens_q[-1]=5 but only 4 tokens"),
    "seqused_k above max_seqlen_k": (
        lambda b: dict(seqused_k=torch.tensor([19, 25], dtype=torch.int32),
                       block_table=torch.zeros(2, 4, dtype=torch.int32)),
        "seqused_k[1]=25 is outside 0..max_seqlen_k=19"),
    "query longer than max_seqlen_q": (
        lambda b: dict(max_seqlen_q=2), "request 0 has 3 query tokens > max_seqlen_q=2"),
    "query longer than its sequence": (
        lambda b: dict(seqused_k=torch.tensor([2, 7], dtype=torch.int32)),
        "request 0: seqused_k[0]=2 is below its query length 3"),
}


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", sorted(BAD_ATTENTION))
def test_check_indices_names_the_bad_argument(monkeypatch, provider, case):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    monkeypatch.setenv("PAGEDATTN_CHECK_INDICES", "1")
    b = batch()
    overrides, message = BAD_ATTENTION[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        attend(b, **overrides(b))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_check_indices_passes_a_good_batch(monkeypatch, provider):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    monkeypatch.setenv("PAGEDATTN_CHECK_INDICES", "1")
    b = batch()
    # A negative id in a column no request uses is never read, so it is fine.
    out = attend(b, block_table=with_entry(b.block_table, (1, 2), -5)
                 if b.block_table.shape[1] > 2 else b.block_table)
    assert not torch.isnan(out).any()
    ref = attend(b)
    torch.testing.assert_close(out, ref)


def test_dense_keys_are_checked_against_cu_seqlens_k(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_CHECK_INDICES", "1")
    q, k = torch.randn(4, 2, 16), torch.randn(6, 1, 16)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k[-1]=9 but only 6 tokens")):
        flash_attn_varlen_func(q, k, k, 2, cu, 5,
                               cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_check_indices_refuses_a_slot_past_the_cache(monkeypatch, provider):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    monkeypatch.setenv("PAGEDATTN_CHECK_INDICES", "1")
    key = torch.randn(3, 1, 16)
    cache = torch.zeros(4, 8, 1, 16)
    message = "slot_mapping[2]=32 is beyond the cache: 4 blocks of 8 hold slots 0..31"
    with pytest.raises(ValueError, match=re.escape(message)):
        reshape_and_cache_flash(key, key, cache, cache.clone(), torch.tensor([0, -1, 32]),
                                "auto")
    assert not cache.any(), "nothing may be written before the check"


def test_without_the_env_var_the_torch_provider_names_a_block_past_the_cache(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "torch")
    b = batch()
    with pytest.raises(ValueError, match=re.escape("block_table[1, 0]=40 (request 1)")):
        attend(b, block_table=with_entry(b.block_table, (1, 0), 40))


def test_without_the_env_var_the_torch_provider_names_a_slot_past_the_cache(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "torch")
    key = torch.randn(2, 1, 16)
    cache = torch.zeros(4, 8, 1, 16)
    with pytest.raises(ValueError, match=re.escape("slot_mapping[1]=99 is beyond the cache")):
        reshape_and_cache_flash(key, key, cache, cache.clone(), torch.tensor([3, 99]), "auto")


def test_without_the_env_var_the_ops_never_copy_indices_to_the_host(monkeypatch):
    """The index checks are the only host copies of index tensors: count their calls."""
    import pagedattn.ops.checks as checks
    import pagedattn.ops.index_checks as index_checks

    calls = []
    monkeypatch.setattr(checks, "check_attention_indices", lambda *a: calls.append(a))
    monkeypatch.setattr(index_checks, "check_slot_mapping", lambda *a: calls.append(a))
    b = batch()
    attend(b)
    reshape_and_cache_flash(b.q[:, :1], b.q[:, :1], b.k_cache, b.v_cache,
                            torch.tensor([0, 1, 2, 3]), "auto")
    assert calls == []
    monkeypatch.setenv("PAGEDATTN_CHECK_INDICES", "1")
    attend(b)
    reshape_and_cache_flash(b.q[:, :1], b.q[:, :1], b.k_cache, b.v_cache,
                            torch.tensor([0, 1, 2, 3]), "auto")
    assert len(calls) == 2


def test_cross_attention_may_have_more_queries_than_keys(monkeypatch):
    """Not causal (cross-attention): a query longer than its keys is legal and computed."""
    monkeypatch.setenv("PAGEDATTN_CHECK_INDICES", "1")
    b = batch()
    used = torch.tensor([2, 7], dtype=torch.int32)
    out = attend(b, seqused_k=used, causal=False)
    want, _ = ref.paged_attention(b.q, b.k_cache, b.v_cache, b.query_lens, [2, 7],
                                  b.block_table, scale=16 ** -0.5, causal=False)
    assert_close(out, want)
