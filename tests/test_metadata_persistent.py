"""A stager that uploads into FLASH_ATTN's persistent buffers (`PersistentBatch`): one upload
a step, no copy in `build()`, the same metadata as the copying path, padding for captured
graphs, and the guard on its pinned mirrors (the CUDA path's events, faked on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedattn import CommonAttentionMetadata, EngineConfig, metadata_persistent
from pagedattn.backends.flash_attn import FlashAttentionMetadataBuilder
from pagedattn.metadata import AttentionSpec
from pagedattn.metadata_persistent import PersistentBatch
from pagedattn.metadata_staging import MetadataStager
from pagedattn.ops import batch_copy

BLOCK = 16
FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")


def _builder(max_num_seqs=8, max_model_len=256, max_tokens=64):
    spec = AttentionSpec(BLOCK, 2, 64, torch.float32)
    return FlashAttentionMetadataBuilder(
        spec, [], EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                               max_num_batched_tokens=max_tokens), "cpu")


def _batch(seed: int, num_reqs: int = 5, decode: bool = False):
    """Random lengths and a random block table (numpy), as an engine passes them."""
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(1, 200, num_reqs)
    query_lens = np.ones(num_reqs, np.int64) if decode else np.minimum(
        seq_lens, rng.integers(0, 9, num_reqs))
    width = int(-(-seq_lens.max() // BLOCK)) + int(rng.integers(0, 3))
    table = rng.integers(0, 1000, (num_reqs, width)).astype(np.int32)
    return query_lens, seq_lens, table


def _no_copies(monkeypatch) -> list:
    """Counts the builder's batch copies (none expected on the one-upload path)."""
    runs = []
    original = batch_copy.BatchCopyPlan.run
    monkeypatch.setattr(batch_copy.BatchCopyPlan, "run",
                        lambda self, *a: runs.append(a) or original(self, *a))
    return runs


def _assert_built_as(built, q, s, table):
    """The builder's metadata holds the batch `from_lengths` defines."""
    want = CommonAttentionMetadata.from_lengths(q.tolist(), s.tolist(),
                                                torch.from_numpy(table), BLOCK)
    n, width = table.shape
    assert torch.equal(built.query_start_loc, want.query_start_loc)
    assert torch.equal(built.seq_lens, want.seq_lens)
    assert torch.equal(built.block_table[:, :width], want.block_table_tensor)
    assert torch.equal(built.slot_mapping, want.slot_mapping)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
def test_one_upload_builds_what_the_copying_path_builds_with_no_copy(seed, decode,
                                                                     monkeypatch):
    copying, direct = _builder(), _builder()
    q, s, table = _batch(seed, decode=decode)
    want = copying.build(0, MetadataStager("cpu").make(q, s, table, BLOCK))
    runs = _no_copies(monkeypatch)
    stager = MetadataStager("cpu", persistent=direct.persistent_batch)
    m = stager.make(q, s, table, BLOCK)
    for name, field in zip(FIELDS, ("query_start_loc", "seq_lens", "block_table_tensor",
                                    "slot_mapping")):  # device fields: the builder's buffers
        assert getattr(m, field).data_ptr() == getattr(direct, name).data_ptr(), name
    got = direct.build(0, m)
    assert runs == []
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.num_actual_tokens, got.max_query_len, got.max_seq_len) == (
        want.num_actual_tokens, want.max_query_len, want.max_seq_len)
    _assert_built_as(got, q, s, table)


def test_an_older_steps_metadata_is_written_again_when_built(monkeypatch):
    builder = _builder()
    stager = MetadataStager("cpu", persistent=builder.persistent_batch)
    first, second = _batch(3), _batch(4)
    m1 = stager.make(*first, BLOCK)
    m2 = stager.make(*second, BLOCK)  # the buffers now hold the second batch
    runs = _no_copies(monkeypatch)
    _assert_built_as(builder.build(0, m1), *first)
    _assert_built_as(builder.build(0, m2), *second)
    _assert_built_as(builder.build(0, m2), *second)
    assert runs == []  # written again from the host fields, not copied


