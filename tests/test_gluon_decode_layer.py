"""A layer's plan of the Gluon decode pass (ops/triton/gluon_decode_layer.py,
`GluonDecodeLaunch.plan_layer`, `TritonAttentionPlan.plan_layer`).

On a CPU, the kernel launch recorded: the layer's path hands the kernel the very arguments
and call key that the launch's `run` hands it for the same tensors (both forms, split and
unsplit, e4m3 with one-value descales, sinks or none), places each call's query and output,
and leaves to `run` what it cannot take as `run` would; the plan's layer path runs the Gluon
launch, then the reduce, into the outputs `run` writes, after the Gluon prefill launch where
the step has both. On an sm_90 GPU with Triton 3.6
(`cuda` marks): a layer's eager decode through its layer plan equals `run`'s output bit for
bit, and the float64 oracle, over bf16 and e4m3 caches.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import reference as ref  # noqa: E402
from conftest import assert_close, make_paged_batch, needs_gluon_sm90, poison  # noqa: E402
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import gluon_decode_launch as gd  # noqa: E402
from pagedattn.ops.triton import launch as launch_mod  # noqa: E402
from pagedattn.ops.triton import layer_plan  # noqa: E402
from pagedattn.ops.triton.attention_plan import plan_attention  # noqa: E402
from pagedattn.ops.triton.gluon_decode_layer import DecodeLayerPlan  # noqa: E402
from test_gluon_decode import _fp8_cache, make_launch  # noqa: E402

cuda = pytest.mark.cuda
on_sm90 = needs_gluon_sm90()
E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16


class Recorder:
    """Stands in for a launch's kernel launches: records (LSE given, sinks given), the
    arguments and the call key of each launch."""

    def __init__(self):
        self.calls = []

    def launch_for(self, write_lse, sinks):
        def launch(args, call_key):
            self.calls.append(((write_lse, sinks), args, call_key))
        return launch


def recorded(persistent=False, split=False, fp8=False):
    """(batch, launch, recorder): make_launch's launch (8 heads over 2 KV heads of 64, three
    requests, six queries), in the persistent form where asked, its launches recorded."""
    b, launch, part = make_launch(split=split, fp8=fp8)
    if persistent:
        launch = gd.PersistentDecodeLaunch(
            batch=3, programs=5, num_splits=3 if split else 1, constexprs=launch.constexprs,
            floats=launch.floats, window=launch.window, total_q=6,
            cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k, block_table=b.block_table,
            partials=part)
    rec = Recorder()
    launch.launch_for = rec.launch_for
    if fp8:
        b.q, b.k_cache, b.v_cache = (x.to(E4M3) for x in (b.q, b.k_cache, b.v_cache))
    return b, launch, rec


def assert_same_args(got, want):
    assert len(got) == len(want)
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, torch.Tensor) or w is None:
            assert a is w, i
        else:
            assert type(a) is type(w) and a == w, i


def rows(b):
    """The layer's rows: q [6, 8 * 64] and a poisoned out of the same width."""
    return b.q.reshape(6, -1), poison((6, 8 * 64), BF16)


CASES = [dict(persistent=p, split=s, fp8=f, sinks=k)
         for p in (False, True) for s in (False, True) for f in (False, True)
         for k in (False, True)]


# --- CPU: the layer's arguments against run's ------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(k for k, v in c.items() if v)
                         or "plain")
