"""Batch-invariant prompts whose Gluon consumers pass the key tiles past the last key their rows
see (`SWITCHES.invariant_skip_unseen`; `gluon_invariant.py`'s SKIP; KERNEL_NOTES v55).

Schedule only: a tile none of a consumer's rows sees would leave each row's state exactly as
it was (the exact softmax step: p 0, alpha 1, l and O unchanged), so passing it without its
products keeps every bit. CPU: the switch reaches batch-invariant launches alone as
INVARIANT_SKIP and is refused when not a bool; the rule the kernel passes tiles by (a
split's tiles after its first whose first key lies at or past the end of the keys its
rows see, `KeyTiles.ranges`' hi) never passes a tile with a key one of its rows sees, under
the oracle's causal and window masks. GPU (`cuda`, sm_90 with Triton 3.6's Gluon): prompts
bit-equal to the `tl` pass's with the switch on, rows bit-equal to the switch off where the
passed tile opens a split, and the mode's shared check (alone, in random batches, chunked,
as decodes).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import reference as ref  # noqa: E402
from conftest import assert_same_but, needs_gluon_sm90, served_by  # noqa: E402
from pagedattn.ops.providers import use_provider  # noqa: E402
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import attention_plan, launch  # noqa: E402
from test_batch_invariant import (  # noqa: E402
    Layer,
    World,
    bits,
    check_gpu_layer,
    check_target,
    cpu_layers,
)
from test_invariant_gluon import (  # noqa: E402
    GLUON_LAYERS,
    SCHEDULE,
    _layer_id,
    _one_schedule,
)
from test_invariant_gluon import (  # noqa: E402 - renamed: collected once, in its own module
    test_gpu_gluon_prompts_have_the_tl_passes_bits as prompts_have_the_tl_passes_bits,
)

on_sm90 = needs_gluon_sm90()
ROWS = 64  # a consumer's rows of a 128-row item


def test_the_switch_is_off_by_default_and_reaches_invariant_launches_alone(monkeypatch):
    """Off: every tile computed (INVARIANT_SKIP False, today's kernel). On: INVARIANT_SKIP in
    batch-invariant launches, every other constexpr as before; the default consumer's
    launches never take it."""
    assert launch.SWITCHES.invariant_skip_unseen is False
    off = ag.launch_config(**SCHEDULE).constexprs
    default_off = ag.launch_config(**dict(SCHEDULE, invariant=None)).constexprs
    assert off["INVARIANT_SKIP"] is False and default_off["INVARIANT_SKIP"] is False
    monkeypatch.setattr(launch.SWITCHES, "invariant_skip_unseen", True)
    on = ag.launch_config(**SCHEDULE).constexprs
    assert on["INVARIANT_SKIP"] is True
    assert_same_but(on, off, "INVARIANT_SKIP")
    assert ag.launch_config(**dict(SCHEDULE, invariant=None)).constexprs == default_off


@pytest.mark.parametrize("value", [1, 0, None, "yes"])
def test_a_switch_that_is_not_a_bool_is_refused(value, monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_skip_unseen", value)
    with pytest.raises(ValueError, match=r"SWITCHES.invariant_skip_unseen=.* must be True or "
                                         r"False"):
        ag.launch_config(**SCHEDULE)


def passed_tiles(q_len: int, seq_len: int, q_block: int, c: int, block_n: int,
                 split_keys: int, left: int, right: int) -> list[int]:
    """The first keys of the tiles consumer c passes in query block q_block, by the
    kernel's rule (`gluon_invariant.invariant_consumer` with SKIP): the item's tiles anchored
    at t_a (the block's first seen key, rounded down to a tile), in splits of split_keys
    keys; in each split the tiles after its first from jv = ceil((hi - t_a) / block_n) on,
    hi the end of the keys the consumer's rows see (`KeyTiles.ranges`, causal: right 0)."""
    context = seq_len - q_len

    def ranges(min_pos: int, max_pos: int) -> tuple[int, int]:
        lo = max(min_pos - left, 0) if left >= 0 else 0
        hi = max(min(seq_len, max_pos + right + 1), 0)
        return lo, hi

    row0 = q_block * 2 * ROWS
    key_lo, key_hi = ranges(context + row0, context + min(row0 + 2 * ROWS, q_len) - 1)
    t_a = key_lo // block_n * block_n
    n = -(-(key_hi - t_a) // block_n) if key_lo < key_hi else 0
    _, rows_hi = ranges(context + row0 + c * ROWS,
                        context + min(row0 + c * ROWS + ROWS, q_len) - 1)
    first = t_a // split_keys
    last = (t_a + n * block_n - 1) // split_keys + 1 if n > 0 else first
    out = []
    for s in range(first, last):
        j0 = max(s * split_keys - t_a, 0) // block_n
        j1 = min((s + 1) * split_keys - t_a, n * block_n) // block_n
        jv = max(min(j1, -(-(rows_hi - t_a) // block_n)), j0 + 1)
        out += [t_a + j * block_n for j in range(jv, j1)]
    return out


@pytest.mark.parametrize("left", [-1, 700, 33])
def test_no_passed_tile_holds_a_key_a_row_of_the_consumer_sees(left):
    """Over random prompt and chunk shapes (a cached context before the queries), windows
    and key tiles: every key of every tile the rule passes is invisible to every row of the
    consumer under the oracle's masks, and under a causal mask at 64-key tiles consumer 0
    passes its item's last tile wherever the queries fill both consumers' rows and the
    context is a whole number of tiles (but where that tile opens a split)."""
    g = torch.Generator().manual_seed(5 + left)
    passed_any = 0
    for _ in range(300):
        q_len = int(torch.randint(1, 1500, (1,), generator=g))
        context = int(torch.randint(0, 3, (1,), generator=g)) * \
            int(torch.randint(0, 1100, (1,), generator=g))
        block_n = (64, 128)[int(torch.randint(0, 2, (1,), generator=g))]
        seq_len = q_len + context
        for q_block in range(-(-q_len // (2 * ROWS))):
            for c in (0, 1):
                keys = passed_tiles(q_len, seq_len, q_block, c, block_n, 1024, left, 0)
                first_row = q_block * 2 * ROWS + c * ROWS  # a consumer past q_len has none
                rows = torch.arange(first_row, max(first_row, min(first_row + ROWS, q_len)))
                rows = rows + context
                for start in keys:
                    k_pos = torch.arange(start, min(start + block_n, seq_len))
                    q_pos, k_pos = torch.meshgrid(rows, k_pos, indexing="ij")
                    seen = ref.causal_visible(q_pos, k_pos) & \
                        ref.window_visible(q_pos, k_pos, left, 0)
                    assert not seen.any(), (q_len, context, q_block, c, start, block_n)
                passed_any += len(keys)
                tail = context + (q_block + 1) * 2 * ROWS - 64  # consumer 1's keys alone
                full = (q_block + 1) * 2 * ROWS <= q_len and context % block_n == 0
                if left < 0 and block_n == 64 and c == 0 and full:  # a split's first: kept
                    assert keys == ([] if tail % 1024 == 0 else [tail])
    assert passed_any > 0


# --- CPU: the `tl` pass under the interpreter ---------------------------------------------
def test_the_switch_keeps_the_guarantee_and_the_cpu_rows(monkeypatch):
    """With the switch on, each row close to the oracle and of the same bits alone, in random
    batches, chunked and as decodes, under every split schedule (the Gluon consumer does not
    run on the CPU: the `tl` pass serves every row and must not read the switch); and one
    batch's outputs and LSEs bit-equal to the switch off."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 32)
    layer = Layer(4, 2, 16, 16, torch.float32, torch.float32, 8)
    world = World(layer, [70, 45, 1], "cpu", seed=7)
    parts = [(0, 0, 0, 70), (1, 1, 10, 45), (2, 0, 0, 1)]
    rows = []
    for on in (False, True):
        monkeypatch.setattr(launch.SWITCHES, "invariant_skip_unseen", on)
        with use_provider("triton"):
            rows.append(world.run(parts))
    for (out_a, lse_a), (out_b, lse_b) in zip(*rows):
        assert torch.equal(bits(out_a), bits(out_b)) and torch.equal(bits(lse_a), bits(lse_b))

    @settings(max_examples=2, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data):
        layer = data.draw(cpu_layers("triton"))
        lengths = data.draw(st.lists(st.integers(1, 60), min_size=2, max_size=4))
        world = World(layer, lengths, "cpu", data.draw(st.integers(0, 2 ** 16)))
        with use_provider("triton"):
            check_target(data, world, 3, (0, 1, 3))

    check()


# --- GPU: the same bits as the `tl` pass and as the switch off, and the guarantee ----------
@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("layer", GLUON_LAYERS, ids=_layer_id)
def test_gpu_skip_unseen_keeps_the_tl_passes_bits(layer, monkeypatch):
    """`test_invariant_gluon.test_gpu_gluon_prompts_have_the_tl_passes_bits` with the switch
    on (whole prompts, chunks after a cached context, a window): outputs and float32 LSEs
    bit for bit."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_skip_unseen", True)
    prompts_have_the_tl_passes_bits(layer, monkeypatch)


# (request, copy, first, end): 32 x 512's shape (items of one to four blocks), a prompt over
# three splits, and chunks after 64 and 1,000 cached keys: after 64, block 7's consumer 0
# sees keys up to 1,023 and passes 1,024-1,087, the first tile of the next split
SKIP_LENGTHS = [512, 512, 512, 2600, 1300, 1500]
SKIP_PARTS = [(0, 0, 0, 512), (1, 1, 0, 512), (2, 0, 0, 512), (3, 0, 0, 2600),
              (4, 1, 64, 1300), (5, 0, 1000, 1500)]


@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("layer", [GLUON_LAYERS[0], GLUON_LAYERS[2]], ids=_layer_id)
def test_gpu_rows_equal_the_switch_off_where_passed_tiles_open_a_split(layer, monkeypatch):
    """The same batch with the switch off and on, on the Gluon consumer both times: every
    output and float32 LSE bit for bit (the passed tiles include a split's first)."""
    _one_schedule(monkeypatch)
    world = World(layer, SKIP_LENGTHS, "cuda", seed=17)
    served = served_by(monkeypatch, attention_plan, "plan_invariant_gluon")
    off = world.run(SKIP_PARTS)
    monkeypatch.setattr(launch.SWITCHES, "invariant_skip_unseen", True)
    on = world.run(SKIP_PARTS)
    assert served and all(served), "the Gluon consumer did not serve the prompts"
    for part, (out_off, lse_off), (out_on, lse_on) in zip(SKIP_PARTS, off, on):
        assert not out_on.isnan().any(), part
        assert torch.equal(bits(out_on), bits(out_off)), part
        assert torch.equal(bits(lse_on), bits(lse_off)), part


@pytest.mark.cuda
@on_sm90
def test_gpu_rows_are_the_same_bits_with_skip_unseen(monkeypatch):
    _one_schedule(monkeypatch)
    monkeypatch.setattr(launch.SWITCHES, "invariant_skip_unseen", True)
    check_gpu_layer(GLUON_LAYERS[0])
