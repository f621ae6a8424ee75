"""Decode context parallelism in one process: where positions live, the per-rank block tables,
the LSE correction, and a sharded context pass merged over simulated ranks vs the oracle."""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
from conftest import LayerRunner, assert_close, make_layers, poison, randn
from pagedattn import (
    BlockAllocator,
    BlockTable,
    CommonAttentionMetadata,
    EngineConfig,
    set_forward_context,
)
from pagedattn.backends.dcp import DCPPlanner, DCPPlans
from pagedattn.backends.flash_attn import FlashAttentionBackend
from pagedattn.kv_sharding import KVSharding
from pagedattn.ops.context_parallel import correct_attn_out, sharded_context_attention
from pagedattn.ops.providers import use_provider

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (3, 4), (4, 16)])
def test_positions_round_robin_in_runs_of_interleave(world, interleave):
    pos = torch.arange(200)
    for rank in range(world):
        s = KVSharding(world, rank, interleave)
        mine = pos[(pos // interleave) % world == rank]
        assert torch.equal(s.owner(pos) == rank, (pos // interleave) % world == rank)
        assert torch.equal(s.global_pos(torch.arange(len(mine))), mine)
        assert [s.local_len(n) for n in range(201)] == [int((mine < n).sum()) for n in range(201)]


def test_bad_sharding_is_refused():
    with pytest.raises(ValueError, match="rank=2 must be in"):
        KVSharding(2, 2)
    with pytest.raises(ValueError, match="interleave=0"):
        KVSharding(2, 0, 0)


@pytest.mark.parametrize("interleave", [1, 16])
def test_block_tables_per_rank_cover_every_token_once(interleave):
    world, block_size, lens = 2, 16, [(37, 5), (3, 3), (70, 1)]  # (seq_len, query_len)
    owners = torch.full((3, 70), -1)
    for rank in range(world):
        sharding = KVSharding(world, rank, interleave)
        table = BlockTable(BlockAllocator(32), block_size, sharding)
        new_slots = []
        for r, (s, q) in enumerate(lens):
            table.add_request(r)
            first = table.append_tokens(r, s - q)
            second = table.append_tokens(r, q)
            slots = torch.cat([first, second])
            new_slots.append(second)
            assert len(table.blocks[r]) == -(-sharding.local_len(s) // block_size)
            here = slots >= 0
            owners[r, :s][here] = rank
            local = slots[here]  # this rank's slots, in position order: 0, 1, 2, ... locally
            ids = torch.tensor(table.blocks[r])
            pos_in_shard = (ids[:, None] * block_size + torch.arange(block_size)).flatten()
            assert torch.equal(local, pos_in_shard[:len(local)])
        md = CommonAttentionMetadata.from_lengths(
            [q for _, q in lens], [s for s, _ in lens], table.tensor([0, 1, 2]), block_size,
            sharding=sharding)
        assert torch.equal(md.slot_mapping, torch.cat(new_slots))
    for r, (s, _) in enumerate(lens):
        assert torch.equal(owners[r, :s], (torch.arange(s) // interleave) % world)


def test_prefix_sharing_is_refused_under_dcp():
    table = BlockTable(BlockAllocator(8), 16, KVSharding(2, 0))
    with pytest.raises(ValueError, match="prefix caching"):
        table.add_request("a", [0])


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_correction_sums_to_the_merged_state(provider):
    world, tokens, heads, dv = 3, 5, 4, 24
    g = torch.Generator().manual_seed(0)
    outs = [randn(tokens, heads, dv, generator=g) for _ in range(world)]
    lses = torch.randn(world, heads, tokens, generator=g) * 3
    lses[0, 0, 0] = -math.inf  # one rank saw nothing for (token 0, head 0)
    lses[1, 1, 2] = math.inf  # +inf is "empty" too
    lses[:, 2, 3] = -math.inf  # nobody saw anything: 0 and -inf
    want_out, want_lse = outs[0].double(), lses[0].double()
    for r in range(1, world):
        want_out, want_lse = ref.merge_states(want_out, want_lse, outs[r], lses[r])
    total = poison((heads, tokens, dv), torch.float32, DEVICE).zero_()
    with use_provider(provider):
        for r in range(world):
            corrected, lse = correct_attn_out(outs[r].to(DEVICE), lses.to(DEVICE), r)
            total += corrected
    lse = lse.cpu()
    assert_close(total.transpose(0, 1), want_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = ~torch.isinf(want_lse)
    assert_close(lse[finite], want_lse[finite])


def test_correction_rejects_a_rank_out_of_range():
    with pytest.raises(ValueError, match="rank=2 must be in"):
        correct_attn_out(torch.zeros(1, 2, 8), torch.zeros(2, 2, 1), 2)


@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("features", [dict(window=(5, 0)), dict(alibi=True),
                                      dict(window=(9, 0), alibi=True, softcap=4.0)])
def test_sharded_context_merged_over_ranks_equals_one_sequence(interleave, features):
    """Context shards (global positions) + the new tokens over themselves == the oracle."""
    world, block_size, heads, kv_heads, d = 3, 4, 4, 2, 16
    ctx_len, n_new = 29, 3
    g = torch.Generator().manual_seed(1)
    q = randn(n_new, heads, d, generator=g)
    k, v = randn(ctx_len + n_new, kv_heads, d, generator=g), randn(
        ctx_len + n_new, kv_heads, d, generator=g)
    window = features.get("window", (-1, -1))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if features.get("alibi") else None
    softcap = features.get("softcap", 0.0)
    opts = dict(scale=d ** -0.5, window=window, softcap=softcap,
                alibi_slopes=None if slopes is None else slopes.tolist())
    state = ref.attend_one_sequence(q, k[ctx_len:], v[ctx_len:], causal=True, **opts)
    for rank in range(world):
        sharding = KVSharding(world, rank, interleave)
        pos = torch.arange(ctx_len)
        mine = pos[sharding.owner(pos) == rank]
        blocks = -(-len(mine) // block_size)
        k_cache = poison((blocks + 1, block_size, kv_heads, d), torch.float32)
        v_cache = poison((blocks + 1, block_size, kv_heads, d), torch.float32)
        table = torch.arange(blocks, 0, -1, dtype=torch.int32)[None]  # reversed blocks
        for i, p in enumerate(mine.tolist()):
            k_cache[table[0, i // block_size], i % block_size] = k[p]
            v_cache[table[0, i // block_size], i % block_size] = v[p]
        out = poison((n_new, heads, d), torch.float32)
        lse = poison((heads, n_new), torch.float32)
        sharded_context_attention(
            q, k_cache, v_cache, out, lse, cu_seqlens_q=torch.tensor([0, n_new],
                                                                      dtype=torch.int32),
            context_lens=torch.tensor([ctx_len], dtype=torch.int32),
            local_context_lens=torch.tensor([len(mine)], dtype=torch.int32),
            block_table=table, sharding=sharding, softmax_scale=d ** -0.5,
            window_left=window[0], softcap=softcap, alibi_slopes=slopes)
        state = ref.merge_states(*state, out, lse)
    want, _ = ref.attend_one_sequence(q, k, v, causal=True, **opts)
    assert_close(state[0], want)


@pytest.mark.parametrize("features", [{}, dict(per_layer_sliding_window=6,
                                                alibi_slopes=[0.5, 0.25, 0.125, 0.0625])])
def test_dcp_path_of_one_rank_equals_the_plain_path(features):
    """The DCP step with a group of one (no collectives) is plain paged attention; on a GPU
    this runs its Triton kernels (context pass with LSE, correction, merge)."""
    layers = make_layers(FlashAttentionBackend, 1, num_heads=4, num_kv_heads=2, head_size=32,
                         sinks=torch.tensor([0.5, -1.0, 0.0, 1.0]), **features)
    layer = next(iter(layers.values())).to(DEVICE)
    config = EngineConfig(enable_cascade=False, max_num_seqs=8, max_model_len=256)
    runner = LayerRunner(layers, num_blocks=32, device=DEVICE, engine_config=config)
    dcp_builder = FlashAttentionBackend.get_builder_cls()(
        runner.builder.kv_cache_spec, list(layers), config, torch.device(DEVICE))
    dcp_builder.dcp = DCPPlanner(config, config.max_num_seqs, torch.device(DEVICE))
    runner.step(["a", "b"], [30, 7])  # fill the cache
    plain, _ = runner.metadata(["a", "b", "c"], [1, 12, 5])
    common = CommonAttentionMetadata.from_lengths(
        [1, 12, 5], plain.seq_lens.tolist(), runner.table.tensor(["a", "b", "c"]), 16, DEVICE)
    with_dcp = dcp_builder.build(0, common)
    assert isinstance(with_dcp.plans.kinds[0], DCPPlans) and plain.dcp is None
    g = torch.Generator().manual_seed(3)
    q, k, v = (randn(18, n * 32, generator=g).to(DEVICE) for n in (4, 2, 2))
    with set_forward_context(plain):
        want = layer(q, k, v)
    with set_forward_context(with_dcp):  # writes the same keys to the same slots again
        got = layer(q, k, v)
    assert_close(got, want, atol=1e-4, rtol=1e-4)
