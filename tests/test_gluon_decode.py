"""The Gluon decode pass (ops/triton/gluon_decode_launch.py, gluon_decode.py kernel).

On a CPU: the refusals, the constexprs and arguments a launch builds (checked against the
kernel's signature), and the plan's wiring behind `SWITCHES.gluon_decode`. On an sm_90 GPU
with Triton 3.6 (`cuda` marks): decodes at real sizes through `plan_attention` with the
switch on, against the float64 oracle, outputs and LSE poisoned with NaN first, and a CUDA
graph replayed with new lengths. Gluon has no interpreter, so the kernel runs only there.
"""

from __future__ import annotations

import functools
import inspect
import math

import pytest
import torch

pytest.importorskip("triton")

import reference as ref  # noqa: E402
from conftest import (  # noqa: E402
    assert_close,
    assert_within_fp8_p_bound,
    make_paged_batch,
    needs_gluon_sm90,
    poison,
)
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import gluon_decode_launch as gd  # noqa: E402
from pagedattn.ops.triton import launch as launch_mod  # noqa: E402
from pagedattn.ops.triton.attention_plan import plan_attention  # noqa: E402
from pagedattn.ops.triton.tile_math import decode_query_count  # noqa: E402

LSE_TOL = dict(atol=5e-2, rtol=2e-2)
cuda = pytest.mark.cuda
on_sm90 = needs_gluon_sm90()

WHY = dict(device=torch.device("cpu"), num_heads=32, num_kv_heads=8, head_size=128,
           head_size_v=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
           out_dtype=torch.bfloat16, paged=True, page_size=16, decode_queries=4,
           use_alibi=False, use_q_descale=False, use_kv_descale=False)


# --- CPU: refusals, constexprs, arguments ----------------------------------------------------
@pytest.mark.parametrize("change, reason", [
    (dict(paged=False), "paged cache"),
    (dict(kv_dtype=torch.float8_e4m3fn), "e4m3 q over an e4m3 cache"),
    (dict(q_dtype=torch.float8_e4m3fn, kv_dtype=torch.float8_e5m2), "e4m3 q over"),
    (dict(q_dtype=torch.float16), "16-bit q over a cache of its dtype"),
    (dict(q_dtype=torch.float8_e4m3fn, kv_dtype=torch.float8_e4m3fn,
          out_dtype=torch.float8_e4m3fn), "16- or 32-bit output"),
    (dict(head_size=96, head_size_v=96), "head sizes 96/96"),
    (dict(head_size_v=64), "head sizes 128/64"),
    (dict(num_kv_heads=3), "32 heads over 3 KV heads"),
    (dict(num_heads=8, num_kv_heads=1, decode_queries=16), "exceed the kernel's 64 rows"),
    (dict(page_size=12), "page size 12"),
    (dict(page_size=4), "page size 4"),
    (dict(use_alibi=True), "ALiBi"),
    (dict(use_q_descale=True), "q descale with a torch.bfloat16 q"),
    (dict(use_kv_descale=True), "k/v descales with a torch.bfloat16 cache"),
])
def test_why_not_names_each_refusal(change, reason):
    reasons = gd.why_not_decode(**dict(WHY, **change))
    assert any(reason in r for r in reasons), reasons
    assert any("sm_90" in r for r in reasons)  # a CPU is never served


