"""Batch-invariant layers of head size 256 on the Gluon kernels alone
(`SWITCHES.invariant_gluon_256`; invariant_plan.gluon_256_refusal, gluon_invariant.py's
FOLD, gluon_decode_invariant.py at head 256).

The `tl` pass's head-256 tiles split a row over two warps, so no Gluon consumer repeats its
bits: such a layer runs its prompts on the Gluon prompt consumer and its decodes on the
Gluon decode kernel, both with one arithmetic a row (64-row wgmma tiles, 64-key tiles from
key 0, the fixed splits' states kept in float32 memory and folded in order), and never the
`tl` pass. CPU: the switch, the per-layer choice from static facts with each refusal's
reason, how every kind of batch is planned (no `tl` attention launch, ever), the
constexprs and the scratch (its sizes). GPU (`cuda`, sm_90 with Triton 3.6's Gluon): a
request's rows and float32 LSEs bit for bit alone, in shuffled batches, chunked, as decodes,
over 1 and 3 splits and any split schedule, bf16 / fp16 / e4m3 caches, GQA 1 / 4 / 8.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import (  # noqa: E402
    FP8_TOLERANCE,
    TOLERANCE,
    assert_close,
    cu_seqlens,
    plan_as_on_sm90,
    served_by,
)
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import attention_plan, invariant_plan, launch  # noqa: E402
from test_batch_invariant import (  # noqa: E402
    FP8,
    Layer,
    World,
    assert_same_bits,
    check_gpu_layer,
    check_last_tokens_agree,
)

SM90 = (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
        and ag.gluon_available())
FACTS = dict(device=torch.device("cuda"), paged=True, page_size=16, num_heads=16,
             num_kv_heads=4, head_size=256, head_size_v=256, q_dtype=torch.bfloat16,
             kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, use_alibi=False,
             use_q_descale=False, use_kv_descale=False)


def as_on_a_gpu(monkeypatch, switch: bool = True) -> None:
    """The planner as on an sm_90 GPU with Gluon (tiles, device checks, SM count)."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_256", switch)
    plan_as_on_sm90(monkeypatch)


# --- CPU: the per-layer choice ---------------------------------------------------------------
def test_the_switch_is_on_by_default_and_named(monkeypatch):
    assert launch.SWITCHES.invariant_gluon_256 is True
    as_on_a_gpu(monkeypatch)
    assert invariant_plan.gluon_256_refusal(**FACTS) == []
    as_on_a_gpu(monkeypatch, switch=False)
    assert invariant_plan.gluon_256_refusal(**FACTS) == ["SWITCHES.invariant_gluon_256 is off"]
    assert not invariant_plan.gluon_256(**FACTS)


@pytest.mark.parametrize("q, kv, heads, kv_heads", [
    (torch.bfloat16, torch.bfloat16, 16, 16), (torch.float16, torch.float16, 16, 4),
    (torch.bfloat16, FP8, 32, 4), (torch.bfloat16, torch.bfloat16, 16, 2)])
def test_head_256_layers_both_kernels_serve_are_taken(q, kv, heads, kv_heads, monkeypatch):
    as_on_a_gpu(monkeypatch)
    facts = dict(FACTS, q_dtype=q, kv_dtype=kv, out_dtype=q, num_heads=heads,
                 num_kv_heads=kv_heads, use_kv_descale=kv == FP8)
    assert invariant_plan.gluon_256_refusal(**facts) == []
    assert invariant_plan.gluon_256(**facts)


@pytest.mark.parametrize("change, reason", [
    (dict(head_size=128, head_size_v=128), "up to 128 the Gluon consumers give the `tl` pass's"),
    (dict(head_size_v=128), "head sizes 256/128: needs one of (256,) for both"),
    (dict(use_alibi=True), "ALiBi"),
    (dict(paged=False), "dense varlen keys"),
    (dict(q_dtype=FP8, kv_dtype=FP8), "the consumer serves a 16-bit q"),
    (dict(kv_dtype=torch.float8_e5m2, use_kv_descale=True), "needs a cache of q's dtype or e4m3"),
    (dict(device=torch.device("cpu")), "device cpu is not an sm_90 GPU"),
])
def test_what_either_kernel_cannot_serve_is_refused_with_the_reason(change, reason,
                                                                   monkeypatch):
    as_on_a_gpu(monkeypatch)
    if "device" in change:
        monkeypatch.setattr(ag, "_sm90", lambda device: device.type == "cuda")
    why = invariant_plan.gluon_256_refusal(**dict(FACTS, **change))
    assert any(reason in r for r in why), why
    assert len(why) == len(set(why))  # a limit both kernels share is named once
    assert not invariant_plan.gluon_256(**dict(FACTS, **change))


