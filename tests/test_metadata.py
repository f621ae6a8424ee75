"""Block allocation, block tables, slot mapping and CommonAttentionMetadata."""

from __future__ import annotations

import pytest
import torch

from pagedattn import BlockAllocator, BlockTable, CommonAttentionMetadata, OutOfBlocksError
from pagedattn.config import CacheConfig, EngineConfig, kv_cache_torch_dtype


def test_allocator_reuses_freed_blocks_and_reports_exhaustion():
    alloc = BlockAllocator(4)
    first = alloc.allocate(3)
    assert sorted(first) == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(OutOfBlocksError, match="asked for 2 KV-cache blocks but only 1"):
        alloc.allocate(2)
    alloc.free([first[1]])
    assert alloc.allocate(1) == [first[1]]
    with pytest.raises(ValueError, match="double free"):
        alloc.free([3, 3])


def test_block_table_grows_and_maps_slots():
    table = BlockTable(BlockAllocator(8), block_size=4)
    table.add_request("a")
    table.add_request("b")
    assert table.append_tokens("a", 6).tolist() == [0, 1, 2, 3, 4, 5]
    assert table.append_tokens("b", 1).tolist() == [8]
    assert table.append_tokens("a", 3).tolist() == [6, 7, 12]  # third block is block 3
    assert table.tensor(["a", "b"]).tolist() == [[0, 1, 3], [2, 0, 0]]
    table.free_request("a")
    assert table.allocator.num_free == 7
    with pytest.raises(ValueError, match="already in the block table"):
        table.add_request("b")


def test_shared_prefix_blocks_are_refcounted_and_give_the_common_prefix():
    table = BlockTable(BlockAllocator(8), block_size=4)
    table.add_request("a")
    table.append_tokens("a", 10)  # blocks 0, 1, 2 (the last one partly filled)
    shared = table.blocks["a"][:2]
    table.add_request("b", prefix_blocks=shared)
    assert table.num_tokens["b"] == 8
    assert table.append_tokens("b", 2).tolist() == [12, 13]  # its own third block (3)
    assert table.allocator.refcount(0) == 2 and table.allocator.refcount(3) == 1
    assert table.common_prefix_len(["a", "b"]) == 8
    assert table.common_prefix_len(["a"]) == 8  # only full blocks count
    assert table.free_request("a") == [2]  # blocks 0 and 1 are still b's
    assert table.allocator.num_free == 5  # 0, 1, 3 held by b
    assert sorted(table.free_request("b")) == [0, 1, 3]
    with pytest.raises(ValueError, match="not allocated, so it cannot be shared"):
        table.add_request("c", prefix_blocks=[5])


def test_common_metadata_from_lengths():
    table = torch.tensor([[5, 2, 0], [7, 0, 0]], dtype=torch.int32)
    m = CommonAttentionMetadata.from_lengths([3, 1], [18, 4], table, block_size=8)
    assert m.query_start_loc.tolist() == [0, 3, 4]
    assert m.num_computed_tokens_cpu.tolist() == [15, 3]
    assert m.num_actual_tokens == 4 and m.max_query_len == 3 and m.max_seq_len == 18
    # request 0 positions 15, 16, 17: its 2nd block (2) offset 7, then its 3rd (0) offsets 0, 1;
    # request 1 position 3: block 7 offset 3
    assert m.slot_mapping.tolist() == [23, 0, 1, 59]
    assert m.slot_mapping.dtype == torch.int64
    assert m.query_lens_cpu.tolist() == [3, 1]


def test_common_metadata_rejects_queries_longer_than_sequences():
    with pytest.raises(ValueError, match="request 0: query_len=5, seq_len=3"):
        CommonAttentionMetadata.from_lengths([5], [3], torch.zeros(1, 1, dtype=torch.int32), 16)


@pytest.mark.parametrize("name, dtype", [("auto", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.float16), ("float32", torch.float32),
                                         ("fp8", torch.float8_e4m3fn),
                                         ("fp8_e4m3", torch.float8_e4m3fn),
                                         ("fp8_e5m2", torch.float8_e5m2)])
def test_kv_cache_dtype_strings(name, dtype):
    assert kv_cache_torch_dtype(name, torch.bfloat16) == dtype


@pytest.mark.parametrize("kwargs, match", [(dict(cache_dtype="int4"), "kv_cache_dtype='int4'"),
                                           (dict(block_size=0), "block_size"),
                                           (dict(sliding_window=-3), "sliding_window")])
