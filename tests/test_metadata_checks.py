"""Every registered backend's builder refuses a malformed batch at build(), with a message
naming the request and the value, from host copies only; a well-formed batch passes."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from pagedattn import selector
from pagedattn.config import CacheConfig, EngineConfig
from pagedattn.metadata import AttentionSpec, CommonAttentionMetadata
from pagedattn.metadata_checks import check_common_metadata

BLOCK_SIZE, NUM_BLOCKS = 16, 12


def builder_for(name: str, num_gpu_blocks=NUM_BLOCKS):
    backend = selector.load_backend(name)
    spec = AttentionSpec(BLOCK_SIZE, 2, 64, torch.float32, head_size_v=64)
    config = EngineConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=128,
                          cache_config=CacheConfig(BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks))
    return backend.get_builder_cls()(spec, [], config, torch.device("cpu"))


def good_batch() -> CommonAttentionMetadata:
    """Two whole prompts, then a decode (a batch every backend serves, block-sparse too)."""
    table = torch.tensor([[3, 7, 0], [11, 0, 0], [5, 1, 9]], dtype=torch.int32)
    return CommonAttentionMetadata.from_lengths([20, 6, 1], [20, 6, 33], table, BLOCK_SIZE)


def replace(m: CommonAttentionMetadata, **fields) -> CommonAttentionMetadata:
    """m with `fields` changed on the device tensor and its host copy alike."""
    pairs = {"query_start_loc": "query_start_loc_cpu", "seq_lens": "seq_lens_cpu",
             "block_table_tensor": "block_table_cpu", "slot_mapping": "slot_mapping_cpu"}
    for name, cpu in pairs.items():
        if name in fields:
            fields[cpu] = fields[name]
    return dataclasses.replace(m, **fields)


def with_block(m, r, c, value):
    table = m.block_table_tensor.clone()
    table[r, c] = value
    return replace(m, block_table_tensor=table)


def with_slot(m, t, value):
    slots = m.slot_mapping.clone()
    slots[t] = value
    return replace(m, slot_mapping=slots)


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


MALFORMED = {
    "non-monotone query_start_loc": (
        lambda m: replace(m, query_start_loc=i32([0, 20, 19, 27])),
        "request 1: query_start_loc is not monotone: query_start_loc[1]=20 > "
        "query_start_loc[2]=19"),
    "query_start_loc not starting at 0": (
        lambda m: replace(m, query_start_loc=i32([1, 21, 26, 27])), "query_start_loc[0]=1"),
    "last entry != num_actual_tokens": (
        lambda m: replace(m, num_actual_tokens=28),
        "query_start_loc ends at 27 but num_actual_tokens=28"),
    "query longer than its sequence": (
        lambda m: replace(m, seq_lens=i32([20, 5, 33])),
        "request 1: query_len=6 > seq_len=5"),
    "negative block id": (
        lambda m: with_block(m, 2, 2, -1),
        "request 2: block_table[2, 2]=-1 is not a valid block id (allowed: 0..11)"),
    "block id past the cache": (
        lambda m: with_block(m, 0, 1, NUM_BLOCKS),
        "request 0: block_table[0, 1]=12 is not a valid block id"),
    "too few block table columns": (
        lambda m: replace(m, block_table_tensor=m.block_table_tensor[:, :2].contiguous()),
        "request 2: seq_len=33 needs 3 blocks of 16 but the block table has 2 columns"),
    "slot_mapping shorter than the tokens": (
        lambda m: replace(m, slot_mapping=m.slot_mapping[:26]),
        "slot_mapping has 26 slots for num_actual_tokens=27"),
    "a padding token with a real slot": (
        lambda m: replace(m, slot_mapping=torch.cat([m.slot_mapping, torch.tensor([5])])),
        "padding token 27 has slot 5"),
    "slot past the cache": (
        lambda m: with_slot(m, 21, NUM_BLOCKS * BLOCK_SIZE),
        "request 1: slot_mapping[21]=192 is beyond the cache: 12 blocks of 16"),
    "max_seq_len too small": (
        lambda m: replace(m, max_seq_len=32), "max_seq_len=32 but a request has seq_len=33"),
    "max_query_len too small": (
        lambda m: replace(m, max_query_len=19), "max_query_len=19 but a request has 20"),
    "num_reqs disagrees with the lengths": (
        lambda m: replace(m, num_reqs=2), "num_reqs=2 but query_start_loc_cpu has 4"),
}


@pytest.mark.parametrize("backend", sorted(selector.BACKENDS))
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_build_refuses_a_malformed_batch(backend, case):
    make, message = MALFORMED[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        builder_for(backend).build(0, make(good_batch()))


@pytest.mark.parametrize("backend", sorted(selector.BACKENDS))
def test_build_accepts_a_good_batch_and_ids_in_unused_columns(backend):
    # Columns past a request's blocks are never read: any value there is fine.
    m = with_block(with_block(good_batch(), 1, 1, -7), 0, 2, 10_000)
    builder_for(backend).check_batch(m)  # what build() runs first; no ValueError


def test_without_the_cache_size_only_the_cache_bound_is_unchecked():
    builder = builder_for("TORCH_SDPA", num_gpu_blocks=None)
    builder.build(0, with_slot(with_block(good_batch(), 0, 1, 99), 4, 99 * 16))
    with pytest.raises(ValueError, match=re.escape("block_table[0, 1]=-3")):
        builder.build(0, with_block(good_batch(), 0, 1, -3))


def test_block_ids_are_checked_on_the_device_table_when_no_host_copy_is_kept():
    m = dataclasses.replace(with_block(good_batch(), 1, 0, -2), block_table_cpu=None)
    with pytest.raises(ValueError, match=re.escape("request 1: block_table[1, 0]=-2")):
        check_common_metadata(m, BLOCK_SIZE, NUM_BLOCKS)


def test_from_lengths_names_the_request_whose_blocks_are_missing():
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="request 1: seq_len=40 needs 3 blocks of 16"):
        CommonAttentionMetadata.from_lengths([1, 1], [3, 40], table, BLOCK_SIZE)


def test_cache_config_refuses_a_non_positive_block_count():
    with pytest.raises(ValueError, match=re.escape("num_gpu_blocks=0")):
        CacheConfig(num_gpu_blocks=0)


def test_requests_without_keys_and_an_empty_block_table_pass():
    m = CommonAttentionMetadata.from_lengths([0, 0], [0, 0], torch.zeros(2, 0, dtype=torch.int32),
                                             16)
    check_common_metadata(m, 16, num_blocks=4)


def test_a_stager_batch_is_checked_for_its_block_ids_only_while_its_fields_are_unchanged(
        monkeypatch):
    import pagedattn.metadata_checks as checks

    full = []
    monkeypatch.setattr(checks, "_check_maxima", lambda *a: full.append(a))
    m = good_batch()
    assert m.made_by_stager is not None and m.made_by_stager[0] == BLOCK_SIZE
    check_common_metadata(m, BLOCK_SIZE, NUM_BLOCKS)
    assert full == []  # the stager's batch: block ids only
    # The block ids it was given are still checked: one out of range in a used column
    bad = CommonAttentionMetadata.from_lengths(
        [1], [20], torch.tensor([[3, NUM_BLOCKS]], dtype=torch.int32), BLOCK_SIZE)
    with pytest.raises(ValueError, match=re.escape(f"block_table[0, 1]={NUM_BLOCKS}")):
        check_common_metadata(bad, BLOCK_SIZE, NUM_BLOCKS)
    negative = CommonAttentionMetadata.from_lengths(
        [1], [20], torch.tensor([[-1, 3]], dtype=torch.int32), BLOCK_SIZE)
    with pytest.raises(ValueError, match=re.escape("block_table[0, 0]=-1")):
        check_common_metadata(negative, BLOCK_SIZE, None)
    # A block id written over in place after make() is checked too (the host copy as it is)
    written = CommonAttentionMetadata.from_lengths(
        [1], [20], torch.tensor([[3, 4]], dtype=torch.int32), BLOCK_SIZE)
    check_common_metadata(written, BLOCK_SIZE, NUM_BLOCKS)
    written.block_table_cpu[0, 1] = NUM_BLOCKS + 5
    with pytest.raises(ValueError, match=re.escape(f"block_table[0, 1]={NUM_BLOCKS + 5}")):
        check_common_metadata(written, BLOCK_SIZE, NUM_BLOCKS)
    # Another block size, a replaced field or an assigned one: the whole check runs
    check_common_metadata(m, 2 * BLOCK_SIZE, 2 * NUM_BLOCKS)
    assert len(full) == 1
    check_common_metadata(dataclasses.replace(m, max_seq_len=m.max_seq_len + 1), BLOCK_SIZE,
                          NUM_BLOCKS)
    assert len(full) == 2
    m.max_query_len = 1  # smaller than the 20-token prompt: the full check refuses it
    monkeypatch.undo()
    with pytest.raises(ValueError, match="max_query_len=1"):
        check_common_metadata(m, BLOCK_SIZE, NUM_BLOCKS)


@pytest.mark.parametrize("rows", [1, 4])
def test_from_lengths_names_a_block_table_with_another_row_count(rows):
    table = torch.zeros(rows, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(f"block_table has {rows} rows for 2 requests")):
        CommonAttentionMetadata.from_lengths([1, 1], [5, 5], table, BLOCK_SIZE)
