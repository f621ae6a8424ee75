"""The persistent block table: a step's bookkeeping in one call (append_tokens_batch, tensor),
equal to the per-request path and to the definitions, atomic on failure, and its reused
table buffer never changing a table somebody still holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedattn import BlockAllocator, BlockTable, CommonAttentionMetadata, OutOfBlocksError
from pagedattn.kv_sharding import KVSharding


def _slots_by_definition(table: BlockTable, req_ids, query_lens, seq_lens) -> list[int]:
    """Each new token's slot from the request's block list, position by position."""
    bs, s = table.block_size, table.sharding
    out = []
    for r, q, n in zip(req_ids, query_lens, seq_lens):
        ids = table.blocks[r]
        for pos in range(n - q, n):
            if s.owner(pos) != s.rank:
                out.append(-1)
                continue
            local = s.local_len(pos)
            out.append(ids[local // bs] * bs + local % bs)
    return out


def _steps(seed: int, num_reqs: int, num_steps: int):
    """Random steps: a random subset of requests, in random order, each with 0-40 tokens."""
    rng = np.random.default_rng(seed)
    for _ in range(num_steps):
        reqs = rng.permutation(num_reqs)[:rng.integers(1, num_reqs + 1)].tolist()
        yield reqs, rng.integers(0, 41, len(reqs))


@pytest.mark.parametrize("world, rank, interleave", [(1, 0, 1), (2, 1, 1), (3, 0, 4)])
@pytest.mark.parametrize("block_size", [4, 16, 12])
def test_batched_steps_equal_per_request_appends_and_the_definitions(world, rank, interleave,
                                                                      block_size):
    """Two tables over equal allocators, one fed whole steps, one request by request: the
    same block ids (rows and columns grow past their first capacity), the slots
    `append_tokens` returns are those `from_lengths` gives the batch, and both are the
    definition's."""
    sharding = KVSharding(world, rank, interleave)
    batched = BlockTable(BlockAllocator(4000), block_size, sharding)
    single = BlockTable(BlockAllocator(4000), block_size, sharding)
    num_reqs = 21  # more rows than the first capacity
    for t in (batched, single):
        for r in range(num_reqs):
            t.add_request(f"req{r}")
    for reqs, lens in _steps(block_size + world, num_reqs, 40):
        ids = [f"req{r}" for r in reqs]
        seq_lens = batched.append_tokens_batch(ids, lens)
        assert seq_lens.dtype == np.int64
        slots = torch.cat([single.append_tokens(r, int(n)) for r, n in zip(ids, lens)])
        assert seq_lens.tolist() == [single.num_tokens[r] for r in ids]
        assert all(batched.blocks[r] == single.blocks[r] for r in ids)
        common = CommonAttentionMetadata.from_lengths(lens, seq_lens, batched.tensor(ids),
                                                      block_size, sharding=sharding)
        want = _slots_by_definition(batched, ids, lens.tolist(), seq_lens.tolist())
        assert common.slot_mapping.tolist() == slots.tolist() == want
    assert batched.allocator.num_free == single.allocator.num_free
    longest = max(len(batched.blocks[r]) for r in batched.blocks)
    assert longest > 8  # more columns than the first capacity


def test_tensor_gathers_rows_padded_with_zeros_in_request_order():
    table = BlockTable(BlockAllocator(64), block_size=4)
    for r in "abc":
        table.add_request(r)
    table.append_tokens_batch(["a", "b", "c"], [9, 1, 0])
    got = table.tensor(["c", "a", "b"])
    assert got.dtype == torch.int32
    assert got.tolist() == [[0, 0, 0], [0, 1, 2], [3, 0, 0]]
    assert table.tensor(["b"], max_blocks=5).tolist() == [[3, 0, 0, 0, 0]]
    wide = table.tensor(["a", "b"], max_blocks=20)  # wider than the table has columns
    assert wide.tolist() == [[0, 1, 2] + [0] * 17, [3] + [0] * 19]
    assert table.tensor(["c"]).tolist() == [[0]]  # no blocks yet: one unused column
    with pytest.raises(ValueError, match=r"request 'a' has 3 blocks > max_blocks=2"):
        table.tensor(["b", "a"], max_blocks=2)


def test_the_table_buffer_is_refilled_only_once_nobody_holds_it():
    """A held table keeps its values while later steps are gathered; once it is let go (even
    after being written over), the next call refills the same buffer, every entry right."""
    table = BlockTable(BlockAllocator(64), block_size=4)
    for r in range(3):
        table.add_request(r)
    table.append_tokens_batch([0, 1, 2], [5, 9, 2])
    held = table.tensor([0, 1, 2])
    want = held.clone()
    address = held.data_ptr()
    table.append_tokens_batch([0, 1, 2], [4, 4, 4])
    second = table.tensor([2, 1, 0])
    assert second.data_ptr() != address and torch.equal(held, want)
    view = second[1:]  # a view holds the buffer too
    address = second.data_ptr()
    del second
    third = table.tensor([0])
    assert third.data_ptr() != address
    address = third.data_ptr()
    third.fill_(-7)
    del third, view, held
    again = table.tensor([1, 0, 2])
    assert again.data_ptr() == address
    assert again.tolist() == [[2, 3, 4, 7], [0, 1, 6, 0], [5, 8, 0, 0]]
    assert not again.is_inference()


