"""Batch-invariant prompts on the Gluon pass's invariant consumer (`SWITCHES.invariant_gluon`;
ops/triton/gluon_invariant.py, invariant_plan.plan_invariant_gluon).

The consumer performs the `tl` invariant pass's operations per row in their order, so a
prompt's rows must have that pass's bits, and the mode's guarantee (a token alike in any
batch, chunked or as a decode) holds with prompts on the Gluon pass and decodes on the `tl`
pass. CPU: what the planner decides and refuses, and that the `tl` launch beside it leaves
the prompts' rows alone (interpreter). GPU (`cuda`, sm_90 with Triton 3.6's Gluon): the two
passes on the same batches, bit for bit, and the mode's shared check with the switch on.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import assert_same_but, cu_seqlens, needs_gluon_sm90, served_by  # noqa: E402
from pagedattn.ops.providers import use_provider  # noqa: E402
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import attention_plan, invariant_plan, launch  # noqa: E402
from pagedattn.ops.triton import gluon_decode_invariant_launch as gdi  # noqa: E402
from pagedattn.ops.triton import invariant_config as ic  # noqa: E402
from test_batch_invariant import (  # noqa: E402
    FP8,
    Layer,
    World,
    bits,
    check_gpu_layer,
)

on_sm90 = needs_gluon_sm90()
REFUSAL = dict(device=torch.device("cpu"), paged=True, page_size=16, num_heads=32,
               num_kv_heads=8, head_size=128, head_size_v=128, q_dtype=torch.bfloat16,
               kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, use_q_descale=False,
               use_kv_descale=False)
SCHEDULE = dict(sm_count=132, batch=3, total_q=3000, max_seqlen_q=2000, num_heads=32,
                num_kv_heads=8, head_size=128, head_size_v=128, causal=True, window_left=-1,
                window_right=-1, softcap=0.0, use_alibi=False, use_sinks=False,
                write_lse=True, paged=True, page_size=16, dense_new_kv=False,
                softmax_scale=0.088, skip_q_len=16, invariant=(64, 1024))


# --- CPU: what the planner decides --------------------------------------------------------
def test_the_switch_is_on_by_default_and_a_cpu_is_refused(monkeypatch):
    assert launch.SWITCHES.invariant_gluon is True
    why = invariant_plan.invariant_gluon_refusal(**REFUSAL)
    assert "device cpu is not an sm_90 GPU" in why
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon", False)
    why = invariant_plan.invariant_gluon_refusal(**REFUSAL)
    assert why[0] == "SWITCHES.invariant_gluon is off"


@pytest.mark.parametrize("change, reason", [
    (dict(paged=False), "dense varlen keys: the consumer serves a paged cache"),
    (dict(q_dtype=FP8, kv_dtype=FP8, use_q_descale=True),
     "q torch.float8_e4m3fn: the consumer serves a 16-bit q"),
    (dict(head_size=256, head_size_v=256, num_heads=16),
     "the `tl` invariant tiles (64 rows, 64 keys, 8 warps) and the consumer's 64-row "
     "warpgroups: 64 rows x 8 warps are not wgmma warpgroups of 16 rows a warp (block_m a "
     "multiple of 64, num_warps = block_m / 16)"),
    (dict(page_size=4), "page size 4 is not a power of 2 >= 8 (TMA boxes)"),
])
def test_what_the_consumer_cannot_serve_is_refused_with_the_reason(change, reason,
                                                                   monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon", True)
    monkeypatch.setattr(launch, "interpreting", lambda: False)  # a GPU's tiles
    assert reason in invariant_plan.invariant_gluon_refusal(**dict(REFUSAL, **change))


def test_fused_multiply_adds_in_the_tl_pass_are_refused(monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon", True)
    monkeypatch.setattr(launch.SWITCHES, "invariant_fp_fusion", True)
    why = invariant_plan.invariant_gluon_refusal(**REFUSAL)
    assert why[0].startswith("SWITCHES.invariant_fp_fusion: the `tl` pass fuses")


@pytest.mark.parametrize("tiles, served", [(None, True), ({128: (128, 128, 8, 2)}, True),
                                           ({128: (64, 64, 4, 3)}, True),
                                           ({128: (128, 32, 8, 2)}, False),
                                           ({128: (128, 256, 8, 2)}, False)])
def test_only_tl_tiles_of_64_or_128_keys_in_warpgroups_of_16_rows_a_warp_are_served(
        tiles, served, monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon", True)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", tiles)
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 1024)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(ag, "_sm90", lambda device: True)
    monkeypatch.setattr(ag, "gluon_available", lambda: True)
    why = invariant_plan.invariant_gluon_refusal(**dict(REFUSAL, device=torch.device("cuda")))
    block_n = tiles[128][1] if tiles else 64
    assert why == ([] if served else [f"the `tl` invariant tiles' block_n {block_n}: the "
                                      "consumers are built for key tiles of (64, 128)"])
    assert invariant_plan.GLUON_BLOCK_NS == (64, 128)


def test_the_tl_pass_keeps_what_its_decode_tiles_hold(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    assert invariant_plan.invariant_gluon_max_q(head_size=128, head_size_v=128,
                                                group_pad=4) == 16  # 64 decode rows / 4
    assert invariant_plan.invariant_gluon_max_q(head_size=64, head_size_v=64,
                                                group_pad=8) == 8
    assert invariant_plan.invariant_gluon_max_q(head_size=128, head_size_v=128,
                                                group_pad=1) == 64


def test_the_invariant_schedule_mirrors_the_tl_tiles_and_scalars(monkeypatch):
    # the scale rides in the exponent by default, as the `tl` pass's does (same switch)
    assert ag.launch_config(**SCHEDULE).constexprs["SCALE_IN_EXP"] is True
    monkeypatch.setattr(launch.SWITCHES, "invariant_scale_in_exp", False)
    c = ag.launch_config(**SCHEDULE).constexprs
    assert (c["BLOCK_M"], c["BLOCK_N"], c["INVARIANT_SPLIT"]) == (128, 64, 1024)
    assert (c["DENSE_ROWS"], c["QK_FP8"], c["PV_FP8"], c["SCALE_IN_EXP"],
            c["LANE_MASKS"]) == (False, False, False, False, False)
    default = ag.launch_config(**dict(SCHEDULE, invariant=None)).constexprs
    assert (default["BLOCK_N"], default["INVARIANT_SPLIT"], default["SCALE_IN_EXP"]) == \
        (128, 0, True)
    # the `tl` pass's scale: softmax_scale * (1 / softcap), not softmax_scale / softcap
    capped = ag.launch_config(**dict(SCHEDULE, softcap=20.0, softmax_scale=0.1))
    assert capped.floats == (0.1 * (1.0 / 20.0), 20.0 * ag.LOG2E)
    assert 0.1 * (1.0 / 20.0) != 0.1 / 20.0  # the two roundings do differ here


@pytest.mark.parametrize("head, fp8, slots", [(128, False, 2), (64, False, 3), (128, True, 2),
                                              (64, True, 3)])
def test_invariant_tiles_keep_the_default_ring_slots(head, fp8, slots):
    """The invariant consumer's 64-key and 128-key tiles keep the default pass's ring slots
    (so 64-key tiles hold half its keys: KERNEL_NOTES v32 measured the same bytes in more
    slots 1-4% slower)."""
    args = dict(SCHEDULE, head_size=head, head_size_v=head, kv_fp8=fp8, use_kv_descale=fp8)
    default = ag.launch_config(**dict(args, invariant=None)).constexprs
    narrow = ag.launch_config(**args).constexprs
    assert (default["BLOCK_N"], default["NUM_BUF"]) == (128, slots)
    assert (narrow["BLOCK_N"], narrow["NUM_BUF"]) == (64, slots)
    wide = ag.launch_config(**dict(args, invariant=(128, 1024))).constexprs
    assert (wide["BLOCK_N"], wide["NUM_BUF"]) == (128, slots)


def test_the_lean_switch_reaches_the_invariant_consumer_alone(monkeypatch):
    """`SWITCHES.invariant_gluon_lean` becomes the kernel's INVARIANT_LEAN in batch-invariant
    mode only (the default consumer has no such form); nothing else changes. On by default."""
    assert ag.launch_config(**SCHEDULE).constexprs["INVARIANT_LEAN"] is True
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_lean", False)
    off = ag.launch_config(**SCHEDULE).constexprs
    assert off["INVARIANT_LEAN"] is False
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_lean", True)
    on = ag.launch_config(**SCHEDULE).constexprs
    assert on["INVARIANT_LEAN"] is True
    assert_same_but(on, off, "INVARIANT_LEAN")
    assert ag.launch_config(**dict(SCHEDULE, invariant=None)).constexprs["INVARIANT_LEAN"] \
        is False


def test_the_invariant_schedule_has_two_consumers_and_no_fp8_product(monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "gluon_consumers", 3)
    c = ag.launch_config(**dict(SCHEDULE, head_size=64, head_size_v=64)).constexprs
    assert (c["BLOCK_M"], c["CONSUMER_REGS"]) == (128, 232)
    fp8 = ag.launch_config(**dict(SCHEDULE, kv_fp8=True, use_kv_descale=True)).constexprs
    assert (fp8["KV_FP8"], fp8["QK_FP8"], fp8["FP16_DOTS"]) == (True, False, True)
    for bad in (dict(q_fp8=True, kv_fp8=True), dict(paged=False), dict(dense_new_kv=True)):
        with pytest.raises(ValueError, match="the invariant consumer reads a paged cache"):
            ag.launch_config(**dict(SCHEDULE, **bad))


def test_the_tl_launch_beside_it_takes_decode_tiles_and_folds_in_program():
    args = dict(device=torch.device("cpu"), cu_seqlens_q=cu_seqlens([1, 2000]),
                seqused_k=torch.tensor([3000, 2000], dtype=torch.int32), cu_seqlens_k=None,
                block_table=torch.zeros(2, 200, dtype=torch.int32), batch=2, total_q=2001,
                max_seqlen_q=2000, max_seqlen_k=3000, num_heads=8, num_kv_heads=2,
                head_size=16, head_size_v=16, page_size=16, q_dtype=torch.float32,
                kv_dtype=torch.float32, out_dtype=torch.float32, softmax_scale=0.25,
                causal=True, window_left=-1, window_right=-1, softcap=0.0, num_splits=4,
                dtypes=(torch.float32,) * 3)
    split = invariant_plan.plan_invariant_launches(**args)
    assert [x.name for x in split] == ["prefill", "reduce"]
    assert split[0].constexprs["MAX_Q_LEN"] is None
    beside = invariant_plan.plan_invariant_launches(**args, max_q_len=4)
    assert [x.name for x in beside] == ["prefill"]
    assert (beside[0].constexprs["MAX_Q_LEN"], beside[0].constexprs["SPLIT_KV"]) == (4, False)
    with pytest.raises(ValueError, match="max_q_len=5 queries x 4 heads exceed the decode "
                                         "tiles' 16 rows"):
        invariant_plan.plan_invariant_launches(**args, max_q_len=5)


@pytest.mark.parametrize("switch, softcap, use_alibi, want", [
    (False, 0.0, False, False), (True, 0.0, False, True), (True, 30.0, False, False),
    (True, 0.0, True, False)])
def test_every_pass_takes_the_scale_into_the_exponent_alike(switch, softcap, use_alibi, want,
                                                          monkeypatch):
    """`SWITCHES.invariant_scale_in_exp` reaches the `tl` launch (its kernel drops the form
    where ALiBi slopes are given), the Gluon prompt consumer and the Gluon decode kernel
    with one answer per layer: no soft cap, no ALiBi, a positive scale."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_scale_in_exp", switch)
    args = dict(device=torch.device("cpu"), cu_seqlens_q=cu_seqlens([1, 200]),
                seqused_k=torch.tensor([300, 200], dtype=torch.int32), cu_seqlens_k=None,
                block_table=torch.zeros(2, 20, dtype=torch.int32), batch=2, total_q=201,
                max_seqlen_q=200, max_seqlen_k=300, num_heads=8, num_kv_heads=2,
                head_size=16, head_size_v=16, page_size=16, q_dtype=torch.float32,
                kv_dtype=torch.float32, out_dtype=torch.float32, softmax_scale=0.25,
                causal=True, window_left=-1, window_right=-1, softcap=softcap, num_splits=1,
                dtypes=(torch.float32,) * 3)
    (tl_launch,) = invariant_plan.plan_invariant_launches(**args)
    assert tl_launch.constexprs["SCALE_IN_EXP"] is (switch and softcap == 0.0)
    gluon = ag.launch_config(**dict(SCHEDULE, softcap=softcap, use_alibi=use_alibi))
    assert gluon.constexprs["SCALE_IN_EXP"] is want
    assert ag.launch_config(**dict(SCHEDULE, softcap=softcap, use_alibi=use_alibi,
                                   invariant=None)).constexprs["SCALE_IN_EXP"] is \
        (softcap == 0.0 and not use_alibi)  # the default pass: its own form, as before
    decode = gdi.decode_constexprs(
        num_heads=32, num_kv_heads=8, head_size=128, page_size=16, decode_queries=16,
        kv_fp8=False, q_fp8=False, dot_f16=False, causal=True, window_left=-1,
        window_right=-1, softcap=softcap, split=False, split_keys=1024,
        scale_in_exp=ic.invariant_scale_in_exp(0.1, softcap, False))
    assert decode["SCALE_IN_EXP"] is (switch and softcap == 0.0)


