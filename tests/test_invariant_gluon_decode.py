"""Batch-invariant decodes on the Gluon decode layout's invariant kernel
(`SWITCHES.invariant_gluon_decode`; ops/triton/gluon_decode_invariant.py,
invariant_plan.plan_invariant_decode).

The kernel performs the `tl` invariant pass's operations per row in their order, so a
decode's rows must have that pass's bits. CPU: what the planner refuses (each reason), how it
routes a batch (decodes alone with in-program folds or split programs and the fold kernel,
beside Gluon prompts, or left to the `tl` pass) and the constexprs and floats it launches
with, and that a plan holding it launches nothing else. GPU (`cuda`, sm_90 with Triton 3.6's
Gluon): batches of decodes (1 and 32 requests, 1 and several splits, in-program folds and
split programs) and a mixed batch through the `tl` pass alone, then with the switch on,
bit for bit on outputs and float32 LSEs; and the mode's shared check with the switch on.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import cu_seqlens, plan_as_on_sm90, served_by  # noqa: E402
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import attention_plan, invariant_plan, launch  # noqa: E402
from pagedattn.ops.triton import gluon_decode_invariant_launch as gdi  # noqa: E402
from test_batch_invariant import FP8, Layer, World, bits, check_gpu_layer  # noqa: E402
from test_invariant_gluon import use_candidate  # noqa: E402

SM90 = (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
        and ag.gluon_available())
REFUSAL = dict(device=torch.device("cuda"), paged=True, page_size=16, num_heads=32,
               num_kv_heads=8, head_size=128, head_size_v=128, q_dtype=torch.bfloat16,
               kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, use_alibi=False,
               use_q_descale=False, use_kv_descale=False)


def _a_gpu(monkeypatch, switch: bool = True) -> None:
    """The planner as on an sm_90 GPU with Gluon (tiles, device checks, SM count)."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_decode", switch)
    plan_as_on_sm90(monkeypatch)


# --- CPU: what the planner refuses -------------------------------------------------------
def test_the_switch_is_on_by_default_and_a_cpu_is_refused():
    assert launch.SWITCHES.invariant_gluon_decode is True
    why = invariant_plan.invariant_gluon_decode_refusal(
        **dict(REFUSAL, device=torch.device("cpu")))
    assert "device cpu is not an sm_90 GPU" in why
    assert "SWITCHES.invariant_gluon_decode is off" not in why


def test_the_switch_turned_off_is_named_first(monkeypatch):
    _a_gpu(monkeypatch, switch=False)
    why = invariant_plan.invariant_gluon_decode_refusal(**REFUSAL)
    assert why == ["SWITCHES.invariant_gluon_decode is off"]


@pytest.mark.parametrize("q, kv, out", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16,
                                                       torch.float16),
    (torch.bfloat16, FP8, torch.bfloat16), (torch.float16, FP8, torch.float16)])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 2, 64), (16, 16, 128), (8, 1, 64)])
def test_16_bit_q_over_its_cache_or_e4m3_at_heads_64_and_128_is_served(q, kv, out, heads,
                                                                        monkeypatch):
    _a_gpu(monkeypatch)
    h, hkv, d = heads
    why = invariant_plan.invariant_gluon_decode_refusal(**dict(
        REFUSAL, q_dtype=q, kv_dtype=kv, out_dtype=out, num_heads=h, num_kv_heads=hkv,
        head_size=d, head_size_v=d, use_kv_descale=kv == FP8))
    assert why == []