def test_a_step_that_does_not_fit_changes_nothing():
    table = BlockTable(BlockAllocator(5), block_size=4)
    table.add_request("a")
    table.add_request("b")
    table.append_tokens_batch(["a", "b"], [4, 4])
    with pytest.raises(OutOfBlocksError, match="asked for 4 KV-cache blocks but only 3"):
        table.append_tokens_batch(["a", "b"], [9, 1])
    assert table.num_tokens["a"] == 4 and table.blocks["a"] == [0]
    assert table.num_tokens["b"] == 4 and table.blocks["b"] == [1]
    assert table.allocator.num_free == 3
    assert table.append_tokens_batch(["b", "a"], [1, 8]).tolist() == [5, 12]
    assert table.blocks["b"] == [1, 2] and table.blocks["a"] == [0, 3, 4]


@pytest.mark.parametrize("req_ids, counts, error, match", [
    (["a", "a"], [1, 1], ValueError, "lists a request twice"),
    (["a", "zz"], [1, 1], ValueError, "request 'zz' is not in the block table"),
    (["a", "b"], [1], ValueError, r"num_tokens has shape \(1,\); need one count per request"),
    (["a", "b"], [1, -2], ValueError, r"num_tokens\[1\]=-2"),
    (["a", "b"], [1.0, 2.0], TypeError, "num_tokens must hold integers"),
])
def test_bad_steps_are_refused_and_change_nothing(req_ids, counts, error, match):
    table = BlockTable(BlockAllocator(8), block_size=4)
    table.add_request("a")
    table.add_request("b")
    table.append_tokens_batch(["a"], [3])
    with pytest.raises(error, match=match):
        table.append_tokens_batch(req_ids, counts)
    assert dict(table.num_tokens) == {"a": 3, "b": 0}
    assert dict(table.blocks) == {"a": [0], "b": []} and table.allocator.num_free == 7


def test_freed_rows_are_reused_clean():
    table = BlockTable(BlockAllocator(32), block_size=4)
    for r in range(3):
        table.add_request(r)
    table.append_tokens_batch([0, 1, 2], [10, 3, 7])
    assert sorted(table.free_request(1)) == [3]
    table.add_request("new")
    table.append_tokens_batch(["new", 0], [1, 0])
    assert table.blocks["new"] == [3] and table.num_tokens["new"] == 1
    assert table.tensor(["new", 2]).tolist() == [[3, 0], [4, 5]]
    assert 1 not in table.blocks and len(table.blocks) == 3
    with pytest.raises(ValueError, match="request 1 is not in the block table"):
        table.free_request(1)


def test_common_prefix_len_counts_the_full_blocks_every_request_shares():
    table = BlockTable(BlockAllocator(64), block_size=4)
    table.add_request("a")
    table.append_tokens_batch(["a"], [14])  # blocks 0..3, the last one partly filled
    table.add_request("b", prefix_blocks=table.blocks["a"][:3])
    table.add_request("c", prefix_blocks=table.blocks["a"][:2])
    table.append_tokens_batch(["b", "c"], [5, 7])
    assert table.common_prefix_len(["a", "b"]) == 12
    assert table.common_prefix_len(["b", "a", "c"]) == 8
    assert table.common_prefix_len(["c"]) == 12  # its own third block is full too
    table.add_request("d")
    assert table.common_prefix_len(["a", "d"]) == 0
    assert table.common_prefix_len([]) == 0


def test_allocator_free_and_share_are_all_or_nothing():
    alloc = BlockAllocator(6)
    blocks = alloc.allocate(3)
    alloc.share([blocks[0], blocks[0]])  # two more holders
    assert alloc.refcount(blocks[0]) == 3
    with pytest.raises(ValueError, match=f"block {blocks[1]} is not allocated"):
        alloc.free([blocks[0], blocks[1], blocks[1]])  # blocks[1] has one holder
    assert [alloc.refcount(b) for b in blocks] == [3, 1, 1] and alloc.num_free == 3
    with pytest.raises(ValueError, match="block 7 is not allocated, so it cannot be shared"):
        alloc.share([blocks[2], 7])
    with pytest.raises(ValueError, match="block -1 is not allocated"):
        alloc.free([-1])
    assert alloc.free([blocks[2], blocks[0], blocks[0], blocks[0]]) == [blocks[2], blocks[0]]
    assert alloc.allocate(2) == [blocks[0], blocks[2]]  # last freed, first out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_table_buffer_is_pinned_and_uploads_without_a_sync():
    """Where CUDA is available the gathered table is pinned: a non_blocking upload of it
    (held until the copy is done) needs no sync and lands the same values."""
    table = BlockTable(BlockAllocator(256), block_size=16)
    for r in range(5):
        table.add_request(r)
    table.append_tokens_batch(list(range(5)), [40, 3, 100, 17, 0])
    host = table.tensor([4, 2, 0, 3, 1])
    assert host.is_pinned()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        device = host.to("cuda", non_blocking=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert device.cpu().tolist() == [table.blocks[r] + [0] * (7 - len(table.blocks[r]))
                                     for r in [4, 2, 0, 3, 1]]