def test_cache_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_engine_config_validation():
    assert EngineConfig().cache_config.block_size == 16
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


# --- the engine-facing path: numpy in, one pinned upload (issue 17) -------------------------

def _lengths_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 70, (9,), generator=g)
    query_lens = torch.minimum(seq_lens, torch.randint(0, 20, (9,), generator=g))
    table = torch.randperm(9 * 5, generator=g).view(9, 5).to(torch.int32)
    return query_lens.tolist(), seq_lens.tolist(), table


def test_stager_takes_numpy_lists_and_tensors_alike():
    import numpy as np

    from pagedattn.metadata_staging import MetadataStager

    q, s, table = _lengths_batch()
    a = MetadataStager("cpu").make(np.array(q), np.array(s), table.numpy(), 16)
    b = CommonAttentionMetadata.from_lengths(q, s, table, 16)
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping",
                 "num_computed_tokens_cpu"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.num_actual_tokens, a.max_query_len, a.max_seq_len) == (
        sum(q), max(q), max(s))
    assert a.slot_mapping.dtype == torch.int64 and a.query_start_loc.dtype == torch.int32
    # every new token's slot: its block id * 16 + offset, computed position by position
    t = 0
    for r in range(len(q)):
        for pos in range(s[r] - q[r], s[r]):
            assert int(a.slot_mapping[t]) == int(table[r, pos // 16]) * 16 + pos % 16
            t += 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stager_packing_round_trips_every_field(seed):
    """The upload path (fields packed as aligned int32 words in one staging buffer, one copy,
    views of the copy) run on the CPU: every device field equals its host copy, and metadata
    made earlier is not overwritten by later steps."""
    from pagedattn.metadata_staging import MetadataStager

    stager = MetadataStager("cpu")
    stager._upload = True  # the packing a GPU stager does, with an unpinned buffer
    batches = [_lengths_batch(seed + i) for i in range(3)] + [([], [], torch.zeros(0, 0))]
    made = [stager.make(q, s, t, 16) for q, s, t in batches]
    for m, (q, s, t) in zip(made, batches):
        want = CommonAttentionMetadata.from_lengths(q, s, t.to(torch.int32), 16)
        for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
            got, ref_ = getattr(m, name), getattr(want, name)
            assert got.dtype == ref_.dtype and torch.equal(got, ref_), name
        assert m.slot_mapping.data_ptr() % 16 == 0 and m.block_table_tensor.data_ptr() % 16 == 0


_FIELDS = ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu",
           "num_computed_tokens_cpu", "block_table_tensor", "block_table_cpu", "slot_mapping",
           "slot_mapping_cpu")


def _decode_step(step: int):
    """A decode step of 5 requests whose lengths and blocks differ from every other step's."""
    import numpy as np

    rng = np.random.default_rng(step)
    seq_lens = rng.integers(1, 64, 5) + step
    return np.ones(5, np.int64), seq_lens, rng.integers(0, 1000, (5, 6)).astype(np.int32)


def _snapshot(m):
    return {name: getattr(m, name).clone() for name in _FIELDS}


def _assert_fields(m, snapshot):
    for name in _FIELDS:
        assert torch.equal(getattr(m, name), snapshot[name]), name


@pytest.mark.parametrize("upload", [False, True], ids=["host", "packed"])
@pytest.mark.parametrize("holder", ["metadata", "field", "view", "numpy", "replaced copy"])
def test_stager_reuses_a_steps_buffers_only_once_nothing_holds_them(holder, upload):
    """Later steps of the same shape get fresh buffers while anything still holds one of an
    older step's tensors (its metadata, one field, a view or a numpy array of one, a
    `dataclasses.replace` copy), and that older step's values stay as made; once it is let
    go, the next step fills its buffers again, every field as its definition says."""
    import dataclasses

    import numpy as np

    from pagedattn.metadata_staging import MetadataStager

    stager = MetadataStager("cpu")
    stager._upload = upload
    old = stager.make(*_decode_step(0), 16)
    want = _snapshot(old)
    hold = {"metadata": lambda m: m, "field": lambda m: m.seq_lens,
            "view": lambda m: m.slot_mapping[2:4], "numpy": lambda m: m.block_table_cpu.numpy(),
            "replaced copy": lambda m: dataclasses.replace(m, causal=False)}[holder](old)
    address = old.slot_mapping.data_ptr()
    del old
    for step in range(1, 6):  # more steps than the stager keeps buffers per shape
        new = stager.make(*_decode_step(step), 16)
        assert new.slot_mapping.data_ptr() != address
        if holder in ("metadata", "replaced copy"):
            _assert_fields(hold, want)
        del new
    values = {"field": want["seq_lens"], "view": want["slot_mapping"][2:4],
              "numpy": want["block_table_cpu"].numpy()}
    if holder in values:
        assert np.array_equal(np.asarray(hold), np.asarray(values[holder]))
    del hold
    m = _assert_made_as_from_lengths(stager, 9)
    assert m.slot_mapping.data_ptr() == address  # the least recently filled buffers: free


def _assert_made_as_from_lengths(stager, seed: int) -> CommonAttentionMetadata:
    """A decode step made by `stager` has every field `from_lengths` gives it."""
    q, s, table = _decode_step(seed)
    m = stager.make(q, s, table, 16)
    want = CommonAttentionMetadata.from_lengths(q.tolist(), s.tolist(), torch.from_numpy(table),
                                                16)
    for name in _FIELDS:
        assert torch.equal(getattr(m, name), getattr(want, name)), name
    return m


@pytest.mark.parametrize("upload", [False, True], ids=["host", "packed"])
def test_stager_writes_every_field_again_when_it_fills_buffers_again(upload):
    """A caller that wrote over an older step's fields in place, then let it go: the step
    that gets its buffers next has every field as its definition says."""
    from pagedattn.metadata_staging import MetadataStager

    stager = MetadataStager("cpu")
    stager._upload = upload
    m = stager.make(*_decode_step(0), 16)
    for name in _FIELDS:
        getattr(m, name).fill_(-7)
    address = m.slot_mapping.data_ptr()
    del m
    m = _assert_made_as_from_lengths(stager, 1)
    assert m.slot_mapping.data_ptr() == address


@pytest.mark.parametrize("upload", [False, True], ids=["host", "packed"])
def test_buffers_made_in_inference_mode_serve_steps_outside_it(upload):
    """An engine's step in inference mode, then one outside it on the same buffers (and
    back): the fields are normal tensors, which a caller may update in place in both."""
    from pagedattn.metadata_staging import MetadataStager

    stager = MetadataStager("cpu")
    stager._upload = upload
    q, s, table = _decode_step(0)
    with torch.inference_mode():
        address = stager.make(q, s, table, 16).slot_mapping.data_ptr()
    m = stager.make(q, s + 1, table, 16)
    assert m.slot_mapping.data_ptr() == address
    fields = {id(getattr(m, name)): getattr(m, name) for name in _FIELDS}  # (host: shared)
    for field in fields.values():
        assert not field.is_inference()
        field.add_(1)
    assert m.seq_lens.tolist() == m.seq_lens_cpu.tolist() == (s + 2).tolist()
    del m
    with torch.inference_mode():
        m = stager.make(q, s + 3, table, 16)
        m.seq_lens_cpu.add_(1)
        assert m.seq_lens.tolist() == (s + 3 + (not upload)).tolist()


def _slots_one_by_one(query_lens, seq_lens, table, block_size):
    return [int(table[r][pos // block_size]) * block_size + pos % block_size
            for r in range(len(query_lens))
            for pos in range(seq_lens[r] - query_lens[r], seq_lens[r])]


@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize("upload", [False, True], ids=["host", "packed"])
@pytest.mark.parametrize("kind", ["decode", "mixed", "empty requests", "huge block ids"])
def test_stager_fields_equal_their_definitions(kind, upload, block_size):
    """Every field against its definition, computed request by request: decode steps (one
    token a request), mixed steps with empty queries, block ids whose slots pass 2^31, and
    a block size that is not a power of two."""
    import numpy as np

    from pagedattn.metadata_staging import MetadataStager, stager_fields

    rng = np.random.default_rng(len(kind))
    n = 7
    seq_lens = rng.integers(1, 90, n)
    query_lens = {"decode": np.ones(n, np.int64), "mixed": rng.integers(1, 20, n),
                  "empty requests": rng.integers(0, 3, n) * 5,
                  "huge block ids": rng.integers(1, 4, n)}[kind]
    query_lens = np.minimum(query_lens, seq_lens)
    high = 2 ** 31 - 1 if kind == "huge block ids" else 100
    table = rng.integers(0, high, (n, 9)).astype(np.int32)
    stager = MetadataStager("cpu")
    stager._upload = upload
    m = stager.make(query_lens, seq_lens, table.T.copy().T, block_size)  # column-major in
    q, s = query_lens.tolist(), seq_lens.tolist()
    starts = [0] + np.cumsum(q).tolist()
    want = {"query_start_loc": starts, "seq_lens": s, "block_table_tensor": table.tolist(),
            "slot_mapping": _slots_one_by_one(q, s, table, block_size),
            "num_computed_tokens_cpu": [a - b for a, b in zip(s, q)]}
    for name, values in want.items():
        assert getattr(m, name).tolist() == values, name
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert torch.equal(getattr(m, name + "_cpu"), getattr(
            m, name + ("_tensor" if name == "block_table" else "")))
    assert m.slot_mapping.dtype == torch.int64 and m.block_table_tensor.dtype == torch.int32
    assert (m.num_reqs, m.num_actual_tokens, m.max_query_len, m.max_seq_len) == (
        n, sum(q), max(q), max(s))
    # make's mark: what build() compares to find the batch unchanged, and the block ids
    assert m.made_by_stager[:2] == (block_size, stager_fields(m))
    assert np.shares_memory(m.made_by_stager[2], m.block_table_cpu.numpy())
    assert m.made_by_stager[2].tolist() == table.tolist()


@pytest.mark.parametrize("args, match", [
    (([1, 2], [1], [[0], [1]]), "query_lens has 2 entries but seq_lens has 1"),
    (([3], [2], [[0]]), r"request 0: query_len=3, seq_len=2"),
    (([1], [40], [[0, 1]]), r"request 0: seq_len=40 needs 3 blocks of 16 but block_table has "
                            "2 columns"),
    (([1.5], [2], [[0]]), "query_lens must hold integers"),
    (([1, -1], [2, 3], [[0], [1]]), r"request 1: query_len=-1, seq_len=3"),
    (([1, 1], [2, 40], [[0, 1], [2, 3]]), r"request 1: seq_len=40 needs 3 blocks"),
])
@pytest.mark.parametrize("as_numpy", [False, True], ids=["lists", "numpy"])
def test_stager_refuses_bad_lengths(args, match, as_numpy):
    """The same errors for lists and for the int64 / int32 arrays an engine passes (which
    skip the conversion)."""
    import numpy as np

    from pagedattn.metadata_staging import MetadataStager

    if as_numpy:
        q, s, table = args
        args = (np.array(q), np.array(s, np.int64), np.array(table, np.int32))
    with pytest.raises((ValueError, TypeError), match=match):
        MetadataStager("cpu").make(*args, 16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stager_uploads_from_pinned_memory_without_a_sync():
    """One non_blocking copy from a pinned buffer per step: no sync (CUDA's sync-debug mode
    would raise on a pageable copy), and every device field equals its host copy."""
    from pagedattn.metadata_staging import MetadataStager

    stager = MetadataStager("cuda")
    q, s, table = _lengths_batch(1)
    stager.make(q, s, table, 16)  # the first call allocates the pinned buffer
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        made = [stager.make(q, s, table, 16) for _ in range(12)]  # more than in flight
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(b.is_pinned() for b in stager._pool._buffers)
    assert len({m.slot_mapping.data_ptr() for m in made}) == 12  # all held: none filled again
    for m in made:
        assert m.query_start_loc.is_cuda and m.slot_mapping.is_cuda
        for dev, host in ((m.query_start_loc, m.query_start_loc_cpu),
                          (m.seq_lens, m.seq_lens_cpu), (m.block_table_tensor, m.block_table_cpu),
                          (m.slot_mapping, m.slot_mapping_cpu)):
            assert torch.equal(dev.cpu(), host)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stager_fills_device_buffers_again_only_on_the_stream_that_last_wrote_them():
    """A step's device buffer is filled again only by an upload on the stream whose work
    last read it (queued behind that work); on another stream a step gets fresh buffers."""
    from pagedattn.metadata_staging import MetadataStager

    stager = MetadataStager("cuda")
    q, s, table = _decode_step(0)
    address = stager.make(q, s, table, 16).slot_mapping.data_ptr()  # let go at once
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        m = stager.make(q, s + 1, table, 16)
        assert m.slot_mapping.data_ptr() != address
        del m
    m = stager.make(q, s + 2, table, 16)
    assert m.slot_mapping.data_ptr() == address
    assert m.seq_lens.tolist() == (s + 2).tolist()
