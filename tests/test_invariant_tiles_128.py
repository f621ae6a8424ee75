"""Batch-invariant mode in 128-key tiles for every pass at heads 64 and 128
(`SWITCHES.invariant_tiles_128`; invariant_config.invariant_tiles_128, the Gluon decode kernel's
FOLD_MEM, the Gluon prompt consumer's fold rows at head 128).

With the switch on, the `tl` passes' one config and decode tiles, the Gluon prompt consumer
and the Gluon decode kernel all stream 128-key tiles from key 0 in the same fixed splits, so
a request's rows keep one arithmetic in any batch (other bits than 64-key tiles'). The
decode kernel's unsplit programs, and at head 128 the prompt consumer, keep their fold
state in float32 memory (the registers of the running fold spilled at 128 keys), planned
with the step. CPU: the switch reaches every plan, nonsense is refused, the scratch, and the
guarantee for the interpreted `tl` passes.
GPU (`cuda`, sm_90 with Triton 3.6's Gluon): a request's rows and float32 LSEs bit for bit
alone, in shuffled batches, chunked, as decodes, over 0 / 1 / 4 splits, bf16 / fp16 / e4m3
caches, GQA 1 / 4 / 8, sinks with a window.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from conftest import served_by  # noqa: E402
from pagedattn.ops.providers import use_provider  # noqa: E402
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import attention_plan, invariant_plan, launch  # noqa: E402
from pagedattn.ops.triton import invariant_config as ic  # noqa: E402
from test_batch_invariant import (  # noqa: E402
    FP8,
    Layer,
    World,
    assert_same_bits,
    check_gpu_layer,
    check_last_tokens_agree,
    check_target,
)
from test_invariant_gluon_256 import as_on_a_gpu, plan_batch, route_to_gluon  # noqa: E402

SM90 = (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
        and ag.gluon_available())


def _cfg(c: launch.AttnConfig) -> tuple:
    return (c.block_m, c.block_n, c.num_warps, c.num_stages)


# --- CPU: the switch and its refusals -------------------------------------------------------
def test_the_default_gives_head_64_alone_128_key_tiles(monkeypatch):
    assert launch.SWITCHES.invariant_tiles_128 is None
    as_on_a_gpu(monkeypatch, switch=False)
    assert _cfg(ic.invariant_config(head_size=128, head_size_v=128, group_pad=4)) == \
        (128, 64, 8, 2)
    assert _cfg(ic.invariant_config(head_size=64, head_size_v=64, group_pad=4)) == \
        (64, 128, 4, 3)
    assert _cfg(ic.invariant_config(head_size=256, head_size_v=256, group_pad=4)) == \
        (64, 64, 8, 2)


def test_the_switch_off_leaves_64_key_tiles(monkeypatch):
    as_on_a_gpu(monkeypatch, switch=False)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", False)
    assert _cfg(ic.invariant_config(head_size=128, head_size_v=128, group_pad=4)) == \
        (128, 64, 8, 2)
    assert _cfg(ic.invariant_config(head_size=64, head_size_v=64, group_pad=4)) == \
        (64, 64, 4, 3)


def test_heads_64_and_128_take_128_key_tiles_for_every_pass(monkeypatch):
    as_on_a_gpu(monkeypatch, switch=False)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    wide = ic.invariant_config(head_size=128, head_size_v=128, group_pad=4)
    assert _cfg(wide) == (128, 128, 8, 2)
    dec = ic.invariant_decode_config(wide, 4, 128)
    assert _cfg(dec) == (64, 128, 4, 3) and ic.invariant_tiles_agree(wide, dec) == ""
    narrow = ic.invariant_config(head_size=64, head_size_v=64, group_pad=8)
    assert _cfg(narrow) == (64, 128, 4, 3)
    assert ic.invariant_decode_config(narrow, 8, 64) is narrow
    assert _cfg(ic.invariant_config(head_size=128, head_size_v=64, group_pad=2)) == \
        (128, 128, 8, 2)  # the largest head size decides
    # head 256 keeps its tiles; a group wider than the decode rows keeps the one config
    assert _cfg(ic.invariant_config(head_size=256, head_size_v=256, group_pad=4)) == \
        (64, 64, 8, 2)
    huge = ic.invariant_config(head_size=128, head_size_v=128, group_pad=128)
    assert ic.invariant_decode_config(huge, 128, 128) is huge
    assert ic.invariant_split_keys(wide.block_n, 128) == 1024
    # the Gluon kernels' tiles follow (`tl_tiles_refusal` accepts them)
    assert invariant_plan.gluon_tiles(own_tiles=False, head_size=128, head_size_v=128,
                                      group_pad=4) == (128, 1024, 16)
    assert invariant_plan.tl_tiles_refusal(num_heads=32, num_kv_heads=8, head_size=64,
                                           head_size_v=64) == []


@pytest.mark.parametrize("value", [1, "on", 0.5])
def test_a_switch_that_is_not_a_bool_is_refused(value, monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", value)
    with pytest.raises(ValueError,
                       match=rf"invariant_tiles_128={value!r} must be None, True or"):
        ic.invariant_config(head_size=128, head_size_v=128, group_pad=4)


def test_other_key_tiles_beside_the_switch_are_refused(monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", (64, 64, 4, 3))
    with pytest.raises(ValueError, match=r"names \(64, 64, 4, 3\) for head size 128, beside "
                                         "invariant_tiles_128"):
        ic.invariant_config(head_size=128, head_size_v=128, group_pad=4)
    # tiles of block_n 128 agree; a head size the switch does not cover keeps its own
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles",
                        {128: (64, 128, 4, 3), 256: (64, 64, 8, 2)})
    assert _cfg(ic.invariant_config(head_size=128, head_size_v=128, group_pad=4)) == \
        (64, 128, 4, 3)
    assert _cfg(ic.invariant_config(head_size=256, head_size_v=256, group_pad=4)) == \
        (64, 64, 8, 2)
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 192)
    with pytest.raises(ValueError, match="invariant_split_keys=192 must be a positive multiple"
                                         " of the batch-invariant tiles' block_n=128"):
        ic.invariant_split_keys(128, 128)


# --- CPU: the plans ---------------------------------------------------------------------------
H128 = dict(head_size=128, head_size_v=128)
BATCHES = {  # name: (query lengths, key lengths)
    "one decode, 3 splits": ([1], [3000]),
    "32 decodes": ([1] * 32, [3000] * 32),
    "decodes of a few queries": ([3, 16, 2], [2000, 2500, 900]),
    "one prompt": ([2600], [2600]),
    "mixed": ([1, 700, 1, 17, 1], [3000, 700, 40, 1100, 2049]),
}
DECODE_FOLD = {  # the decode kernel's fold state: (token, head) rows or, where fewer, its
    # programs' 64 rows (16 queries x GQA 4) per (request, KV head)
    "one decode, 3 splits": (1, 16, 128),
    "32 decodes": (32, 16, 128),
    "decodes of a few queries": (21, 16, 128),
    "one prompt": (1, 4, 64, 128),
    "mixed": (5, 4, 64, 128),
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("num_splits", [0, 1, 4])
@pytest.mark.parametrize("kv", [torch.bfloat16, FP8])
def test_every_pass_a_batch_plans_streams_128_key_tiles(name, num_splits, kv, monkeypatch):
    """The Gluon prompt consumer, the Gluon decode kernel and any `tl` launch of a head-128
    layer's batches: BLOCK_N 128 and 1,024-key splits; the prompt consumer folds in memory
    (head 256's fold rows: a persistent program's 128 rows of Dv float32 in the plan), the
    decode kernel's unsplit programs too (a row per (token, head), or where fewer a
    program's 64 rows per (request, KV head)), its split programs through partials and the
    fold launch."""
    route_to_gluon(monkeypatch, switch=False)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    lengths, keys = BATCHES[name]
    plan = plan_batch(lengths, keys, num_splits, kv_dtype=kv, **H128)
    for x in plan.launches:  # `tl` launches: at most the fold of split programs here
        assert x.name == "reduce" or x.constexprs["BLOCK_N"] == 128
    if max(lengths) > 16:
        s = plan.gluon.schedule
        assert (s.constexprs["BLOCK_N"], s.constexprs["INVARIANT_SPLIT"]) == (128, 1024)
        # the prompt consumer's fold rows from word FOLD_AT of its Work, past a dynamic
        # hand-out's counters
        assert s.constexprs["FOLD_AT"] == (32 if s.constexprs["DYNAMIC"] else 0)
        fold = plan.gluon.fold
        assert fold.shape == (s.grid, 128, 128) and 0 < s.grid <= 132
        assert fold.dtype == torch.float32
        assert fold.numel() * 4 == invariant_plan.invariant_scratch_bytes(
            total_q=sum(lengths), num_heads=16, head_size_v=128, fold=fold.shape)
    decodes = plan.gluon_decode
    c = decodes.constexprs
    assert (c["BLOCK_N"], c["SPLIT_KEYS"], c["QUERIES"], c["NUM_BUF"]) == \
        (128, 1024, 16, 2 if kv == FP8 else 3)
    if decodes.partials is not None:
        assert c["FOLD_MEM"] is False and decodes.fold is None
        assert [x.name for x in plan.launches] == ["reduce"]
    else:
        assert c["FOLD_MEM"] is True
        shape = DECODE_FOLD[name]
        assert decodes.fold.shape == shape and c["FOLD_BY_PROGRAM"] is (len(shape) == 4)
        assert decodes.fold.dtype == torch.float32
        assert decodes.fold.numel() * 4 == invariant_plan.invariant_scratch_bytes(
            total_q=sum(lengths), num_heads=16, head_size_v=128, fold=shape)


def test_the_fold_state_is_planned_once_for_every_form_a_call_may_pick(monkeypatch):
    """Planned with and without sinks / LSE (a wrapper whose run() chooses): the decode
    kernel's fold state and the prompt consumer's are made by the plan, not by a layer's
    call, one for every form, and a layer's run launches what the plan holds."""
    route_to_gluon(monkeypatch, switch=False)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    plan = plan_batch(*BATCHES["mixed"], use_sinks=None, **H128)
    assert plan.gluon_decode.fold is not None
    assert plan.gluon_decode.constexprs["FOLD_MEM"] is True
    forms = list(plan.gluon_choices.values())
    assert len(forms) == 2 and all(f.fold is not None for f in forms)
    assert len({f.work.data_ptr() for f in forms}) == 1  # one Work for both forms