@pytest.mark.parametrize("q_dtype, kv_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float8_e4m3fn, torch.float8_e4m3fn)])
@pytest.mark.parametrize("group, queries", [(1, 16), (4, 4), (8, 2), (64, 1)])
def test_served_shapes_are_refused_only_for_the_device(q_dtype, kv_dtype, group, queries):
    fp8 = q_dtype == torch.float8_e4m3fn
    reasons = gd.why_not_decode(**dict(
        WHY, num_heads=8 * group, q_dtype=q_dtype, kv_dtype=kv_dtype, decode_queries=queries,
        use_q_descale=fp8, use_kv_descale=fp8))
    assert all("sm_90" in r or "Gluon" in r for r in reasons), reasons


def test_the_plan_fills_the_kernels_rows_the_tl_pass_way():
    """decode_query_count(group) tokens x the padded group fill 16 of the 64 rows (more for
    groups past 16), never more than 64: every group up to 64 is served."""
    for group in (1, 2, 3, 4, 5, 8, 16, 32, 64):
        pad = 1 << (group - 1).bit_length()
        assert decode_query_count(group) * pad == max(16, pad) <= gd.MAX_ROWS


@pytest.mark.parametrize("head_size, fp8, block_n, num_buf, stages", [
    (64, False, 128, 5, 1), (128, False, 128, 3, 1), (256, False, 64, 3, 1),
    (64, True, 128, 4, 4), (128, True, 128, 3, 3), (256, True, 64, 2, 3)])
def test_tiles_fit_shared_memory(head_size, fp8, block_n, num_buf, stages):
    tiles = gd.gluon_decode_tiles(head_size, fp8)
    assert tiles[:3] == (block_n, num_buf, stages)
    q_bytes = 1 if fp8 else 2
    rings = gd.tiles.smem_bytes(head_size, fp8, q_bytes)
    kv = 1 if fp8 else 2
    assert rings == (64 * head_size * q_bytes + num_buf * block_n * head_size * (kv + 2)
                     + (stages * block_n * head_size if fp8 else 0))
    assert rings + 1024 <= gd.tiles.SMEM_BYTES  # barriers and alignment beside


@pytest.mark.parametrize("head_size, fp8, block_n, num_buf, stages, worker_regs", [
    (64, False, 128, 3, 1, 48), (128, False, 64, 3, 1, 48), (64, True, 128, 3, 3, 72),
    (128, True, 64, 3, 3, 72)])
def test_two_programs_a_sm_fit_half_the_shared_memory(head_size, fp8, block_n, num_buf,
                                                      stages, worker_regs):
    assert gd.gluon_decode_tiles(head_size, fp8, 2) == (block_n, num_buf, stages, worker_regs)
    rings = gd.tiles.smem_bytes(head_size, fp8, 1 if fp8 else 2, per_sm=2)
    # two blocks and their 1 KB reserved each within the SM's 228 KB (sm_90)
    assert 2 * (rings + 1024 + 1024) <= 228 * 1024


def test_tiles_refuse_other_head_sizes():
    with pytest.raises(ValueError, match="head size 96"):
        gd.gluon_decode_tiles(96, False)
    with pytest.raises(ValueError, match="head size 256"):
        gd.gluon_decode_tiles(256, False, 2)
    assert gd.tiles.per_sm_served(256, False, 2) == 1
    assert gd.tiles.per_sm_served(128, True, 2) == 2


def test_programs_per_sm_reads_the_switch(monkeypatch):
    assert gd.programs_per_sm(128, True) == 2 and gd.programs_per_sm(256, False) == 1  # None
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_per_sm", 1)
    assert gd.programs_per_sm(128, False) == 1
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_per_sm", 2)
    assert gd.programs_per_sm(128, False) == 2 and gd.programs_per_sm(256, False) == 1
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_per_sm", 3)
    with pytest.raises(ValueError, match="gluon_decode_per_sm must be None, 1 or 2, got 3"):
        gd.programs_per_sm(128, False)


def test_the_measured_rule_takes_fp8_decodes_over_long_splits(monkeypatch):
    """None: an e4m3 q over an e4m3 cache whose splits stream 1,024+ keys (H200: 1.02-1.17x
    the `tl` pass there, 0.87x on 668-key splits); a 16-bit q over its own cache likewise
    with the persistent form (1.00-1.05x), the `tl` pass with the grid form; a 16-bit q over
    an fp8 cache never."""
    e4m3, bf16, fp16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
    takes = functools.partial(gd.takes_decodes, q_dtype=e4m3, kv_dtype=e4m3)
    assert takes(max_seqlen_k=16384, num_splits=3) and takes(max_seqlen_k=1024, num_splits=1)
    assert not takes(max_seqlen_k=32768, num_splits=49)
    assert launch_mod.SWITCHES.gluon_decode_persistent is True
    for dt in (bf16, fp16):
        assert gd.takes_decodes(q_dtype=dt, kv_dtype=dt, max_seqlen_k=16384, num_splits=2)
        assert not gd.takes_decodes(q_dtype=dt, kv_dtype=dt, max_seqlen_k=1000, num_splits=1)
    assert not gd.takes_decodes(q_dtype=bf16, kv_dtype=e4m3, max_seqlen_k=16384, num_splits=2)
    assert not gd.takes_decodes(q_dtype=bf16, kv_dtype=fp16, max_seqlen_k=16384, num_splits=2)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", False)
    assert not gd.takes_decodes(q_dtype=bf16, kv_dtype=bf16, max_seqlen_k=16384, num_splits=2)
    assert takes(max_seqlen_k=16384, num_splits=3)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    assert gd.takes_decodes(q_dtype=bf16, kv_dtype=bf16, max_seqlen_k=64, num_splits=4)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", False)
    assert not takes(max_seqlen_k=16384, num_splits=3)


@pytest.mark.parametrize("kw, expected", [
    (dict(), dict(GROUP=4, GROUP_PAD=4, QUERIES=4, BLOCK_N=128, NUM_BUF=3, WINDOW_LEFT=False,
                  WINDOW_RIGHT=True, USE_SOFTCAP=False, SPLIT_KV=False, KV_FP8=False,
                  KV_DESCALE=False, Q_DESCALE=False, SCALE_IN_EXP=True, WRITE_LSE=True)),
    (dict(num_heads=24, decode_queries=2, split=True, window_left=100, softcap=30.0,
          kv_fp8=True, causal=False, window_right=-1),
     dict(GROUP=3, GROUP_PAD=4, QUERIES=2, SPLIT_KV=True, WRITE_LSE=False, WINDOW_LEFT=True,
          WINDOW_RIGHT=False, USE_SOFTCAP=True, SCALE_IN_EXP=False, KV_FP8=True,
          KV_DESCALE=True, Q_DESCALE=True, STAGES=3)),
])
def test_constexprs(kw, expected):
    args = dict(num_heads=32, num_kv_heads=8, head_size=128, page_size=16, decode_queries=4,
                kv_fp8=False, causal=True, window_left=-1, window_right=-1, softcap=0.0,
                split=False, write_lse=True, use_sinks=False)
    c = gd.decode_constexprs(**dict(args, **kw))
    for name, value in expected.items():
        assert c[name] == value, name
    params = inspect.signature(gd.gluon_decode.gluon_decode_kernel.fn).parameters
    constexprs = [n for n, p in params.items() if "constexpr" in str(p.annotation)]
    assert sorted(c) == sorted(constexprs)


def test_floats_and_windows_fold_as_the_tl_pass():
    assert ag.score_floats(0.125, 0.0) == pytest.approx((0.125 * ag.LOG2E, 0.0))
    assert ag.score_floats(0.125, 50.0) == pytest.approx((0.125 / 50.0, 50.0 * ag.LOG2E))
    assert gd.decode_window(True, -1, -1) == (0, 0)
    assert gd.decode_window(True, 255, 7) == (255, 0)  # causal: a wider right window is 0
    assert gd.decode_window(False, 64, 3) == (64, 3)


def make_launch(split=False, fp8=False, sinks=False):
    b = make_paged_batch([1, 3, 2], [40, 300, 77], 8, 2, 64, dtype=torch.bfloat16)
    splits = 3 if split else 1
    part = (torch.empty(3, 6, 8, 64), torch.empty(3, 6, 8)) if split else None
    c = gd.decode_constexprs(num_heads=8, num_kv_heads=2, head_size=64, page_size=16,
                             decode_queries=4, kv_fp8=fp8, causal=True, window_left=-1,
                             window_right=-1, softcap=0.0, split=split, write_lse=True,
                             use_sinks=sinks)
    launch = gd.GluonDecodeLaunch(
        grid=(3, 2, splits), constexprs=c, floats=ag.score_floats(0.125, 0.0),
        window=(0, 0), total_q=6, cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k,
        block_table=b.block_table, partials=part)
    return b, launch, part


def _by_name(args):
    params = inspect.signature(gd.gluon_decode.gluon_decode_kernel.fn).parameters
    names = [n for n, p in params.items() if "constexpr" not in str(p.annotation)]
    assert len(args) == len(names)
    return dict(zip(names, args, strict=True))


def test_kernel_args_unsplit_match_the_signature():
    b, launch, _ = make_launch()
    out = torch.empty(6, 8, 64, dtype=torch.bfloat16)
    lse = torch.empty(8, 6)
    args, key = launch.kernel_args(b.q, b.k_cache, b.v_cache, out, lse)
    a = _by_name(args)
    assert a["Out"] is out and a["Lse"] is lse and a["num_splits"] == 1
    assert (a["stride_ot"], a["stride_oh"], a["stride_qt"]) == (8 * 64, 64, 8 * 64)
    # NHD cache [blocks, 16, 2, 64]: a row per slot, KV head h at column h * 64
    nb = b.k_cache.shape[0]
    assert (a["kv_rows"], a["page_rows"], a["head_rows"], a["head_cols_k"]) == (
        nb * 16, 16, 0, 64)
    assert a["stride_kc"] == 2 * 64 and a["stride_bt"] == b.block_table.stride(0)
    assert a["q_descale"] is None and a["k_descale"] is None and a["sinks"] is None
    assert a["qk_scale"] == pytest.approx(0.125 * ag.LOG2E)
    assert key is not None and key[:4] == (torch.bfloat16,) * 4


def test_kernel_args_split_write_the_partials():
    b, launch, (part_out, part_lse) = make_launch(split=True)
    out = torch.empty(6, 8, 64, dtype=torch.bfloat16)
    a = _by_name(launch.kernel_args(b.q, b.k_cache, b.v_cache, out, None)[0])
    assert a["Out"] is part_out and a["Lse"] is part_lse and a["num_splits"] == 3


def test_kernel_args_fp8_descales_default_to_one_and_expand():
    b, launch, _ = make_launch(fp8=True)
    out = torch.empty(6, 8, 64, dtype=torch.bfloat16)
    a = _by_name(launch.kernel_args(b.q, b.k_cache, b.v_cache, out)[0])
    assert all(float(a[n]) == 1.0 for n in ("q_descale", "k_descale", "v_descale"))
    assert (a["stride_ds_b"], a["stride_ds_h"]) == (0, 0)
    per_head = torch.rand(3, 2)
    a = _by_name(launch.kernel_args(b.q, b.k_cache, b.v_cache, out, k_descale=per_head,
                                    v_descale=per_head, descale_head=1)[0])
    assert a["k_descale"] is per_head and (a["stride_ds_b"], a["stride_ds_h"]) == (2, 1)
    assert torch.equal(a["q_descale"], torch.ones(3, 2))  # the missing one, laid out alike


def test_a_launch_checks_its_metadata_and_partials():
    b, launch, _ = make_launch()
    kw = dict(grid=(3, 2, 1), constexprs=launch.constexprs, floats=(1.0, 0.0), window=(0, 0),
              total_q=6, cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k,
              block_table=b.block_table)
    with pytest.raises(ValueError, match="seqused_k must be int32"):
        gd.GluonDecodeLaunch(**dict(kw, seqused_k=b.seqused_k.long()))
    with pytest.raises(ValueError, match="split launch writes partials"):
        gd.GluonDecodeLaunch(**dict(kw, grid=(3, 2, 2)))


def plan_for(batch_lens=((1, 3, 2), (40, 300, 77)), **kw):
    query_lens, seq_lens = batch_lens
    b = make_paged_batch(list(query_lens), list(seq_lens), 32, 8, 128, dtype=torch.bfloat16)
    return plan_attention(**b.plan_args(**{"softmax_scale": 0.125, **kw}))


@pytest.mark.parametrize("switch", [False, True])
def test_the_switch_off_or_a_refusal_keeps_the_tl_decode_pass(switch, monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", switch)
    plan = plan_for(num_splits=2)
    assert plan.gluon_decode is None  # a CPU is refused
    assert [p.name for p in plan.launches] == ["decode", "reduce"]


def test_a_served_plan_replaces_the_decode_launch_and_keeps_the_reduce(monkeypatch):
    """Where the Gluon pass serves (the device check stubbed: a CPU plans as an sm_90 GPU
    would), the decode PassLaunch goes, the reduce stays, and the Gluon launch writes the
    plan's partials with the decode pass's split count. The grid form (the persistent one's
    plans: tests/test_gluon_decode_persistent.py)."""
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_persistent", False)
    monkeypatch.setattr(gd, "why_not_decode", lambda **kw: [])
    plan = plan_for(num_splits=3)
    assert [p.name for p in plan.launches] == ["reduce"]
    g = plan.gluon_decode
    assert g.grid == (3, 8, 3) and g.split
    reduce = plan.launches[0]
    assert g.partials[0] is reduce.batch.PartOut and g.partials[1] is reduce.batch.PartLse
    assert g.constexprs["QUERIES"] == 4 and g.constexprs["GROUP_PAD"] == 4
    # caches of another dtype: run() takes each call (test_gluon_decode_layer: the layer path)
    assert plan.plan_layer(torch.empty(1), torch.empty(1)) is None
    unsplit = plan_for(num_splits=1)
    assert unsplit.launches == () and unsplit.gluon_decode.grid == (3, 8, 1)
    # a step with a prefill keeps the prefill pass beside the Gluon decode
    mixed = plan_for(batch_lens=((1, 40), (50, 60)), num_splits=1)
    assert [p.name for p in mixed.launches] == ["prefill"] and mixed.gluon_decode is not None


def test_plan_run_hands_the_layer_to_the_gluon_launch_before_the_reduce(monkeypatch):
    """run() gives the Gluon launch the layer's tensors and the descales as `_descales`
    lays them out, then runs the reduce over the partials it wrote."""
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(gd, "why_not_decode", lambda **kw: [])
    plan = plan_for(num_splits=2, use_sinks=None, write_lse=True)
    calls = []

    def fake_run(q, k, v, out, lse, sinks, q_descale, k_descale, v_descale, descale_head):
        calls.append((q, out, lse, sinks, k_descale, descale_head))
        part_out, part_lse = plan.gluon_decode.partials
        part_out.fill_(1.0)  # every split's rows: 1 with LSE 0
        part_lse.fill_(0.0)

    monkeypatch.setattr(plan.gluon_decode, "run", fake_run)
    b = make_paged_batch([1, 3, 2], [40, 300, 77], 32, 8, 128, dtype=torch.bfloat16)
    out = poison((6, 32, 128), torch.bfloat16)
    lse = poison((32, 6), torch.float32)
    sinks = torch.zeros(32)
    plan.run(b.q, b.k_cache, b.v_cache, out, lse, None, sinks)
    (q, target, lse_given, sinks_given, k_descale, descale_head), = calls
    assert q is b.q and target is out and lse_given is lse and sinks_given is sinks
    assert k_descale is None and descale_head == 0
    # the reduce merged two splits of 1 (LSE 0 each): 1, LSE log 2
    assert torch.equal(out.float(), torch.ones(6, 32, 128))
    assert torch.allclose(lse, torch.full((32, 6), math.log(2.0)))


def test_two_programs_a_sm_compile_with_maxnreg(monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(gd, "why_not_decode", lambda **kw: [])
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_per_sm", 1)
    assert plan_for(num_splits=1).gluon_decode.options == {}
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_per_sm", None)  # the default: 2
    g = plan_for(num_splits=1).gluon_decode
    assert g.options == {"maxnreg": 128}
    assert (g.constexprs["BLOCK_N"], g.constexprs["WORKER_REGS"]) == (64, 48)
    assert g.launch_for(False, False).kwargs["maxnreg"] == 128


def test_a_tile_override_keeps_the_tl_decode_pass(monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)
    monkeypatch.setattr(gd, "why_not_decode", lambda **kw: [])
    plan = plan_for(num_splits=1, config=launch_mod.AttnConfig(16, 16, 4, 1, 1))
    assert plan.gluon_decode is None and [p.name for p in plan.launches] == ["decode"]


# --- GPU: real sizes against the oracle --------------------------------------------------
def _fp8_cache(cache, table, seq_lens, block_size, scales):
    """The cache as an e4m3 cache holds it (x / scale[sequence, KV head], saturated) and the
    float64 values the oracle attends over (x8 * scale)."""
    x = cache.cpu()
    x8 = torch.zeros(x.shape, dtype=torch.uint8)
    x64 = torch.zeros(x.shape, dtype=torch.float64)
    for r, s in enumerate(seq_lens):
        blocks = table[r, :math.ceil(s / block_size)].cpu().long()
        for h in range(x.shape[2]):
            q8 = ref.quantize_for_cache(x[blocks, :, h], torch.float8_e4m3fn,
                                        float(scales[r, h]))
            x8[blocks, :, h] = q8.view(torch.uint8)
            x64[blocks, :, h] = ref.dequantize(q8, float(scales[r, h]))
    if cache.stride(2) > cache.stride(1):  # HND: keep the memory order
        x8 = x8.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    return x8.view(torch.float8_e4m3fn).to(cache.device), x64


def run_decode(query_lens, seq_lens, *, num_heads=32, num_kv_heads=8, head_size=128,
               dtype=torch.bfloat16, fp8=False, window=(-1, -1), softcap=0.0, sinks=False,
               num_splits=0, block_size=16, layout="NHD", seed=0, nan_tail=False):
    """Decodes of `query_lens` queries over `seq_lens` keys (shuffled pages) through
    plan_attention with the Gluon decode pass on: its output and LSE against the float64
    oracle (fp8: an e4m3 q and cache with descales per (sequence, KV head), the oracle over
    their dequantised values). Returns (plan, inputs) for further runs."""
    dev = "cuda"
    b = make_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_size,
                         block_size, dtype, layout=layout, device=dev, seed=seed)
    if nan_tail:  # unwritten slots of each sequence's last page hold NaN
        for r, s in enumerate(seq_lens):
            for pos in range(s, math.ceil(s / block_size) * block_size):
                blk = int(b.block_table[r, pos // block_size])
                b.k_cache[blk, pos % block_size] = float("nan")
                b.v_cache[blk, pos % block_size] = float("nan")
    q, k, v = b.q, b.k_cache, b.v_cache
    q64, k64, v64 = q.cpu().double(), k.cpu().double(), v.cpu().double()
    descales = (None, None, None)
    if fp8:
        g = torch.Generator().manual_seed(seed + 5)
        scales = [torch.rand(len(seq_lens), num_kv_heads, generator=g) * 0.04 + 0.01
                  for _ in range(3)]
        k, k64 = _fp8_cache(k, b.block_table, seq_lens, block_size, scales[1])
        v, v64 = _fp8_cache(v, b.block_table, seq_lens, block_size, scales[2])
        seq_of = torch.repeat_interleave(torch.arange(len(query_lens)),
                                         torch.tensor(query_lens))
        per_row = scales[0][seq_of][:, torch.arange(num_heads) // (num_heads // num_kv_heads)]
        q8 = (q.cpu().float() / per_row[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        q, q64 = q8.to(dev), q8.double() * per_row[..., None].double()
        descales = tuple(s.to(dev) for s in scales)
    g = torch.Generator().manual_seed(seed + 1)
    sink = (torch.randn(num_heads, generator=g) * 2).to(dev) if sinks else None
    total_q = sum(query_lens)
    plan = plan_attention(
        device=torch.device(dev), cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k,
        cu_seqlens_k=None, block_table=b.block_table, batch=len(query_lens), total_q=total_q,
        max_seqlen_q=max(query_lens), max_seqlen_k=max(seq_lens), num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size,
        page_size=block_size, q_dtype=q.dtype, kv_dtype=k.dtype, out_dtype=dtype,
        softmax_scale=head_size ** -0.5, causal=True, window_left=window[0],
        window_right=window[1], softcap=softcap, use_alibi=False, use_sinks=sinks,
        use_q_descale=fp8, use_kv_descale=fp8, write_lse=True, num_splits=num_splits)
    assert plan.gluon_decode is not None, "the Gluon decode pass does not serve this case"
    if num_splits:
        assert plan.gluon_decode.num_splits == num_splits
    out = poison((total_q, num_heads, head_size), dtype, dev)
    lse = poison((num_heads, total_q), torch.float32, dev)
    plan.run(q, k, v, out, lse, None, sink, *descales)
    torch.cuda.synchronize()
    oracle = functools.partial(
        ref.paged_attention, q64, k_cache=k64, query_lens=query_lens, seq_lens=seq_lens,
        block_table=b.block_table.cpu(), scale=head_size ** -0.5, causal=True, window=window,
        softcap=softcap, sinks=None if sink is None else sink.cpu())
    exp_out, exp_lse = oracle(v_cache=v64)
    assert_out(plan.gluon_decode, out, exp_out, dtype, lambda: oracle(v_cache=v64.abs())[0])
    assert_close(lse, exp_lse, **LSE_TOL)
    return plan, (q, k, v, sink, descales, b)


def assert_out(gluon, out, expected, dtype, abs_v_oracle):
    """The launch's outputs against the oracle's: within `dtype`'s tolerance, or with an fp8
    P V (`SWITCHES.gluon_decode_fp8_pv`) within its bound (DESIGN.md: P rounded to e4m3 puts
    each weight within 2^-4 of itself, so each output within 2^-4 of the oracle's weighted
    mean of |V|, `abs_v_oracle()`, beyond the 16-bit tolerance; the LSE is unchanged)."""
    if gluon.constexprs["PV_FP8"]:
        assert_within_fp8_p_bound(out, expected, abs_v_oracle(), 2.0 ** -4, atol=1e-2,
                                  rtol=1e-2)
    else:
        assert_close(out, expected, dtype)


GPU_CASES = {
    "bf16 G4 unsplit": dict(query_lens=[1] * 8, seq_lens=[4000, 17, 1, 129, 2048, 700, 333,
                                                           5000], num_splits=1),
    "bf16 G4 split": dict(query_lens=[1] * 3, seq_lens=[9000, 127, 3000], num_splits=5),
    "bf16 G4 auto split": dict(query_lens=[1, 1], seq_lens=[32768, 1000]),
    "fp16 G4": dict(query_lens=[1] * 4, seq_lens=[1500, 64, 3001, 800], dtype=torch.float16),
    "bf16 G1 head 64": dict(query_lens=[1] * 4, seq_lens=[2000, 31, 700, 4097],
                            num_heads=8, num_kv_heads=8, head_size=64, num_splits=3),
    "bf16 G8 head 64": dict(query_lens=[1, 2, 1], seq_lens=[3000, 513, 77], num_heads=32,
                            num_kv_heads=4, head_size=64),
    "bf16 head 256": dict(query_lens=[1] * 3, seq_lens=[1000, 129, 2500], num_heads=16,
                          num_kv_heads=4, head_size=256, num_splits=2),
    "multi-query G4": dict(query_lens=[2, 4, 3, 1], seq_lens=[1000, 4, 2049, 300],
                           num_splits=2),
    "multi-query G1": dict(query_lens=[16, 5, 9], seq_lens=[700, 16, 2000], num_heads=8,
                           num_kv_heads=8, num_splits=1),
    "sliding window": dict(query_lens=[1, 3, 1], seq_lens=[5000, 3000, 100],
                           window=(255, 0), num_splits=4),
    "sinks split": dict(query_lens=[1, 2], seq_lens=[3000, 50], sinks=True, num_splits=3),
    "sinks unsplit": dict(query_lens=[1, 2], seq_lens=[3000, 50], sinks=True, num_splits=1),
    "soft cap": dict(query_lens=[1, 1], seq_lens=[2500, 900], softcap=30.0),
    "HND cache, NaN tails": dict(query_lens=[1, 3, 1], seq_lens=[999, 1001, 17],
                                 layout="HND", nan_tail=True, num_splits=2),
    "e4m3 G4 unsplit": dict(query_lens=[1] * 4, seq_lens=[3000, 129, 1, 4500], fp8=True,
                            num_splits=1),
    "e4m3 G4 split": dict(query_lens=[1, 3], seq_lens=[9000, 2000], fp8=True, num_splits=4),
    "e4m3 G8 head 64, window, sinks": dict(query_lens=[1, 2], seq_lens=[3000, 600],
                                           num_heads=32, num_kv_heads=4, head_size=64,
                                           fp8=True, window=(300, 0), sinks=True),
    "e4m3 G1 head 128": dict(query_lens=[1, 4], seq_lens=[2000, 300], num_heads=8,
                             num_kv_heads=8, fp8=True, num_splits=2),
}


@pytest.fixture
def gluon_decode_on(monkeypatch):
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode", True)


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_real_sizes(name, gluon_decode_on):
    run_decode(**GPU_CASES[name])


TWO_PER_SM_CASES = ["bf16 G4 split", "bf16 G8 head 64", "multi-query G4",
                    "HND cache, NaN tails", "e4m3 G4 split", "e4m3 G8 head 64, window, sinks",
                    "sinks split"]


@cuda
@on_sm90
@pytest.mark.parametrize("name", TWO_PER_SM_CASES)
def test_gpu_two_programs_a_sm(name, gluon_decode_on, monkeypatch):
    """`SWITCHES.gluon_decode_per_sm = 2`: half-size rings, maxnreg 128."""
    monkeypatch.setattr(launch_mod.SWITCHES, "gluon_decode_per_sm", 2)
    plan, _ = run_decode(**GPU_CASES[name])
    assert plan.gluon_decode.options == {"maxnreg": 128}


@cuda
@on_sm90
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_graph_replays_with_new_lengths(fp8, gluon_decode_on):
    graph_replays(fp8)


def graph_replays(fp8):
    """A plan made for a graph (bucket: max lengths) captured once, replayed after the
    batch's lengths change in place: each replay's rows match the oracle of its lengths.
    Returns the graph's plan."""
    query_lens, long_lens = [1, 2, 1, 3], [6000, 3000, 40, 1500]
    plan, (q, k, v, sink, descales, b) = run_decode(query_lens, long_lens, fp8=fp8)
    graph_plan = plan_attention(
        device=q.device, cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k,
        cu_seqlens_k=None, block_table=b.block_table, batch=4, total_q=7, max_seqlen_q=3,
        max_seqlen_k=6000, num_heads=32, num_kv_heads=8, head_size=128, head_size_v=128,
        page_size=16, q_dtype=q.dtype, kv_dtype=k.dtype, out_dtype=torch.bfloat16,
        softmax_scale=128 ** -0.5, causal=True, window_left=-1, window_right=-1, softcap=0.0,
        use_alibi=False, use_sinks=False, use_q_descale=fp8, use_kv_descale=fp8,
        write_lse=True, cuda_graph=True)
    assert graph_plan.gluon_decode is not None
    out = poison((7, 32, 128), torch.bfloat16, "cuda")
    lse = poison((32, 7), torch.float32, "cuda")
    graph_plan.run(q, k, v, out, lse, None, None, *descales)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_plan.run(q, k, v, out, lse, None, None, *descales)
    q64 = q.cpu().double()
    k64, v64 = k.cpu().double(), v.cpu().double()
    if fp8:
        k64, v64 = (_fp8_values(x, s, b, long_lens) for x, s in ((k, descales[1]),
                                                                  (v, descales[2])))
        q64 = _q_values(q, descales[0], query_lens, 32, 8)
    for lens in ([5000, 17, 33, 1499], [6000, 3000, 40, 1500], [1, 2999, 3, 64]):
        b.seqused_k.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        oracle = functools.partial(ref.paged_attention, q64, k_cache=k64,
                                   query_lens=query_lens, seq_lens=lens,
                                   block_table=b.block_table.cpu(), scale=128 ** -0.5,
                                   causal=True)
        exp_out, exp_lse = oracle(v_cache=v64)
        assert_out(graph_plan.gluon_decode, out, exp_out, torch.bfloat16,
                   functools.partial(lambda o: o(v_cache=v64.abs())[0], oracle))
        assert_close(lse, exp_lse, **LSE_TOL)
    return graph_plan


def _fp8_values(x8, scales, b, seq_lens):
    """float64 x8 * scale[sequence, KV head] over each sequence's pages."""
    out = x8.cpu().float().double()
    for r, s in enumerate(seq_lens):
        blocks = b.block_table[r, :math.ceil(s / 16)].cpu().long()
        out[blocks] = out[blocks] * scales[r].cpu().double().view(1, 1, -1, 1)
    return out


def _q_values(q8, scales, query_lens, num_heads, num_kv_heads):
    seq_of = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    per_row = scales.cpu()[seq_of][:, torch.arange(num_heads) // (num_heads // num_kv_heads)]
    return q8.cpu().double() * per_row[..., None].double()