@pytest.mark.parametrize("change, reason", [
    (dict(paged=False), "dense varlen keys: the kernel reads a paged cache"),
    (dict(q_dtype=FP8, kv_dtype=FP8, use_q_descale=True, use_kv_descale=True),
     "q torch.float8_e4m3fn: the kernel is served a 16-bit q, as the prompts' consumer (an "
     "fp8 q compiles but has not been checked on the GPU)"),
    (dict(kv_dtype=torch.float8_e5m2, use_kv_descale=True),
     "kv torch.float8_e5m2 under a torch.bfloat16 q: needs a cache of q's dtype or e4m3"),
    (dict(q_dtype=torch.float16, kv_dtype=torch.bfloat16, out_dtype=torch.float16),
     "kv torch.bfloat16 under a torch.float16 q: needs a cache of q's dtype or e4m3"),
    (dict(head_size=256, head_size_v=256, num_heads=16),
     "head sizes 256/256: needs one of (64, 128) for both"),
    (dict(head_size_v=64), "head sizes 128/64: needs one of (64, 128) for both"),
    (dict(use_alibi=True), "ALiBi: the `tl` pass keeps it (the decode launch takes no slopes)"),
    (dict(page_size=4), "page size 4 is not a power of 2 >= 8 (TMA boxes)"),
    (dict(head_size=256, head_size_v=256, num_heads=16),
     "the `tl` invariant tiles (64 rows, 64 keys, 8 warps) and the consumer's 64-row "
     "warpgroups: 64 rows x 8 warps are not wgmma warpgroups of 16 rows a warp (block_m a "
     "multiple of 64, num_warps = block_m / 16)"),
])
def test_what_the_kernel_cannot_serve_is_refused_with_the_reason(change, reason, monkeypatch):
    _a_gpu(monkeypatch)
    assert reason in invariant_plan.invariant_gluon_decode_refusal(**dict(REFUSAL, **change))


def test_products_other_than_16_bits_are_refused(monkeypatch):
    """fp8 -> bf16 products where the `tl` pass has them (its fp16 switch off) are served;
    an fp32 product (the interpreter's bf16 stand-in) is not."""
    _a_gpu(monkeypatch)
    fp8 = dict(REFUSAL, kv_dtype=FP8, use_kv_descale=True)
    monkeypatch.setattr(launch.SWITCHES, "fp16_dot_for_fp8_kv", False)
    assert invariant_plan.invariant_gluon_decode_refusal(**fp8) == []
    assert gdi.products_dtype(torch.bfloat16, FP8, torch.bfloat16, REFUSAL["device"]) == \
        torch.bfloat16
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    why = invariant_plan.invariant_gluon_decode_refusal(**REFUSAL)
    assert "the `tl` pass's products in fp32: the kernel multiplies in fp16 or bf16, a 16-bit " \
           "cache in its own" in why


def test_fused_multiply_adds_and_other_tl_tiles_are_refused(monkeypatch):
    _a_gpu(monkeypatch)
    monkeypatch.setattr(launch.SWITCHES, "invariant_fp_fusion", True)
    why = invariant_plan.invariant_gluon_decode_refusal(**REFUSAL)
    assert why[0].startswith("SWITCHES.invariant_fp_fusion: the `tl` pass fuses")
    monkeypatch.setattr(launch.SWITCHES, "invariant_fp_fusion", False)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", {128: (128, 32, 8, 2)})
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles", {128: (64, 4, 3)})
    assert invariant_plan.invariant_gluon_decode_refusal(**REFUSAL) == [
        "the `tl` invariant tiles' block_n 32: the consumers are built for key tiles of "
        "(64, 128)"]
    # 128-key tiles (64 decode rows beside 128 prompt rows) are the kernel's too
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", {128: (128, 128, 8, 2)})
    assert invariant_plan.invariant_gluon_decode_refusal(**REFUSAL) == []
    # decode tiles of 128 rows: more decode rows than the kernel's 64
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", {128: (128, 64, 8, 2)})
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles", {128: (128, 8, 2)})
    assert invariant_plan.invariant_gluon_decode_refusal(**REFUSAL) == [
        "the `tl` decode tiles' 32 queries x 4 heads exceed the kernel's 64 rows"]


# --- CPU: how a batch is routed ----------------------------------------------------------
def _route(monkeypatch, switch: bool = True) -> None:
    """The router as on an sm_90 GPU whose refusal passes, planning on the CPU."""
    _a_gpu(monkeypatch, switch)
    monkeypatch.setattr(invariant_plan, "invariant_gluon_decode_refusal", lambda **kw: [])


def _plan(batch: int, max_q: int, max_k: int, num_splits: int = 0, prompts_elsewhere=False,
          **change):
    lengths = [max_q] + [1] * (batch - 1)
    args = dict(
        device=torch.device("cpu"), cu_seqlens_q=cu_seqlens(lengths),
        seqused_k=torch.full((batch,), max_k, dtype=torch.int32),
        block_table=torch.zeros(batch, 400, dtype=torch.int32), batch=batch,
        total_q=sum(lengths), max_seqlen_q=max_q, max_seqlen_k=max_k, num_heads=32,
        num_kv_heads=8, head_size=128, head_size_v=128, page_size=16,
        q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
        softmax_scale=0.088, causal=True, window_left=-1, window_right=-1, softcap=0.0,
        use_alibi=False, use_q_descale=False, use_kv_descale=False, num_splits=num_splits,
        dtypes=(torch.bfloat16,) * 3, prompts_elsewhere=prompts_elsewhere)
    args.update(change)
    return invariant_plan.plan_invariant_decode(**args)