class _FakeGluon:
    """Stands in for the Gluon launch on a CPU: records its calls, writes nothing."""

    def __init__(self):
        self.calls = 0

    def run(self, *args):
        self.calls += 1


def test_prompts_are_left_to_the_gluon_launch_and_decodes_keep_their_bits(monkeypatch):
    """With the Gluon launch planned, the `tl` launch writes the decodes' rows with the bits
    it gives them alone, and leaves the prompt's rows as they were (poisoned: NaN)."""
    fake = _FakeGluon()
    planned = []

    def plan_gluon(**kwargs):
        planned.append(kwargs["write_lse"])
        return {(lse, sinks): fake for lse in (False, True) for sinks in (False, True)}

    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 32)
    layer = Layer(4, 2, 16, 16, torch.float32, torch.float32, 8, sinks=True)
    world = World(layer, [70, 45, 90], "cpu", seed=3)
    decodes = [(0, 0, 69, 70), (1, 1, 44, 45)]
    with use_provider("triton"):
        alone = world.run(decodes)
        monkeypatch.setattr(attention_plan, "plan_invariant_gluon", plan_gluon)
        mixed = world.run(decodes[:1] + [(2, 0, 10, 90)] + decodes[1:])
    assert planned == [True] and fake.calls == 1
    for (out_a, lse_a), (out_b, lse_b) in zip(alone, mixed[:1] + mixed[2:]):
        assert torch.equal(bits(out_a), bits(out_b)) and torch.equal(bits(lse_a), bits(lse_b))
    assert mixed[1][0].isnan().all()  # the prompt's rows: the Gluon launch's, not written here