def test_todays_128_key_tiles_without_the_switch_keep_the_fold_in_registers(monkeypatch):
    """`invariant_tiles` naming 128-key tiles (the sweep's "128-key tiles" config) without
    the switch: the decode kernel as before (FOLD_MEM off, no fold state); the switch off
    with 64-key tiles: nothing changes."""
    route_to_gluon(monkeypatch, switch=False)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", ic.INVARIANT_TILES_128)
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles",
                        ic.INVARIANT_DECODE_TILES_128)
    plan = plan_batch(*BATCHES["mixed"], **H128)
    c = plan.gluon_decode.constexprs
    assert (c["BLOCK_N"], c["FOLD_MEM"]) == (128, False) and plan.gluon_decode.fold is None
    s = plan.gluon.schedule  # the prompt consumer likewise: its fold in registers
    assert (s.constexprs["BLOCK_N"], s.constexprs["FOLD_AT"]) == (128, -1)
    assert plan.gluon.fold is None
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", None)
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles", None)
    plan = plan_batch(*BATCHES["mixed"], **H128)
    c = plan.gluon_decode.constexprs
    assert (c["BLOCK_N"], c["FOLD_MEM"]) == (64, False) and plan.gluon_decode.fold is None
    s = plan.gluon.schedule
    assert (s.constexprs["BLOCK_N"], s.constexprs["FOLD_AT"]) == (64, -1)
    assert plan.gluon.fold is None