def test_the_switch_off_plans_nothing(monkeypatch):
    _route(monkeypatch, switch=False)
    assert _plan(32, 1, 3000) is None


def test_many_decodes_fold_their_splits_in_the_program(monkeypatch):
    _route(monkeypatch)
    decodes, after = _plan(32, 1, 3000)  # 32 x 8 programs >= 132 SMs
    assert after == () and decodes.grid == (32, 8, 1) and decodes.partials is None
    c = decodes.constexprs
    assert (c["QUERIES"], c["GROUP"], c["GROUP_PAD"], c["BLOCK_N"], c["SPLIT_KEYS"],
            c["SPLIT_KV"], c["DOT_F16"], c["KV_FP8"], c["Q_DESCALE"]) == \
        (16, 4, 4, 64, 1024, False, False, False, False)
    assert decodes.options == {"enable_fp_fusion": False}
    assert decodes.floats == (0.088 * ag.LOG2E, 0.0) and decodes.window == (0, 0)


def test_few_decodes_run_split_programs_folded_by_the_fold_kernel(monkeypatch):
    _route(monkeypatch)
    decodes, after = _plan(2, 3, 3000)  # 2 x 8 programs < 132 SMs: 3 splits of 1,024 keys
    assert decodes.grid == (2, 8, 3) and decodes.constexprs["SPLIT_KV"] is True
    part_out, part_lse = decodes.partials
    assert part_out.shape == (3, 4, 32, 128) and part_lse.shape == (3, 4, 32)
    (fold,) = after
    assert fold.name == "reduce" and fold.constexprs["SPLIT_KEYS"] == 1024
    assert fold.batch.PartOut is part_out and fold.batch.PartLse is part_lse
    never, _ = _plan(2, 3, 3000, num_splits=1)
    always, _ = _plan(32, 1, 3000, num_splits=4)
    one_split, none_after = _plan(2, 1, 1000)
    assert (never.grid, always.grid, one_split.grid, none_after) == \
        ((2, 8, 1), (32, 8, 3), (2, 8, 1), ())


@pytest.mark.parametrize("head, fp8, tiles", [
    (128, False, (3, 1, 40)), (64, False, (4, 1, 40)), (128, True, (2, 2, 72)),
    (64, True, (3, 3, 72))])
def test_128_key_tl_tiles_give_the_kernel_128_key_tiles_in_half_the_slots(head, fp8, tiles,
                                                                          monkeypatch):
    """The `tl` pass's block_n reaches the kernel (BLOCK_N), with the ring's slots of
    `gluon_decode_invariant.TILES` for it: half the 64-key tiles' slots, the same bytes."""
    _route(monkeypatch)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles",
                        {64: (64, 128, 4, 3), 128: (128, 128, 8, 2)})
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles", {128: (64, 4, 3)})
    kv = FP8 if fp8 else torch.bfloat16
    decodes, after = _plan(32, 1, 3000, head_size=head, head_size_v=head, kv_dtype=kv,
                           use_kv_descale=fp8)
    c = decodes.constexprs
    assert (c["BLOCK_N"], c["NUM_BUF"], c["STAGES"], c["WORKER_REGS"], c["SPLIT_KEYS"]) == \
        (128, *tiles, 1024)
    assert (c["QUERIES"], after) == (16, ())  # 64 decode rows / GQA 4
    narrow = gdi.decode_constexprs(
        num_heads=32, num_kv_heads=8, head_size=head, page_size=16, decode_queries=16,
        kv_fp8=fp8, q_fp8=False, dot_f16=fp8, causal=True, window_left=-1, window_right=-1,
        softcap=0.0, split=False, split_keys=1024)
    assert narrow["BLOCK_N"] == 64 and narrow["NUM_BUF"] == 2 * tiles[0]
    with pytest.raises(ValueError, match=r"block_n=32: the kernel is built for key tiles of "
                                         r"\(64, 128\)"):
        gdi.decode_constexprs(
            num_heads=32, num_kv_heads=8, head_size=head, page_size=16, decode_queries=16,
            kv_fp8=fp8, q_fp8=False, dot_f16=fp8, causal=True, window_left=-1,
            window_right=-1, softcap=0.0, split=False, split_keys=1024, block_n=32)