@pytest.mark.parametrize("switch", ["invariant_gluon", "invariant_gluon_decode"])
def test_the_gluon_invariant_switches_and_fused_multiply_adds_are_refused(switch,
                                                                         monkeypatch):
    as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(launch.SWITCHES, switch, False)
    assert f"SWITCHES.{switch} is off" in invariant_plan.gluon_256_refusal(**FACTS)
    monkeypatch.setattr(launch.SWITCHES, switch, True)
    monkeypatch.setattr(launch.SWITCHES, "invariant_fp_fusion", True)
    why = invariant_plan.gluon_256_refusal(**FACTS)
    assert sum("invariant_fp_fusion" in r for r in why) == 1, why


# --- CPU: how batches are planned -------------------------------------------------------------
def route_to_gluon(monkeypatch, switch: bool = True) -> None:
    """`as_on_a_gpu`, planning with CPU tensors (the Gluon limits checked as for a GPU)."""
    as_on_a_gpu(monkeypatch, switch)
    real = ag.why_not
    monkeypatch.setattr(ag, "why_not", lambda **kw: real(**dict(kw, device=FACTS["device"])))


def plan_batch(lengths: list[int], keys: list[int], num_splits: int = 0, **change):
    """plan_attention in batch-invariant mode over requests of `lengths` queries and `keys`
    keys, FACTS' layer (GQA 4, head 256) unless changed."""
    f = dict(FACTS, **change)
    batch = len(lengths)
    kv = f["kv_dtype"]
    return attention_plan.plan_attention(
        device=torch.device("cpu"), cu_seqlens_q=cu_seqlens(lengths),
        seqused_k=torch.tensor(keys, dtype=torch.int32), cu_seqlens_k=None,
        block_table=torch.zeros(batch, 400, dtype=torch.int32), batch=batch,
        total_q=sum(lengths), max_seqlen_q=max(lengths), max_seqlen_k=max(keys),
        num_heads=f["num_heads"], num_kv_heads=f["num_kv_heads"], head_size=f["head_size"],
        head_size_v=f["head_size_v"], page_size=16, q_dtype=f["q_dtype"], kv_dtype=kv,
        out_dtype=f["out_dtype"], softmax_scale=0.0625, causal=True, window_left=-1,
        window_right=-1, softcap=0.0, use_alibi=False, use_sinks=f.get("use_sinks", False),
        use_q_descale=False, use_kv_descale=kv == FP8, write_lse=True, num_splits=num_splits,
        batch_invariant=True)