def test_the_layer_path_hands_the_kernel_what_run_hands_it(case):
    b, launch, rec = recorded(case["persistent"], case["split"], case["fp8"])
    sinks = torch.randn(8) if case["sinks"] else None
    # fp8: one-value descales, q's missing (1, the launch's own)
    descales = (None, torch.tensor(0.5), torch.full((1, 1), 0.25)) if case["fp8"] else \
        (None, None, None)
    q, out = rows(b)
    plan = launch.plan_layer(b.k_cache, b.v_cache, sinks, *descales, q_dtype=q.dtype,
                             out_dtype=BF16)
    assert isinstance(plan, DecodeLayerPlan)
    plan.run(plan.call_args(q, out))
    launch.run(q, b.k_cache, b.v_cache, out, None, sinks, *descales)
    (layer_choice, layer_args, layer_key), (run_choice, run_args, run_key) = rec.calls
    assert layer_choice == run_choice == (False, case["sinks"])
    assert layer_key == run_key and layer_key is not None
    assert_same_args(layer_args, run_args)
    # what the arguments are, by the kernel's names
    kernel = gd.gluon_decode_persistent.gluon_decode_persistent_kernel if case["persistent"] \
        else gd.gluon_decode.gluon_decode_kernel
    a = dict(zip(kernel.arg_names, layer_args))  # the runtime ones lead
    assert a["Q"] is q and a["stride_qt"] == 8 * 64 and a["sinks"] is sinks
    if case["split"]:
        assert a["Out"] is launch.partials[0] and a["Lse"] is launch.partials[1]
    else:
        assert a["Out"] is out and a["Lse"] is None
        assert (a["stride_ot"], a["stride_oh"]) == (8 * 64, 64)
    if case["fp8"]:
        assert a["q_descale"] is launch.ones and a["k_descale"] is descales[1]
        assert a["v_descale"] is descales[2] and layer_key[0] is E4M3
        assert (a["stride_ds_b"], a["stride_ds_h"]) == (0, 0)
    else:
        assert a["q_descale"] is None and a["k_descale"] is None
    if case["persistent"]:
        assert layer_args[-2:] == (3, 5)  # batch, programs


@pytest.mark.parametrize("split", [False, True])
def test_each_call_places_its_own_query_and_output(split):
    """A second call with other tensors (a query of wider rows, as a view of a fused QKV
    projection has): only the query, its row stride and the output change, as in run's."""
    b, launch, rec = recorded(split=split)
    q, out = rows(b)
    plan = launch.plan_layer(b.k_cache, b.v_cache, None, None, None, None, q_dtype=BF16,
                             out_dtype=BF16)
    plan.run(plan.call_args(q, out))
    qkv = torch.randn(6, (8 + 2 * 2) * 64).to(BF16)
    q2, out2 = qkv[:, :8 * 64], poison((6, 8 * 64), BF16)
    plan.run(plan.call_args(q2, out2))
    launch.run(q2, b.k_cache, b.v_cache, out2)
    (_, first, key1), (_, second, key2), (_, by_run, run_key) = rec.calls
    assert key1 == key2 == run_key
    assert_same_args(second, by_run)
    a1, a2 = (dict(zip(gd.gluon_decode.gluon_decode_kernel.arg_names, x))
              for x in (first, second))
    assert a2["Q"] is q2 and a2["stride_qt"] == 12 * 64 and a1["stride_qt"] == 8 * 64
    assert a2["Out"] is (launch.partials[0] if split else out2)
    changed = {n for n in a1 if n in a2 and not (
        a1[n] is a2[n] if isinstance(a1[n], torch.Tensor) else a1[n] == a2[n])}
    assert changed == ({"Q", "stride_qt"} if split else {"Q", "stride_qt", "Out"})


# --- CPU: what the layer path leaves to run --------------------------------------------------
def test_a_layer_plan_is_refused_where_run_would_convert_or_lay_out():
    b, launch, _ = recorded(fp8=True)
    k, v = b.k_cache, b.v_cache
    kw = dict(q_dtype=E4M3, out_dtype=BF16)
    one = torch.tensor(0.5)
    assert launch.plan_layer(k, v, None, one, one, one, **kw) is not None
    # an expanded one value (strides 0) is one value to the kernel
    assert launch.plan_layer(k, v, None, one.expand(3, 2), None, None, **kw) is not None
    misaligned = torch.empty(9)[1:]
    for refused in [
            (torch.randn(8).double(), None, None, None),  # run() converts the sinks
            (misaligned, None, None, None),  # Triton specialises on the alignment
            (None, torch.rand(3, 2), None, None),  # per-head: the plan lays them out
            (None, None, torch.rand(3, 2), torch.rand(3, 2)),
            (None, one.double(), None, None),
            (None, None, misaligned[:1], None)]:
        assert launch.plan_layer(k, v, *refused, **kw) is None, refused
    # caches without a TMA row view (run raises for each call) or unaligned
    nb = k.shape[0]  # slots 136 bytes apart: no 16-byte rows
    no_rows = torch.empty(nb * 16 * 136, dtype=torch.uint8).view(E4M3).as_strided(
        k.shape, (16 * 136, 136, 64, 1))
    assert launch.plan_layer(no_rows, no_rows, None, None, None, None, **kw) is None
    flat = torch.empty(k.numel() + 1, dtype=torch.uint8)[1:].view(E4M3).view(k.shape)
    assert launch.plan_layer(flat, flat, None, None, None, None, **kw) is None