def test_decodes_beside_prompts_run_only_beside_gluon_prompts_and_fold_in_program(
        monkeypatch):
    _route(monkeypatch)
    assert _plan(2, 500, 3000) is None  # the `tl` pass runs the prompt: it keeps the decodes
    decodes, after = _plan(2, 500, 3000, prompts_elsewhere=True)
    assert after == () and decodes.grid == (2, 8, 1) and decodes.constexprs["QUERIES"] == 16


def test_an_e4m3_cache_window_sinks_and_soft_cap_reach_the_kernel(monkeypatch):
    _route(monkeypatch)
    decodes, _ = _plan(32, 1, 3000, kv_dtype=FP8, use_kv_descale=True, window_left=700,
                       softcap=30.0, softmax_scale=0.1, num_heads=16, num_kv_heads=2,
                       head_size=64, head_size_v=64, dtypes=(torch.bfloat16, FP8,
                                                             torch.bfloat16))
    c = decodes.constexprs
    assert (c["KV_FP8"], c["KV_DESCALE"], c["DOT_F16"], c["WINDOW_LEFT"], c["WINDOW_RIGHT"],
            c["USE_SOFTCAP"], c["QUERIES"], c["HEAD_D"]) == \
        (True, True, True, True, True, True, 8, 64)
    # the `tl` pass's floats: softmax_scale * (1 / softcap), which differs from scale / cap
    assert decodes.floats == (0.1 * (1.0 / 30.0), 30.0 * ag.LOG2E)
    assert decodes.window == (700, 0)
    with pytest.raises(ValueError, match="decode_queries=17 x the padded GQA group exceed"):
        gdi.make_invariant_decode(
            cu_seqlens_q=cu_seqlens([1]), seqused_k=torch.ones(1, dtype=torch.int32),
            block_table=torch.zeros(1, 1, dtype=torch.int32), batch=1, total_q=1,
            num_heads=32, num_kv_heads=8, head_size=128, page_size=16,
            q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
            softmax_scale=0.1, causal=True, window_left=-1, window_right=-1, softcap=0.0,
            decode_queries=17, split_keys=1024, splits=1)


class _FakeDecodes:
    """Stands in for the Gluon decode launch on a CPU: records its calls, writes nothing."""

    def __init__(self):
        self.calls = []

    def run(self, q, k, v, out, lse, sinks, *descales):
        self.calls.append((q.shape, out.data_ptr(), lse is not None, sinks is not None))


def test_a_plan_with_gluon_decodes_launches_nothing_else(monkeypatch):
    """plan_attention hands a batch of decodes to the Gluon launch when the router serves it
    (the `tl` launches then absent: the output stays poisoned), else to the `tl` pass."""
    fake = _FakeDecodes()
    asked = []

    def route(**kwargs):
        asked.append(kwargs["prompts_elsewhere"])
        return fake, ()

    monkeypatch.setattr(attention_plan, "plan_invariant_decode", route)
    q = torch.randn(3, 4, 16)
    k = torch.randn(4, 16, 2, 16)
    args = dict(device=torch.device("cpu"), cu_seqlens_q=cu_seqlens([1, 1, 1]),
                seqused_k=torch.tensor([20, 30, 40], dtype=torch.int32), cu_seqlens_k=None,
                block_table=torch.tensor([[0, 1, 2], [1, 2, 3], [3, 0, 1]], dtype=torch.int32),
                batch=3, total_q=3, max_seqlen_q=1, max_seqlen_k=40, num_heads=4,
                num_kv_heads=2, head_size=16, head_size_v=16, page_size=16,
                q_dtype=torch.float32, kv_dtype=torch.float32, out_dtype=torch.float32,
                softmax_scale=0.25, causal=True, window_left=-1, window_right=-1,
                softcap=0.0, use_alibi=False, use_sinks=False, use_q_descale=False,
                use_kv_descale=False, write_lse=True, batch_invariant=True)
    plan = attention_plan.plan_attention(**args)
    assert plan.gluon_decode is fake and plan.launches == () and asked == [False]
    out = torch.full((3, 4, 16), float("nan"))
    lse = torch.full((4, 3), float("nan"))
    plan.run(q, k, k, out, lse)
    assert fake.calls == [((3, 4, 16), out.data_ptr(), True, False)]
    assert out.isnan().all() and lse.isnan().all()
    monkeypatch.setattr(attention_plan, "plan_invariant_decode", lambda **kwargs: None)
    plan = attention_plan.plan_attention(**args)
    assert plan.gluon_decode is None and [x.name for x in plan.launches] == ["prefill"]


