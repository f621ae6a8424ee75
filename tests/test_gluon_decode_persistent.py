"""The Gluon decode pass's persistent form (`SWITCHES.gluon_decode_persistent`:
gluon_decode_persistent.py, gluon_decode_units.py, gluon_decode_launch.PersistentDecodeLaunch).

On a CPU: the units' order and the split model (values), the launch's arguments against the
kernel's signature, and the plan's wiring (the form, its grid and split count, the reduce).
On an sm_90 GPU with Triton 3.6 (`cuda` marks): decodes through `plan_attention` in the
persistent form against the float64 oracle (`test_gluon_decode.run_decode`: outputs and LSE
poisoned first), with units fewer than programs and, on a grid made small, many rounds of
them; and a CUDA graph replayed with new lengths.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from conftest import needs_gluon_sm90  # noqa: E402
from pagedattn.ops.triton import gluon_decode_launch as gd  # noqa: E402
from pagedattn.ops.triton import gluon_decode_units as units  # noqa: E402
from pagedattn.ops.triton import launch as launch_mod  # noqa: E402
from test_gluon_decode import (  # noqa: E402
    GPU_CASES,
    graph_replays,
    make_launch,
    plan_for,
    run_decode,
)

cuda = pytest.mark.cuda
on_sm90 = needs_gluon_sm90()
H200_SMS = 132


# --- CPU: units and the split model -------------------------------------------------------
def test_programs_are_one_a_unit_up_to_per_sm_times_sms():
    assert units.persistent_programs(8, 132, 2) == 8
    assert units.persistent_programs(1024, 132, 2) == 264
    assert units.persistent_programs(1024, 132, 1) == 132
    assert units.persistent_programs(0, 132, 1) == 1
    with pytest.raises(ValueError, match="per_sm=3"):
        units.persistent_programs(8, 132, 3)
    with pytest.raises(ValueError, match="sms=0"):
        units.persistent_programs(8, 0, 1)


def test_units_decode_heads_fastest_then_requests_then_splits():
    # 3 requests x 2 KV heads x 2 splits
    assert [units.unit_order(u, 6, 2) for u in range(12)] == [
        (r, h, s) for s in range(2) for r in range(3) for h in range(2)]


@pytest.mark.parametrize("programs, count", [(4, 10), (5, 5), (7, 3), (3, 12), (264, 1000)])
def test_every_unit_is_walked_once(programs, count):
    walked = sorted(u for p in range(programs) for u in units.program_units(p, programs, count))
    assert walked == list(range(count))


def test_rounds_alternate_direction():
    """Program p takes p, then the mirror of p in the next round (2 P - 1 - p), ...: with
    pairs a multiple of the programs, a pair's splits are not all one program's."""
    assert units.program_units(0, 4, 10) == [0, 7, 8]
    assert units.program_units(1, 4, 10) == [1, 6, 9]
    assert units.program_units(3, 4, 10) == [3, 4]
    # 4 pairs x 2 splits on 4 programs: program 0 runs pair 0's split 0 and pair 3's split 1
    assert [units.unit_order(u, 4, 1) for u in units.program_units(0, 4, 8)] == [
        (0, 0, 0), (3, 0, 1)]


@pytest.mark.parametrize("row, per_sm, splits", [
    # issue 41's rows (8 KV heads), H200: units that fill the programs, 1,024+ keys a split
    ((1, 32768), 2, 32), ((1, 32768), 1, 16), ((8, 131072), 2, 4), ((8, 131072), 1, 2),
    ((64, 16384), 2, 1), ((32, 4096), 2, 1), ((128, 1024), 2, 1), ((4, 8192), 2, 8)])
def test_split_model_on_issue_41s_rows(row, per_sm, splits):
    batch, keys = row
    got = units.persistent_splits(H200_SMS, per_sm, batch * 8, keys)
    assert got == splits
    assert got == 1 or -(-keys // got) >= units.MIN_KEYS
    count = batch * 8 * got
    # one unit a program where units fit the grid, else a near-even share
    programs = units.persistent_programs(count, H200_SMS, per_sm)
    assert count <= per_sm * H200_SMS or count / (programs * -(-count // programs)) > 0.95


def test_split_model_keeps_min_keys_and_prefers_fewer_splits_on_ties():
    # 1,500 keys: no split of 1,024+ keys but one
    assert units.persistent_splits(H200_SMS, 2, 8, 1500) == 1
    # 8 pairs, 2,048 keys: two splits of 1,024 beat one (16 units on 16 programs)
    assert units.persistent_splits(H200_SMS, 2, 8, 2048) == 2
    assert units.persistent_splits(H200_SMS, 2, 8, 2048, min_keys=4096) == 1
    # 264 pairs on 264 programs: splitting only adds units of the same busiest load
    assert units.persistent_splits(H200_SMS, 2, 264, 65536) == 1
    # the cap: 1 pair of 2M keys stops at MAX_SPLITS
    assert units.persistent_splits(H200_SMS, 1, 1, 1 << 21) == units.MAX_SPLITS


def test_model_time_counts_the_busiest_program_and_its_sm():
    # 64 pairs x 4 splits on 256 programs, two an SM: 1 unit of 32,768 keys each, at half
    # of the SM's bandwidth (two programs of 0.75 draw share it)
    assert units.persistent_time(4, 64, 131072, H200_SMS, 2) == (32768 + 256) * 2
    # x 2 splits: 128 programs, one an SM, drawing 0.75 of it
    assert units.persistent_time(2, 64, 131072, H200_SMS, 2) == pytest.approx(
        (65536 + 256) / 0.75)


def test_split_model_refuses_bad_input():
    with pytest.raises(ValueError, match="pairs=0"):
        units.persistent_splits(H200_SMS, 2, 0, 4096)
    with pytest.raises(ValueError, match="min_keys=0"):
        units.persistent_splits(H200_SMS, 2, 8, 4096, min_keys=0)


# --- CPU: the launch and the plan -------------------------------------------------------------
def _persistent(split=False, fp8=False):
    b, other, part = make_launch(split=split, fp8=fp8)
    launch = gd.PersistentDecodeLaunch(
        batch=3, programs=5, num_splits=3 if split else 1, constexprs=other.constexprs,
        floats=other.floats, window=other.window, total_q=6, cu_seqlens_q=b.cu_seqlens_q,
        seqused_k=b.seqused_k, block_table=b.block_table, partials=part)
    return b, launch


def _names(kernel):
    params = inspect.signature(kernel.fn).parameters
    runtime = [n for n, p in params.items() if "constexpr" not in str(p.annotation)]
    return runtime, [n for n in params if n not in runtime]


def test_persistent_kernel_takes_the_other_forms_arguments_then_batch_and_grid():
    runtime, constexprs = _names(gd.gluon_decode_persistent.gluon_decode_persistent_kernel)
    other_runtime, other_constexprs = _names(gd.gluon_decode.gluon_decode_kernel)
    assert runtime == other_runtime + ["batch", "programs"]
    assert constexprs == other_constexprs


@pytest.mark.parametrize("split", [False, True])
def test_persistent_kernel_args(split):
    b, launch = _persistent(split=split)
    out = torch.empty(6, 8, 64, dtype=torch.bfloat16)
    args, key = launch.kernel_args(b.q, b.k_cache, b.v_cache, out, torch.empty(8, 6))
    runtime, _ = _names(gd.gluon_decode_persistent.gluon_decode_persistent_kernel)
    a = dict(zip(runtime, args, strict=True))
    assert (a["batch"], a["programs"], a["num_splits"]) == (3, 5, 3 if split else 1)
    assert (a["Out"] is launch.partials[0]) if split else (a["Out"] is out)
    assert launch.grid == (5,) and launch.split == split and key is not None
    assert launch.scratch.numel() == 5 * gd.SCRATCH_PER_PROGRAM
    assert launch.kernel() is gd.gluon_decode_persistent.gluon_decode_persistent_kernel


def test_persistent_launch_checks_its_counts():
    b, launch = _persistent()
    kw = dict(constexprs=launch.constexprs, floats=(1.0, 0.0), window=(0, 0), total_q=6,
              cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k, block_table=b.block_table)
    with pytest.raises(ValueError, match="programs=0"):
        gd.PersistentDecodeLaunch(batch=3, programs=0, num_splits=1, **kw)
    with pytest.raises(ValueError, match="split launch writes partials"):
        gd.PersistentDecodeLaunch(batch=3, programs=4, num_splits=2, **kw)


@pytest.fixture
def persistent_served(monkeypatch):
    """The switches on and the device check stubbed: a CPU plans as an sm_90 GPU of
    H200_SMS SMs would (the `tl` pass's own split count keeps the interpreter's SMs)."""
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", True)
    monkeypatch.setattr(gd, "why_not_decode", lambda **kw: [])
    monkeypatch.setattr(gd, "sm_count", lambda device: H200_SMS)


def test_a_decode_step_takes_the_persistent_form_and_its_splits(persistent_served):
    plan = plan_for(batch_lens=((1,), (5000,)))
    g = plan.gluon_decode
    assert isinstance(g, gd.PersistentDecodeLaunch)
    # 8 pairs, 5,000 keys: 4 splits of 1,250 keys, 32 units on 32 programs
    assert g.num_splits == units.persistent_splits(H200_SMS, 2, 8, 5000) == 4
    assert g.grid == (32,) and g.batch == 1 and g.programs == 32
    reduce, = plan.launches
    assert reduce.name == "reduce" and reduce.constexprs["NUM_SPLITS"] == 4
    assert g.partials[0].shape[0] == 4 and g.partials[0] is reduce.batch.PartOut
    many = plan_for(batch_lens=((1, 3, 2) * 40, (40, 300, 77) * 40)).gluon_decode
    assert (many.num_splits, many.programs) == (1, 264)  # 960 units on 264 programs


def test_forced_splits_and_mixed_steps_keep_their_split_count(persistent_served):
    forced = plan_for(batch_lens=((1,), (5000,)), num_splits=3).gluon_decode
    assert isinstance(forced, gd.PersistentDecodeLaunch)
    assert (forced.num_splits, forced.programs) == (3, 24)
    # a prefill shares the step: the `tl` pass's count (its split scratch is shared)
    mixed = plan_for(batch_lens=((1, 40), (5000, 60)))
    assert isinstance(mixed.gluon_decode, gd.PersistentDecodeLaunch)
    assert "prefill" in [p.name for p in mixed.launches]
    tl = launch_mod.auto_splits(torch.device("cpu"), 2, 5000, 8)
    assert mixed.gluon_decode.num_splits == tl


def test_switch_off_or_a_refusal_keeps_the_other_form_and_the_tl_count(persistent_served,
                                                                     monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", False)
    g = plan_for(batch_lens=((1,), (5000,))).gluon_decode
    assert type(g) is gd.GluonDecodeLaunch and g.grid[:2] == (1, 8)
    why = dict(device=torch.device("cpu"), num_heads=32, num_kv_heads=8, head_size=128,
               head_size_v=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
               out_dtype=torch.bfloat16, paged=True, page_size=16, decode_queries=4,
               use_alibi=False, use_q_descale=False, use_kv_descale=False)
    assert gd.persistent_decode_splits(max_seqlen_k=5000, num_splits=7, batch=1, **why) == 7
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", True)
    assert gd.persistent_decode_splits(max_seqlen_k=5000, num_splits=7, batch=1, **why) == 4
    # the measured rule (switch None) takes a 16-bit q over its own cache with this form
    # (its 1,250-key splits), and keeps the `tl` count where it would not take the step
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", None)
    assert gd.persistent_decode_splits(max_seqlen_k=5000, num_splits=7, batch=1, **why) == 4
    assert gd.persistent_decode_splits(max_seqlen_k=900, num_splits=7, batch=1, **why) == 7
    monkeypatch.setattr(gd, "why_not_decode", lambda **kw: ["refused"])
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    assert gd.persistent_decode_splits(max_seqlen_k=5000, num_splits=7, batch=1, **why) == 7


def test_fp8_takes_the_persistent_count_where_the_measured_rule_would_not(persistent_served,
                                                                          monkeypatch):
    """With the measured rule (switch None), B1 L32k's `tl` count (668-key splits) keeps the
    `tl` pass; the persistent form's 1,024-key splits pass it."""
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", None)
    e4m3 = torch.float8_e4m3fn
    why = dict(device=torch.device("cpu"), num_heads=32, num_kv_heads=8, head_size=128,
               head_size_v=128, q_dtype=e4m3, kv_dtype=e4m3, out_dtype=torch.bfloat16,
               paged=True, page_size=16, decode_queries=4, use_alibi=False,
               use_q_descale=True, use_kv_descale=True)
    assert not gd.takes_decodes(q_dtype=e4m3, kv_dtype=e4m3, max_seqlen_k=32768, num_splits=49)
    assert gd.persistent_decode_splits(max_seqlen_k=32768, num_splits=49, batch=1, **why) == 32