def test_a_call_is_left_to_run_unless_its_rows_are_the_planned_ones():
    b, launch, _ = recorded()
    plan = launch.plan_layer(b.k_cache, b.v_cache, None, None, None, None, q_dtype=BF16,
                             out_dtype=BF16)
    q, out = rows(b)
    assert plan.call_args(q, out) == (q, 8 * 64, out)
    odd_rows = torch.randn(6, 8 * 64 + 1).to(BF16)[:, :8 * 64]  # 1,026-byte rows
    misaligned_out = torch.empty(6 * 8 * 64 + 1, dtype=BF16)[1:].view(6, 8 * 64)
    for call in [(q.half(), out), (q, out.float()), (b.q, out), (q, out.view(6, 8, 64)),
                 (q.t().contiguous().t(), out), (odd_rows, out),
                 (q, out.t().contiguous().t()), (q, poison((6, 8 * 64 * 2), BF16)[:, ::2]),
                 (q, misaligned_out)]:
        assert plan.call_args(*call) is None


# --- CPU: the plan's layer path ---------------------------------------------------------------
def served_plan(monkeypatch, **kw):
    """A plan of 32 heads over 8 KV heads of 128 (make_paged_batch's batch b) with the
    Gluon decode pass served (the device check stubbed: a CPU plans as an sm_90 GPU would),
    its launches recorded ("decode", arguments, call key) by a fake that writes each
    target from the call's query."""
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(gd, "why_not_decode", lambda **why: [])
    query_lens, seq_lens = kw.pop("batch_lens", ((1, 3, 2), (40, 300, 77)))
    b = make_paged_batch(list(query_lens), list(seq_lens), 32, 8, 128, dtype=BF16)
    plan = plan_attention(**b.plan_args(**{"softmax_scale": 0.125, **kw}))
    calls = []

    def launch(args, call_key):
        calls.append(("decode", args, call_key))
        q, target, lse = args[0], args[3], args[4]
        total_q = q.shape[0]
        if lse is not None:  # split: each split's rows from q, LSE by split
            target[:, :total_q].copy_(q.float().view(1, total_q, 32, 128))
            lse[:, :total_q].copy_(torch.arange(lse.shape[0]).view(-1, 1, 1))
        else:
            target.copy_(q.view(target.shape))

    monkeypatch.setattr(plan.gluon_decode, "launch_for", lambda lse, sinks: launch)
    return plan, b, calls


@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_plans_layer_path_writes_what_run_writes(num_splits, monkeypatch):
    """Through `layer_plan.plan_layer` (no cache write): the Gluon decode launch, then the
    reduce over its splits, into the outputs run() writes, from the same arguments."""
    plan, b, calls = served_plan(monkeypatch, num_splits=num_splits)
    layer = layer_plan.plan_layer(plan, None, b.k_cache, b.v_cache, None, None, None, None,
                                  None, None, None, num_tokens=6)
    assert isinstance(layer.gluon, DecodeLayerPlan)
    assert [p[0].name for p in layer.passes] == (["reduce"] if num_splits > 1 else [])
    q = b.q.reshape(6, -1)
    by_run, by_layer = poison((6, 32 * 128), BF16), poison((6, 32 * 128), BF16)
    plan.run(q, b.k_cache, b.v_cache, by_run)
    assert layer.run(q, None, None, by_layer) is True
    (_, run_args, run_key), (_, layer_args, layer_key) = calls
    assert layer_key == run_key and layer_key is not None
    assert_same_args(layer_args, run_args[:3] + (by_layer,) + run_args[4:] if num_splits == 1
                     else run_args)
    # the reduce merged every split of q's values (equal values: q, to its rounding)
    assert torch.equal(by_layer, by_run)
    assert_close(by_layer, q.double(), BF16)