BATCHES = {  # name: (query lengths, key lengths)
    "one decode, 3 splits": ([1], [3000]),
    "32 decodes": ([1] * 32, [3000] * 32),
    "decodes of a few queries": ([3, 16, 2], [2000, 2500, 900]),
    "one prompt": ([2600], [2600]),
    "a chunk after a context": ([500], [2600]),
    "mixed": ([1, 700, 1, 17, 1], [3000, 700, 40, 1100, 2049]),
}
# The decode kernel's fold state where its programs fold (unsplit): a row per (token, head)
# or, where fewer, a program's 64 rows (16 queries x GQA 4) per (request, KV head)
DECODE_FOLD = {
    "one decode, 3 splits": (1, 16, 256),
    "32 decodes": (32, 16, 256),  # 512 rows against 32 x 4 x 64
    "decodes of a few queries": (21, 16, 256),  # 336 against 768
    "one prompt": (1, 4, 64, 256),  # 256 rows against 2600 x 16
    "a chunk after a context": (1, 4, 64, 256),
    "mixed": (5, 4, 64, 256),  # 1280 rows against 720 x 16
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_every_batch_of_the_layer_runs_on_the_gluon_kernels_alone(name, num_splits,
                                                                  monkeypatch):
    """No `tl` attention launch in any batch of a head-256 layer (at most the fold of the
    decode kernel's split programs), prompts (more than 64 / 4 queries) on the prompt
    consumer with its fold state, decodes on the decode kernel at the same tiles."""
    route_to_gluon(monkeypatch)
    lengths, keys = BATCHES[name]
    plan = plan_batch(lengths, keys, num_splits)
    assert [x.name for x in plan.launches] in ([], ["reduce"])
    decodes = plan.gluon_decode
    assert decodes is not None  # every batch plans it (its programs skip longer requests)
    c = decodes.constexprs
    assert (c["HEAD_D"], c["BLOCK_N"], c["SPLIT_KEYS"], c["QUERIES"], c["GROUP_PAD"]) == \
        (256, 64, 1024, 16, 4)
    prompts = max(lengths) > 16
    assert (plan.gluon is not None) == prompts
    if prompts:
        s = plan.gluon.schedule
        assert (s.constexprs["BLOCK_N"], s.constexprs["INVARIANT_SPLIT"], s.skip_q_len) == \
            (64, 1024, 16)
        # a persistent program's 128 rows: it folds one item at a time
        assert plan.gluon.fold.shape == (s.grid, 128, 256) and 0 < s.grid <= 132
        assert plan.gluon.fold.dtype == torch.float32
        assert decodes.partials is None and plan.launches == ()  # beside prompts: in program
    if decodes.partials is not None:  # split programs: the fold kernel folds their states
        assert decodes.fold is None and [x.name for x in plan.launches] == ["reduce"]
    else:
        assert decodes.fold.shape == DECODE_FOLD[name]
        assert decodes.fold.dtype == torch.float32
        assert c["FOLD_BY_PROGRAM"] is (len(DECODE_FOLD[name]) == 4)


def test_the_switch_off_leaves_the_layer_to_the_tl_pass(monkeypatch):
    route_to_gluon(monkeypatch, switch=False)
    for lengths, keys in BATCHES.values():
        plan = plan_batch(lengths, keys)
        assert plan.gluon is None and plan.gluon_decode is None
        assert [x.name for x in plan.launches][0] == "prefill"


def test_a_layer_the_kernels_refuse_runs_every_batch_on_the_tl_pass(monkeypatch):
    """Head sizes 256 / 128 are the decode kernel's limit: the prompts of such a layer do not
    go to the Gluon consumer either (its rows would not be the `tl` decodes')."""
    route_to_gluon(monkeypatch)
    for lengths, keys in BATCHES.values():
        plan = plan_batch(lengths, keys, head_size_v=128)  # refused: head sizes 256 / 128
        assert plan.gluon is None and plan.gluon_decode is None
        assert "prefill" in [x.name for x in plan.launches]


def test_the_scratch_sizes(monkeypatch):
    route_to_gluon(monkeypatch)
    size = invariant_plan.invariant_scratch_bytes
    assert size(total_q=2600, num_heads=16, head_size_v=256, fold=(132, 128, 256)) == \
        4 * 132 * 128 * 256
    assert size(total_q=1, num_heads=16, head_size_v=256, splits=3) == 4 * 3 * 16 * 257
    assert size(total_q=5, num_heads=16, head_size_v=256) == 0
    plan = plan_batch([1], [3000])  # one decode over 3 splits: split programs and the fold
    out, lse = plan.gluon_decode.partials
    assert out.shape == (3, 1, 16, 256) and lse.shape == (3, 1, 16)
    assert (out.numel() + lse.numel()) * 4 == size(total_q=1, num_heads=16, head_size_v=256,
                                                   splits=3)
    mixed = plan_batch(*BATCHES["mixed"])  # a fold state each: the programs' rows
    grid = mixed.gluon.schedule.grid
    assert mixed.gluon.fold.numel() * 4 == size(total_q=720, num_heads=16, head_size_v=256,
                                                fold=(grid, 128, 256)) == 4 * grid * 128 * 256
    assert mixed.gluon_decode.fold.numel() * 4 == 4 * 5 * 4 * 64 * 256
    either = plan_batch(*BATCHES["mixed"], use_sinks=None)  # planned with and without sinks
    assert len({id(c.work) for c in either.gluon_choices.values()}) == 1  # the fold's


MIB = 1 << 20
STEPS = {  # name: (query lengths, key lengths, prompt fold bytes, decode fold bytes) at 32
    # heads, GQA 4, head 256; before, each was 4 x total_q x 32 x 256 bytes (8 x 2048: 512 MiB)
    "8 x 2048 prompts": ([2048] * 8, [2048] * 8, 132 * 128 * 256 * 4, 8 * 8 * 64 * 256 * 4),
    "256 decodes": ([1] * 256, [3000] * 256, None, 256 * 32 * 256 * 4),
    "8 x 2048 prompts beside 64 decodes": ([2048] * 8 + [1] * 64, [2048] * 8 + [3000] * 64,
                                           132 * 128 * 256 * 4, 72 * 8 * 64 * 256 * 4),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_the_fold_states_are_sized_by_the_programs_not_the_steps_tokens(name, monkeypatch):
    """The prompt consumer's fold state is its persistent programs' rows, [grid, 128, Dv]
    float32 (a step of 8 x 2048 tokens: 16.5 MiB, was 512 MiB); the decode kernel's the
    smaller of its tokens' rows and its programs' (beside prompts: the programs')."""
    route_to_gluon(monkeypatch)
    lengths, keys, prompt_bytes, decode_bytes = STEPS[name]
    plan = plan_batch(lengths, keys, num_splits=1, num_heads=32, num_kv_heads=8)
    if prompt_bytes is None:
        assert plan.gluon is None
    else:
        assert plan.gluon.schedule.grid == 132  # min(items, SMs)
        assert plan.gluon.fold.numel() * 4 == prompt_bytes
        assert plan.gluon.fold.shape == (132, 128, 256)
    assert plan.gluon_decode.fold.numel() * 4 == decode_bytes
    assert plan.gluon is None or plan.gluon_decode.fold is not plan.gluon.work
    assert prompt_bytes is None or prompt_bytes < 17 * MIB


def test_the_dynamic_hand_out_keeps_a_programs_fold_rows(monkeypatch):
    """A batch the dynamic hand-out serves (long prompts over more K/V than L2, GQA 2): a
    program still takes its items one after the other, so its rows hold its fold state."""
    route_to_gluon(monkeypatch)
    plan = plan_batch([2048] * 8, [2048] * 8, num_splits=1, num_heads=32, num_kv_heads=16)
    s = plan.gluon.schedule
    assert s.constexprs["DYNAMIC"] is True
    assert plan.gluon.fold.shape == (s.grid, 128, 256) and s.grid == 132
    # one work area: the item counters (zero) in its first 128 bytes, then the fold rows
    assert plan.gluon.queue.tolist() == [0, 0]
    assert plan.gluon.queue.data_ptr() == plan.gluon.work.data_ptr()
    assert plan.gluon.fold.data_ptr() == plan.gluon.work.data_ptr() + 128


def test_heads_up_to_128_keep_their_tl_bits_with_the_switch_on(monkeypatch):
    """The switch changes nothing below head 256: the Gluon kernels there keep the `tl`
    pass's tiles and fold in registers (no fold state)."""
    route_to_gluon(monkeypatch)
    plan = plan_batch(*BATCHES["mixed"], head_size=128, head_size_v=128)
    assert plan.gluon.fold is None and plan.gluon_decode.fold is None
    assert plan.gluon_decode.constexprs["QUERIES"] == 16


# --- GPU: one arithmetic a row ----------------------------------------------------------------
# bf16 / fp16 / e4m3 caches, GQA 4 / 1 / 8, a window with sinks, soft cap
LAYERS = [
    Layer(16, 4, 256, 256, torch.bfloat16, torch.bfloat16, 16),
    Layer(8, 8, 256, 256, torch.float16, torch.float16, 16, softcap=30.0),
    Layer(16, 2, 256, 256, torch.bfloat16, torch.bfloat16, 32, window=700, sinks=True),
    Layer(16, 4, 256, 256, torch.bfloat16, FP8, 16),
    Layer(32, 4, 256, 256, torch.bfloat16, FP8, 16, sinks=True, window=1500),
]


def _layer_id(c: Layer) -> str:
    return (f"h{c.num_heads}/{c.num_kv_heads}-d{c.head_size}-{str(c.cache_dtype)[6:]}"
            f"{'-win' if c.window else ''}{'-sinks' if c.sinks else ''}"
            f"{'-cap' if c.softcap else ''}")


def _gluon_only(monkeypatch) -> tuple[list, list, list]:
    """The switch on, and spies: the layer's choice (per call), whether the decode planner
    served, and the `tl` pass's planner (called: it should never be)."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_256", True)
    choices = []
    real = invariant_plan.gluon_256

    def choice(**facts):
        choices.append(real(**facts))
        return choices[-1]

    monkeypatch.setattr(invariant_plan, "gluon_256", choice)
    return (choices, served_by(monkeypatch, attention_plan, "plan_invariant_decode"),
            served_by(monkeypatch, attention_plan, "plan_invariant_launches"))


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton 3.6's Gluon")
@pytest.mark.parametrize("layer", LAYERS, ids=_layer_id)
def test_gpu_a_requests_rows_are_one_arithmetic_on_the_gluon_kernels(layer, monkeypatch):
    """The mode's shared check (`test_batch_invariant.check_gpu_layer`: alone against the
    float64 oracle, chunks and decodes in shuffled batches of chunks and decodes, 0 / 1 / 4
    splits, decodes in steps of decodes alone) with every batch on the Gluon kernels."""
    layer_choice, decodes, tl_pass = _gluon_only(monkeypatch)
    check_gpu_layer(layer)
    assert layer_choice and all(layer_choice) and decodes and all(decodes)
    assert tl_pass == [], "the `tl` pass was planned for a head-256 layer on the Gluon kernels"


LENGTHS = [2600, 1, 1024, 1025, 63, 64, 65, 2048, 2049, 3000, 700, 17]


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton 3.6's Gluon")
@pytest.mark.parametrize("layer", [LAYERS[0], LAYERS[3]], ids=_layer_id)
def test_gpu_decodes_and_prompts_of_0_1_3_splits_agree(layer, monkeypatch):
    """Each request's last token as a decode (alone over its splits: 1 key, one split, a
    split's edge, 3 splits; beside every other decode; beside prompts) and as a prompt's last
    row, whole and chunked across a split's edge: the same bits, outputs and LSEs."""
    layer_choice, _, tl_pass = _gluon_only(monkeypatch)
    world = World(layer, LENGTHS, "cuda", seed=7)
    check_last_tokens_agree(world, LENGTHS)
    assert all(layer_choice) and tl_pass == []


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton 3.6's Gluon")
@pytest.mark.parametrize("layer", [LAYERS[0], LAYERS[4]], ids=_layer_id)
def test_gpu_the_dynamic_hand_out_gives_the_static_orders_bits(layer, monkeypatch):
    """Prompts through the dynamic hand-out, whose item counters and fold rows share the
    plan's Work (`gluon_launch.work_words`: the rows from word 32): the static order's rows
    and LSEs bit for bit, read from the other copy of the cache; the longest request's
    against the float64 oracle."""
    layer_choice, _, tl_pass = _gluon_only(monkeypatch)
    plans = []
    real = ag.plan_gluon_prefill

    def spy(**kwargs):
        plans.append(real(**kwargs))
        return plans[-1]

    monkeypatch.setattr(ag, "plan_gluon_prefill", spy)
    world = World(layer, LENGTHS, "cuda", seed=11)
    monkeypatch.setattr(launch.SWITCHES, "gluon_dynamic", False)
    static = world.run([(r, r % 2, 0, n) for r, n in enumerate(LENGTHS)])
    forms = {(p.schedule.constexprs["DYNAMIC"], p.schedule.constexprs["FOLD_AT"])
             for p in plans if p is not None}
    assert forms == {(False, 0)}
    plans.clear()
    monkeypatch.setattr(launch.SWITCHES, "gluon_dynamic", True)
    dynamic = world.run([(r, 1 - r % 2, 0, n) for r, n in enumerate(LENGTHS)])
    forms = {(p.schedule.constexprs["DYNAMIC"], p.schedule.constexprs["FOLD_AT"])
             for p in plans if p is not None}
    assert forms == {(True, 32)}
    for r, rows in enumerate(dynamic):
        assert_same_bits(rows, static[r], 0, f"request {r} through the dynamic hand-out")
    want_out, want_lse = world.oracle(0)
    assert_close(static[0][0], want_out,
                 **(FP8_TOLERANCE if layer.cache_dtype == FP8 else TOLERANCE[layer.dtype]))
    assert_close(static[0][1], want_lse, **TOLERANCE[torch.float16])
    assert all(layer_choice) and tl_pass == []