def test_a_capture_between_make_and_build_pads_the_step(monkeypatch):
    """The generator's order: make, capture a larger bucket, build for the replay."""
    builder = _builder()
    stager = MetadataStager("cpu", persistent=builder.persistent_batch)
    q, s, table = _batch(5, num_reqs=3, decode=True)
    m = stager.make(q, s, table, BLOCK)
    dummy = CommonAttentionMetadata.from_lengths([1] * 6, [1] * 6,
                                                 torch.zeros(6, 1, dtype=torch.int32), BLOCK)
    captured = builder.build_for_cudagraph_capture(dummy)
    captured.slot_mapping.fill_(-1)  # as the graph runner does before its warm-up
    runs = _no_copies(monkeypatch)
    _assert_built_as(builder.build(0, m), q, s, table)
    assert captured.query_start_loc.tolist() == [0, 1, 2, 3, 3, 3, 3]  # empty requests
    assert captured.seq_lens.tolist() == s.tolist() + [0, 0, 0]
    assert captured.slot_mapping[3:].tolist() == [-1, -1, -1]  # padded tokens write nothing
    # and a later step comes padded from make itself
    q2, s2, t2 = _batch(6, num_reqs=2, decode=True)
    _assert_built_as(builder.build(0, stager.make(q2, s2, t2, BLOCK)), q2, s2, t2)
    assert captured.seq_lens.tolist() == s2.tolist() + [0] * 4
    assert captured.slot_mapping[2:].tolist() == [-1] * 4
    assert runs == []


def test_another_builder_copies_the_step_from_the_buffers_that_hold_it():
    owner, other = _builder(), _builder()
    stager = MetadataStager("cpu", persistent=owner.persistent_batch)
    first, second = _batch(7), _batch(8)
    m1 = stager.make(*first, BLOCK)
    stager.make(*second, BLOCK)
    _assert_built_as(other.build(0, m1), *first)  # the owner's buffers hold m1 again first


def test_replaced_device_fields_are_copied_not_trusted(monkeypatch):
    builder = _builder()
    stager = MetadataStager("cpu", persistent=builder.persistent_batch)
    q, s, table = _batch(9)
    m = stager.make(q, s, table, BLOCK)
    m.seq_lens = torch.from_numpy(s).to(torch.int32)  # not the buffers' view: copied
    stager.make(*_batch(10), BLOCK)  # and the buffers hold another batch by now
    runs = _no_copies(monkeypatch)
    built = builder.build(0, m)
    assert len(runs) == 1
    assert torch.equal(built.seq_lens, torch.from_numpy(s).to(torch.int32))


def test_a_batch_past_the_buffers_is_refused_with_the_limits():
    builder = _builder(max_num_seqs=4)
    stager = MetadataStager("cpu", persistent=builder.persistent_batch)
    with pytest.raises(ValueError, match="5 requests.*does not fit buffers of 4"):
        stager.make(*_batch(0, num_reqs=5), BLOCK)


def test_a_stager_refuses_buffers_of_another_device_type():
    with pytest.raises(ValueError, match="persistent buffers on cpu for a stager on meta"):
        MetadataStager("meta", persistent=_builder().persistent_batch)


# --- the pinned mirrors' guard (CUDA events, faked: the CPU build has none) -----------------

class FakeEvent:
    def __init__(self, done: bool):
        self.done, self.queries, self.waits = done, 0, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def _uploaded(num_mirrors: int, monkeypatch) -> PersistentBatch:
    """Buffers whose `num_mirrors` mirrors were uploaded in turn on one CUDA stream, none
    done yet: each with a fake event (as is every mirror made from now on)."""
    p = PersistentBatch(4, 4, 8, torch.device("cpu"))
    p._pin = True

    def mirror(index, size, layout, pin):
        m = unpinned(index, size, layout, False)
        m.event = FakeEvent(done=False)
        return m

    unpinned = metadata_persistent._Mirror
    monkeypatch.setattr(metadata_persistent, "_Mirror", mirror)
    for serial in range(1, num_mirrors + 1):
        m = mirror(serial - 1, p.words.shape[0], p.layout, False)
        m.serial, m.stream = serial, 7
        p._mirrors.append(m)
    p._newest, p._next = p._mirrors[-1], num_mirrors
    return p


def test_the_ring_is_made_before_any_mirror_is_checked(monkeypatch):
    p = _uploaded(3, monkeypatch)
    p._mirrors[0].event.done = True
    assert p._mirror() is p._mirrors[3]  # a fourth one, no query, no wait
    assert sum(m.event.queries + m.event.waits for m in p._mirrors) == 0