def test_a_mixed_step_runs_its_prefill_pass_after_the_gluon_decode(monkeypatch):
    plan, b, _ = served_plan(monkeypatch, batch_lens=((1, 40), (50, 60)), num_splits=1)
    attend = plan.plan_layer(b.k_cache, b.v_cache)
    assert isinstance(attend.gluon, DecodeLayerPlan)
    assert [p[0].name for p in attend.passes] == ["prefill"]


def test_the_plan_leaves_to_run_what_its_layer_path_cannot_take(monkeypatch):
    plan, b, _ = served_plan(monkeypatch, num_splits=2)
    k, v = b.k_cache, b.v_cache
    assert plan.plan_layer(k, v) is not None
    assert plan.plan_layer(k, v, sinks=torch.randn(32).double()) is None
    lse_plan, b, _ = served_plan(monkeypatch, num_splits=2, write_lse=True)
    assert lse_plan.gluon_decode is not None and lse_plan.plan_layer(k, v) is None
    fp8_plan, b, _ = served_plan(monkeypatch, num_splits=1, kv_dtype=E4M3, q_dtype=E4M3,
                                 use_kv_descale=True, use_q_descale=True)
    k8, v8 = b.k_cache.to(E4M3), b.v_cache.to(E4M3)
    assert fp8_plan.plan_layer(k8, v8, k_descale=torch.tensor(0.5)) is not None
    assert fp8_plan.plan_layer(k8, v8, k_descale=torch.rand(3, 8),
                               v_descale=torch.rand(3, 8)) is None  # per head: run() lays out
    assert fp8_plan.plan_layer(k, v) is None  # a cache of another dtype


@pytest.mark.parametrize("sinks", [False, True])
def test_a_step_with_both_gluon_passes_runs_them_in_runs_order(sinks, monkeypatch):
    """A step of prompts and decodes with the Gluon prefill pass served too (its device
    check stubbed as well): the layer runs the prefill launch, then the decode launch, then
    the decode splits' reduce, with the arguments run() gives them."""
    monkeypatch.setattr(ag, "why_not", lambda **why: [])
    monkeypatch.setattr(ag, "_sm_count", lambda device: 132)  # an H200's: decodes split
    monkeypatch.setattr(launch_mod, "sm_count", lambda device: 132)
    plan, b, calls = served_plan(monkeypatch, batch_lens=((1, 600, 2), (1100, 700, 50)),
                                 use_sinks=sinks)
    assert plan.gluon is not None and plan.gluon_decode.split
    monkeypatch.setattr(plan.gluon, "launcher", lambda args, key: calls.append(("prefill",
                                                                               args, key)))
    sink = torch.randn(32) if sinks else None
    layer = layer_plan.plan_layer(plan, None, b.k_cache, b.v_cache, None, None, None, sink,
                                  None, None, None, num_tokens=603)
    assert isinstance(layer.gluon, layer_plan.GluonLayerPlans)
    assert [p[0].name for p in layer.passes] == ["reduce"]
    q = b.q.reshape(603, -1)
    by_run, by_layer = poison((603, 32 * 128), BF16), poison((603, 32 * 128), BF16)
    plan.run(q, b.k_cache, b.v_cache, by_run, None, None, sink)
    n = len(calls)
    assert layer.run(q, None, None, by_layer) is True
    assert [c[0] for c in calls] == ["prefill", "decode"] * 2
    for (_, by_run_args, run_key), (_, layer_args, layer_key) in zip(calls, calls[n:]):
        assert layer_key == run_key and layer_key is not None
        if by_run_args[0] is q and by_run_args[5] is by_run:  # the prefill's Out
            by_run_args = by_run_args[:5] + (by_layer,) + by_run_args[6:]
        assert_same_args(layer_args, by_run_args)
    # the decode rows: merged from their splits (q's values); the prompt rows: the prefill
    # launch's (the stand-in wrote none: NaN in both)
    assert torch.equal(by_layer.isnan(), by_run.isnan())
    decode_rows = torch.tensor([0, 601, 602])
    assert torch.equal(by_layer[decode_rows], by_run[decode_rows])
    assert_close(by_layer[decode_rows], q[decode_rows].double(), BF16)


