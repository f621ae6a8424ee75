"""The PyTorch provider's once-per-batch groups (ops/torch/paged_batch.py): decodes of far
apart key lengths run in several groups, and every layer's run of one plan matches the oracle."""

from __future__ import annotations

import pytest
import torch

import reference as ref
from conftest import assert_close, make_paged_batch, poison
from pagedattn.ops.plan import plan_varlen_attention
from pagedattn.ops.torch import paged_batch
from pagedattn.ops.torch.paged_rows import request_groups

# Twelve decodes of far apart lengths, and a prompt chunk after its context.
QUERY_LENS = [1] * 12 + [40]
SEQ_LENS = [20, 700, 35, 650, 3, 480, 90, 1000, 17, 300, 260, 900, 140]


def _plan(b, **kw):
    return plan_varlen_attention(
        cu_seqlens_q=b.cu_seqlens_q, num_tokens=b.total_q, max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k, num_heads=b.q.shape[1], num_kv_heads=b.k_cache.shape[2],
        head_size=b.q.shape[2], q_dtype=b.q.dtype, kv_dtype=b.k_cache.dtype,
        seqused_k=b.seqused_k, block_table=b.block_table, page_size=b.k_cache.shape[1],
        return_softmax_lse=True, provider="torch", **kw)


def test_decodes_of_far_apart_lengths_are_grouped_by_key_length():
    b = make_paged_batch(QUERY_LENS, SEQ_LENS, 8, 2, 32)
    groups = request_groups(b.cu_seqlens_q, b.seqused_k, len(SEQ_LENS), b.max_seqlen_q,
                            b.max_seqlen_k, 8, 1 << 25, min_padding=1 << 12)
    assert len(groups) >= 3
    assert sorted(r for g in groups for r in g[0].tolist()) == list(range(len(SEQ_LENS)))
    for reqs, group_q, group_k in groups:
        assert group_k == max(SEQ_LENS[r] for r in reqs.tolist())
        assert group_q == max(QUERY_LENS[r] for r in reqs.tolist())
    # without min_padding the decodes share one group, padded to the longest
    plain = request_groups(b.cu_seqlens_q, b.seqused_k, len(SEQ_LENS), b.max_seqlen_q,
                           b.max_seqlen_k, 8, 1 << 25)
    assert len(plain) == 2


FEATURES = {
    "plain": {},
    "window": dict(window_size=(50, 0)),
    "alibi": dict(alibi=[2 ** -(h + 1) for h in range(8)]),
    "sinks": dict(sinks=[0.3 * h - 1.0 for h in range(8)]),
    "softcap": dict(softcap=5.0),  # the einsum path
}


@pytest.mark.parametrize("held", [True, False], ids=["masks_held", "masks_per_run"])
@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_plan_serves_every_layer_over_its_groups(name, dtype, held, monkeypatch):
    """Two layers' caches (one with NaN in every slot past the keys) through one plan, with
    the chunks' masks made with the batch, or (a batch over HELD_PAIRS) per run."""
    if not held:
        monkeypatch.setattr(paged_batch, "HELD_PAIRS", 0)
    f = dict(FEATURES[name])
    alibi, sinks = f.pop("alibi", None), f.pop("sinks", None)
    plan = None
    for seed in (0, 1):
        b = make_paged_batch(QUERY_LENS, SEQ_LENS, 8, 2, 32, 16, dtype, seed=seed)
        if seed == 0:
            first = b
        else:  # an uninitialised cache: NaN wherever no key was written
            b.block_table.copy_(first.block_table)  # one batch: the plan's block table
            for cache in (b.k_cache, b.v_cache):
                written = torch.zeros(cache.shape[:2], dtype=torch.bool)
                for r, n in enumerate(SEQ_LENS):
                    for pos in range(n):
                        written[b.block_table[r, pos // 16], pos % 16] = True
                cache[~written] = float("nan")
        plan = plan or _plan(b, causal=True, softmax_scale=32 ** -0.5, use_alibi=bool(alibi),
                             use_sinks=sinks is not None, **f)
        groups = plan.provider_plan.groups
        assert len(groups) >= 3
        assert all((c.held is not None) == held for g in groups for c in g.chunks)
        out = poison((b.total_q, 8, 32), dtype)
        lse = poison((8, b.total_q), torch.float32)
        plan.run(b.q, b.k_cache, b.v_cache, out, softmax_lse=lse,
                 alibi_slopes=None if alibi is None else torch.tensor(alibi),
                 s_aux=None if sinks is None else torch.tensor(sinks))
        want, want_lse = ref.paged_attention(
            b.q, b.k_cache, b.v_cache, QUERY_LENS, SEQ_LENS, first.block_table,
            scale=32 ** -0.5, causal=True, window=f.get("window_size", (-1, -1)),
            softcap=f.get("softcap", 0.0), alibi_slopes=alibi, sinks=sinks)
        assert_close(out, want, dtype)
        assert_close(lse, want_lse, torch.float32, atol=1e-4, rtol=1e-4)
