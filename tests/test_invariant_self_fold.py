"""Batch-invariant split programs that fold their own splits (`SWITCHES.invariant_self_fold`;
`attention.invariant_self_fold_kernel`, `invariant.fold_own_splits`, and the Gluon decode
kernel's SELF_FOLD).

The last split program of a request folds every split in order with the fold launch's
function, so its rows and LSEs must equal the two-launch form's bit for bit. CPU (the `tl`
pass under the interpreter, whose programs run one after another: the last one folds): random
batches over GQA 1/4/8, 1/2/5 splits, bf16 and fp8 caches, windows, sinks and soft cap, each
plan run twice with the output poisoned before each run (the counters back at 0 after each),
and what the plan launches. GPU (`cuda`, an H200): the same comparisons at real sizes, on the
Gluon decode kernel and the `tl` pass, and three CUDA-graph replays with new lengths.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from conftest import cu_seqlens, plan_as_on_sm90  # noqa: E402
from pagedattn.ops.providers import use_provider  # noqa: E402
from pagedattn.ops.triton import attention_plan, invariant_plan, launch  # noqa: E402
from pagedattn.ops.triton import gluon_decode_invariant_launch as gdi  # noqa: E402
from pagedattn.ops.triton import invariant_config as ic  # noqa: E402
from pagedattn.ops.triton.attention_args import Batch, SelfFold  # noqa: E402
from test_batch_invariant import FP8, Layer, World  # noqa: E402

SPLIT_KEYS = 16  # the interpreter's fixed splits (one of its 16-key tiles)


def scratch_of(plan) -> list:
    """(PartOut, PartLse, Tickets) of each of a plan's self-folding launches (the `tl`
    pass's, whose batch ends with `SelfFold`, and the Gluon decode launch's)."""
    size = len(Batch._fields + SelfFold._fields)
    out = [tuple(x.batch[-3:]) for x in plan.launches if len(x.batch) == size]
    if plan.gluon_decode is not None and plan.gluon_decode.self_fold is not None:
        out.append(tuple(plan.gluon_decode.self_fold))
    return out


def tickets_of(plan) -> list:
    """The ticket counters of a plan's self-folding launches."""
    return [scratch[2] for scratch in scratch_of(plan)]


class Runs:
    """Spies on the plans a call makes: each plan's launches by name, and each run (out, LSE
    and a self-folding plan's partial states poisoned with NaN first: a fold that read a
    partial before it was written would show it) with its results kept; a self-folding
    plan's run made twice, its ticket counters kept after each."""

    def __init__(self, monkeypatch):
        self.names, self.results, self.tickets, self.plans = [], [], [], []
        real = attention_plan.plan_attention

        def spy(**kwargs):
            plan = real(**kwargs)
            self.names.append(tuple(x.name for x in plan.launches))
            self.plans.append(plan)
            run = plan.run

            scratch = scratch_of(plan)
            tickets = [t for _, _, t in scratch]

            def twice(q, k, v, out, softmax_lse=None, *args, **kw):
                for _ in range(2 if tickets else 1):
                    for t in [out, softmax_lse] + [p for s in scratch for p in s[:2]]:
                        if t is not None:
                            t.fill_(float("nan"))
                    run(q, k, v, out, softmax_lse, *args, **kw)
                    self.results.append((out.clone(), None if softmax_lse is None
                                         else softmax_lse.clone()))
                    self.tickets += [t.clone() for t in tickets]
            plan.run = twice
            return plan

        monkeypatch.setattr(attention_plan, "plan_attention", spy)


LAYERS = [
    Layer(4, 4, 16, 16, torch.bfloat16, torch.bfloat16, 8),
    Layer(8, 2, 16, 16, torch.bfloat16, FP8, 8, sinks=True),
    Layer(8, 1, 16, 16, torch.bfloat16, torch.bfloat16, 16, window=40, softcap=20.0),
    Layer(4, 1, 32, 32, torch.bfloat16, FP8, 8, window=25, sinks=True, softcap=10.0),
]