# --- GPU: the two passes, bit for bit -------------------------------------------------------
# bf16 and fp16, heads 64 and 128, GQA 4 / 1 / 8, soft cap with ALiBi, a window with sinks,
# an e4m3 cache (keys converted to fp16, as the `tl` pass converts them): one Gluon compile
# each (the shared check below reuses two)
GLUON_LAYERS = [
    Layer(32, 8, 128, 128, torch.bfloat16, torch.bfloat16, 16),
    Layer(16, 16, 128, 128, torch.float16, torch.float16, 16, softcap=30.0, alibi=True),
    Layer(16, 2, 64, 64, torch.float16, torch.float16, 32, window=700, sinks=True),
    Layer(32, 8, 128, 128, torch.bfloat16, FP8, 16, sinks=True),
]
# (request, copy, first, end) in one batch: whole prompts over one and three splits' keys,
# chunks after a cached context (one across a split's edge), decodes
LENGTHS = [2600, 900, 1700, 40, 1100]
PARTS = [(0, 0, 0, 2600), (1, 1, 0, 900), (2, 0, 1200, 1700), (3, 1, 0, 40),
         (4, 0, 1099, 1100), (2, 1, 1699, 1700), (0, 1, 2000, 2100)]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units of the last place between two float tensors."""
    ia, ib = bits(a).long(), bits(b).long()
    flip = 0x7FFF if a.element_size() == 2 else 0x7FFFFFFF
    ia = torch.where(ia < 0, -(ia & flip), ia)  # sign-magnitude -> a monotone integer line
    ib = torch.where(ib < 0, -(ib & flip), ib)
    return int((ia - ib).abs().max()) if ia.numel() else 0


def _compare(layer: Layer, tl_rows: list, gluon_rows: list) -> None:
    problems = []
    for (r, _, a, b), (out_t, lse_t), (out_g, lse_g) in zip(PARTS, tl_rows, gluon_rows):
        for name, t, g in (("output", out_t, out_g),
                           ("LSE", lse_t.t().contiguous(), lse_g.t().contiguous())):
            same = (bits(t) == bits(g)).reshape(t.shape[0], -1).all(1)
            if not same.all():
                first = a + int((~same).nonzero()[0])
                problems.append(f"request {r} tokens [{a}, {b}): {name} of "
                                f"{int((~same).sum())} of {t.shape[0]} tokens differ, max "
                                f"{_ulps(t, g)} ulp, first at token {first}")
    assert not problems, f"{layer}:\n" + "\n".join(problems)


def _one_schedule(monkeypatch) -> None:
    """One item order for every batch (the schedule never enters the bits): one compile of
    the Gluon kernel per layer, not one per order, keeps the GPU tests within a minute."""
    monkeypatch.setattr(launch.SWITCHES, "gluon_dynamic", False)
    monkeypatch.setattr(launch.SWITCHES, "gluon_lpt_group", 0)


def _layer_id(c: Layer) -> str:
    return (f"h{c.num_heads}/{c.num_kv_heads}-d{c.head_size}-{str(c.cache_dtype)[6:]}"
            f"{'-win' if c.window else ''}{'-sinks' if c.sinks else ''}"
            f"{'-cap' if c.softcap else ''}{'-alibi' if c.alibi else ''}")


@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("layer", GLUON_LAYERS, ids=_layer_id)
def test_gpu_gluon_prompts_have_the_tl_passes_bits(layer, monkeypatch):
    """One batch (prompts over the keys of one and of three 1,024-key splits, a chunk
    after a cached context across a split's edge, decodes) through the `tl` invariant pass
    alone, then with its prompts on the Gluon consumer: outputs and float32 LSEs equal bit
    for bit (the message counts the tokens that differ and their largest ulp distance)."""
    _one_schedule(monkeypatch)
    world = World(layer, LENGTHS, "cuda", seed=11)
    served = served_by(monkeypatch, attention_plan, "plan_invariant_gluon")
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon", False)  # every row on the tl pass
    tl_rows = world.run(PARTS)
    assert served and not any(served)
    served.clear()
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon", True)
    gluon_rows = world.run(PARTS)
    assert served and all(served), "the Gluon consumer did not serve the prompts"
    _compare(layer, tl_rows, gluon_rows)


@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("layer", [GLUON_LAYERS[0], GLUON_LAYERS[3]], ids=_layer_id)
def test_gpu_rows_are_the_same_bits_with_prompts_on_the_gluon_pass(layer, monkeypatch):
    """The mode's shared check (`test_batch_invariant.check_gpu_layer`: alone, in random
    batches, chunked, as decodes, any split schedule) with the switch on."""
    _one_schedule(monkeypatch)
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon", True)
    check_gpu_layer(layer)


# --- GPU: the prompt candidates of issue 44 (KERNEL_NOTES v32), bit for bit ---------------
# Each a set of `launch.SWITCHES` (tools/sweep_invariant.py times the same): the consumer
# without work that cannot change a bit, 128-key tiles for every pass and the score scale in
# the exponent's fma (both change the `tl` pass's rows too: the Gluon prompt consumer and
# decode kernel must follow them bit for bit).
TILES_128 = dict(invariant_tiles={64: (64, 128, 4, 3), 128: (128, 128, 8, 2)},
                 invariant_decode_tiles={128: (64, 4, 3)})
CANDIDATES = {
    "lean": dict(invariant_gluon_lean=True),
    "128 keys": dict(TILES_128, invariant_gluon_lean=True),
    "128 keys, not lean": TILES_128,
    "scale in exp": dict(invariant_scale_in_exp=True),
    "all": dict(TILES_128, invariant_gluon_lean=True, invariant_scale_in_exp=True),
}
# (layer 1's soft cap and ALiBi keep scaled scores: the form is off there in every pass)
CANDIDATE_CASES = [("lean", i) for i in range(4)] + [("128 keys", i) for i in range(4)] \
    + [("128 keys, not lean", 0), ("128 keys, not lean", 3)] \
    + [("scale in exp", i) for i in (0, 2, 3)] + [("all", i) for i in range(4)]


def use_candidate(monkeypatch, name: str) -> None:
    """The candidate's switches set for the test (undone after it)."""
    for field, value in CANDIDATES[name].items():
        monkeypatch.setattr(launch.SWITCHES, field, value)


