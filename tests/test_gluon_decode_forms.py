"""The Gluon decode kernel's forms by switch: the fp8 P V (`SWITCHES.gluon_decode_fp8_pv`:
gluon_decode_rings.py, `gluon_decode.decode_unit`, `gluon_decode_tiles.fp8_pv`) and the
lazy O rescale (`SWITCHES.gluon_decode_max_slack`: `gluon_decode.rescale`,
`gluon_decode_tiles.max_slack`).

On a CPU: each switch reaches both kernel forms' constexpr (PV_FP8 over an fp8 cache only,
MAX_SLACK over every cache), off by default; other values are refused by name; the V slots'
shared memory. On an sm_90 GPU with Triton 3.6 (`cuda` marks): decodes through
`plan_attention`, outputs within the fp8 P V's bound of the float64 oracle where it runs
(`test_gluon_decode.assert_out`; else the dtype's tolerance) and LSEs at the usual
tolerance, both poisoned first: GQA 1 / 4 / 8, heads 64 / 128 / 256, splits 1 and more, a
window, sinks, a soft cap, both forms, many units a program, and CUDA graphs replayed with
new lengths. An e5m2 cache is the `tl` pass's (the Gluon decode pass serves an e4m3 q over
an e4m3 cache only), so the fp8 P V never reaches one.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from conftest import assert_same_but, needs_gluon_sm90, poison  # noqa: E402
from pagedattn.ops.triton import gluon_decode_launch as gd  # noqa: E402
from pagedattn.ops.triton import gluon_decode_tiles as tiles  # noqa: E402
from pagedattn.ops.triton import launch as launch_mod  # noqa: E402
from test_gluon_decode import GPU_CASES, graph_replays, plan_for, run_decode  # noqa: E402

cuda = pytest.mark.cuda
on_sm90 = needs_gluon_sm90()
E4M3 = torch.float8_e4m3fn
FP8_PLAN = dict(q_dtype=E4M3, kv_dtype=E4M3, out_dtype=torch.bfloat16, use_q_descale=True,
                use_kv_descale=True)


# --- CPU: the switch, its constexpr and its refusals -------------------------------------
@pytest.fixture
def served(monkeypatch):
    """The Gluon decode pass on and the device check stubbed: a CPU plans as an sm_90 GPU."""
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(gd, "why_not_decode", lambda **kw: [])
    monkeypatch.setattr(gd, "sm_count", lambda device: 132)


def test_the_defaults_run_the_fp8_p_v_and_the_exact_lazy_rescale():
    assert launch_mod.Switches().gluon_decode_fp8_pv is True
    assert launch_mod.Switches().gluon_decode_max_slack == 0


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("switch, fp8, expected", [
    (False, True, False), (True, True, True), (True, False, False), (False, False, False)])
def test_the_switch_reaches_both_forms_over_fp8_caches_alone(switch, fp8, expected, persistent,
                                                             served, monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", persistent)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_fp8_pv", switch)
    g = plan_for(num_splits=2, **(FP8_PLAN if fp8 else {})).gluon_decode
    assert isinstance(g, gd.PersistentDecodeLaunch) == persistent
    assert g.constexprs["KV_FP8"] is fp8 and g.constexprs["PV_FP8"] is expected
    # every other constexpr is the fp16 P V's: the switch changes the V slots' form alone
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_fp8_pv", False)
    other = plan_for(num_splits=2, **(FP8_PLAN if fp8 else {})).gluon_decode
    assert_same_but(g.constexprs, other.constexprs, "PV_FP8")


@pytest.mark.parametrize("value", [None, 1, "yes", 0.0])
def test_other_values_are_refused_by_name(value, served, monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_fp8_pv", value)
    message = f"SWITCHES.gluon_decode_fp8_pv must be True or False, got {value!r}"
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_for(num_splits=2, **FP8_PLAN)
    with pytest.raises(TypeError, match="gluon_decode_fp8_pv"):
        tiles.fp8_pv(value)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("slack, fp8", [(-1, True), (0, True), (0, False), (8, False),
                                        (4, True)])
def test_the_slack_reaches_both_forms_over_every_cache(slack, fp8, persistent, served,
                                                       monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", persistent)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_max_slack", slack)
    g = plan_for(num_splits=2, **(FP8_PLAN if fp8 else {})).gluon_decode
    assert isinstance(g, gd.PersistentDecodeLaunch) == persistent
    assert g.constexprs["MAX_SLACK"] == slack and g.constexprs["KV_FP8"] is fp8


@pytest.mark.parametrize("value, error, text", [
    (9, ValueError, "-1 \\(off\\), 0 \\(exact skip\\) or a slack of 1 to 8, got 9"),
    (-2, ValueError, "got -2"), (None, TypeError, "must be an int, got None"),
    (True, TypeError, "must be an int, got True"), (0.5, TypeError, "got 0.5"),
    ("0", TypeError, "got '0'")])
def test_other_slacks_are_refused_by_name(value, error, text, served, monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_max_slack", value)
    with pytest.raises(error, match="SWITCHES.gluon_decode_max_slack must"):
        plan_for(num_splits=2)
    with pytest.raises(error, match=text):
        tiles.max_slack(value)


def test_decode_constexprs_take_it_over_an_fp8_cache_only():
    args = dict(num_heads=32, num_kv_heads=8, head_size=128, page_size=16, decode_queries=4,
                causal=True, window_left=-1, window_right=-1, softcap=0.0, split=False,
                write_lse=False, use_sinks=False, fp8_pv=True)
    assert gd.decode_constexprs(kv_fp8=True, **args)["PV_FP8"] is True
    assert gd.decode_constexprs(kv_fp8=False, **args)["PV_FP8"] is False
    assert gd.decode_constexprs(kv_fp8=True, **dict(args, fp8_pv=False))["PV_FP8"] is False
    assert gd.decode_constexprs(kv_fp8=False, **args)["MAX_SLACK"] == -1
    assert gd.decode_constexprs(kv_fp8=False, max_slack=8, **args)["MAX_SLACK"] == 8


def test_both_kernels_default_to_the_fp16_p_v_and_a_rescale_every_tile():
    """A launch (or SASS spec) that names neither constexpr compiles today's kernel."""
    for kernel in (gd.gluon_decode.gluon_decode_kernel,
                   gd.gluon_decode_persistent.gluon_decode_persistent_kernel):
        params = inspect.signature(kernel.fn).parameters
        for name, default in (("PV_FP8", False), ("MAX_SLACK", -1)):
            assert "constexpr" in str(params[name].annotation)
            assert params[name].default == default and type(params[name].default) is \
                type(default)