# --- GPU: the two passes, bit for bit ----------------------------------------------------
# bf16 / fp16 / e4m3 caches (q bf16 or fp16), heads 64 / 128, GQA 4 / 1 / 8, soft cap, a
# window with sinks
GLUON_LAYERS = [
    Layer(32, 8, 128, 128, torch.bfloat16, torch.bfloat16, 16),
    Layer(16, 16, 128, 128, torch.float16, torch.float16, 16, softcap=30.0),
    Layer(16, 2, 64, 64, torch.float16, torch.float16, 32, window=700, sinks=True),
    Layer(32, 8, 128, 128, torch.bfloat16, FP8, 16, sinks=True, softcap=30.0),
    Layer(16, 2, 64, 64, torch.bfloat16, FP8, 16, window=1500),
]
# 32 requests over 1 to 3 splits of 1,024 keys (lengths across a split's edge, a page's
# edge, a tile's edge, a single key)
LENGTHS = [2600, 1, 1024, 1025, 63, 64, 65, 2048, 2049, 3000, 700, 1500, 17, 2999, 1000,
           1023, 511, 2222, 129, 900, 1700, 40, 1100, 2500, 333, 1999, 2001, 77, 1234, 2700,
           3001, 5]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units of the last place between two float tensors (NaN
    and inf as their bit patterns)."""
    ia, ib = bits(a).long(), bits(b).long()
    flip = 0x7FFF if a.element_size() == 2 else 0x7FFFFFFF
    ia = torch.where(ia < 0, -(ia & flip), ia)  # sign-magnitude -> a monotone integer line
    ib = torch.where(ib < 0, -(ib & flip), ib)
    return int((ia - ib).abs().max()) if ia.numel() else 0


def _compare(what: str, parts: list, tl_rows: list, gluon_rows: list) -> None:
    """Every part's outputs and LSEs bit for bit; the message names each part that differs
    with the count of its rows (token x head) that differ and their largest ulp distance."""
    problems = []
    for (r, _, a, b), (out_t, lse_t), (out_g, lse_g) in zip(parts, tl_rows, gluon_rows):
        for name, t, g in (("output", out_t, out_g),
                           ("LSE", lse_t.t().contiguous(), lse_g.t().contiguous())):
            same = bits(t) == bits(g)
            if name == "output":
                same = same.all(-1)  # a row: one token's head
            if not same.all():
                token, head = (~same).nonzero()[0].tolist()
                problems.append(f"request {r} tokens [{a}, {b}): {name} of "
                                f"{int((~same).sum())} of {same.numel()} rows differ, max "
                                f"{_ulps(t, g)} ulp, first token {a + token} head {head}")
    assert not problems, f"{what}:\n" + "\n".join(problems)


def _both(monkeypatch, world: World, parts: list, num_splits: int, what: str) -> None:
    """parts through the `tl` pass alone (every row), then with the Gluon decodes (and the
    Gluon prompts beside them): the same bits."""
    served = served_by(monkeypatch, attention_plan, "plan_invariant_decode")
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon", False)
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_decode", False)
    tl_rows = world.run(parts, num_splits)
    assert served and not any(served)
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon", True)
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_decode", True)
    served.clear()
    gluon_rows = world.run(parts, num_splits)
    assert served and all(served), f"{what}: the Gluon decode kernel did not serve the decodes"
    _compare(what, parts, tl_rows, gluon_rows)


def _layer_id(c: Layer) -> str:
    return (f"h{c.num_heads}/{c.num_kv_heads}-d{c.head_size}-{str(c.cache_dtype)[6:]}"
            f"{'-win' if c.window else ''}{'-sinks' if c.sinks else ''}"
            f"{'-cap' if c.softcap else ''}")


def _scenario(layer: Layer, name: str) -> list:
    """(parts, num_splits choices) of a scenario over LENGTHS' requests."""
    decodes = [(r, r % 2, n - 1, n) for r, n in enumerate(LENGTHS)]  # one decode each
    if name == "batch 1":  # 3 splits: split programs (0, 4 forced) and in-program folds (1)
        return [(decodes[:1], s) for s in (0, 1, 4)]
    if name == "batch 32":  # 1 to 3 splits: the schedule's choice, in-program, split programs
        return [(decodes, s) for s in (0, 1, 4)]
    if name == "several queries":  # a few decode queries a request (speculative decoding)
        group_pad = 1 << (layer.num_heads // layer.num_kv_heads - 1).bit_length()
        q = min(64 // group_pad, 3)
        return [([(r, 0, n - min(q, n), n) for r, n in enumerate(LENGTHS)], s) for s in (0, 4)]
    # mixed: prompts (a chunk after a cached context across a split's edge, a whole prompt,
    # 17 and 222 queries) on the Gluon prompt consumer, the decodes beside them in-program
    return [([(0, 0, 1200, 2600), decodes[1], (2, 1, 0, 1024)] + decodes[3:16]
             + [(16, 0, 0, 17), (17, 1, 2000, 2222)] + decodes[18:], 0)]


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton 3.6's Gluon")
@pytest.mark.parametrize("scenario", ["batch 1", "batch 32", "several queries", "mixed"])
@pytest.mark.parametrize("layer", GLUON_LAYERS, ids=_layer_id)
def test_gpu_gluon_decodes_have_the_tl_passes_bits(layer, scenario, monkeypatch):
    """Decodes through the `tl` pass alone and then on the Gluon kernel (prompts of a mixed
    batch on the Gluon prompt consumer), outputs and float32 LSEs bit for bit: one request
    over 3 splits and 32 requests over 1 to 3 (split programs and the fold kernel,
    in-program folds), requests of a few decode queries, decodes beside prompts."""
    world = World(layer, LENGTHS, "cuda", seed=5)
    for parts, splits in _scenario(layer, scenario):
        _both(monkeypatch, world, parts, splits, f"{layer}: {scenario}, num_splits {splits}")


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton 3.6's Gluon")
@pytest.mark.parametrize("layer", [GLUON_LAYERS[0], GLUON_LAYERS[3]], ids=_layer_id)
def test_gpu_rows_are_the_same_bits_with_decodes_on_the_gluon_kernel(layer, monkeypatch):
    """The mode's shared check (`test_batch_invariant.check_gpu_layer`: alone, in random
    batches, chunked, as decodes in steps of decodes alone, any split schedule) with the
    switch on."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_gluon_decode", True)
    check_gpu_layer(layer)


# `test_invariant_gluon.CANDIDATES` that change the decodes' arithmetic too: 128-key tiles for
# every pass (the kernel at BLOCK_N 128), and with them the scale in the exponent ("all");
# a request over 3 splits, 32 requests, a mixed batch
DECODE_CASES = [("128 keys", 0, "batch 32"), ("128 keys", 0, "mixed"),
                ("128 keys", 2, "batch 32"), ("128 keys", 3, "mixed"),
                ("128 keys", 4, "batch 32"), ("all", 0, "batch 1"), ("all", 0, "batch 32"),
                ("all", 0, "mixed"), ("all", 2, "mixed"), ("all", 3, "batch 32"),
                ("all", 4, "mixed"), ("scale in exp", 0, "batch 32"),
                ("scale in exp", 4, "mixed")]


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton 3.6's Gluon")
@pytest.mark.parametrize("candidate, layer, scenario",
                         [(c, GLUON_LAYERS[i], s) for c, i, s in DECODE_CASES],
                         ids=[f"{c}-{_layer_id(GLUON_LAYERS[i])}-{s}"
                              for c, i, s in DECODE_CASES])
def test_gpu_gluon_decodes_of_the_candidates_have_the_tl_passes_bits(candidate, layer,
                                                                     scenario, monkeypatch):
    """`test_gpu_gluon_decodes_have_the_tl_passes_bits` under a candidate's switches (the
    `tl` pass under the same ones)."""
    use_candidate(monkeypatch, candidate)
    test_gpu_gluon_decodes_have_the_tl_passes_bits(layer, scenario, monkeypatch)
