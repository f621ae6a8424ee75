"""Async scheduling: each step launched before the one before it is read back, same tokens.

With `async_scheduling` the generator schedules and launches step t+1 before it reads step
t's tokens: step t+1's decodes take their tokens from step t's on the device, a request that
stops at step t by EOS has one more token computed at step t+1 (discarded), and its blocks are
freed once step t+1 is read back. On the CPU nothing runs apart from the host, but the code
path is the same; these tests check it gives the serial generator's tokens (and
transformers') with EOS-terminated requests, chunked prompts, a token budget that mixes
prefill and decode, requests waiting for a seat, and prefix-cache hits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: transformers")

from pagedattn.integrations import transformers as hf  # noqa: E402
from pagedattn.integrations.async_steps import carry_tokens, pending_rows  # noqa: E402
from pagedattn.integrations.hf_generator import PagedGenerator  # noqa: E402
from pagedattn.integrations.hf_models import tiny_model  # noqa: E402

NUM_REQS, MAX_NEW = 24, 20


@pytest.fixture(scope="module")
def workload():
    """(model, prompts, max_new_tokens each, the EOS id, transformers' tokens for each):
    prompts of 1-3 tokens and some of 14 (chunked under a small budget), different
    max_new_tokens, and an EOS that stops a few requests early."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (1 + i % 3 if i % 4 else 14,), generator=g).tolist()
               for i in range(NUM_REQS)]
    max_new = torch.randint(4, MAX_NEW + 1, (NUM_REQS,), generator=g).tolist()
    ref_tokens, _ = hf.hf_generate_greedy(model, prompts, MAX_NEW)
    eos = ref_tokens[0][3]
    want = []
    for tokens, n in zip(ref_tokens, max_new):
        tokens = tokens[:n]
        want.append(tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
    assert sum(len(w) < n for w, n in zip(want, max_new)) >= 2  # EOS ends a few early
    return model, prompts, max_new, eos, want


def _run(workload, async_scheduling: bool, max_num_seqs: int, budget: int
         ) -> tuple[PagedGenerator, list[list[int]], list[torch.Tensor]]:
    model, prompts, max_new, eos, _ = workload
    gen = PagedGenerator(model, block_size=4, num_blocks=512, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=budget, record_logits=True,
                         async_scheduling=async_scheduling)
    reqs = [gen.add_request(p, n, eos_token_id=[eos, 2]) for p, n in zip(prompts, max_new)]
    while gen.has_unfinished():
        gen.step()
    return gen, [r.output_ids for r in reqs], [torch.stack(r.logits) for r in reqs]


def test_async_scheduling_is_on_where_the_device_runs_apart_from_the_host():
    model = tiny_model("llama")
    assert PagedGenerator(model, num_blocks=16).async_scheduling is False  # on the CPU
    assert PagedGenerator(model, num_blocks=16, async_scheduling=True).async_scheduling
    assert not PagedGenerator(model, num_blocks=16, async_scheduling=False).async_scheduling


# (max_num_seqs, token budget): prompt chunks beside decodes; requests waiting for a seat;
# whole prompts in one step
@pytest.mark.parametrize("max_num_seqs,budget", [(24, 6), (5, 6), (24, 64)])
def test_async_steps_give_the_serial_tokens_and_transformers(workload, max_num_seqs, budget):
    want = workload[-1]
    gen, tokens, logits = _run(workload, True, max_num_seqs, budget)
    serial, serial_tokens, serial_logits = _run(workload, False, max_num_seqs, budget)
    assert tokens == serial_tokens == want
    for a, b in zip(logits, serial_logits):  # one per output token: none of a discarded one
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    overlapped = sum(s.overlapped for s in gen.stats)
    assert overlapped >= len(gen.stats) * 3 // 4, (overlapped, len(gen.stats))
    assert not any(s.overlapped or s.discarded for s in serial.stats)
    # every request stopped by EOS before its last step had one token computed past its end
    stopped_early = sum(len(w) < n for w, n in zip(want, workload[2]))
    assert 1 <= sum(s.discarded for s in gen.stats) <= stopped_early
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in gen.stats)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in gen.stats)
    assert all(s.num_reqs <= max_num_seqs for s in gen.stats)
    assert all(0 < s.host_seconds <= s.seconds for s in gen.stats)
    assert gen.allocator.num_free == gen.num_blocks and not gen.block_table.blocks
    assert not gen.has_unfinished()


def test_a_request_stopped_by_eos_keeps_its_blocks_until_the_step_ahead_is_read(workload):
    model, prompts, max_new, eos, want = workload
    early = [i for i, (w, n) in enumerate(zip(want, max_new)) if len(w) < n]
    for async_scheduling in (True, False):
        gen = PagedGenerator(model, block_size=4, num_blocks=512, max_num_seqs=NUM_REQS,
                             max_num_batched_tokens=64, async_scheduling=async_scheduling)
        reqs = [gen.add_request(p, n, eos_token_id=eos) for p, n in zip(prompts, max_new)]
        held_after_stop, stopped = [], []
        while gen.has_unfinished():
            finished = gen.step()
            # those that stopped a step earlier: the step read back now computed their
            # token past EOS, and their blocks went with it
            assert gen.stats[-1].discarded == (len(stopped) if async_scheduling else 0)
            assert not any(r.req_id in gen.block_table.blocks for r in stopped)
            stopped = [r for r in finished if r.req_id in early]
            for req in stopped:
                assert req.output_ids == want[req.req_id]  # the token past EOS never lands
                held_after_stop.append(req.req_id in gen.block_table.blocks)
        assert len(held_after_stop) == len(early)
        # overlapped, the step ahead still reads them; serialised, they go at once
        assert all(held_after_stop) if async_scheduling else not any(held_after_stop)
        assert [r.output_ids for r in reqs] == want
        assert gen.allocator.num_free == gen.num_blocks


def test_prefix_cache_hits_with_async_steps():
    """Later requests share a running request's cached prompt blocks and match transformers."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 256, (20,), generator=g).tolist()
    prompts = [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 7, 1)]
    ref_tokens, _ = hf.hf_generate_greedy(model, prompts, 8)
    gen = PagedGenerator(model, block_size=4, num_blocks=64, max_num_seqs=4,
                         max_num_batched_tokens=64, async_scheduling=True)
    holder = gen.add_request(prompts[0], 40)  # keeps the prefix blocks alive while others run
    gen.step()
    assert gen.generate(prompts[1:], 8) == ref_tokens[1:]  # runs the holder to the end too
    hits = {r.req_id: r.num_prefix_hits for r in gen.finished}
    assert hits[holder.req_id] == 0
    assert [hits[r] for r in sorted(hits) if r > holder.req_id] == [20, 20]  # 5 full blocks
    assert any(s.overlapped for s in gen.stats)
    assert gen.allocator.num_free == gen.num_blocks and not gen.block_table.blocks


@pytest.mark.parametrize("rows", [[0, 1, 2, -1, -1], [2, -1, 0, 3, -1], [-1, 1, 0]])
def test_carry_tokens_writes_the_launched_steps_tokens_into_the_pending_inputs(rows):
    tokens = torch.randint(3, 1000, (4,))
    ids = torch.full((len(rows) + 2,), -7, dtype=torch.long)  # poisoned: what is not carried
    dest, src = pending_rows(np.array(rows, dtype=np.int64))
    carry_tokens(ids, tokens, dest, src)
    want = [int(tokens[r]) if r >= 0 else -7 for r in rows] + [-7, -7]
    assert ids.tolist() == want
    assert pending_rows(np.array([-1, -1], dtype=np.int64)) is None