@pytest.mark.parametrize("head_size, per_sm", [(64, 1), (128, 1), (256, 1), (64, 2),
                                               (128, 2)])
def test_fp8_v_slots_take_half_the_v_rings_bytes(head_size, per_sm):
    block_n, num_buf, _, _ = tiles.decode_tiles(head_size, True, per_sm)
    fp16 = tiles.smem_bytes(head_size, True, 1, per_sm)
    fp8 = tiles.smem_bytes(head_size, True, 1, per_sm, pv_fp8=True)
    assert fp16 - fp8 == num_buf * block_n * head_size  # one byte an element, not two
    # a 16-bit cache's slots are 16-bit whatever the switch says
    assert tiles.smem_bytes(head_size, False, 2, per_sm, pv_fp8=True) == \
        tiles.smem_bytes(head_size, False, 2, per_sm)


# --- GPU: real sizes against the oracle, within the fp8 P V's bound -----------------------
# e4m3 cases (`test_gluon_decode.run_decode`'s fp8: an e4m3 q and cache, descales per
# (sequence, KV head)); each compiles a kernel variant of its own.
CASES = {
    "G4 unsplit": GPU_CASES["e4m3 G4 unsplit"],
    "G4 split": GPU_CASES["e4m3 G4 split"],
    "G8 head 64, window, sinks": GPU_CASES["e4m3 G8 head 64, window, sinks"],
    "G1 split": GPU_CASES["e4m3 G1 head 128"],
    "G4 multi-query, sinks, split": dict(query_lens=[2, 4, 1], seq_lens=[3000, 700, 5000],
                                         fp8=True, sinks=True, num_splits=3),
    "G4 window, split": dict(query_lens=[1, 3, 1], seq_lens=[5000, 3000, 100], fp8=True,
                             window=(255, 0), num_splits=4),
    "G4 soft cap": dict(query_lens=[1, 1], seq_lens=[2500, 900], fp8=True, softcap=30.0),
    "G4 head 256, split": dict(query_lens=[1] * 3, seq_lens=[1000, 129, 2500], num_heads=16,
                               num_kv_heads=4, head_size=256, fp8=True, num_splits=2),
    "G4 HND, NaN tails": dict(query_lens=[1, 3, 1], seq_lens=[999, 1001, 17], fp8=True,
                              layout="HND", nan_tail=True, num_splits=2),
    "G4 model splits": dict(query_lens=[1], seq_lens=[20000], fp8=True),
}