# --- GPU: the persistent form against the oracle ----------------------------------------------
# Each case compiles a kernel variant of its own (dtype, head, group, split, window / sinks),
# the costly part of these tests; the small-grid cases reuse these variants.
PERSISTENT_CASES = {
    # units fewer than programs (8 x 8 unsplit = 64 units), mixed lengths, GQA 4
    "bf16 G4 unsplit": GPU_CASES["bf16 G4 unsplit"],
    "bf16 G4 split, HND, NaN tails": GPU_CASES["HND cache, NaN tails"],
    "bf16 G4 window, sinks": dict(query_lens=[1, 3, 1], seq_lens=[5000, 3000, 100],
                                  window=(255, 0), sinks=True, num_splits=4),
    "bf16 G1 head 64": GPU_CASES["bf16 G1 head 64"],
    "e4m3 G4 unsplit": GPU_CASES["e4m3 G4 unsplit"],
    "e4m3 G4 split": GPU_CASES["e4m3 G4 split"],
    # GQA 8 and the form's own split count (decodes alone, no forced count: 2 splits)
    "e4m3 G8 head 64, window, sinks": GPU_CASES["e4m3 G8 head 64, window, sinks"],
    "e4m3 G4 model splits": dict(query_lens=[1], seq_lens=[20000], fp8=True),
}
# Many more units than programs: a grid of 3 SMs (6 programs, or 3 at one a SM), so every
# program walks rounds of units in both directions, the last round part empty, over mixed
# lengths (variants above)
SMALL_GRID_CASES = {
    "bf16 G4 many units": (2, dict(query_lens=[1, 2, 1, 1, 3, 1],
                                   seq_lens=[700, 33, 2100, 1, 1500, 260], num_splits=3,
                                   layout="HND", nan_tail=True)),
    "bf16 G4 many units, one a SM": (1, dict(query_lens=[1, 1, 2, 1], seq_lens=[900, 2500, 40, 1],
                                             num_splits=2)),
    "e4m3 G4 many units": (2, dict(query_lens=[1, 1, 2, 1, 1],
                                   seq_lens=[1200, 3000, 17, 640, 2222], fp8=True,
                                   num_splits=2)),
    "e4m3 G8 head 64 many units": (2, dict(query_lens=[1, 2, 1, 1], seq_lens=[900, 2500, 40, 3],
                                           num_heads=32, num_kv_heads=4, head_size=64,
                                           fp8=True, window=(300, 0), sinks=True,
                                           num_splits=2)),
}