def test_the_newest_uploads_event_vouches_for_every_earlier_one(monkeypatch):
    p = _uploaded(4, monkeypatch)
    p._mirrors[3].event.done = True  # the newest upload is done: so is every earlier one
    assert p._mirror() is p._mirrors[0]
    assert sum(m.event.queries for m in p._mirrors) == 1
    assert p._mirror() is p._mirrors[1]  # known done already: no query at all
    assert p._mirror() is p._mirrors[2]
    assert p._mirror() is p._mirrors[3]
    assert sum(m.event.queries for m in p._mirrors) == 1  # one query for four writes


def test_a_mirror_still_in_flight_is_skipped_and_the_host_waits_only_when_all_are(monkeypatch):
    p = _uploaded(4, monkeypatch)
    p._mirrors[1].event.done = True  # an older upload done, the newest not
    assert p._mirror() is p._mirrors[1]
    p = _uploaded(4, monkeypatch)
    m = p._mirror()  # all four in flight: wait for the oldest
    assert m is p._mirrors[0] and m.event.waits == 1
    assert all(other.event.waits == 0 for other in p._mirrors[1:])


def test_an_upload_on_another_stream_is_not_vouched_for_by_the_newest(monkeypatch):
    p = _uploaded(4, monkeypatch)
    p._mirrors[0].stream = 8
    p._mirrors[3].event.done = True
    assert p._mirror() is p._mirrors[1]  # mirror 0's own event still says in flight
    assert p._mirrors[0].event.queries == 1


def test_host_only_step_buffers_are_reused_whatever_the_stream():
    """On CUDA a stager with persistent buffers keeps its step buffers on the host only: no
    GPU reads them, so the current stream does not decide their reuse."""
    from pagedattn.metadata_buffers import StepBufferPool

    class NoStream:
        def get(self):
            raise AssertionError("host-only buffers asked for the current stream")

    pool = StepBufferPool(torch.device("cpu"))
    pool._pin, pool._stream = True, NoStream()  # as on CUDA
    first = pool.take(3, 2, 3, upload=False)
    assert pool.take(3, 2, 3, upload=False) is first  # nothing holds it: filled again


def test_steps_made_in_inference_mode_and_outside_it_alike():
    """The generator makes its steps in inference mode; a later step outside it writes the
    same buffers in place (views made in inference mode would refuse that)."""
    builder = _builder()
    stager = MetadataStager("cpu", persistent=builder.persistent_batch)
    q, s, table = _batch(11, decode=True)
    with torch.inference_mode():
        stager.make(q, s, table, BLOCK)
    m = stager.make(q, s + 1, table, BLOCK)
    m.slot_mapping.fill_(-1)  # a holder's in-place write outside inference mode
    _assert_built_as(builder.build(0, stager.make(q, s + 2, table, BLOCK)), q, s + 2, table)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_uploads_queued_behind_a_busy_gpu_keep_each_steps_values():
    """The pinned mirrors' events on a real GPU: steps made while the device is still busy
    (more of them than there are mirrors) each reach the buffers with their own values."""
    spec = AttentionSpec(BLOCK, 2, 64, torch.bfloat16)
    builder = FlashAttentionMetadataBuilder(
        spec, [], EngineConfig(max_num_seqs=8, max_model_len=256,
                               max_num_batched_tokens=64), torch.device("cuda"))
    stager = MetadataStager("cuda", persistent=builder.persistent_batch)
    batches = [_batch(20 + i) for i in range(2 * metadata_persistent._MIRRORS + 1)]
    torch.cuda._sleep(200_000_000)  # keeps the stream busy while the steps are made
    seen = []
    for q, s, table in batches:
        built = builder.build(0, stager.make(q, s, table, BLOCK))
        # snapshots queued behind this step's upload, in stream order
        seen.append([getattr(built, name).clone() for name in FIELDS])
    torch.cuda.synchronize()
    for (q, s, table), snapshot in zip(batches, seen):
        want = CommonAttentionMetadata.from_lengths(q.tolist(), s.tolist(),
                                                    torch.from_numpy(table), BLOCK)
        width = table.shape[1]
        assert torch.equal(snapshot[0].cpu(), want.query_start_loc)
        assert torch.equal(snapshot[1].cpu(), want.seq_lens)
        assert torch.equal(snapshot[2][:, :width].cpu(), want.block_table_tensor)
        assert torch.equal(snapshot[3].cpu(), want.slot_mapping)