@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("candidate, layer", [(c, GLUON_LAYERS[i]) for c, i in CANDIDATE_CASES],
                         ids=[f"{c}-{_layer_id(GLUON_LAYERS[i])}" for c, i in CANDIDATE_CASES])
def test_gpu_candidates_keep_the_tl_passes_bits(candidate, layer, monkeypatch):
    """`test_gpu_gluon_prompts_have_the_tl_passes_bits` with a candidate's switches, the
    `tl` pass under the same tiles: the prompts (and, beside them, the decodes on the Gluon
    decode kernel) bit for bit on outputs and float32 LSEs."""
    use_candidate(monkeypatch, candidate)
    test_gpu_gluon_prompts_have_the_tl_passes_bits(layer, monkeypatch)


@pytest.mark.cuda
@on_sm90
def test_gpu_rows_are_the_same_bits_with_every_candidate(monkeypatch):
    """The mode's shared check (alone, in random batches, chunked, as decodes, any split
    schedule) with 128-key tiles, the lean consumer and the scale in the exponent: the
    guarantee itself, not only the passes' agreement."""
    _one_schedule(monkeypatch)
    use_candidate(monkeypatch, "all")
    check_gpu_layer(GLUON_LAYERS[0])


# --- GPU: head 128's prompts folding in memory (`SWITCHES.invariant_tiles_128`) -------------
# At head 128 the switch's 128-key tiles put the consumer's fold state in float32 memory, as
# head 256's (`gluon_launch.fold_at`): the same fold operations, so the `tl` pass's bits.
# The lazy rescale keeps them; the slack changes every pass's alike.
FOLD_FORMS = {
    "switch": dict(invariant_tiles_128=True),
    "switch, lean, scale in exp": dict(invariant_tiles_128=True, invariant_gluon_lean=True,
                                       invariant_scale_in_exp=True),
    "switch, lean, lazy rescale": dict(invariant_tiles_128=True, invariant_gluon_lean=True,
                                       invariant_lazy_rescale=True, invariant_max_slack=0),
    "switch, lean, max slack 8": dict(invariant_tiles_128=True, invariant_gluon_lean=True,
                                      invariant_max_slack=8),
}
FOLD_CASES = [("switch", 0), ("switch", 1), ("switch", 3), ("switch, lean, scale in exp", 0),
              ("switch, lean, scale in exp", 3), ("switch, lean, lazy rescale", 0),
              ("switch, lean, lazy rescale", 3), ("switch, lean, max slack 8", 0)]