@pytest.fixture
def fp8_pv_on(monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_fp8_pv", True)


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_fp8_pv_persistent(name, fp8_pv_on):
    plan, _ = run_decode(**CASES[name])
    g = plan.gluon_decode
    assert isinstance(g, gd.PersistentDecodeLaunch) and g.constexprs["PV_FP8"]


GRID_CASES = ["G4 split", "G8 head 64, window, sinks", "G4 head 256, split"]


@cuda
@on_sm90
@pytest.mark.parametrize("name", GRID_CASES)
def test_gpu_fp8_pv_grid(name, fp8_pv_on, monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", False)
    plan, _ = run_decode(**CASES[name])
    g = plan.gluon_decode
    assert type(g) is gd.GluonDecodeLaunch and g.constexprs["PV_FP8"]


@cuda
@on_sm90
@pytest.mark.parametrize("per_sm", [1, 2])
def test_gpu_fp8_pv_many_units_a_program(per_sm, fp8_pv_on, monkeypatch):
    """A grid of 3 SMs: every program walks rounds of units, the rings' slots and phases
    (the V^T ring's too) counted across them."""
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_per_sm", per_sm)
    monkeypatch.setattr(gd, "sm_count", lambda device: 3)
    plan, _ = run_decode(query_lens=[1, 1, 2, 1, 1], seq_lens=[1200, 3000, 17, 640, 2222],
                         fp8=True, num_splits=2)
    g = plan.gluon_decode
    assert g.programs == 3 * per_sm < g.batch * g.constexprs["NUM_KV"] * g.num_splits


@cuda
@on_sm90
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_fp8_pv_graph_replays_with_new_lengths(persistent, fp8_pv_on, monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", persistent)
    assert graph_replays(True).gluon_decode.constexprs["PV_FP8"]


# The lazy rescale: (slack, fp8 P V, case). Exact (0) over both P V forms; a slack of 8 over
# a 16-bit P V (an fp8 P's shift would be 0: weights in e4m3's subnormals, DESIGN.md).
LAZY_CASES = {
    "0, fp16 P V, e4m3 G4 split": (0, False, CASES["G4 split"]),
    "0, fp16 P V, e4m3 G8 head 64, window, sinks": (0, False,
                                                    CASES["G8 head 64, window, sinks"]),
    "0, fp8 P V, G4 unsplit": (0, True, CASES["G4 unsplit"]),
    "0, fp8 P V, G4 multi-query, sinks, split": (0, True,
                                                 CASES["G4 multi-query, sinks, split"]),
    "0, fp8 P V, G4 head 256, split": (0, True, CASES["G4 head 256, split"]),
    "0, fp8 P V, G1 split": (0, True, CASES["G1 split"]),
    "8, bf16 G4 split": (8, False, GPU_CASES["bf16 G4 split"]),
    "8, bf16 sinks split": (8, False, GPU_CASES["sinks split"]),
    "8, bf16 sliding window": (8, False, GPU_CASES["sliding window"]),
    "8, bf16 soft cap": (8, False, GPU_CASES["soft cap"]),
    "8, fp16 P V, e4m3 G4 model splits": (8, False, CASES["G4 model splits"]),
}


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(LAZY_CASES))
def test_gpu_lazy_rescale(name, monkeypatch):
    slack, fp8_pv, case = LAZY_CASES[name]
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_fp8_pv", fp8_pv)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_max_slack", slack)
    plan, _ = run_decode(**case)
    assert plan.gluon_decode.constexprs["MAX_SLACK"] == slack


@cuda
@on_sm90
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_lazy_rescale_graph_replays_with_new_lengths(fp8, monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_fp8_pv", fp8)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_max_slack", 0)
    assert graph_replays(fp8).gluon_decode.constexprs["MAX_SLACK"] == 0


def _outputs(plan, inputs):
    """(out, lse) of `plan` over `run_decode`'s inputs, both poisoned first."""
    q, k, v, sink, descales, _ = inputs
    out = poison(q.shape, torch.bfloat16, q.device)
    lse = poison((q.shape[1], q.shape[0]), torch.float32, q.device)
    plan.run(q, k, v, out, lse, None, sink, *descales)
    torch.cuda.synchronize()
    return out, lse


@cuda
@on_sm90
@pytest.mark.parametrize("fp8_pv", [False, True])
def test_gpu_exact_lazy_rescale_is_bit_equal_to_a_rescale_every_tile(fp8_pv, monkeypatch):
    """MAX_SLACK 0 skips only multiplies by 1.0: the same bits, split partials and LSE too."""
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_fp8_pv", fp8_pv)
    case = CASES["G4 multi-query, sinks, split"]
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_max_slack", 0)
    lazy, inputs = run_decode(**case)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_max_slack", -1)
    every, _ = run_decode(**case)
    (out_a, lse_a), (out_b, lse_b) = _outputs(lazy, inputs), _outputs(every, inputs)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