# --- GPU: the layer's eager decode against run() and the oracle -------------------------------
GPU_CASES = {
    "bf16 split": dict(num_splits=3),
    "bf16 unsplit, sinks": dict(num_splits=1, sinks=True),
    "e4m3 split, sinks": dict(num_splits=2, fp8=True, sinks=True),
    "e4m3 unsplit": dict(num_splits=1, fp8=True),
    "e4m3 persistent split": dict(num_splits=2, fp8=True, persistent=True),
    # a prompt on the Gluon prefill pass beside the decodes (enough query blocks to fill
    # the SMs, so that pass serves it): both Gluon launches, then the reduce
    "bf16 with a Gluon prompt": dict(num_splits=0, lens=([1, 600, 2], [3000, 700, 50])),
}


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_a_layers_decode_equals_run(name, monkeypatch):
    case = dict(GPU_CASES[name])
    fp8, sinks = case.pop("fp8", False), case.pop("sinks", False)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent",
                        case.pop("persistent", False))
    query_lens, seq_lens = case.pop("lens", ([1, 2, 1], [3000, 700, 33]))
    total_q = sum(query_lens)
    b = make_paged_batch(query_lens, seq_lens, 32, 8, 128, dtype=BF16, device="cuda")
    q, k, v = b.q, b.k_cache, b.v_cache
    q64, k64, v64 = q.cpu().double(), k.cpu().double(), v.cpu().double()
    descales = (None, None, None)
    if fp8:  # one value each, as a layer's scales are
        scales = [torch.tensor(s) for s in (0.02, 0.03, 0.015)]
        k, k64 = _fp8_cache(k, b.block_table, seq_lens, 16, scales[1].expand(3, 8))
        v, v64 = _fp8_cache(v, b.block_table, seq_lens, 16, scales[2].expand(3, 8))
        q8 = (q.float() / scales[0].item()).clamp(-448, 448).to(E4M3)
        q, q64 = q8, q8.cpu().double() * scales[0].item()
        descales = tuple(s.cuda() for s in scales)
    sink = torch.randn(32, generator=torch.Generator().manual_seed(3)).cuda() if sinks \
        else None
    plan = plan_attention(**b.plan_args(q_dtype=q.dtype, kv_dtype=k.dtype, out_dtype=BF16,
                                        use_sinks=sinks, use_q_descale=fp8,
                                        use_kv_descale=fp8, **case))
    assert plan.gluon_decode is not None
    assert plan.gluon_decode.num_splits == case["num_splits"] or not case["num_splits"]
    layer = layer_plan.plan_layer(plan, None, k, v, None, None, None, sink, *descales,
                                  num_tokens=total_q)
    assert isinstance(layer.gluon, DecodeLayerPlan if plan.gluon is None
                      else layer_plan.GluonLayerPlans)
    assert (plan.gluon is not None) == (total_q > 4), "the prompt is not on the Gluon pass"
    rows = q.reshape(total_q, -1)
    by_run = poison((total_q, 32 * 128), BF16, "cuda")
    by_layer = poison((total_q, 32 * 128), BF16, "cuda")
    plan.run(rows, k, v, by_run, None, None, sink, *descales)
    assert layer.run(rows, None, None, by_layer) is True
    torch.cuda.synchronize()
    assert torch.equal(by_layer, by_run)
    expected, _ = ref.paged_attention(
        q64, k64, v64, query_lens, seq_lens, b.block_table.cpu(), scale=128 ** -0.5,
        causal=True, sinks=None if sink is None else sink.cpu())
    assert_close(by_layer.view(total_q, 32, 128), expected, BF16)