@pytest.fixture
def persistent_on(monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", True)


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(PERSISTENT_CASES))
def test_gpu_persistent(name, persistent_on):
    plan, _ = run_decode(**PERSISTENT_CASES[name])
    g = plan.gluon_decode
    assert isinstance(g, gd.PersistentDecodeLaunch)
    assert g.programs == min(g.batch * g.constexprs["NUM_KV"] * g.num_splits,
                             2 * launch_mod.sm_count(g.device))


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(SMALL_GRID_CASES))
def test_gpu_persistent_many_units_a_program(name, persistent_on, monkeypatch):
    per_sm, case = SMALL_GRID_CASES[name]
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_per_sm", per_sm)
    monkeypatch.setattr(gd, "sm_count", lambda device: 3)
    plan, _ = run_decode(**case)
    g = plan.gluon_decode
    assert g.programs == 3 * per_sm < g.batch * g.constexprs["NUM_KV"] * g.num_splits


@cuda
@on_sm90
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_persistent_graph_replays_with_new_lengths(fp8, persistent_on):
    """A graph plan (max lengths) captured once, replayed after the lengths change: every
    partition walks the units' tiles of the new lengths."""
    assert isinstance(graph_replays(fp8).gluon_decode, gd.PersistentDecodeLaunch)