def test_head_256_on_the_gluon_kernels_alone_keeps_its_tiles(monkeypatch):
    route_to_gluon(monkeypatch, switch=True)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    plan = plan_batch(*BATCHES["mixed"])  # FACTS' head 256
    assert plan.gluon_decode.constexprs["BLOCK_N"] == 64
    assert plan.gluon_decode.constexprs["FOLD_MEM"] is False  # HEAD_DV > 128 folds anyway


# --- CPU: the guarantee on the interpreted `tl` passes ----------------------------------------
@st.composite
def head_64_layers(draw) -> Layer:
    num_kv_heads = draw(st.sampled_from((1, 2)))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16)))
    fp8 = dtype != torch.float32 and draw(st.booleans())
    return Layer(
        num_heads=num_kv_heads * draw(st.sampled_from((1, 2, 4))), num_kv_heads=num_kv_heads,
        head_size=64, head_size_v=64, dtype=dtype, cache_dtype=FP8 if fp8 else dtype,
        block_size=draw(st.sampled_from((8, 16))), window=draw(st.sampled_from((0, 0, 70))),
        softcap=draw(st.sampled_from((0.0, 5.0))), alibi=draw(st.booleans()),
        sinks=draw(st.booleans()))


def test_the_tl_passes_keep_the_guarantee_in_128_key_tiles(monkeypatch):
    """Head 64 under the interpreter with the switch on (the `tl` pass's (64, 128, 4, 3)
    tiles, splits of 128 keys so that rows fold up to 3): each row close to the oracle and
    of the same bits alone, in any batch, chunked and as decodes, under every split
    schedule."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 128)
    seen = []
    real = ic.invariant_config

    def spy(**kw):
        cfg = real(**kw)
        seen.append(_cfg(cfg))
        return cfg

    monkeypatch.setattr(ic, "invariant_config", spy)

    @settings(max_examples=3, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data):
        layer = data.draw(head_64_layers())
        lengths = data.draw(st.lists(st.integers(1, 300), min_size=2, max_size=3))
        world = World(layer, lengths, "cpu", data.draw(st.integers(0, 2 ** 16)))
        with use_provider("triton"):
            check_target(data, world, 2, (0, 1, 3))

    check()
    assert seen and {c[1] for c in seen} == {128}


# --- GPU: the Gluon kernels and the `tl` passes in 128-key tiles ------------------------------
LAYERS = [
    Layer(32, 8, 128, 128, torch.bfloat16, torch.bfloat16, 16),
    Layer(8, 8, 128, 128, torch.float16, torch.float16, 16, softcap=30.0),
    Layer(32, 4, 64, 64, torch.bfloat16, torch.bfloat16, 32, window=700, sinks=True),
    Layer(32, 8, 128, 128, torch.bfloat16, FP8, 16),
    Layer(32, 4, 128, 128, torch.bfloat16, FP8, 16, sinks=True, window=1500),
    Layer(16, 2, 64, 64, torch.float16, FP8, 16, sinks=True),
]


def _layer_id(c: Layer) -> str:
    return (f"h{c.num_heads}/{c.num_kv_heads}-d{c.head_size}-{str(c.cache_dtype)[6:]}"
            f"{'-win' if c.window else ''}{'-sinks' if c.sinks else ''}"
            f"{'-cap' if c.softcap else ''}")


def _switch_on(monkeypatch) -> tuple[list, list]:
    """The switch on, and spies: the decode kernel's constexprs per plan that served, and
    whether the Gluon prompt consumer served."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    forms = []
    real = attention_plan.plan_invariant_decode

    def spy(**kwargs):
        result = real(**kwargs)
        if result is not None:
            c = result[0].constexprs
            forms.append((c["BLOCK_N"], c["FOLD_MEM"], result[0].fold is not None))
        return result

    monkeypatch.setattr(attention_plan, "plan_invariant_decode", spy)
    return forms, served_by(monkeypatch, attention_plan, "plan_invariant_gluon")


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton 3.6's Gluon")
@pytest.mark.parametrize("layer", LAYERS, ids=_layer_id)
def test_gpu_a_requests_rows_are_one_arithmetic_in_128_key_tiles(layer, monkeypatch):
    """The mode's shared check (`test_batch_invariant.check_gpu_layer`: alone against the
    float64 oracle, chunks and decodes in shuffled batches of chunks and decodes, 0 / 1 / 4
    splits, decodes in steps of decodes alone) with every pass in 128-key tiles: the Gluon
    decode kernel's programs (folding in memory where unsplit) beside the `tl` passes and
    the Gluon prompt consumer."""
    forms, prompts = _switch_on(monkeypatch)
    check_gpu_layer(layer)
    assert forms and all(block_n == 128 for block_n, _, _ in forms)
    assert any(fold_mem and fold for _, fold_mem, fold in forms)
    assert any(prompts)