def _id(c: Layer) -> str:
    return (f"G{c.num_heads // c.num_kv_heads}-{str(c.cache_dtype)[6:]}"
            f"{'-win' if c.window else ''}{'-sinks' if c.sinks else ''}"
            f"{'-cap' if c.softcap else ''}")


@pytest.mark.parametrize("layer", LAYERS, ids=_id)
def test_self_fold_rows_equal_the_fold_launch_rows(monkeypatch, layer):
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", SPLIT_KEYS)

    @settings(max_examples=2, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow,
                                     HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def check(data):
        # 1, 2 and 5 splits of 16 keys among the requests
        lengths = data.draw(st.lists(st.sampled_from([1, 9, 16, 17, 32, 70, 80]),
                                     min_size=1, max_size=3))
        world = World(layer, lengths, "cpu", data.draw(st.integers(0, 2 ** 16)))
        parts = [(r, data.draw(st.integers(0, 1)), n - 1, n) for r, n in enumerate(lengths)]
        runs = Runs(monkeypatch)
        rows = {}
        for self_fold in (False, True):
            monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", self_fold)
            with use_provider("triton"):
                rows[self_fold] = world.run(parts, num_splits=4)
        many = max(lengths) > SPLIT_KEYS
        assert runs.names == ([("prefill", "reduce"), ("prefill",)] if many
                              else [("prefill",), ("prefill",)])
        for (out_a, lse_a), (out_b, lse_b) in zip(rows[False], rows[True]):
            assert not out_b.isnan().any()
            assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
        first, second = runs.results[1:] if many else (runs.results[1], runs.results[1])
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
        assert len(runs.tickets) == (2 if many else 0)
        assert all(not t.any() for t in runs.tickets)

    check()


def test_a_prompt_split_in_programs_folds_itself_too(monkeypatch):
    """Split programs of several query blocks a request (a prompt with num_splits > 1): a
    counter per query block, the same rows as the fold launch's."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", SPLIT_KEYS)
    layer = Layer(4, 2, 16, 16, torch.bfloat16, torch.bfloat16, 8, sinks=True)
    world = World(layer, [40, 30], "cpu", seed=11)
    parts = [(0, 0, 20, 40), (1, 1, 29, 30)]
    runs = Runs(monkeypatch)
    rows = {}
    for self_fold in (False, True):
        monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", self_fold)
        with use_provider("triton"):
            rows[self_fold] = world.run(parts, num_splits=3)
    assert runs.names == [("prefill", "reduce"), ("prefill",)]
    assert runs.tickets[0].shape[0] > 2 and not any(t.any() for t in runs.tickets)
    for (out_a, lse_a), (out_b, lse_b) in zip(rows[False], rows[True]):
        assert not out_b.isnan().any()
        assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_switch_that_is_not_a_bool_is_refused(monkeypatch, value):
    monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", value)
    with pytest.raises(ValueError, match=rf"invariant_self_fold={value!r} must be True or "):
        ic.invariant_self_fold()


def test_the_switch_is_off_by_default():
    assert launch.SWITCHES.invariant_self_fold is False
    assert ic.invariant_self_fold() is False


# --- CPU: the Gluon decode kernel's plan (as on an H200) ---------------------------------
def _gluon_plan(monkeypatch, batch: int, max_k: int, head: int = 128, num_splits: int = 0):
    plan_as_on_sm90(monkeypatch)
    monkeypatch.setattr(invariant_plan, "invariant_gluon_decode_refusal", lambda **kw: [])
    return invariant_plan.plan_invariant_decode(
        device=torch.device("cpu"), cu_seqlens_q=cu_seqlens([1] * batch),
        seqused_k=torch.full((batch,), max_k, dtype=torch.int32),
        block_table=torch.zeros(batch, 400, dtype=torch.int32), batch=batch, total_q=batch,
        max_seqlen_q=1, max_seqlen_k=max_k, num_heads=32, num_kv_heads=8, head_size=head,
        head_size_v=head, page_size=16, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
        out_dtype=torch.bfloat16, softmax_scale=0.088, causal=True, window_left=-1,
        window_right=-1, softcap=0.0, use_alibi=False, use_q_descale=False,
        use_kv_descale=False, num_splits=num_splits, dtypes=(torch.bfloat16,) * 3,
        prompts_elsewhere=False)


def test_gluon_split_programs_fold_themselves_without_a_fold_launch(monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", True)
    decodes, after = _gluon_plan(monkeypatch, 1, 8192)  # 8 programs < 132 SMs: 8 splits
    assert after == () and decodes.grid == (1, 8, 8) and decodes.partials is None
    assert decodes.split is False  # it writes the outputs, as an unsplit launch does
    c = decodes.constexprs
    assert (c["SPLIT_KV"], c["SELF_FOLD"], c["SPLIT_KEYS"]) == (True, True, 1024)
    fold, part_out, part_lse, tickets = decodes.form_args()
    assert fold is None and part_out.shape == (8, 1, 32, 128) and part_lse.shape == (8, 1, 32)
    assert tickets.shape == (1, 8) and tickets.dtype == torch.int32 and not tickets.any()


def test_gluon_self_fold_is_not_used_where_no_split_programs_run(monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", True)
    many, after = _gluon_plan(monkeypatch, 32, 8192)  # 256 programs: folds in the program
    assert after == () and many.grid == (32, 8, 1) and many.constexprs["SELF_FOLD"] is False
    assert many.form_args() == (None, None, None, None)
    monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", False)
    off, (fold,) = _gluon_plan(monkeypatch, 1, 8192)
    assert off.constexprs["SELF_FOLD"] is False and fold.name == "reduce"


def test_gluon_head_256_keeps_the_fold_launch(monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", True)
    monkeypatch.setattr(invariant_plan, "gluon_256", lambda **facts: True)
    decodes, (fold,) = _gluon_plan(monkeypatch, 1, 8192, head=256)
    assert decodes.constexprs["SELF_FOLD"] is False and fold.name == "reduce"


def test_make_invariant_decode_refuses_self_fold_without_split_programs():
    with pytest.raises(ValueError, match="self_fold needs split programs"):
        gdi.make_invariant_decode(
            cu_seqlens_q=cu_seqlens([1]), seqused_k=torch.ones(1, dtype=torch.int32),
            block_table=torch.zeros(1, 4, dtype=torch.int32), batch=1, total_q=1,
            num_heads=4, num_kv_heads=1, head_size=128, page_size=16,
            q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
            softmax_scale=0.1, causal=True, window_left=-1, window_right=-1, softcap=0.0,
            decode_queries=1, split_keys=1024, splits=1, self_fold=(None, None, None))


def test_a_bad_switch_value_is_refused_by_the_planner(monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", "on")
    with pytest.raises(ValueError, match="invariant_self_fold='on' must be True or False"):
        _gluon_plan(monkeypatch, 1, 8192)


# --- GPU: real sizes, the Gluon decode kernel and the `tl` pass, and graph replays -------
GPU_LAYERS = [
    Layer(32, 32, 128, 128, torch.bfloat16, torch.bfloat16, 16),
    Layer(32, 8, 128, 128, torch.bfloat16, torch.bfloat16, 16, softcap=30.0),
    Layer(16, 2, 64, 64, torch.float16, torch.float16, 32, window=700, sinks=True),
    Layer(32, 8, 128, 128, torch.bfloat16, FP8, 16, sinks=True, softcap=30.0),
    Layer(32, 4, 128, 128, torch.bfloat16, FP8, 16, window=1500, sinks=True),
]
# 1, 2 and 5 splits of 1,024 keys (and edges: a split's, a page's, one key)
GPU_LENGTHS = [4100, 1, 1024, 1025, 2048, 5000, 63, 3000]
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _rows_both_ways(monkeypatch, world: World, parts: list, gluon: bool) -> list:
    """parts through the fold launch's form, then the self-folding one (each plan run twice,
    poisoned first): the second's rows and LSEs, after checking both against the first's."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_decode", gluon)
    runs = Runs(monkeypatch)
    rows = {}
    for self_fold in (False, True):
        monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", self_fold)
        rows[self_fold] = world.run(parts, num_splits=4)
    for (out_a, lse_a), (out_b, lse_b) in zip(rows[False], rows[True]):
        assert not out_b.isnan().any()
        assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    served = runs.plans[-1].gluon_decode is not None
    assert served == gluon, f"the Gluon decode kernel served: {served}"
    a, b = runs.results[1:]  # the self-folding plan, run twice
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert runs.tickets and all(not t.any() for t in runs.tickets)
    return rows[True]


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU (the Gluon kernel: Triton 3.6)")
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "tl"])
@pytest.mark.parametrize("layer", GPU_LAYERS, ids=_id)
def test_gpu_self_fold_rows_equal_the_fold_launch_rows(monkeypatch, layer, gluon):
    """Batches of 1, 2 and 8 decodes over 1 to 5 splits, split programs forced: the
    self-folding form's outputs and LSEs equal the fold launch's, bit for bit."""
    world = World(layer, GPU_LENGTHS, "cuda", seed=7)
    decodes = [(r, r % 2, n - 1, n) for r, n in enumerate(GPU_LENGTHS)]
    for parts in ([decodes[0]], [decodes[5]], decodes[2:4], decodes):
        _rows_both_ways(monkeypatch, world, parts, gluon)


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU (the Gluon kernel: Triton 3.6)")
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "tl"])
@pytest.mark.parametrize("layer", [GPU_LAYERS[1], GPU_LAYERS[3]], ids=_id)
def test_gpu_self_fold_replays_from_a_cuda_graph_with_new_lengths(monkeypatch, layer, gluon):
    """A self-folding plan over 4 decodes captured in a CUDA graph and replayed three times
    with new lengths (written into its seqused_k): each replay's rows equal an eager run of
    the fold launch's form at those lengths (the counters are back at 0 after each)."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_decode", gluon)
    world = World(layer, [5000, 4100, 3000, 2048], "cuda", seed=9)
    made, calls = [], []
    real = attention_plan.plan_attention
    monkeypatch.setattr(attention_plan, "plan_attention",
                        lambda **kw: made.append((real(**kw), kw)) or made[-1][0])
    run = attention_plan.TritonAttentionPlan.run
    signature = inspect.signature(run)

    def spy(self, *a, **kw):
        calls.append(signature.bind(self, *a, **kw).arguments)
        return run(self, *a, **kw)

    monkeypatch.setattr(attention_plan.TritonAttentionPlan, "run", spy)
    monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", True)
    parts = [(r, 0, n - 1, n) for r, n in enumerate(world.lengths)]
    world.run(parts, num_splits=4)  # planned at the longest lengths: 5 splits
    (plan, planned_with), args = made[-1], dict(calls[-1])
    assert plan is args.pop("self")
    out, lse, seqused_k = args["out"], args["softmax_lse"], planned_with["seqused_k"]
    tickets = tickets_of(plan)
    assert len(tickets) == 1
    run(plan, **args)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(plan, **args)
    for lengths in ([4000, 4100, 1, 2048], [1025, 3000, 2999, 1024], [5000, 1, 64, 2047]):
        seqused_k.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not tickets[0].any()
        # the fold launch's form, eager, at the same lengths and the same query rows
        monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", False)
        want = dict(args, out=torch.empty_like(out), softmax_lse=torch.empty_like(lse))
        run(real(**dict(planned_with, seqused_k=seqused_k.clone())), **want)
        monkeypatch.setattr(launch.SWITCHES, "invariant_self_fold", True)
        assert torch.equal(out, want["out"]) and torch.equal(lse, want["softmax_lse"]), \
            f"replay at lengths {lengths}"