@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("form, layer", [(f, GLUON_LAYERS[i]) for f, i in FOLD_CASES],
                         ids=[f"{f}-{_layer_id(GLUON_LAYERS[i])}" for f, i in FOLD_CASES])
def test_gpu_head_128_prompts_folding_in_memory_keep_the_tl_passes_bits(form, layer,
                                                                         monkeypatch):
    """`test_gpu_gluon_prompts_have_the_tl_passes_bits` under `invariant_tiles_128` at head
    128: every Gluon prompt launch planned keeps its fold rows in memory (a persistent
    program's 128 rows of 128 float32), and its rows and LSEs are the `tl` pass's bit for
    bit (prompts over one and three splits, chunks across a split's edge)."""
    for field, value in FOLD_FORMS[form].items():
        monkeypatch.setattr(launch.SWITCHES, field, value)
    folds = []
    real = attention_plan.plan_invariant_gluon

    def spy(**kwargs):
        result = real(**kwargs)
        if result is not None:
            folds.extend(choice.fold for choice in result.values())
        return result

    monkeypatch.setattr(attention_plan, "plan_invariant_gluon", spy)
    test_gpu_gluon_prompts_have_the_tl_passes_bits(layer, monkeypatch)
    assert folds, "no Gluon prompt launch was planned"
    assert all(f is not None and tuple(f.shape[1:]) == (128, 128) for f in folds)