LENGTHS = [2600, 1, 1024, 1025, 127, 128, 129, 2048, 2049, 3000, 700, 17]


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton 3.6's Gluon")
@pytest.mark.parametrize("layer", [LAYERS[0], LAYERS[2], LAYERS[4]], ids=_layer_id)
def test_gpu_decodes_and_prompts_of_0_1_4_splits_agree(layer, monkeypatch):
    """Each request's last token as a decode (1 key, a tile's edge, a split's edge, 3 splits;
    alone, beside every other decode, beside prompts) and as a prompt's last row, whole and
    chunked across a split's edge: the same bits, outputs and LSEs, under 0 / 1 / 4 splits
    (the decode kernel's unsplit programs folding in memory, its split programs and the
    fold launch)."""
    forms, _ = _switch_on(monkeypatch)
    world = World(layer, LENGTHS, "cuda", seed=11)
    check_last_tokens_agree(world, LENGTHS)
    assert {fold_mem for _, fold_mem, _ in forms} == {True, False}  # both decode forms ran


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton 3.6's Gluon")
def test_gpu_the_fold_in_memory_gives_the_register_folds_bits(monkeypatch):
    """The decode kernel at 128-key tiles with its fold in registers (today's form, the
    "128-key tiles" config) and in memory (the switch): the same bits, over 1-3 splits."""
    layer = LAYERS[4]
    world = World(layer, LENGTHS, "cuda", seed=13)
    decodes = [(r, 0, n - 1, n) for r, n in enumerate(LENGTHS)]
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", ic.INVARIANT_TILES_128)
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles",
                        ic.INVARIANT_DECODE_TILES_128)
    in_registers = world.run(decodes, 1)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    in_memory = world.run(decodes, 1)
    for r, (a, b) in enumerate(zip(in_registers, in_memory)):
        assert_same_bits(a, b, 0, f"request {r}'s decode, fold in memory vs registers")
