"""The Gluon prefill pass (ops/triton/attention_gluon.py, gluon_launch.py, gluon_*.py kernel).

On a CPU: the planner's decisions (who may not be served, the schedule and switches) and the
paged cache's 2-D row view. On an sm_90 GPU with Triton 3.6 (`cuda` marks): one case per
feature at real sizes against the float64 oracle, outputs and LSE poisoned with NaN first.
Gluon has no interpreter, so the kernel itself runs only there.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import reference as ref  # noqa: E402
from conftest import (  # noqa: E402
    assert_close,
    assert_same_but,
    assert_within_fp8_p_bound,
    cu_seqlens,
    make_paged_batch,
    needs_gluon_sm90,
    poison,
    randn,
)
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import gluon_launch, gluon_schedule  # noqa: E402

LSE_TOL = dict(atol=5e-2, rtol=2e-2)
cuda = pytest.mark.cuda
on_sm90 = needs_gluon_sm90()

PLAN = dict(batch=2, total_q=300, max_seqlen_q=200, max_seqlen_k=400, num_heads=8,
            num_kv_heads=2, head_size=128, head_size_v=128, q_dtype=torch.bfloat16,
            kv_dtype=torch.bfloat16, causal=True, window_left=-1, window_right=-1,
            softcap=0.0, use_alibi=False, use_sinks=False, write_lse=True, page_size=16,
            dense_new_kv=False, softmax_scale=0.125)


def config(paged=False, **changes) -> ag.GluonSchedule:
    kw = {k: v for k, v in dict(PLAN, **changes).items()
          if k not in ("max_seqlen_k", "q_dtype", "kv_dtype")}
    return ag.launch_config(sm_count=132, paged=paged, **kw)


# --- CPU: what the planner decides --------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("head, invariant, tiles_128, fold_at", [
    (256, 64, None, 0), (128, 64, None, -1), (64, 64, None, -1), (256, 0, None, -1),
    (128, 0, None, -1),
    # `SWITCHES.invariant_tiles_128`'s 128-key tiles at head 128: O, S, P and a register
    # fold spilled there; its 128-key tiles at head 64, and those tiles named by
    # `invariant_tiles` alone (the sweep's register-fold config), keep the fold in registers
    (128, 128, True, 0), (64, 128, True, -1), (128, 128, None, -1), (128, 128, False, -1),
    (256, 64, True, 0), (128, 0, True, -1)])
def test_the_invariant_consumer_keeps_fold_rows_above_head_128_and_at_128_key_tiles(
        head, invariant, tiles_128, fold_at, dynamic, monkeypatch):
    """FOLD_AT, the one place the rule lives: the fold rows' first word in the kernel's Work,
    past the item counters' 128 bytes where the hand-out is dynamic; -1: none."""
    monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", dynamic)
    monkeypatch.setattr(ag.SWITCHES, "invariant_tiles_128", tiles_128)
    s = config(paged=True, head_size=head, head_size_v=head,
               invariant=(invariant, 1024) if invariant else None)
    expected = fold_at + 32 * dynamic if fold_at >= 0 else -1
    assert s.constexprs["FOLD_AT"] == expected and s.constexprs["DYNAMIC"] is dynamic
    fold = gluon_launch.fold_shape(s)
    assert fold == (None if expected < 0 else (s.grid, 128, head))
    assert gluon_launch.work_words(s) == \
        (expected + math.prod(fold) if fold else 32 if dynamic else 0)


def test_cpu_device_is_never_served():
    cu = cu_seqlens([100, 200])
    assert ag.plan_gluon_prefill(device=torch.device("cpu"), cu_seqlens_q=cu,
                                 seqused_k=torch.tensor([100, 200], dtype=torch.int32),
                                 cu_seqlens_k=cu, **PLAN) is None


@pytest.mark.parametrize("change, reason", [
    (dict(q_dtype=torch.float8_e4m3fn), "16-bit q"),
    (dict(kv_dtype=torch.float16), "16-bit q"),
    (dict(kv_dtype=torch.float8_e4m3fn), "paged cache only"),
    (dict(head_size=96), "head sizes"),
    (dict(head_size_v=512), "head sizes"),
    (dict(num_kv_heads=3), "KV heads"),
    (dict(paged=True, page_size=12), "page size"),
    (dict(paged=True, page_size=4), "page size"),
    (dict(use_kv_descale=True), "descales"),
    (dict(use_q_descale=True), "q descale"),
])
def test_why_not_names_each_missing_feature(change, reason):
    kw = dict(device=torch.device("cpu"), num_heads=8, num_kv_heads=2, head_size=128,
              head_size_v=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
              out_dtype=None, paged=False, page_size=16, use_q_descale=False,
              use_kv_descale=False)
    reasons = ag.why_not(**dict(kw, **change))
    assert any(reason in r for r in reasons), reasons
    assert any("sm_90" in r for r in reasons)


@pytest.mark.parametrize("q_dtype, kv_dtype", [
    (torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e5m2),
    (torch.float8_e4m3fn, torch.float8_e5m2)])
def test_an_fp8_q_over_an_fp8_cache_is_served_with_a_16_bit_output(q_dtype, kv_dtype):
    kw = dict(device=torch.device("cpu"), num_heads=16, num_kv_heads=2, head_size=128,
              head_size_v=128, q_dtype=q_dtype, kv_dtype=kv_dtype, paged=True, page_size=16,
              use_q_descale=True, use_kv_descale=True)
    reasons = ag.why_not(out_dtype=torch.bfloat16, **kw)
    assert all("sm_90" in r or "Gluon" in r for r in reasons), reasons
    assert any("16- or 32-bit output" in r for r in ag.why_not(out_dtype=None, **kw))
    assert any("fp8 q with fp8 K/V" in r
               for r in ag.why_not(out_dtype=torch.bfloat16, **dict(kw, kv_dtype=torch.bfloat16)))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_servable_shapes_have_only_the_device_against_them(kv_dtype):
    for head_size in ag.HEAD_SIZES:
        reasons = ag.why_not(device=torch.device("cpu"), num_heads=16, num_kv_heads=1,
                             head_size=head_size, head_size_v=head_size,
                             q_dtype=torch.float16, kv_dtype=kv_dtype, out_dtype=None,
                             paged=True, page_size=64, use_q_descale=False,
                             use_kv_descale=kv_dtype in ag.FP8)
        assert all("sm_90" in r or "Gluon" in r for r in reasons), reasons


@pytest.mark.skipif(ag.gluon_prefill is None, reason="Triton without Gluon")
class TestLaunchConfig:
    def test_longest_first_across_requests_for_even_batches(self):
        c = config(batch=8, total_q=8 * 2048, max_seqlen_q=2048)
        assert c.constexprs["LPT_ACROSS"]
        assert c.num_items == 8 * 16 * 8  # heads x requests x blocks of 128
        assert c.grid == 132

    def test_a_batch_whose_keys_exceed_l2_runs_in_two_halves(self):
        # 8 x 8192, 8 KV heads of 128: 268 MB of K/V; a half holds 62 rounds of 132 programs
        big = config(batch=8, total_q=8 * 8192, max_seqlen_q=8192, num_heads=32,
                     num_kv_heads=8)
        assert (big.constexprs["LPT_ACROSS"], big.constexprs["DYNAMIC"]) == (4, False)
        small = config(batch=8, total_q=8 * 512, max_seqlen_q=512)  # 4 MB of K/V in all
        assert (small.constexprs["LPT_ACROSS"], small.constexprs["DYNAMIC"]) == (1, False)

    def test_few_query_heads_per_kv_head_over_l2_take_items_in_pairs_of_requests(self):
        # 8 x 2048, 16 q / 8 KV heads of 256: 134 MB of K/V, each tile read by two heads
        c = config(batch=8, total_q=8 * 2048, max_seqlen_q=2048, num_heads=16,
                   num_kv_heads=8, head_size=256, head_size_v=256)
        assert (c.constexprs["LPT_ACROSS"], c.constexprs["DYNAMIC"]) == (2, True)

    def test_item_order(self, monkeypatch):
        mb = 1 << 20
        assert ag.item_order(8, 16, 16, 2, 17 * mb, 132) == (2, True)  # 8 x 2048, head 256
        assert ag.item_order(8, 16, 32, 4, 8 * mb, 132) == (4, False)  # head 128, GQA 4
        assert ag.item_order(32, 4, 16, 2, 4 * mb, 132) == (1, False)  # short requests
        assert ag.item_order(8, 16, 16, 2, 4 * mb, 132) == (1, False)  # 32 MB: fits L2
        assert ag.item_order(7, 16, 16, 2, 17 * mb, 132) == (1, False)  # no pairs
        assert ag.item_order(2, 16, 16, 2, 64 * mb, 132) == (1, False)  # too few requests
        monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", True)
        assert ag.item_order(7, 16, 32, 4, 17 * mb, 132) == (1, True)
        monkeypatch.setattr(ag.SWITCHES, "gluon_lpt_group", 4)
        assert ag.item_order(8, 16, 32, 4, 17 * mb, 132) == (4, True)
        monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", False)
        monkeypatch.setattr(ag.SWITCHES, "gluon_lpt_group", None)
        assert ag.item_order(8, 16, 16, 2, 17 * mb, 132) == (4, False)  # static halves

    def test_request_major_order_is_the_compact_slots(self, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_lpt_group", 0)
        c = config(batch=8, total_q=8 * 2048, max_seqlen_q=2048)
        assert c.constexprs["LPT_ACROSS"] == 0
        assert c.num_items == 8 * (8 * 2048 // 128 + 8)

    def test_dynamic_items_where_switched_on(self, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", True)
        assert config(batch=8, total_q=8 * 2048, max_seqlen_q=2048).constexprs["DYNAMIC"]
        assert not config(batch=1, total_q=1, max_seqlen_q=1, skip_q_len=1).constexprs[
            "DYNAMIC"]  # nothing to hand out
        monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", False)
        assert not config(batch=8, total_q=8 * 2048, max_seqlen_q=2048).constexprs["DYNAMIC"]

    def test_compact_slots_when_one_long_request_rides_with_decodes(self):
        c = config(batch=257, total_q=8192 + 256, max_seqlen_q=8192)
        assert not c.constexprs["LPT_ACROSS"]
        assert c.num_items == 8 * ((8192 + 256) // 128 + 257)

    def test_nothing_to_do_when_every_request_belongs_to_the_decode_pass(self):
        c = config(batch=4, total_q=4, max_seqlen_q=1, skip_q_len=1)
        assert c.grid == 0 and c.num_items == 0
        assert config(batch=0, total_q=0, max_seqlen_q=0).grid == 0

    def test_small_batches_use_fewer_programs_than_sms(self):
        c = config(batch=1, total_q=100, max_seqlen_q=100, num_heads=4, num_kv_heads=4)
        assert c.grid == c.num_items == 4

    @pytest.mark.parametrize("window_right, right", [(-1, 0), (0, 0), (7, 0)])
    def test_causal_is_a_right_window_of_zero(self, window_right, right):
        c = config(causal=True, window_right=window_right)
        assert c.window[1] == right and c.constexprs["WINDOW_RIGHT"]

    def test_non_causal_keeps_its_windows(self):
        c = config(causal=False, window_left=9, window_right=5)
        assert c.window == (9, 5)
        assert c.constexprs["WINDOW_LEFT"] and c.constexprs["WINDOW_RIGHT"]
        c = config(causal=False)
        assert not c.constexprs["WINDOW_LEFT"] and not c.constexprs["WINDOW_RIGHT"]

    def test_scale_folding(self):
        c = config(softmax_scale=0.125)
        assert c.constexprs["SCALE_IN_EXP"]
        assert c.floats[0] == pytest.approx(0.125 * math.log2(math.e))
        c = config(softcap=30.0)
        assert not c.constexprs["SCALE_IN_EXP"]
        assert c.floats == pytest.approx((0.125 / 30.0, 30.0 * math.log2(math.e)))
        assert not config(use_alibi=True).constexprs["SCALE_IN_EXP"]
        assert not config(softmax_scale=-0.1).constexprs["SCALE_IN_EXP"]

    @pytest.mark.parametrize("head_size, fp8, block_n, smem_kb", [
        (64, False, 128, 128), (128, False, 128, 192), (256, False, 64, 192),
        (64, True, 128, 160), (128, True, 128, 224), (256, True, 64, 224)])
    def test_tiles_fit_shared_memory(self, head_size, fp8, block_n, smem_kb):
        c = config(head_size=head_size, head_size_v=head_size, paged=fp8, kv_fp8=fp8)
        assert c.constexprs["BLOCK_N"] == block_n
        q_bytes = c.constexprs["NUM_QBUF"] * c.constexprs["BLOCK_M"] * head_size * 2
        ring = c.constexprs["NUM_BUF"] * block_n * 2 * head_size * 2
        staged = c.constexprs["STAGES"] * block_n * 2 * head_size if fp8 else 0
        assert (q_bytes + ring + staged) // 1024 == smem_kb <= 227
        regs = c.constexprs
        assert 2 * regs["CONSUMER_REGS"] + regs["PRODUCER_REGS"] == 504  # 3 warpgroups at 168

    def test_three_consumers_make_192_row_items_at_head_64(self, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", 3)
        c = config(batch=8, total_q=8 * 2048, max_seqlen_q=2048, head_size=64, head_size_v=64)
        k = c.constexprs
        assert k["BLOCK_M"] == 192 and k["BLOCK_N"] == 128
        assert c.num_items == 8 * 8 * 11  # heads x requests x blocks of 192 (2048 / 192)
        # three consumer warpgroups and the producer's (with the converter's warps) share
        # the SM's 64K registers
        assert 3 * 128 * k["CONSUMER_REGS"] + 128 * k["PRODUCER_REGS"] <= 65536
        assert (k["CONSUMER_REGS"], k["PRODUCER_REGS"]) == (160, 32)
        q_bytes = k["NUM_QBUF"] * 192 * 64 * 2
        ring = k["NUM_BUF"] * 128 * 2 * 64 * 2
        assert (q_bytes + ring) // 1024 == 144
        monkeypatch.setattr(ag.SWITCHES, "gluon_lpt_group", 0)  # the compact slots
        c = config(batch=3, total_q=1000, max_seqlen_q=600, head_size=64, head_size_v=64)
        assert c.num_items == 8 * (1000 // 192 + 3)

    @pytest.mark.parametrize("change", [
        dict(head_size=128, head_size_v=128), dict(head_size=64, head_size_v=128),
        dict(head_size=64, head_size_v=64, paged=True, kv_fp8=True, use_kv_descale=True)])
    def test_three_consumers_fall_back_to_two_where_they_cannot_serve(self, change,
                                                                     monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", 3)
        k = config(**change).constexprs
        assert (k["BLOCK_M"], k["CONSUMER_REGS"]) == (128, 232)

    @pytest.mark.parametrize("consumers, block_m", [(None, 128), (2, 128), (3, 192)])
    def test_the_consumer_switch_picks_the_item_rows(self, consumers, block_m, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", consumers)
        assert config(head_size=64, head_size_v=64).constexprs["BLOCK_M"] == block_m
        assert ag.consumers_for(64, fp8=False) == block_m // 64

    @pytest.mark.parametrize("batch, mean_q, causal, head, block_m", [
        (1, 8192, True, 64, 192), (2, 8192, True, 64, 192), (1, 16384, True, 64, 192),
        (4, 4096, True, 64, 128), (1, 8192, False, 64, 128), (1, 8192, True, 128, 128),
        (3, 2730, True, 64, 128)])  # one 8,192-token prompt beside two decodes
    def test_the_measured_rule_takes_three_consumers_where_prompts_are_long(
            self, batch, mean_q, causal, head, block_m, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", None)
        c = config(batch=batch, total_q=batch * mean_q, max_seqlen_q=8192 * (batch == 3)
                   or mean_q, head_size=head, head_size_v=head, causal=causal)
        assert c.constexprs["BLOCK_M"] == block_m

    @pytest.mark.parametrize("bad", [1, 4, True, "3"])
    def test_the_consumer_switch_refuses_other_counts(self, bad, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", bad)
        with pytest.raises(ValueError, match=r"gluon_consumers must be None, 2 or 3, got"):
            config(head_size=64, head_size_v=64)

    def test_three_consumer_tiles_name_what_they_refuse(self):
        from pagedattn.ops.triton.gluon_schedule import config_for, three_consumers_refusal

        assert three_consumers_refusal(64, fp8=False) == ""
        assert "up to 64" in three_consumers_refusal(128, fp8=False)
        assert "16-bit" in three_consumers_refusal(64, fp8=True)
        with pytest.raises(ValueError, match="not 256"):
            config_for(256, consumers=3)
        with pytest.raises(ValueError, match="consumers must be 2 or 3, got 4"):
            config_for(64, consumers=4)

    H64_FP8_Q = dict(head_size=64, head_size_v=64, paged=True, kv_fp8=True,
                     use_kv_descale=True, q_fp8=True, use_q_descale=True)

    @pytest.mark.parametrize("fp8_pv", [None, True])
    def test_three_consumers_serve_an_fp8_q_at_head_64_with_their_switch(self, fp8_pv,
                                                                         monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", 3)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", fp8_pv)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_three_consumers", True)
        c = config(**dict(self.H64_FP8_Q, batch=2, total_q=2 * 2048, max_seqlen_q=2048))
        k = c.constexprs
        assert (k["BLOCK_M"], k["BLOCK_N"], k["LANE_MASKS"]) == (192, 128, True)
        assert (k["CONSUMER_REGS"], k["PRODUCER_REGS"]) == (160, 32)
        assert 3 * 128 * k["CONSUMER_REGS"] + 128 * k["PRODUCER_REGS"] <= 65536
        assert c.num_items == 8 * 2 * 11  # heads x requests x blocks of 192 (2048 / 192)
        # the P V head 64 takes from `gluon_fp8_pv` (None: 16-bit, O's rescale lazy by
        # slack 8; True: fp8, P as words, V^T by PRMT over the ldmatrix words, every tile)
        pv = fp8_pv is True
        assert (k["PV_FP8"], k["P_WORDS"], k["V_PRMT"]) == (pv, pv, 2 if pv else False)
        assert k["MAX_SLACK"] == (-1 if pv else 8)
        assert (k["VT_COLS"], k["VT_PREFETCH"], k["RESCALE_AFTER_PV"]) == (64, False, False)
        # shared memory: 1-byte Q buffers of three parts, the fp8 K / V staging ring, the
        # consumers' V ring (16-bit V, or fp8 V^T), all under an sm_90 block's 227 KB
        q_bytes = k["NUM_QBUF"] * 192 * 64
        staged = k["STAGES"] * 128 * 2 * 64
        v_ring = k["NUM_BUF"] * 128 * 64 * (1 if pv else 2)
        assert (k["NUM_QBUF"], k["STAGES"], k["NUM_BUF"]) == (2, 4, 3)
        assert (q_bytes + staged + v_ring) // 1024 == (112 if pv else 136)

    @pytest.mark.parametrize("switch, consumers, change, block_m", [
        (False, 3, {}, 128),  # the switch off: an fp8 q keeps two
        (True, 2, {}, 128),
        (True, None, dict(batch=1, total_q=8192, max_seqlen_q=8192), 192),  # the rule
        (True, None, dict(batch=8, total_q=8 * 2048, max_seqlen_q=2048), 128),
        (True, 3, dict(head_size=128, head_size_v=128), 128),  # head 64 alone
        (True, 3, dict(q_fp8=False, use_q_descale=False), 128),  # a 16-bit q: split
    ])
    def test_the_fp8_three_consumer_switch_takes_the_consumer_rule_for_an_fp8_q(
            self, switch, consumers, change, block_m, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", consumers)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_three_consumers", switch)
        q_fp8 = change.get("q_fp8", True)
        k = config(**dict(self.H64_FP8_Q, **change),
                   split_q=not q_fp8).constexprs
        assert k["BLOCK_M"] == block_m
        assert k["CONSUMER_REGS"] == (160 if block_m == 192 else 232)

    @pytest.mark.parametrize("change", [dict(), dict(head_size=64, head_size_v=64),
                                        dict(head_size=64, head_size_v=64, paged=True,
                                             kv_fp8=True, use_kv_descale=True)])
    def test_the_fp8_three_consumer_switch_leaves_16_bit_q_plans_unchanged(self, change,
                                                                          monkeypatch):
        for consumers in (None, 3):
            monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", consumers)
            monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_three_consumers", False)
            before = config(**change).constexprs
            monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_three_consumers", True)
            assert config(**change).constexprs == before

    @pytest.mark.parametrize("bad", [None, 1, "yes"])
    def test_the_fp8_three_consumer_switch_refuses_non_bools(self, bad, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_three_consumers", bad)
        with pytest.raises(TypeError, match=r"gluon_fp8_three_consumers must be True or False, "
                                            rf"got {bad!r}"):
            config(**self.H64_FP8_Q)

    def test_three_consumer_tiles_for_an_fp8_q(self):
        from pagedattn.ops.triton.gluon_schedule import config_for, three_consumers_refusal

        assert three_consumers_refusal(64, fp8=True, q_fp8=True) == ""
        assert "16-bit q over an fp8 cache" in three_consumers_refusal(64, fp8=True)
        assert "not 128" in three_consumers_refusal(128, fp8=True, q_fp8=True)
        assert config_for(64, True, True, consumers=3) == (128, 3, 2, 4, 160, 32)
        with pytest.raises(ValueError, match="16-bit q over an fp8 cache"):
            config_for(64, True, False, split_q=True, consumers=3)

    @pytest.mark.parametrize("change", [
        dict(head_size=64, head_size_v=64), dict(), dict(head_size=256, head_size_v=256),
        dict(paged=True, dense_new_kv=True), dict(use_alibi=True),
        dict(window_left=100, use_sinks=True),
        dict(paged=True, kv_fp8=True, use_kv_descale=True),
        dict(paged=True, kv_fp8=True, use_kv_descale=True, q_fp8=True, use_q_descale=True)])
    def test_two_consumers_on_their_default_tiles_keep_columns_in_registers(self, change):
        k = config(**change).constexprs
        assert (k["BLOCK_M"], k["LANE_MASKS"]) == (128, False)

    def test_three_consumers_mask_by_lane(self, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", 3)
        k = config(head_size=64, head_size_v=64).constexprs
        assert (k["BLOCK_M"], k["LANE_MASKS"]) == (192, True)
        # where three cannot serve, two keep the columns in registers
        k = config(head_size=128, head_size_v=128).constexprs
        assert (k["BLOCK_M"], k["LANE_MASKS"]) == (128, False)

    FP8_Q = dict(paged=True, kv_fp8=True, use_kv_descale=True, q_fp8=True,
                 use_q_descale=True)

    @pytest.mark.parametrize("slack", [0, 4, 8])
    @pytest.mark.parametrize("change", [{}, dict(head_size=64, head_size_v=64), FP8_Q])
    def test_the_max_slack_switch_reaches_every_plan_but_the_invariant_one(
            self, slack, change, monkeypatch):
        # None: 8 with a 16-bit P V, every tile with an fp8 P V (`attention_gluon.slack_for`)
        assert config(**change).constexprs["MAX_SLACK"] == (-1 if change is self.FP8_Q else 8)
        monkeypatch.setattr(ag.SWITCHES, "gluon_max_slack", -1)  # the same: every tile
        assert config(**change).constexprs["MAX_SLACK"] == -1
        monkeypatch.setattr(ag.SWITCHES, "gluon_max_slack", slack)
        assert config(**change).constexprs["MAX_SLACK"] == slack
        # the invariant plan takes the mode's own slack (`invariant_max_slack`, 8), never this
        assert config(paged=True, invariant=(64, 1024)).constexprs["MAX_SLACK"] == 8

    @pytest.mark.parametrize("fp8_pv, change, expected", [
        (True, FP8_Q, True), (False, FP8_Q, False), (True, {}, False),
        (True, dict(FP8_Q, head_size=64, head_size_v=64), True),
        (True, dict(paged=True, kv_fp8=True, use_kv_descale=True), False)])
    @pytest.mark.parametrize("switch, constexpr", [("gluon_fp8_v_prmt", "V_PRMT"),
                                                   ("gluon_fp8_p_words", "P_WORDS")])
    def test_the_v_prmt_and_p_words_switches_reach_fp8_p_v_plans_alone(
            self, fp8_pv, change, expected, switch, constexpr, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", fp8_pv)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_v_words", False)  # V_PRMT True, not 2
        default = config(**change).constexprs[constexpr]  # None: on with an fp8 P V
        monkeypatch.setattr(ag.SWITCHES, switch, False)
        off = config(**change).constexprs
        monkeypatch.setattr(ag.SWITCHES, switch, True)
        on = config(**change).constexprs
        assert (off[constexpr], on[constexpr], default) == (False, expected, expected)
        assert_same_but(on, off, constexpr)

    @pytest.mark.parametrize("head, fp8_pv, v_prmt", [(128, True, 2), (96, True, 2),
                                                      (64, False, False), (256, True, 2)])
    def test_the_measured_rule_runs_fp8_p_v_above_head_64_with_its_switches(self, head, fp8_pv,
                                                                            v_prmt):
        # `SWITCHES.gluon_fp8_pv` None (H200: 1.12-1.15x the fp16 P V on the head-128 rows
        # with P as words and V^T by PRMT; 1.05x at head 256 with V^T over the ldmatrix
        # words, `gluon_fp8_v_words`; 0.94x at head 64), and there the max slack with an
        # fp16 P V (`attention_gluon.slack_for`)
        c = config(**dict(self.FP8_Q, head_size=head, head_size_v=head)).constexprs
        assert (c["PV_FP8"], c["P_WORDS"], c["V_PRMT"], c["MAX_SLACK"]) == \
            (fp8_pv, fp8_pv, v_prmt, -1 if fp8_pv else 8)
        assert type(c["V_PRMT"]) is type(v_prmt)
        sixteen = config(head_size=head, head_size_v=head).constexprs  # a 16-bit q
        assert (sixteen["PV_FP8"], sixteen["MAX_SLACK"], sixteen["V_PRMT"]) == (False, 8, False)

    @pytest.mark.parametrize("words", [None, True, False])
    def test_p_words_reach_head_256_with_an_fp8_p_v(self, words, monkeypatch):
        # the consumers keep one P tile live there, so ptxas no longer serialises their
        # wgmmas (sm_90 SASS, tools/gluon_sass.py)
        head_256 = dict(self.FP8_Q, head_size=256, head_size_v=256)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_p_words", words)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", False)
        assert config(**head_256).constexprs["P_WORDS"] is False
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", True)
        k = config(**head_256).constexprs
        assert (k["P_WORDS"], k["V_PRMT"], k["PV_FP8"]) == (words is not False, 2, True)

    @pytest.mark.parametrize("fp8_pv, prmt, change, expected", [
        (True, None, FP8_Q, 2), (True, True, FP8_Q, 2), (True, False, FP8_Q, False),
        (False, None, FP8_Q, False), (True, None, {}, False),
        (True, None, dict(FP8_Q, head_size=64, head_size_v=64), 2),
        (True, None, dict(FP8_Q, head_size=256, head_size_v=256), 2)])
    def test_the_v_words_switch_reaches_the_prmt_plans_alone(self, fp8_pv, prmt, change,
                                                             expected, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", fp8_pv)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_v_prmt", prmt)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_v_words", False)
        off = config(**change).constexprs
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_v_words", True)
        on = config(**change).constexprs
        assert on["V_PRMT"] == expected and type(on["V_PRMT"]) is type(expected)
        assert off["V_PRMT"] is (expected is not False)
        assert_same_but(on, off, "V_PRMT")

    @pytest.mark.parametrize("name, bad, error", [
        ("gluon_fp8_v_prmt", 1, TypeError),
        ("gluon_fp8_p_words", "yes", TypeError), ("gluon_fp8_pv", 1, TypeError),
        ("gluon_fp8_v_words", None, TypeError), ("gluon_max_slack", 9, ValueError),
        ("gluon_max_slack", -2, ValueError), ("gluon_max_slack", False, ValueError),
        ("gluon_max_slack", "4", ValueError)])
    def test_the_softmax_switches_refuse_other_values(self, name, bad, error, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, name, bad)
        with pytest.raises(error, match=rf"SWITCHES.{name} must be .*, got {bad!r}"):
            config()

    # The wide fp8 key tiles (`SWITCHES.gluon_fp8_wide_tiles`): FA3's shapes where an fp8 P V
    # carries P as words, (BLOCK_N, NUM_BUF, NUM_QBUF, STAGES, consumer and producer
    # registers) of `gluon_schedule.wide_config_for`, and lane masks.
    WIDE = {128: (256, 2, 1, 2, 240, 24), 256: (128, 2, 1, 2, 240, 24)}
    TILE_KEYS = ("BLOCK_N", "NUM_BUF", "NUM_QBUF", "STAGES", "CONSUMER_REGS", "PRODUCER_REGS")

    @pytest.mark.parametrize("head", [128, 256])
    @pytest.mark.parametrize("change", [{}, dict(page_size=64), dict(use_sinks=True),
                                        dict(use_sinks=True, window_left=100),
                                        dict(causal=False), dict(num_kv_heads=8)])
    def test_the_wide_tile_switch_reaches_fp8_p_v_plans_at_heads_128_and_256(
            self, head, change, monkeypatch):
        plan = dict(self.FP8_Q, head_size=head, head_size_v=head, **change)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", False)
        off = config(**plan).constexprs
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", True)
        on = config(**plan).constexprs
        assert tuple(on[k] for k in self.TILE_KEYS) == self.WIDE[head]
        assert (off["PV_FP8"], off["P_WORDS"], off["LANE_MASKS"], on["LANE_MASKS"]) == \
            (True, True, False, True)
        assert tuple(off[k] for k in self.TILE_KEYS) != self.WIDE[head]
        changed = set(self.TILE_KEYS) | {"LANE_MASKS", "PAGE"}
        assert_same_but(on, off, *changed)
        # the page size stays the launch's (tiles of several pages, or a page in several)
        assert on["PAGE"] == off["PAGE"] == plan.get("page_size", 16)

    @pytest.mark.parametrize("switches, change", [
        ({}, {}),  # a 16-bit q
        ({}, dict(paged=True, kv_fp8=True, use_kv_descale=True)),  # split q over fp8
        ({}, dict(FP8_Q, head_size=64, head_size_v=64)),  # head 64: a 16-bit P V
        ({}, dict(FP8_Q, head_size=96, head_size_v=96)),  # not a wide-tile head
        ({}, dict(FP8_Q, head_size=256, head_size_v=128)),  # K and V heads apart
        ({}, dict(FP8_Q, use_alibi=True)),  # ALiBi keeps the columns in registers
        ({}, dict(FP8_Q, softcap=30.0)),  # the soft cap's temporaries spilled in the loop
        ({}, dict(FP8_Q, head_size=256, head_size_v=256, softcap=30.0)),
        (dict(gluon_fp8_pv=False), FP8_Q),  # a 16-bit P V
        (dict(gluon_fp8_p_words=False), FP8_Q),  # P as bytes: two tiles of P live
        ({}, dict(paged=True, dense_new_kv=True)),  # bf16 cache, new rows dense
    ])
    def test_the_wide_tile_switch_leaves_other_plans_unchanged(self, switches, change,
                                                               monkeypatch):
        for name, value in switches.items():
            monkeypatch.setattr(ag.SWITCHES, name, value)
        off = config(**change)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", True)
        on = config(**change)
        assert on == off

    def test_the_wide_tile_switch_leaves_invariant_plans_unchanged(self, monkeypatch):
        plan = dict(paged=True, invariant=(64, 1024))
        off = config(**plan)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", True)
        assert config(**plan) == off

    @pytest.mark.parametrize("bad", [1, 256, "on"])
    def test_the_wide_tile_switch_refuses_non_bools(self, bad, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", bad)
        with pytest.raises(TypeError,
                           match=rf"SWITCHES.gluon_fp8_wide_tiles must be None, True or False, "
                                 rf"got {bad!r}"):
            config(**self.FP8_Q)

    @pytest.mark.parametrize("head, max_seqlen_q, max_seqlen_k, wide", [
        (256, 100, 0, False), (256, 2048, 2048, False), (256, 512, ag.WIDE_MIN_KEYS, True),
        (256, ag.WIDE_MIN_KEYS, 0, True),
        (128, 2048, 0, False), (128, 2048, 2048, False),
        (128, ag.WIDE_MIN_KEYS - 1, 0, False), (128, ag.WIDE_MIN_KEYS, 0, True),
        (128, 2048, ag.WIDE_MIN_KEYS, True),  # a chunk after a long context
        (128, ag.WIDE_MIN_KEYS, ag.WIDE_MIN_KEYS - 1, False)])  # the keys decide, not q
    def test_the_wide_tiles_default_takes_launches_of_long_requests(
            self, head, max_seqlen_q, max_seqlen_k, wide):
        assert ag.SWITCHES.gluon_fp8_wide_tiles is None
        plan = dict(self.FP8_Q, head_size=head, head_size_v=head, max_seqlen_q=max_seqlen_q,
                    total_q=max_seqlen_q)
        got = ag.launch_config(sm_count=132, max_seqlen_k=max_seqlen_k, **{
            k: v for k, v in dict(PLAN, **plan).items()
            if k not in ("max_seqlen_k", "q_dtype", "kv_dtype")}).constexprs
        assert got["BLOCK_N"] == (self.WIDE[head][0] if wide else {128: 128, 256: 64}[head])
        assert got["LANE_MASKS"] == wide

    @pytest.mark.parametrize("head", [32, 96, 192, 512])
    def test_wide_tiles_exist_for_heads_64_128_and_256_alone(self, head):
        with pytest.raises(ValueError, match=f"head sizes 64, 128 and 256, not {head}"):
            gluon_schedule.wide_config_for(head)

    # Head 64's wide tiles (`SWITCHES.gluon_fp8_wide_tiles_64`): 256 keys where an fp8 P V
    # runs on two consumers, by `gluon_fp8_wide_tiles`' rule
    H64 = dict(FP8_Q, head_size=64, head_size_v=64)

    @pytest.mark.parametrize("change", [{}, dict(page_size=64), dict(use_sinks=True),
                                        dict(use_sinks=True, window_left=100),
                                        dict(causal=False), dict(num_kv_heads=8)])
    def test_the_head_64_wide_tile_switch_reaches_fp8_p_v_plans(self, change, monkeypatch):
        plan = dict(self.H64, **change)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", True)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", True)
        off = config(**plan).constexprs
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles_64", True)
        on = config(**plan).constexprs
        assert tuple(on[k] for k in self.TILE_KEYS) == (256, 3, 2, 3, 232, 40)
        assert tuple(off[k] for k in self.TILE_KEYS) == (128, 3, 2, 4, 232, 40)
        assert (on["PV_FP8"], on["P_WORDS"], on["LANE_MASKS"], off["LANE_MASKS"]) == \
            (True, True, True, False)
        assert (on["BLOCK_M"], on["VT_COLS"], on["VT_PREFETCH"]) == (128, 64, False)
        changed = set(self.TILE_KEYS) | {"LANE_MASKS"}
        assert_same_but(on, off, *changed)

    @pytest.mark.parametrize("switches, change", [
        ({}, {}),  # head 64's default: a 16-bit P V
        (dict(gluon_fp8_pv=True), dict(use_alibi=True)),
        (dict(gluon_fp8_pv=True), dict(softcap=30.0)),
        (dict(gluon_fp8_pv=True, gluon_fp8_wide_tiles=False), {}),  # forced off
        (dict(gluon_fp8_pv=True, gluon_fp8_wide_tiles=None), dict(max_seqlen_q=2048)),
        # three consumers keep their 128-key tiles (S of 256 keys is not in 160 registers)
        (dict(gluon_fp8_pv=True, gluon_consumers=3, gluon_fp8_three_consumers=True), {}),
        (dict(gluon_fp8_pv=True), dict(FP8_Q, head_size=128, head_size_v=128)),  # its own
        (dict(gluon_fp8_pv=True), dict(head_size=64, head_size_v=64)),  # a 16-bit q
    ])
    def test_the_head_64_wide_tile_switch_leaves_other_plans_unchanged(self, switches, change,
                                                                      monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", True)
        for name, value in switches.items():
            monkeypatch.setattr(ag.SWITCHES, name, value)
        plan = dict(self.H64, **change)
        if "head_size" in change and "q_fp8" not in change:
            plan = dict(PLAN, **change)
        plan = dict(plan, total_q=plan.get("max_seqlen_q", 200))
        off = config(**plan)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles_64", True)
        assert config(**plan) == off

    def test_the_head_64_wide_tiles_take_the_long_request_rule(self, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", True)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles_64", True)
        for keys, block_n in ((ag.WIDE_MIN_KEYS, 256), (ag.WIDE_MIN_KEYS - 1, 128)):
            plan = dict(self.H64, max_seqlen_q=keys, total_q=keys)
            assert config(**plan).constexprs["BLOCK_N"] == block_n

    @pytest.mark.parametrize("bad", [None, 1, "on"])
    def test_the_head_64_wide_tile_switch_refuses_non_bools(self, bad, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles_64", bad)
        with pytest.raises(TypeError, match=rf"SWITCHES.gluon_fp8_wide_tiles_64 must be True "
                                            rf"or False, got {bad!r}"):
            config(**self.FP8_Q)

    # The converter's V^T in slabs of 128 columns (`SWITCHES.gluon_fp8_vt_wide_slabs`) and
    # the V^T ring's depth on the default tiles (`gluon_fp8_vt_slots`): fp8 P V plans alone.
    @pytest.mark.parametrize("head, wide, cols, slots", [
        (128, False, 128, 4), (256, False, 128, 4), (256, False, 128, 3),
        (128, True, 128, 2), (256, True, 128, 2),  # the wide tiles keep their 2 slots
        (64, False, 64, 4)])  # Dv 64: one 64-column slab already
    def test_the_vt_switches_reach_fp8_p_v_plans(self, head, wide, cols, slots, monkeypatch):
        plan = dict(self.FP8_Q, head_size=head, head_size_v=head)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", True)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", wide)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_wide_slabs", False)
        off = config(**plan).constexprs
        assert off["VT_COLS"] == 64
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_wide_slabs", True)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_slots", 4 if slots == 2 else slots)
        on = config(**plan).constexprs
        assert (on["VT_COLS"], on["NUM_BUF"]) == (cols, off["NUM_BUF"] if wide else slots)
        # the slabs bring the prefetch along at Dv 256 (on by default), nothing else
        assert (off["VT_PREFETCH"], on["VT_PREFETCH"]) == (False, cols == 128 and head > 128)
        changed = ("VT_COLS", "NUM_BUF", "VT_PREFETCH")
        assert_same_but(on, off, *changed)

    @pytest.mark.parametrize("change", [{}, dict(paged=True, kv_fp8=True, use_kv_descale=True),
                                        dict(FP8_Q, head_size=256, head_size_v=256)])
    def test_the_vt_switches_leave_plans_without_an_fp8_p_v_unchanged(self, change,
                                                                      monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", False)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_wide_slabs", False)
        off = config(**change)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_wide_slabs", True)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_slots", 4)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_prefetch", True)
        assert config(**change) == off
        assert (off.constexprs["VT_COLS"], off.constexprs["VT_PREFETCH"]) == (64, False)

    @pytest.mark.parametrize("name, bad, error", [
        ("gluon_fp8_vt_wide_slabs", None, TypeError), ("gluon_fp8_vt_wide_slabs", 1, TypeError),
        ("gluon_fp8_vt_wide_slabs", "on", TypeError), ("gluon_fp8_vt_slots", 1, ValueError),
        ("gluon_fp8_vt_slots", 5, ValueError), ("gluon_fp8_vt_slots", True, ValueError),
        ("gluon_fp8_vt_slots", 3.0, ValueError), ("gluon_fp8_vt_slots", "3", ValueError),
        ("gluon_fp8_vt_prefetch", None, TypeError), ("gluon_fp8_vt_prefetch", 1, TypeError)])
    def test_the_vt_switches_refuse_other_values(self, name, bad, error, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, name, bad)
        with pytest.raises(error, match=rf"SWITCHES.{name} must be .*, got {bad!r}"):
            config(**self.FP8_Q)

    # The converter's 128-column V^T slabs loaded a slab ahead (`SWITCHES.
    # gluon_fp8_vt_prefetch`): at Dv 256 alone (head 128's 32-key slabs would spill)
    @pytest.mark.parametrize("head", [128, 256])
    @pytest.mark.parametrize("wide", [False, True])
    @pytest.mark.parametrize("wide_slabs", [False, True])
    def test_vt_prefetch_reaches_dv_256_slabs_of_128_columns_alone(self, head, wide,
                                                                   wide_slabs, monkeypatch):
        plan = dict(self.FP8_Q, head_size=head, head_size_v=head)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", True)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", wide)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_wide_slabs", wide_slabs)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_prefetch", False)
        off = config(**plan).constexprs
        assert off["VT_PREFETCH"] is False
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_prefetch", True)
        on = config(**plan).constexprs
        assert on["VT_PREFETCH"] is (head == 256 and wide_slabs)
        assert on["VT_COLS"] == (128 if wide_slabs else 64)
        assert_same_but(on, off, "VT_PREFETCH")

    # O's rescale after the P V wait (`SWITCHES.gluon_fp8_rescale_after_pv`): head 256's fp8
    # P V with P words alone, the consumers' one-P order (tiles of at most 128 keys there)
    @pytest.mark.parametrize("head, wide, slack", [
        (256, False, None), (256, True, None), (256, False, 4), (128, False, None),
        (128, True, None)])
    def test_rescale_after_pv_reaches_head_256_fp8_p_v_plans_alone(self, head, wide, slack,
                                                                   monkeypatch):
        plan = dict(self.FP8_Q, head_size=head, head_size_v=head)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", True)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", wide)
        monkeypatch.setattr(ag.SWITCHES, "gluon_max_slack", slack)
        off = config(**plan).constexprs
        assert off["RESCALE_AFTER_PV"] is False
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_rescale_after_pv", True)
        on = config(**plan).constexprs
        assert on["RESCALE_AFTER_PV"] is (head == 256)
        assert_same_but(on, off, "RESCALE_AFTER_PV")
        if head == 256:  # the consumer's one-P order: P words, no P V before S (> 128 keys)
            assert on["P_WORDS"] and on["BLOCK_N"] <= 128

    @pytest.mark.parametrize("change", [
        {}, dict(paged=True, kv_fp8=True, use_kv_descale=True, head_size=256, head_size_v=256),
        dict(FP8_Q, head_size=256, head_size_v=256, pv=False),
        dict(FP8_Q, head_size=256, head_size_v=256, p_words=False)])
    def test_rescale_after_pv_leaves_other_plans_unchanged(self, change, monkeypatch):
        change = dict(change)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", change.pop("pv", True))
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_p_words", change.pop("p_words", None))
        off = config(**change)
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_rescale_after_pv", True)
        assert config(**change) == off
        assert off.constexprs["RESCALE_AFTER_PV"] is False

    @pytest.mark.parametrize("bad", [None, 1, "on"])
    def test_rescale_after_pv_refuses_other_values(self, bad, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_rescale_after_pv", bad)
        with pytest.raises(TypeError, match=rf"SWITCHES.gluon_fp8_rescale_after_pv must be "
                                            rf"True or False, got {bad!r}"):
            config(**self.FP8_Q)

    @pytest.mark.parametrize("head", [128, 256])
    def test_four_vt_slots_fit_beside_the_default_tiles(self, head):
        # fp8 bytes: two consumers' Q buffers, the K and V staging rings, 4 V^T slots, the
        # 4 KB O staging (`gluon_schedule.row_stores`), 1 KB for barriers and alignment
        block_n, _, num_qbuf, stages, _, _ = gluon_schedule.config_for(head, True, True)
        ring = num_qbuf * 2 * 64 * head + stages * block_n * 2 * head + 4 * block_n * head
        assert gluon_schedule.row_stores(True, True, True, head, block_n)
        assert ring + 4096 + 1024 <= 227 * 1024

    @pytest.mark.parametrize("head", [64, 128, 256])
    def test_wide_tiles_fit_shared_memory_and_registers(self, head):
        # fp8 bytes throughout: Q buffers of two consumers' 64 rows, K and V staging slots,
        # V^T slots; O's 4 KB staging where it fits (`gluon_schedule.row_stores`); 3
        # warpgroups' registers within an SM's 64K
        wide = gluon_schedule.wide_config_for(head)
        block_n, num_buf, num_qbuf, stages, consumer, producer = wide
        ring = num_qbuf * 2 * 64 * head + stages * block_n * 2 * head + num_buf * block_n * head
        staging = 4096 if gluon_schedule.row_stores(True, True, True, head, block_n) else 0
        assert ring + staging + 1024 <= 227 * 1024  # 1 KB for the barriers and alignment
        assert staging == (0 if head == 256 else 4096)
        assert 128 * (2 * consumer + producer) <= 65536
        # a consumer's S, O and one tile of P words, in registers, under its 240
        assert block_n // 2 + head // 2 + block_n // 8 <= consumer - 16

    def test_fp8_caches_give_every_key_from_the_pages(self):
        c = config(paged=True, dense_new_kv=True, kv_fp8=True, use_kv_descale=True)
        assert not c.constexprs["DENSE_ROWS"] and not c.dense_new_kv
        assert c.constexprs["KV_FP8"] and c.constexprs["KV_DESCALE"]

    def test_phases(self):
        assert config(paged=True, dense_new_kv=True).constexprs["DENSE_ROWS"]
        assert not config(paged=True, dense_new_kv=False).constexprs["DENSE_ROWS"]
        assert config(paged=False).constexprs["DENSE_ROWS"]
        assert config(paged=True, page_size=32).constexprs["PAGE"] == 32

    def test_runtime_arguments_come_before_the_constexprs(self):
        # fast_launch appends the constexprs after run()'s arguments, in signature order
        launch, rec, b = recorded_launch()
        launch.run(b.q, torch.zeros(700, 2, 128, dtype=torch.bfloat16),
                   torch.zeros(700, 2, 128, dtype=torch.bfloat16), torch.empty_like(b.q),
                   torch.empty(8, 300))
        names = ag.gluon_prefill.gluon_prefill_kernel.arg_names
        n = len(rec.calls[0][0])
        assert sorted(names[n:]) == sorted(launch.schedule.constexprs)

    def test_batch_args_follow_the_kernel_signature(self):
        c = config(window_left=9)
        names = ag.gluon_prefill.gluon_prefill_kernel.arg_names
        first = names.index("qk_scale")
        assert names[first:first + len(c.batch_args())] == [
            "qk_scale", "softcap", "left", "right", "batch", "total_q", "num_items", "grid",
            "skip_q_len"]
        assert c.batch_args()[2:] == (9, 0, 2, 300, c.num_items, c.grid, 0)


@pytest.mark.skipif(ag.gluon_prefill is None, reason="Triton without Gluon")
def test_a_stale_max_keeps_fp8_p_under_e4m3s_largest():
    from triton.experimental.gluon import language as gl

    from pagedattn.ops.triton import gluon_softmax

    # P <= 2^(P_SHIFT + slack) (`gluon_softmax.stale_max`): 256 < 448 for every slack
    for slack in range(-1, 9):
        shift = gluon_softmax.p_shift(gl.float8e4nv, slack)
        assert 2.0 ** (shift + max(slack, 0)) == 256.0
        assert gluon_softmax.p_shift(gl.float16, slack) == 0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_rows_hold_each_page_of_a_kv_head_in_consecutive_rows(layout):
    b = make_paged_batch([3], [40], 4, 3, 32, 16, torch.float16, head_size_v=64,
                         layout=layout, device="cpu")
    k, v = b.k_cache, b.v_cache
    r = ag.paged_rows(k, v)
    kc = k.as_strided((r.rows, 2 * r.cols_k + 32), (r.stride_k, 1))
    vc = v.as_strided((r.rows, 2 * r.cols_v + 64), (r.stride_v, 1))
    for blk in (0, k.shape[0] - 1):
        for h in range(3):
            row = blk * r.page_rows + h * r.head_rows
            assert torch.equal(kc[row:row + 16, h * r.cols_k:h * r.cols_k + 32], k[blk, :, h])
            assert torch.equal(vc[row:row + 16, h * r.cols_v:h * r.cols_v + 64], v[blk, :, h])


def test_paged_rows_refuse_a_layout_without_consecutive_slots():
    k = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="one layout"):
        ag.paged_rows(k, k[:, :8])
    odd = torch.zeros(4, 2, 16, 64 * 3, dtype=torch.float16)[..., ::3].permute(0, 2, 1, 3)
    with pytest.raises(ValueError, match="strides"):
        ag.paged_rows(odd, odd)


@pytest.mark.skipif(ag.gluon_prefill is None, reason="Triton without Gluon")
@pytest.mark.parametrize("head_dv", [64, 128, 256])
def test_o_leaves_in_16_byte_runs_of_the_accumulators_rows(head_dv):
    """The epilogue's layout: every element of a consumer's [64, Dv] tile once; each thread
    holds runs of 8 consecutive columns (16 bytes of bf16), on the rows its accumulator
    fragment holds (warp w: rows 16 w + lane // 4 and 8 below), so the change of layout stays
    inside each warp."""
    from pagedattn.ops.triton import gluon_consumer

    layout = gluon_consumer.o_store_layout(64, head_dv)

    def at(bases, index):
        row = col = 0
        for bit, (r, c) in enumerate(bases):
            if index >> bit & 1:
                row, col = row ^ r, col ^ c
        return row, col

    seen = set()
    regs = 2 ** len(layout.reg_bases)
    for warp in range(4):
        for lane in range(32):
            base = [a ^ b for a, b in zip(at(layout.warp_bases, warp),
                                          at(layout.lane_bases, lane))]
            cells = [(base[0] ^ r, base[1] ^ c)
                     for r, c in (at(layout.reg_bases, i) for i in range(regs))]
            assert {r for r, _ in cells} == {16 * warp + lane // 4, 16 * warp + lane // 4 + 8}
            for run in range(0, regs, 8):
                row, first = cells[run]
                assert first % 8 == 0
                assert cells[run:run + 8] == [(row, first + i) for i in range(8)]
            seen.update(cells)
    assert len(seen) == 64 * head_dv == 128 * regs


@pytest.mark.skipif(ag.gluon_prefill is None, reason="Triton without Gluon")
def test_partitions_take_structures_not_long_argument_lists():
    """The kernel entry takes 40 runtime arguments (one Work for the plan's two buffers: a
    dynamic launch's item counters, batch-invariant mode's fold state at head 256; None
    where neither is used) and groups them into aggregates
    (`gluon_args`, `gluon_schedule`): every other Gluon function of the kernel, aggregate
    methods included, takes at most 16 parameters."""
    import importlib

    kernel = ag.gluon_prefill.gluon_prefill_kernel
    runtime = [p.name for p in kernel.params if not p.is_constexpr]
    assert len(runtime) == 40, runtime
    jitted = {}
    for name in ("gluon_prefill", "gluon_consumer", "gluon_softmax", "gluon_operands",
                 "gluon_producer", "gluon_convert", "gluon_schedule", "gluon_args"):
        module = importlib.import_module(f"pagedattn.ops.triton.{name}")
        for obj in vars(module).values():
            members = vars(obj).items() if getattr(obj, "__triton_aggregate__", False) \
                else [(getattr(obj, "__name__", ""), obj)]
            for member, fn in members:
                if hasattr(fn, "arg_names") and fn is not kernel:
                    jitted[f"{name}.{getattr(obj, '__name__', '')}.{member}"] = fn.arg_names
    assert len(jitted) > 30  # every partition, helper and aggregate method
    too_long = {n: len(args) for n, args in jitted.items() if len(args) > 16}
    assert not too_long, too_long
    assert {"consumer", "producer", "converter"} <= {n.split(".")[-1] for n in jitted}


# --- CPU: what run() hands the kernel (a recording launcher in place of the GPU) ----------
class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, args, call_key):
        self.calls.append((args, call_key))


def recorded_launch(paged=False, dense_new_kv=False, cache_dtype=None, **changes):
    """A launch over PLAN's batch with its kernel arguments recorded, and the batch."""
    b = make_paged_batch([100, 200], [300, 400], 8, 2, 128, 16, torch.bfloat16,
                         cache_dtype=cache_dtype, device="cpu")
    if cache_dtype is not None:
        changes.update(kv_fp8=True, use_kv_descale=True)
    kw = dict(PLAN, **changes)
    schedule = config(paged=paged, dense_new_kv=dense_new_kv, **changes)
    recorder = Recorder()
    launch = ag.GluonPrefillLaunch(
        schedule, cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k,
        cu_seqlens_k=None if paged else cu_seqlens([300, 400]),
        block_table=b.block_table if paged else None, launcher=recorder)
    assert kw["num_heads"] == b.q.shape[1]
    return launch, recorder, b


def named(args) -> dict:
    names = ag.gluon_prefill.gluon_prefill_kernel.arg_names
    return dict(zip(names, args))


@pytest.mark.skipif(ag.gluon_prefill is None, reason="Triton without Gluon")
class TestRunArguments:
    def test_dense_keys(self):
        launch, rec, b = recorded_launch()
        k = torch.randn(700, 2, 128).to(torch.bfloat16)
        v = torch.randn(700, 2, 128).to(torch.bfloat16)
        out = torch.empty_like(b.q)
        lse = torch.empty(8, 300)
        launch.run(b.q, k, v, out, lse)
        (args, key), = rec.calls
        a = named(args)
        assert a["Q"] is b.q and a["K"] is k and a["V"] is v and a["Out"] is out
        assert a["KC"] is None and a["VC"] is None and launch.block_table is None
        assert a["kv_index"] is launch.cu_seqlens_k and a["Lse"] is lse  # each request's row
        assert (a["stride_q"], a["kv_rows"], a["stride_k"], a["page_rows"]) == (
            8 * 128, 700, 2 * 128, 0)
        assert (a["stride_ot"], a["stride_oh"]) == (8 * 128, 128)
        assert key is not None

    @pytest.mark.parametrize("layout", ["NHD", "HND"])
    def test_paged_context_and_new_rows(self, layout):
        launch, rec, b = recorded_launch(paged=True, dense_new_kv=True)
        k, v = b.k_cache, b.v_cache
        if layout == "HND":
            k = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
            v = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        k_new = torch.randn(300, 2, 128).to(torch.bfloat16)
        launch.run(b.q, k, v, torch.empty_like(b.q), torch.empty(8, 300), k_new=k_new,
                   v_new=k_new.clone())
        a = named(rec.calls[0][0])
        r = ag.paged_rows(k, v)
        assert a["KC"] is k and a["VC"] is v and a["K"] is k_new
        assert a["kv_index"] is launch.block_table and launch.cu_seqlens_k is None
        # kv_rows: the cache's rows (the new rows are read up to the plan's total_q)
        assert (a["kv_rows"], a["page_rows"], a["head_rows"], a["head_cols_k"]) == (
            r.rows, r.page_rows, r.head_rows, r.cols_k)
        assert a["stride_bt"] == b.block_table.stride(0)

    def test_the_layers_rows_give_the_arguments_of_its_3d_tensors(self):
        launch, rec, b = recorded_launch(paged=True, dense_new_kv=True)
        k_new = torch.randn(300, 2, 128).to(torch.bfloat16)
        v_new = torch.randn(300, 2, 128).to(torch.bfloat16)
        out = torch.empty_like(b.q)
        lse = torch.empty(8, 300)
        launch.run(b.q, b.k_cache, b.v_cache, out, lse, k_new=k_new, v_new=v_new)
        launch.run(b.q.view(300, -1), b.k_cache, b.v_cache, out.view(300, -1), lse,
                   k_new=k_new.view(300, -1), v_new=v_new.view(300, -1))
        (heads, key3), (rows, key2) = rec.calls
        assert key3 == key2
        for name, a3, a2 in zip(ag.gluon_prefill.gluon_prefill_kernel.arg_names, heads, rows):
            if isinstance(a3, torch.Tensor):  # the same memory, seen as rows
                assert a2.data_ptr() == a3.data_ptr() and a2.stride(0) == a3.stride(0), name
            else:
                assert a2 == a3, name
        a = named(rows)
        assert (a["stride_q"], a["stride_k"], a["stride_ot"], a["stride_oh"]) == (
            8 * 128, 2 * 128, 8 * 128, 128)
        # rows whose stride no descriptor can walk are copied, as 3-D tensors are
        q_odd = torch.randn(300, 8 * 128 + 1).to(torch.bfloat16)[:, 1:]
        launch.run(q_odd, b.k_cache, b.v_cache, out, lse, k_new=k_new, v_new=v_new)
        q_arg = named(rec.calls[-1][0])["Q"]
        assert q_arg.is_contiguous() and torch.equal(q_arg, q_odd)

    def test_paged_cache_alone_has_no_dense_rows(self):
        launch, rec, b = recorded_launch(paged=True)
        launch.run(b.q, b.k_cache, b.v_cache, torch.empty_like(b.q), torch.empty(8, 300))
        a = named(rec.calls[0][0])
        assert a["K"] is None and a["V"] is None
        assert a["kv_rows"] == ag.paged_rows(b.k_cache, b.v_cache).rows

    def test_query_heads_not_packed_are_copied(self):
        launch, rec, b = recorded_launch()
        q = torch.randn(8, 300, 128).to(torch.bfloat16).transpose(0, 1)
        k = torch.zeros(700, 2, 128, dtype=torch.bfloat16)
        launch.run(q, k, k, torch.empty(300, 8, 128), torch.empty(8, 300))
        a = named(rec.calls[0][0])
        assert a["Q"].is_contiguous() and torch.equal(a["Q"], q)

    def test_features_must_match_the_plan(self):
        launch, _, b = recorded_launch()
        k = torch.zeros(700, 2, 128, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="lse"):
            launch.run(b.q, k, k, torch.empty_like(b.q))  # planned with write_lse
        with pytest.raises(ValueError, match="k_new"):
            launch2, _, b2 = recorded_launch(paged=True, dense_new_kv=True)
            launch2.run(b2.q, b2.k_cache, b2.v_cache, torch.empty_like(b2.q),
                        torch.empty(8, 300))
        k_new = torch.zeros(299, 2, 128, dtype=torch.bfloat16)  # one row per query: 300
        with pytest.raises(ValueError, match="299 / 299 rows"):
            launch2.run(b2.q, b2.k_cache, b2.v_cache, torch.empty_like(b2.q),
                        torch.empty(8, 300), k_new=k_new, v_new=k_new)

    def test_metadata_is_checked_at_plan_time(self):
        s = config(paged=True)
        cu = cu_seqlens([100, 200])
        with pytest.raises(ValueError, match="block_table"):
            ag.GluonPrefillLaunch(s, cu_seqlens_q=cu, seqused_k=cu[1:], launcher=Recorder())
        with pytest.raises(ValueError, match="int32"):
            ag.GluonPrefillLaunch(config(), cu_seqlens_q=cu.long(), seqused_k=cu[1:],
                                  cu_seqlens_k=cu, launcher=Recorder())

    def test_fp8_descales(self):
        launch, rec, b = recorded_launch(paged=True, dense_new_kv=True,
                                         cache_dtype=torch.float8_e4m3fn)
        out, lse = torch.empty_like(b.q), torch.empty(8, 300)
        per_head = torch.rand(2, 2)
        launch.run(b.q, b.k_cache, b.v_cache, out, lse, k_descale=per_head)
        a = named(rec.calls[-1][0])
        assert a["KC"] is b.k_cache and a["K"] is None  # the new tokens come from the cache
        # a missing v descale is 1, laid out like the k descale (one pair of strides)
        assert torch.equal(a["k_descale"], per_head)
        assert torch.equal(a["v_descale"], torch.ones(2, 2))
        assert (a["stride_ds_b"], a["stride_ds_h"]) == (2, 1)
        launch.run(b.q, b.k_cache, b.v_cache, out, lse, k_descale=per_head, v_descale=per_head)
        a = named(rec.calls[-1][0])
        assert a["k_descale"] is per_head and a["v_descale"] is per_head
        launch.run(b.q, b.k_cache, b.v_cache, out, lse, k_descale=torch.tensor(0.5),
                   v_descale=torch.tensor([[0.25]]))
        a = named(rec.calls[-1][0])
        assert (a["stride_ds_b"], a["stride_ds_h"]) == (0, 0)
        launch.run(b.q, b.k_cache, b.v_cache, out, lse, k_descale=per_head.t(),
                   v_descale=torch.tensor(0.25))  # strides differ: both laid out [batch, H_kv]
        a = named(rec.calls[-1][0])
        assert torch.equal(a["k_descale"], per_head.t()) and a["v_descale"].shape == (2, 2)
        assert (a["stride_ds_b"], a["stride_ds_h"]) == (2, 1)
        assert torch.equal(a["v_descale"], torch.full((2, 2), 0.25))

    def test_fp8_q_takes_its_descale_beside_the_caches(self):
        launch, rec, b = recorded_launch(paged=True, cache_dtype=torch.float8_e4m3fn,
                                         q_fp8=True, use_q_descale=True)
        assert launch.schedule.constexprs["QK_FP8"] and launch.schedule.constexprs["Q_DESCALE"]
        q8 = b.q.to(torch.float8_e4m3fn)
        out, lse = torch.empty_like(b.q), torch.empty(8, 300)
        per_head = torch.rand(2, 2)
        launch.run(q8, b.k_cache, b.v_cache, out, lse, k_descale=per_head,
                   v_descale=per_head, q_descale=per_head.t())  # strides differ: laid out
        a = named(rec.calls[-1][0])
        assert a["Q"] is q8 and a["Out"] is out
        assert torch.equal(a["q_descale"], per_head.t()) and torch.equal(a["k_descale"], per_head)
        assert (a["stride_ds_b"], a["stride_ds_h"]) == (2, 1)
        launch.run(q8, b.k_cache, b.v_cache, out, lse)  # none given: each is 1
        a = named(rec.calls[-1][0])
        assert all(float(a[n]) == 1.0 for n in ("q_descale", "k_descale", "v_descale"))
        assert (a["stride_ds_b"], a["stride_ds_h"]) == (0, 0)
        assert rec.calls[-1][1][0][0] == torch.float8_e4m3fn  # the call key names q's dtype

    def test_an_fp8_q_needs_an_fp8_cache(self):
        with pytest.raises(ValueError, match="kv_fp8"):
            config(paged=True, q_fp8=True)

    @pytest.mark.parametrize("q_dtype, kv_dtype, head_size, split", [
        (torch.bfloat16, torch.float8_e4m3fn, 128, True),
        (torch.float16, torch.float8_e4m3fn, 64, True),
        (torch.bfloat16, torch.float8_e4m3fn, 256, False),  # no registers for it
        (torch.bfloat16, torch.float8_e5m2, 128, True),  # an e4m3 x e5m2 product
        (torch.float8_e4m3fn, torch.float8_e4m3fn, 128, False),  # an fp8 q is not split
        (torch.bfloat16, torch.bfloat16, 128, False)])
    def test_a_16_bit_q_over_an_fp8_cache_is_split(self, q_dtype, kv_dtype, head_size,
                                                     split, monkeypatch):
        assert ag.split_q_for(q_dtype, kv_dtype, head_size) is split
        monkeypatch.setattr(ag.SWITCHES, "gluon_split_q", False)
        assert ag.split_q_for(q_dtype, kv_dtype, head_size) is False

    @pytest.mark.parametrize("head_size, smem_kb", [(64, 144), (128, 192)])
    def test_split_q_reads_k_where_it_lands(self, head_size, smem_kb):
        """Q K^T over the staging ring (QK_FP8), no 16-bit K ring; the 16-bit Q buffers,
        the V ring and the staging ring fit shared memory."""
        c = config(paged=True, kv_fp8=True, use_kv_descale=True, split_q=True,
                   head_size=head_size, head_size_v=head_size)
        k = c.constexprs
        assert k["QK_FP8"] and not k["Q_DESCALE"]
        q_bytes = k["NUM_QBUF"] * k["BLOCK_M"] * head_size * 2
        v_ring = k["NUM_BUF"] * k["BLOCK_N"] * head_size * 2
        staged = k["STAGES"] * k["BLOCK_N"] * 2 * head_size
        assert (q_bytes + v_ring + staged) // 1024 == smem_kb <= 227
        assert k["STAGES"] >= 3  # the K ring's depth too
        assert not config(paged=True, kv_fp8=True, use_kv_descale=True).constexprs["QK_FP8"]

    @pytest.mark.parametrize("change", [dict(q_fp8=True), dict(kv_fp8=False),
                                        dict(head_size=256, head_size_v=256)])
    def test_split_q_needs_a_16_bit_q_over_fp8_heads_up_to_128(self, change):
        kw = dict(dict(kv_fp8=True, split_q=True), **change)
        with pytest.raises(ValueError, match="split_q"):
            config(paged=True, **kw)

    def test_descales_need_a_plan_for_them(self):
        launch, _, b = recorded_launch(paged=True)
        with pytest.raises(ValueError, match="descale"):
            launch.run(b.q, b.k_cache, b.v_cache, torch.empty_like(b.q), torch.empty(8, 300),
                       k_descale=torch.tensor(1.0))
        launch, _, b = recorded_launch(paged=True, cache_dtype=torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="use_q_descale"):
            launch.run(b.q, b.k_cache, b.v_cache, torch.empty_like(b.q), torch.empty(8, 300),
                       q_descale=torch.tensor(1.0))

    @pytest.mark.parametrize("case", ["dense", "paged_new_rows", "paged_fp8", "fp8_q",
                                      "features"])
    def test_a_layers_plan_hands_the_kernel_what_run_hands_it(self, case):
        paged, features = case != "dense", case == "features"
        fp8, q_fp8 = case in ("paged_fp8", "fp8_q"), case == "fp8_q"
        launch, rec, b = recorded_launch(
            paged=paged, dense_new_kv=case in ("paged_new_rows", "features"),
            cache_dtype=torch.float8_e4m3fn if fp8 else None, write_lse=False,
            use_alibi=features, use_sinks=features, q_fp8=q_fp8, use_q_descale=q_fp8)
        q = b.q.view(300, -1)
        q_dtype = torch.bfloat16
        q_descale = None
        if q_fp8:
            q, q_dtype, q_descale = q.to(torch.float8_e4m3fn), torch.float8_e4m3fn, \
                torch.rand(2, 2)
        out = torch.empty_like(q)
        rows = 300 if paged else 700  # the new tokens', or every key of a dense batch
        k_new = torch.randn(rows, 2 * 128).to(torch.bfloat16)
        v_new = torch.randn(rows, 2 * 128).to(torch.bfloat16)
        slopes, sinks = (torch.rand(8), torch.rand(8)) if features else (None, None)
        descale = torch.rand(2, 2) if fp8 else None
        caches = (b.k_cache, b.v_cache) if paged else (None, None)
        out = torch.empty(300, 8 * 128, dtype=torch.bfloat16)
        layer_plan = launch.plan_layer(*caches, slopes, sinks, descale, descale, q_dtype,
                                       torch.bfloat16, torch.bfloat16, q_descale=q_descale)
        layer_plan.run(layer_plan.call_args(q, out, k_new, v_new))
        if paged:
            launch.run(q, *caches, out, None, slopes, sinks, k_new, v_new, descale, descale,
                       q_descale)
        else:
            launch.run(q, k_new, v_new, out, None, slopes, sinks)
        (bound_args, bound_key), (run_args, run_key) = rec.calls
        assert bound_key == run_key and bound_key is not None
        names = ag.gluon_prefill.gluon_prefill_kernel.arg_names
        assert len(bound_args) == len(run_args)
        for name, a_bound, a_run in zip(names, bound_args, run_args):
            if isinstance(a_run, torch.Tensor) or a_run is None:
                assert a_bound is a_run, name
            else:
                assert a_bound == a_run, name

    def test_a_layers_plan_leaves_to_run_what_it_cannot_take(self):
        launch, _, b = recorded_launch(paged=True, dense_new_kv=True)  # planned with an LSE
        assert launch.plan_layer(b.k_cache, b.v_cache, None, None, None, None,
                                 *[torch.bfloat16] * 3) is None
        launch, _, b = recorded_launch(paged=True, dense_new_kv=True, write_lse=False,
                                       use_alibi=True)
        dtypes = [torch.bfloat16] * 3
        assert launch.plan_layer(b.k_cache, b.v_cache, torch.rand(8).double(), None, None,
                                 None, *dtypes) is None  # run() converts the slopes
        layer_plan = launch.plan_layer(b.k_cache, b.v_cache, torch.rand(8), None, None, None,
                                       *dtypes)
        q, out = b.q.view(300, -1), torch.empty(300, 8 * 128, dtype=torch.bfloat16)
        k_new = torch.randn(300, 2 * 128).to(torch.bfloat16)
        assert layer_plan.call_args(q, out, k_new, k_new) is not None
        q_odd = torch.randn(300, 8 * 128 + 1).to(torch.bfloat16)[:, 1:]  # rows TMA can't walk
        for call in [(q.half(), out, k_new, k_new), (q, out.half(), k_new, k_new),
                     (q_odd, out, k_new, k_new), (q, out, None, None),
                     (q, out, k_new.half(), k_new), (q, out.t().contiguous().t(), k_new, k_new),
                     (q, out, k_new.view(300, 2, 128), k_new),
                     (q, out, k_new, k_new[:299])]:  # a new row short of the queries
            assert layer_plan.call_args(*call) is None

    def test_nothing_launches_for_an_empty_schedule(self):
        rec = Recorder()
        cu = cu_seqlens([1])
        launch = ag.GluonPrefillLaunch(config(batch=1, total_q=1, max_seqlen_q=1, skip_q_len=1),
                                       cu_seqlens_q=cu, seqused_k=cu[1:], cu_seqlens_k=cu,
                                       launcher=rec)
        launch.run(None, None, None, None)
        assert rec.calls == []

    @pytest.mark.parametrize("dynamic", [False, True])
    def test_a_dynamic_launch_takes_its_plans_item_counter(self, dynamic, monkeypatch):
        monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", dynamic)
        launch, rec, b = recorded_launch()
        k = torch.randn(700, 2, 128).to(torch.bfloat16)
        launch.run(b.q, k, k, torch.empty_like(b.q), torch.empty(8, 300))
        launch.run(b.q, k, k, torch.empty_like(b.q), torch.empty(8, 300))
        works = [named(args)["Work"] for args, _ in rec.calls]
        if dynamic:  # [next item, programs done], zero: the kernel leaves it zero again
            assert works[0] is works[1] is launch.work
            assert launch.work.dtype == torch.float32
            assert launch.work.numel() == gluon_launch.QUEUE_WORDS == 32  # no fold rows
            assert launch.queue.dtype == torch.int32 and launch.queue.tolist() == [0, 0]
            assert launch.queue.data_ptr() == launch.work.data_ptr()  # the counters head it
        else:
            assert works == [None, None] and launch.work is None and launch.queue is None
        assert launch.fold is None and launch.schedule.constexprs["FOLD_AT"] == -1

    @pytest.mark.parametrize("dynamic", [False, True])
    def test_one_work_area_holds_the_counters_and_the_head_256_fold_rows(self, dynamic,
                                                                          monkeypatch):
        """Batch-invariant mode at head 256: the fold rows [grid, BLOCK_M, Dv] in the launch's
        Work, after the item counters' 128 bytes where dynamic (zero), from word 0 else."""
        monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", dynamic)
        b = make_paged_batch([100, 200], [300, 400], 8, 2, 256, 16, torch.bfloat16)
        schedule = config(paged=True, head_size=256, head_size_v=256, invariant=(64, 1024))
        rec = Recorder()
        launch = ag.GluonPrefillLaunch(schedule, cu_seqlens_q=b.cu_seqlens_q,
                                       seqused_k=b.seqused_k, block_table=b.block_table,
                                       launcher=rec)
        grid, at = schedule.grid, schedule.constexprs["FOLD_AT"]
        assert grid > 0 and at == (32 if dynamic else 0)
        assert launch.work.dtype == torch.float32
        assert launch.work.numel() == at + grid * 128 * 256
        assert launch.fold.shape == (grid, 128, 256) and launch.fold.dtype == torch.float32
        assert launch.fold.data_ptr() == launch.work.data_ptr() + 4 * at
        if dynamic:
            assert launch.queue.tolist() == [0, 0]
            assert launch.queue.data_ptr() == launch.work.data_ptr()
        else:
            assert launch.queue is None
        out = torch.empty(300, 8, 256, dtype=torch.bfloat16)
        launch.run(b.q, b.k_cache, b.v_cache, out, torch.empty(8, 300))
        (args, _), = rec.calls
        assert named(args)["Work"] is launch.work
        assert "Fold" not in named(args) and "queue" not in named(args)

    def test_scratch_serves_the_descriptors(self):
        launch, _, _ = recorded_launch()
        assert launch.allocate(gluon_launch.SCRATCH_PER_PROGRAM * launch.schedule.grid, 16,
                               None) is launch.scratch
        assert launch.allocate(launch.scratch.numel() + 1, 16, None) is not launch.scratch


# --- GPU: the kernel at real sizes, one case per feature -----------------------------------
def _new_rows(cache, block_table, query_lens, seq_lens):
    rows = [ref.gather_paged(cache, block_table[r], s)[s - n:]
            for r, (n, s) in enumerate(zip(query_lens, seq_lens))]
    return torch.cat(rows)


def per_sequence(cache, block_table, seq_lens, block_size, fn):
    """fn(the blocks of sequence r, r) applied to each sequence's pages of `cache`."""
    for r, s in enumerate(seq_lens):
        fn(block_table[r, :math.ceil(s / block_size)].long(), r)


def quantize(cache, block_table, seq_lens, block_size, scales, cache_dtype):
    """The cache as an fp8 cache holds it: x / scale[sequence, KV head], saturated (the
    oracle's quantize_for_cache); unused blocks 0. Built as bytes on the CPU, in the cache's
    memory order (NHD or HND)."""
    x = cache.cpu()
    out = torch.zeros(x.shape, dtype=torch.uint8)

    def write(blocks, r):
        for h in range(x.shape[2]):
            x8 = ref.quantize_for_cache(x[blocks, :, h], cache_dtype, float(scales[r, h]))
            out[blocks, :, h] = x8.view(torch.uint8)

    per_sequence(x, block_table.cpu(), seq_lens, block_size, write)
    if cache.stride(2) > cache.stride(1):  # HND
        out = out.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    return out.view(cache_dtype).to(cache.device)


def dequantize(cache8, block_table, seq_lens, block_size, scales):
    """float64 x8 * scale[sequence, KV head]: what the oracle attends over."""
    bytes_ = cache8.cpu().view(torch.uint8)
    out = torch.zeros(cache8.shape, dtype=torch.float64)

    def read(blocks, r):
        for h in range(cache8.shape[2]):
            x8 = bytes_[blocks, :, h].view(cache8.dtype)
            out[blocks, :, h] = ref.dequantize(x8, float(scales[r, h]))

    per_sequence(cache8, block_table.cpu(), seq_lens, block_size, read)
    return out


def run_case(query_lens, seq_lens, *, paged="context", num_heads=16, num_kv_heads=4,
             head_size=128, head_size_v=None, dtype=torch.bfloat16, causal=True,
             window=(-1, -1), softcap=0.0, alibi=False, sinks=False, block_size=16,
             layout="NHD", skip_q_len=0, nan_tail=False, cache_dtype=None,
             descale="per_head", q_fp8=None, q_spread=0, seed=0, again=False,
             planned=None):
    """paged: "context" (cache pages + the new tokens' dense rows), "cache" (every key from
    the pages: the public op over a paged cache) or None (dense varlen keys). cache_dtype: an
    fp8 cache, with descales per (sequence, KV head) ("per_head") or one value ("one");
    q_fp8: q quantised to this fp8 dtype too, with a q descale of the same kind (the output
    stays `dtype`). q_spread: each query row scaled by 2^k, k uniform in [-q_spread, 3]
    (rows of unequal norms in one tile). again: the plan then runs twice more eagerly and is
    captured in a CUDA graph replayed twice, each into fresh poison, bit for bit the first
    output. planned: constexprs the plan must have (the variant a switch asks for)."""
    dev = "cuda"
    hv = head_size_v or head_size
    b = make_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
                         dtype, head_size_v=hv, layout=layout, device=dev, seed=seed)
    descales = (None, None)
    if cache_dtype is not None:
        g8 = torch.Generator().manual_seed(seed + 2)
        shape = (len(seq_lens), num_kv_heads) if descale == "per_head" else (1, 1)
        scales = [(torch.rand(shape, generator=g8) * 0.04 + 0.01).expand(
            len(seq_lens), num_kv_heads) for _ in range(2)]
        b.k_cache = quantize(b.k_cache, b.block_table, seq_lens, block_size, scales[0],
                             cache_dtype)
        b.v_cache = quantize(b.v_cache, b.block_table, seq_lens, block_size, scales[1],
                             cache_dtype)
        descales = tuple((s if descale == "per_head" else s[0, 0]).contiguous().to(dev)
                         for s in scales)
    if nan_tail:  # unwritten slots past each sequence's end (same page and later) hold NaN
        for r, s in enumerate(seq_lens):
            for pos in range(s, math.ceil(s / block_size) * block_size):
                blk = int(b.block_table[r, pos // block_size])
                for cache in (b.k_cache, b.v_cache):
                    if cache_dtype is None:
                        cache[blk, pos % block_size] = float("nan")
                    else:  # 0x7f: NaN in e4m3fn and e5m2
                        cache.view(torch.uint8)[blk, pos % block_size] = 0x7F
    g = torch.Generator().manual_seed(seed + 1)
    slopes = (torch.rand(num_heads, generator=g) * 0.5).to(dev) if alibi else None
    sink = (torch.randn(num_heads, generator=g) * 2).to(dev) if sinks else None
    total_q = sum(query_lens)
    if q_spread:
        k = torch.randint(-q_spread, 4, (b.q.shape[0], b.q.shape[1], 1), generator=g)
        b.q = (b.q.cpu().double() * 2.0 ** k).to(dtype).to(dev)
    q, q_ref, q_descale = b.q, b.q.cpu(), None
    if q_fp8 is not None:  # x / scale[sequence, KV head], saturated to the fp8 range
        g8 = torch.Generator().manual_seed(seed + 3)
        shape = (len(seq_lens), num_kv_heads) if descale == "per_head" else (1, 1)
        q_scales = (torch.rand(shape, generator=g8) * 0.04 + 0.01).expand(
            len(seq_lens), num_kv_heads)
        seq_of = torch.repeat_interleave(torch.arange(len(query_lens)),
                                         torch.tensor(query_lens))
        per_row = q_scales[seq_of][:, torch.arange(num_heads) // (num_heads // num_kv_heads)]
        limit = torch.finfo(q_fp8).max
        q8 = (b.q.cpu().float() / per_row[..., None]).clamp(-limit, limit).to(q_fp8)
        q, q_ref = q8.to(dev), q8.double() * per_row[..., None].double()
        q_descale = (q_scales if descale == "per_head" else q_scales[0, 0]).contiguous().to(dev)
    if paged:  # an fp8 plan reads the new tokens from the cache: no dense rows
        k_new = v_new = None
        if cache_dtype is None:
            k_new = _new_rows(b.k_cache, b.block_table, query_lens, seq_lens)
            v_new = _new_rows(b.v_cache, b.block_table, query_lens, seq_lens)
        k, v, cu_k = b.k_cache, b.v_cache, None
    else:
        k = randn(sum(seq_lens), num_kv_heads, head_size, dtype=dtype, device=dev, generator=g)
        v = randn(sum(seq_lens), num_kv_heads, hv, dtype=dtype, device=dev, generator=g)
        k_new = v_new = None
        cu_k = cu_seqlens(seq_lens, dev)
    launch = ag.plan_gluon_prefill(
        device=torch.device(dev), cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k,
        cu_seqlens_k=cu_k, block_table=b.block_table if paged else None,
        batch=len(query_lens), total_q=total_q, max_seqlen_q=max(query_lens),
        max_seqlen_k=max(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, head_size_v=hv, q_dtype=q.dtype, kv_dtype=b.k_cache.dtype,
        causal=causal, window_left=window[0], window_right=window[1], softcap=softcap,
        use_alibi=alibi, use_sinks=sinks, write_lse=True, page_size=block_size,
        dense_new_kv=paged == "context", softmax_scale=head_size ** -0.5,
        skip_q_len=skip_q_len, use_kv_descale=cache_dtype is not None, out_dtype=dtype,
        use_q_descale=q_fp8 is not None)
    assert launch is not None
    for name, value in (planned or {}).items():
        assert launch.schedule.constexprs[name] == value, name
    out = poison((total_q, num_heads, hv), dtype, dev)
    lse = poison((num_heads, total_q), torch.float32, dev)
    launch.run(q, k, v, out, lse, slopes, sink, k_new, v_new, *descales, q_descale)
    torch.cuda.synchronize()
    features = dict(scale=head_size ** -0.5, causal=causal, window=window, softcap=softcap,
                    alibi_slopes=None if slopes is None else slopes.cpu(),
                    sinks=None if sink is None else sink.cpu())
    if cache_dtype is not None:  # the oracle attends over x8 * scale in float64
        k64 = dequantize(b.k_cache, b.block_table, seq_lens, block_size, scales[0])
        v64 = dequantize(b.v_cache, b.block_table, seq_lens, block_size, scales[1])
        exp_out, exp_lse = ref.paged_attention(q_ref, k64, v64, query_lens, seq_lens,
                                               b.block_table.cpu(), **features)
    elif paged:
        exp_out, exp_lse = ref.paged_attention(q_ref, b.k_cache.cpu(), b.v_cache.cpu(),
                                               query_lens, seq_lens, b.block_table.cpu(),
                                               **features)
    else:
        exp_out, exp_lse = ref.varlen_attention(q_ref, k.cpu(), v.cpu(), query_lens,
                                                seq_lens, **features)
    served = torch.tensor([n > skip_q_len for n in query_lens for _ in range(n)])
    if launch.schedule.constexprs["PV_FP8"]:
        # P in e4m3 (gluon_softmax's P_SHIFT): each weight within 2^-4 of itself, so each
        # output within 2^-4 of the weighted mean of |V| (the oracle over |V|) of the exact one
        # (an fp8 q reads an fp8 cache: k64 / v64 are its dequantised values). A stale max
        # (MAX_SLACK) changes no weight: the division cancels it.
        rel = 2.0 ** -4
        bound, _ = ref.paged_attention(q_ref, k64, v64.abs(), query_lens, seq_lens,
                                       b.block_table.cpu(), **features)
        assert_within_fp8_p_bound(out[served.to(dev)], exp_out[served], bound[served], rel,
                                  atol=1e-2, rtol=1e-2)
    else:
        assert_close(out[served.to(dev)], exp_out[served], dtype)
    assert_close(lse[:, served.to(dev)], exp_lse[:, served], **LSE_TOL)
    # Requests left to another pass are not touched: their poison stays.
    assert torch.isnan(out[~served.to(dev)].float()).all()
    if again:
        args = (q, k, v, out, lse, slopes, sink, k_new, v_new, *descales, q_descale)
        _run_again(launch, args, out.clone(), lse.clone())


def _run_again(launch, args, first_out, first_lse):
    """The plan's launch repeated eagerly and replayed from a CUDA graph: the same bits each
    time (a dynamic plan's item counter is back at zero after every launch)."""
    q, k, v, out, lse, *rest = args

    def fresh():
        out.copy_(poison(out.shape, out.dtype, out.device))
        lse.copy_(poison(lse.shape, lse.dtype, lse.device))

    def check():  # bit for bit, the poison of rows left to another pass too
        torch.cuda.synchronize()
        torch.testing.assert_close(out, first_out, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(lse, first_lse, rtol=0, atol=0, equal_nan=True)
        if launch.queue is not None:
            assert launch.queue.tolist() == [0, 0]

    for _ in range(2):
        fresh()
        launch.run(q, k, v, out, lse, *rest)
        check()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launch.run(q, k, v, out, lse, *rest)
    torch.cuda.synchronize()
    for _ in range(2):
        fresh()
        graph.replay()
        check()


GPU_CASES = {
    "causal_prompts": dict(query_lens=[4096, 1000, 129], seq_lens=[4096, 1000, 129],
                           paged=None),
    "non_causal_keys_longer": dict(query_lens=[700, 300], seq_lens=[900, 1300], paged=None,
                                   causal=False),
    "context_plus_new_rows": dict(query_lens=[2048, 300], seq_lens=[6000, 5300]),
    # 3 new tokens in the context's last page, slots past them NaN: the V fix-up path
    "short_chunk_inside_one_page": dict(query_lens=[3, 200], seq_lens=[1033, 1000],
                                        nan_tail=True),
    "paged_cache_only": dict(query_lens=[700, 64], seq_lens=[3000, 701], paged="cache",
                             nan_tail=True),
    "paged_hnd_pages_of_64": dict(query_lens=[600], seq_lens=[2500], layout="HND",
                                  block_size=64),
    "pages_wider_than_a_tile": dict(query_lens=[500], seq_lens=[1800], block_size=256,
                                    paged="cache", nan_tail=True),
    "sliding_window": dict(query_lens=[3000], seq_lens=[3500], window=(1024, 0)),
    "non_causal_two_sided_window": dict(query_lens=[1500], seq_lens=[1500], paged=None,
                                        causal=False, window=(200, 77)),
    "alibi": dict(query_lens=[1500], seq_lens=[1700], alibi=True),
    "softcap": dict(query_lens=[1500], seq_lens=[1500], softcap=30.0, paged=None),
    "sinks": dict(query_lens=[1500, 700], seq_lens=[1500, 900], sinks=True),
    "head_64": dict(query_lens=[2000], seq_lens=[2500], head_size=64),
    "head_256": dict(query_lens=[1200, 300], seq_lens=[1200, 800], head_size=256,
                     num_heads=16, num_kv_heads=8),
    "head_256_paged_cache": dict(query_lens=[400], seq_lens=[1003], head_size=256,
                                 num_heads=8, num_kv_heads=8, paged="cache", nan_tail=True),
    "mqa": dict(query_lens=[1024], seq_lens=[1024], num_kv_heads=1, paged=None),
    "values_narrower_than_keys": dict(query_lens=[900], seq_lens=[1300], head_size_v=64),
    "values_wider_than_keys": dict(query_lens=[700], seq_lens=[700], head_size=64,
                                   head_size_v=128, paged=None),
    "fp16": dict(query_lens=[1000], seq_lens=[1200], dtype=torch.float16),
    "short_prompts_beside_decodes": dict(query_lens=[512] * 31 + [77, 1, 1, 3],
                                         seq_lens=[512] * 31 + [300, 40, 900, 3],
                                         skip_q_len=4, paged=None),
    "one_long_among_many_short": dict(query_lens=[3000] + [8] * 300,
                                      seq_lens=[3000] + [20] * 300, num_heads=8,
                                      num_kv_heads=2),
    # fp8 caches: the converter's tiles, descales per (sequence, KV head) or one value, NaN
    # in the unwritten slots of the last page (the converter zeroes V rows past the end)
    "fp8_e4m3_cache": dict(query_lens=[700, 64], seq_lens=[3000, 701], paged="cache",
                           cache_dtype=torch.float8_e4m3fn, nan_tail=True),
    "fp8_e5m2_context_one_descale": dict(query_lens=[2048, 300], seq_lens=[6000, 5300],
                                         cache_dtype=torch.float8_e5m2, descale="one"),
    "fp8_head_64_hnd_fp16": dict(query_lens=[600], seq_lens=[2500], head_size=64,
                                 layout="HND", block_size=64, dtype=torch.float16,
                                 cache_dtype=torch.float8_e4m3fn, nan_tail=True),
    "fp8_head_256": dict(query_lens=[400], seq_lens=[1003], head_size=256, num_heads=8,
                         num_kv_heads=8, paged="cache", cache_dtype=torch.float8_e4m3fn,
                         nan_tail=True),
    "fp8_sliding_window_sinks": dict(query_lens=[1500], seq_lens=[3500], window=(1024, 0),
                                     sinks=True, cache_dtype=torch.float8_e4m3fn),
    # a bf16 q over an fp8 cache is split in two e4m3 terms scaled by a tile's largest |q|:
    # rows 2^-8 to 2^3 apart in one tile keep their own precision
    "fp8_split_q_rows_of_unequal_norms": dict(query_lens=[900, 300], seq_lens=[2000, 300],
                                              cache_dtype=torch.float8_e4m3fn, q_spread=8,
                                              softcap=30.0),
    # fp8 q over an fp8 cache (the layer quantises q for an e4m3 cache): Q K^T an fp8
    # product straight from the staging ring, q descales per (sequence, KV head) or one value
    "fp8_q_chunks_after_context": dict(query_lens=[2048, 300], seq_lens=[6000, 5300],
                                       cache_dtype=torch.float8_e4m3fn,
                                       q_fp8=torch.float8_e4m3fn),
    "fp8_q_cache_only_one_descale": dict(query_lens=[700, 64], seq_lens=[3000, 701],
                                         paged="cache", cache_dtype=torch.float8_e4m3fn,
                                         q_fp8=torch.float8_e4m3fn, descale="one",
                                         nan_tail=True),
    "fp8_q_e5m2_head_64_hnd_fp16": dict(query_lens=[600], seq_lens=[2500], head_size=64,
                                        layout="HND", block_size=64, dtype=torch.float16,
                                        cache_dtype=torch.float8_e5m2,
                                        q_fp8=torch.float8_e5m2, nan_tail=True),
    "fp8_q_head_256": dict(query_lens=[400, 129], seq_lens=[1003, 500], head_size=256,
                           num_heads=8, num_kv_heads=8, paged="cache",
                           cache_dtype=torch.float8_e4m3fn, q_fp8=torch.float8_e4m3fn,
                           nan_tail=True),
    "fp8_q_window_sinks_softcap_alibi": dict(
        query_lens=[1500], seq_lens=[3500], window=(1024, 0), sinks=True, softcap=30.0,
        alibi=True, cache_dtype=torch.float8_e4m3fn, q_fp8=torch.float8_e4m3fn),
    "fp8_q_prompts_beside_decodes": dict(query_lens=[512] * 7 + [1, 3], seq_lens=[512] * 7
                                         + [40, 900], skip_q_len=4, paged="cache",
                                         cache_dtype=torch.float8_e4m3fn,
                                         q_fp8=torch.float8_e4m3fn),
}


@cuda
@on_sm90
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("paged", [None, "context"])
def test_gpu_lpt_groups_compute_every_item_once(group, paged, monkeypatch):
    """Requests of unequal lengths in groups of `group` (a group's slots run past its
    shorter requests' blocks): every served row is written once and right."""
    monkeypatch.setattr(ag.SWITCHES, "gluon_lpt_group", group)
    query_lens = [300, 700, 129, 1000, 64, 513, 900, 2]
    seq_lens = query_lens if paged is None else [q + 333 for q in query_lens]
    run_case(query_lens, seq_lens, paged=paged)


# Dynamic item hand-out: the producer takes ids from the counter and hands them to the
# consumers (and the converter, over an fp8 cache); empty and skipped items take ids too.
DYNAMIC_CASES = ["causal_prompts", "context_plus_new_rows", "short_prompts_beside_decodes",
                 "one_long_among_many_short", "fp8_e4m3_cache", "fp8_q_head_256", "head_256",
                 "sinks"]


@cuda
@on_sm90
@pytest.mark.parametrize("order", [None, 0])
@pytest.mark.parametrize("name", DYNAMIC_CASES)
def test_gpu_dynamic_items_compute_every_item_once(name, order, monkeypatch):
    """Every case's rows right with items taken from the counter, in the planned order or
    one request after the other (order 0), and the same bits again when the plan runs again
    and from a CUDA graph."""
    monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", True)
    monkeypatch.setattr(ag.SWITCHES, "gluon_lpt_group", order)
    run_case(**GPU_CASES[name], again=True)


@cuda
@on_sm90
def test_gpu_a_static_plan_runs_again_and_from_a_graph(monkeypatch):
    monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", False)
    run_case(**GPU_CASES["context_plus_new_rows"], again=True)


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_real_sizes(name):
    run_case(**GPU_CASES[name])


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(n for n in GPU_CASES if n.startswith("fp8_q")))
def test_gpu_fp8_p_v_real_sizes(name, monkeypatch):
    """The fp8 P V (`SWITCHES.gluon_fp8_pv`) at every head size, with the switches that go
    with it by default (P as words, V^T by PRMT): every
    fp8-q case within P's quantisation bound, and the same bits again when the plan runs
    again and from a CUDA graph."""
    monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_pv", True)
    run_case(**GPU_CASES[name], again=True)


# The softmax's switches (`SWITCHES.gluon_max_slack`: O's rescale skipped by warps none of
# whose rows moved its max, the max kept within the slack; `gluon_fp8_v_prmt`:
# the converter's V^T by PRMT, bit for bit the same V^T; `gluon_fp8_p_words`: P carried as
# words of four e4m3 keys, the same bits as Triton's conversion): over an fp8 P V
# (an fp8 q; e4m3 and e5m2 caches) within P's bound (`run_case`), over a 16-bit P within the
# 16-bit tolerance (the stale max is exact after the division). Causal prompts, chunks after a
# context, sinks, soft cap, ALiBi, windows, rows that see no key, GQA 1 / 2 / 4 / 8, heads
# 64 / 128 / 256, three consumers.
E4M3 = dict(cache_dtype=torch.float8_e4m3fn, q_fp8=torch.float8_e4m3fn)
# each run from every one of these off (the defaults turn some on for an fp8 q at heads 128
# and 256; the wide tiles have runs of their own, WIDE_TILE_CASES)
SOFTMAX_SWITCHES_OFF = dict(gluon_fp8_pv=False, gluon_fp8_p_words=False,
                            gluon_fp8_v_prmt=False, gluon_fp8_v_words=False,
                            gluon_max_slack=-1, gluon_fp8_wide_tiles=False)
SOFTMAX_SWITCH_RUNS = {
    "fp8_pv_slack_4_head_256_gqa_1": (
        dict(gluon_fp8_pv=True, gluon_max_slack=4), GPU_CASES["fp8_q_head_256"]),
    "fp8_pv_slack_4_window_sinks_softcap_alibi": (
        dict(gluon_fp8_pv=True, gluon_max_slack=4),
        GPU_CASES["fp8_q_window_sinks_softcap_alibi"]),
    "fp8_pv_slack_0_prompts_beside_decodes": (
        dict(gluon_fp8_pv=True, gluon_max_slack=0), GPU_CASES["fp8_q_prompts_beside_decodes"]),
    "fp8_pv_slack_4_gqa_8": (
        dict(gluon_fp8_pv=True, gluon_max_slack=4),
        dict(query_lens=[1500, 700], seq_lens=[1500, 2900], num_heads=32, num_kv_heads=4,
             paged="cache", nan_tail=True, **E4M3)),
    "fp8_pv_v_prmt_chunks_after_context": (
        dict(gluon_fp8_pv=True, gluon_fp8_v_prmt=True), GPU_CASES["fp8_q_chunks_after_context"]),
    "fp8_pv_v_prmt_head_256_cache_only": (
        dict(gluon_fp8_pv=True, gluon_fp8_v_prmt=True), GPU_CASES["fp8_q_head_256"]),
    "fp8_pv_v_prmt_slack_4_e5m2_head_64": (
        dict(gluon_fp8_pv=True, gluon_fp8_v_prmt=True, gluon_max_slack=4),
        GPU_CASES["fp8_q_e5m2_head_64_hnd_fp16"]),
    "fp8_pv_p_words_chunks_after_context": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True),
        GPU_CASES["fp8_q_chunks_after_context"]),
    "fp8_pv_p_words_e5m2_head_64": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True), GPU_CASES["fp8_q_e5m2_head_64_hnd_fp16"]),
    "fp8_pv_p_words_v_prmt_slack_4_head_256_gqa_1": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True,
             gluon_max_slack=4), GPU_CASES["fp8_q_head_256"]),
    "fp8_pv_p_words_head_256_chunks_after_context_gqa_4": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True),
        dict(query_lens=[700, 64, 1], seq_lens=[2100, 1000, 777], head_size=256,
             num_heads=16, num_kv_heads=4, paged="cache", nan_tail=True, **E4M3)),
    "fp8_pv_p_words_v_prmt_head_256_e5m2_sinks_window": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True),
        dict(query_lens=[500, 300], seq_lens=[900, 300], head_size=256, num_heads=8,
             num_kv_heads=2, paged="cache", sinks=True, window=(200, 0),
             cache_dtype=torch.float8_e5m2, q_fp8=torch.float8_e5m2)),
    "fp8_pv_p_words_v_words_chunks_after_context": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True,
             gluon_fp8_v_words=True), GPU_CASES["fp8_q_chunks_after_context"]),
    "fp8_pv_p_words_v_words_e5m2_head_64": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True,
             gluon_fp8_v_words=True), GPU_CASES["fp8_q_e5m2_head_64_hnd_fp16"]),
    "fp8_pv_p_words_v_words_head_256_gqa_1": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True,
             gluon_fp8_v_words=True), GPU_CASES["fp8_q_head_256"]),
    "fp8_pv_v_words_slack_4_prompts_beside_decodes_gqa_8": (
        dict(gluon_fp8_pv=True, gluon_fp8_v_prmt=True, gluon_fp8_v_words=True,
             gluon_max_slack=4),
        dict(GPU_CASES["fp8_q_prompts_beside_decodes"], num_heads=32, num_kv_heads=4)),
    "fp8_pv_p_words_v_prmt_window_sinks_softcap_alibi": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True),
        GPU_CASES["fp8_q_window_sinks_softcap_alibi"]),
    "fp8_pv_p_words_v_prmt_slack_4_prompts_beside_decodes_gqa_8": (
        dict(gluon_fp8_pv=True, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True,
             gluon_max_slack=4),
        dict(GPU_CASES["fp8_q_prompts_beside_decodes"], num_heads=32, num_kv_heads=4)),
    "p16_slack_8_context_plus_new_rows": (dict(gluon_max_slack=8),
                                          GPU_CASES["context_plus_new_rows"]),
    "p16_slack_8_sliding_window": (dict(gluon_max_slack=8), GPU_CASES["sliding_window"]),
    "p16_slack_0_head_64_fp16": (dict(gluon_max_slack=0), GPU_CASES["fp8_head_64_hnd_fp16"]),
    "p16_slack_8_rows_that_see_no_key": (dict(gluon_max_slack=8), dict(
        query_lens=[300, 200], seq_lens=[100, 200], paged=None, sinks=True)),
    "p16_slack_8_three_consumers_gqa_8": (
        dict(gluon_max_slack=8, gluon_consumers=3),
        dict(query_lens=[2000, 129], seq_lens=[2000, 129], head_size=64, num_heads=32,
             num_kv_heads=4, paged=None)),
}


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(SOFTMAX_SWITCH_RUNS))
def test_gpu_softmax_switches_real_sizes(name, monkeypatch):
    switches, case = SOFTMAX_SWITCH_RUNS[name]
    for switch, value in dict(SOFTMAX_SWITCHES_OFF, **switches).items():
        monkeypatch.setattr(ag.SWITCHES, switch, value)
    fp8_p = switches.get("gluon_fp8_pv", False) and "q_fp8" in case
    planned = dict(PV_FP8=fp8_p, MAX_SLACK=switches.get("gluon_max_slack", -1),
                   V_PRMT=fp8_p and switches.get("gluon_fp8_v_prmt", False)
                   and (2 if switches.get("gluon_fp8_v_words", False) else True),
                   P_WORDS=fp8_p and switches.get("gluon_fp8_p_words", False))
    run_case(**case, planned=planned, again=name.endswith("gqa_8"))


@cuda
@on_sm90
@pytest.mark.parametrize("sinks", [False, True])
def test_gpu_rows_that_see_no_key_give_zero_and_lse_of_the_sink(sinks):
    # Dense keys shorter than the queries: the first queries sit before every key.
    run_case([300, 200], [100, 200], paged=None, sinks=sinks)


# Three consumers (`SWITCHES.gluon_consumers = 3`): 192-row items at head 64, three Q parts
# sharing each K/V tile; lengths around multiples of 192 and 128 (a consumer whose rows see
# none of an item's last tile, rows past a request's end in the last part).
THREE_CONSUMER_CASES = {
    "causal_prompts_gqa_4": dict(query_lens=[4096, 1000, 129, 192], seq_lens=[4096, 1000, 129,
                                                                           192], paged=None),
    "causal_prompts_mha_fp16": dict(query_lens=[1000, 385], seq_lens=[1000, 385],
                                    num_heads=8, num_kv_heads=8, paged=None,
                                    dtype=torch.float16),
    "context_plus_new_rows_gqa_8": dict(query_lens=[2048, 300], seq_lens=[6000, 5300],
                                        num_heads=32, num_kv_heads=4),
    "context_plus_new_rows_fp16": dict(query_lens=[577, 64], seq_lens=[1601, 700],
                                       dtype=torch.float16),
    "paged_cache_only": dict(query_lens=[700, 64], seq_lens=[3000, 701], paged="cache",
                             nan_tail=True),
    "non_causal_keys_longer": dict(query_lens=[700, 300], seq_lens=[900, 1300], paged=None,
                                   causal=False),
    "sliding_window_sinks": dict(query_lens=[3000], seq_lens=[3500], window=(1024, 0),
                                 sinks=True),
    "two_sided_window_alibi_softcap": dict(query_lens=[1500], seq_lens=[1500], paged=None,
                                           causal=False, window=(200, 77), alibi=True,
                                           softcap=30.0),
    "short_prompts_beside_decodes": dict(query_lens=[512] * 31 + [77, 1, 1, 3],
                                         seq_lens=[512] * 31 + [300, 40, 900, 3],
                                         skip_q_len=4, paged=None),
    "rows_that_see_no_key": dict(query_lens=[300, 200], seq_lens=[100, 200], paged=None,
                                 sinks=True),
}


@cuda
@on_sm90
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", sorted(THREE_CONSUMER_CASES))
def test_gpu_three_consumers_real_sizes(name, dynamic, monkeypatch):
    """Head 64 with three consumers of 64 rows: every case against the oracle, items in the
    static order or from the counter, and the same bits again eagerly and from a graph."""
    monkeypatch.setattr(ag.SWITCHES, "gluon_consumers", 3)
    monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", dynamic)
    run_case(**THREE_CONSUMER_CASES[name], head_size=64, again=dynamic,
             planned=dict(BLOCK_M=192, CONSUMER_REGS=160, DYNAMIC=dynamic))


# Head 64's fp8 forms beside FA3 fp8's 192-row tiles: three consumers over an fp8 q
# (`SWITCHES.gluon_fp8_three_consumers`) with the 16-bit P V head 64 runs by default and with
# the fp8 P V, items static or from the counter; and two consumers over 256-key tiles with
# the fp8 P V (`gluon_fp8_wide_tiles_64`; no ALiBi or soft cap there). e4m3 and e5m2 caches
# (an fp8 P V within P's bound), causal prompts around multiples of 192, 128 and 256, chunks
# after a context, ragged last pages of NaN, sinks, a soft cap, windows, ALiBi, non-causal
# keys, GQA 1 / 4 / 8, pages of 16 and 64, prompts beside decodes left to another pass; the
# same bits again and from a CUDA graph.
FP8_E5M2 = dict(cache_dtype=torch.float8_e5m2, q_fp8=torch.float8_e5m2)
H64_FP8_CASES = {
    "causal_prompts_gqa_4": dict(query_lens=[4096, 1000, 129, 192],
                                 seq_lens=[4096, 1000, 129, 192], paged="cache", nan_tail=True,
                                 **E4M3),
    "chunks_after_context_gqa_8": dict(query_lens=[2048, 300, 1], seq_lens=[6000, 5300, 777],
                                       num_heads=32, num_kv_heads=4, paged="cache",
                                       nan_tail=True, **E4M3),
    "e5m2_sinks_window_pages_of_64": dict(query_lens=[1500, 700], seq_lens=[2500, 700],
                                          paged="cache", sinks=True, window=(300, 0),
                                          block_size=64, nan_tail=True, **FP8_E5M2),
    "softcap_gqa_1_one_descale": dict(query_lens=[1000, 385], seq_lens=[1000, 385],
                                      num_heads=8, num_kv_heads=8, paged="cache",
                                      softcap=30.0, descale="one", **E4M3),
    "window_sinks_softcap_alibi": dict(query_lens=[1500], seq_lens=[3500], window=(1024, 0),
                                       sinks=True, softcap=30.0, alibi=True, paged="cache",
                                       **E4M3),
    "non_causal_hnd_pages_of_64": dict(query_lens=[700, 300], seq_lens=[900, 1300],
                                       causal=False, paged="cache", layout="HND",
                                       block_size=64, **E4M3),
    "prompts_beside_decodes": dict(query_lens=[512] * 7 + [1, 3], seq_lens=[512] * 7
                                   + [40, 900], skip_q_len=4, paged="cache", **E4M3),
}


# form -> (switches, constexprs the plan must have)
H64_FP8_FORMS = {
    "three_consumers_16_bit_p_v": (
        dict(gluon_consumers=3, gluon_fp8_three_consumers=True, gluon_fp8_pv=None),
        dict(BLOCK_M=192, CONSUMER_REGS=160, PV_FP8=False, DYNAMIC=False)),
    "three_consumers_fp8_p_v": (
        dict(gluon_consumers=3, gluon_fp8_three_consumers=True, gluon_fp8_pv=True),
        dict(BLOCK_M=192, CONSUMER_REGS=160, PV_FP8=True, DYNAMIC=False)),
    "three_consumers_fp8_p_v_dynamic": (
        dict(gluon_consumers=3, gluon_fp8_three_consumers=True, gluon_fp8_pv=True,
             gluon_dynamic=True),
        dict(BLOCK_M=192, CONSUMER_REGS=160, PV_FP8=True, DYNAMIC=True)),
    "wide_256_keys_fp8_p_v": (
        dict(gluon_fp8_pv=True, gluon_fp8_wide_tiles=True, gluon_fp8_wide_tiles_64=True),
        dict(BLOCK_M=128, BLOCK_N=256, PV_FP8=True, LANE_MASKS=True, DYNAMIC=False)),
}


@cuda
@on_sm90
@pytest.mark.parametrize("form, name", [
    (form, name) for form in sorted(H64_FP8_FORMS) for name in sorted(H64_FP8_CASES)
    # the wide tiles refuse ALiBi and a soft cap (those plans keep the default tiles)
    if not (form.startswith("wide") and ("softcap" in H64_FP8_CASES[name]
                                         or "alibi" in H64_FP8_CASES[name]))])
def test_gpu_fp8_head_64_forms_real_sizes(form, name, monkeypatch):
    switches, planned = H64_FP8_FORMS[form]
    monkeypatch.setattr(ag.SWITCHES, "gluon_dynamic", False)
    for switch, value in switches.items():
        monkeypatch.setattr(ag.SWITCHES, switch, value)
    run_case(**H64_FP8_CASES[name], head_size=64, again=True, planned=planned)


# The wide fp8 key tiles (`SWITCHES.gluon_fp8_wide_tiles`: head 128 over 256-key tiles, its
# P V waited for before S; head 256 over 128-key tiles, no O staging): an fp8 q over e4m3
# and e5m2 caches within P's bound, causal prompts, chunks after a context (the causal
# diagonal inside a 256-key tile, half tiles), a ragged last page of NaN, sinks, windows
# (no soft cap nor ALiBi: those plans keep the default tiles), non-causal keys, GQA 1 / 4 /
# 8, pages of 16, 64 and 512 keys; the same bits again and from a CUDA graph.
WIDE_E5M2 = dict(cache_dtype=torch.float8_e5m2, q_fp8=torch.float8_e5m2)
WIDE_TILE_CASES = {
    "h128_chunks_after_context": (256, GPU_CASES["fp8_q_chunks_after_context"]),
    "h128_cache_only_one_descale": (256, GPU_CASES["fp8_q_cache_only_one_descale"]),
    "h128_causal_prompts_gqa_8": (256, dict(
        query_lens=[3000, 1000, 129, 5], seq_lens=[3000, 1000, 129, 5], num_heads=32,
        num_kv_heads=4, paged="cache", nan_tail=True, **E4M3)),
    "h128_e5m2_sinks_window": (256, dict(
        query_lens=[1500, 700], seq_lens=[2500, 700], paged="cache", sinks=True,
        window=(300, 0), nan_tail=True, **WIDE_E5M2)),
    "h128_non_causal_hnd_pages_of_64": (256, dict(
        query_lens=[700, 300], seq_lens=[900, 1300], causal=False, paged="cache",
        layout="HND", block_size=64, **E4M3)),
    "h128_pages_of_512": (256, dict(query_lens=[500], seq_lens=[1800], block_size=512,
                                    paged="cache", nan_tail=True, **E4M3)),
    "h256_gqa_1": (128, GPU_CASES["fp8_q_head_256"]),
    "h256_chunks_after_context_gqa_4": (128, dict(
        query_lens=[700, 64, 1], seq_lens=[2100, 1000, 777], head_size=256, num_heads=16,
        num_kv_heads=4, paged="cache", nan_tail=True, **E4M3)),
    "h256_e5m2_sinks_window": (128, dict(
        query_lens=[500, 300], seq_lens=[900, 300], head_size=256, num_heads=8,
        num_kv_heads=2, paged="cache", sinks=True, window=(200, 0), **WIDE_E5M2)),
    "h256_causal_prompts_gqa_8": (128, dict(
        query_lens=[2048, 333], seq_lens=[2048, 333], head_size=256, num_heads=16,
        num_kv_heads=2, paged="cache", nan_tail=True, **E4M3)),
}


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(WIDE_TILE_CASES))
def test_gpu_fp8_wide_tiles_real_sizes(name, monkeypatch):
    block_n, case = WIDE_TILE_CASES[name]
    monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", True)
    run_case(**case, again=True,
             planned=dict(BLOCK_N=block_n, PV_FP8=True, P_WORDS=True, LANE_MASKS=True))


# The converter's V^T in 128-column slabs and the V^T ring's depth
# (`SWITCHES.gluon_fp8_vt_wide_slabs`, `gluon_fp8_vt_slots`): an fp8 q over e4m3 and e5m2
# caches within P's bound, on the default tiles and the wide ones (wide: True), heads 128
# and 256, causal prompts up to 3,072 keys, chunks after a context, ragged last pages of NaN
# (the tail tile's zeroed keys), sinks and windows, GQA 1 / 4 / 8, pages of 16 and 64; the
# same bits again and from a CUDA graph. name -> (wide tiles, V^T slots, case)
VT_CASES = {
    "h256_causal_prompts_gqa_8": (False, 4, dict(
        query_lens=[3072, 333], seq_lens=[3072, 333], head_size=256, num_heads=16,
        num_kv_heads=2, paged="cache", nan_tail=True, **E4M3)),
    "h256_wide_causal_prompts_gqa_8": (True, None, dict(
        query_lens=[3072, 333], seq_lens=[3072, 333], head_size=256, num_heads=16,
        num_kv_heads=2, paged="cache", nan_tail=True, **E4M3)),
    "h256_gqa_1_three_slots": (False, 3, GPU_CASES["fp8_q_head_256"]),
    "h256_chunks_after_context_gqa_4": (False, 4, dict(
        query_lens=[700, 64, 1], seq_lens=[2100, 1000, 777], head_size=256, num_heads=16,
        num_kv_heads=4, paged="cache", nan_tail=True, **E4M3)),
    "h256_wide_e5m2_sinks_window_pages_of_64": (True, None, dict(
        query_lens=[500, 300], seq_lens=[900, 300], head_size=256, num_heads=8,
        num_kv_heads=2, paged="cache", sinks=True, window=(200, 0), block_size=64,
        **WIDE_E5M2)),
    "h128_chunks_after_context": (False, 4, GPU_CASES["fp8_q_chunks_after_context"]),
    "h128_wide_e5m2_sinks_window": (True, None, dict(
        query_lens=[1500, 700], seq_lens=[2500, 700], paged="cache", sinks=True,
        window=(300, 0), nan_tail=True, **WIDE_E5M2)),
}


@cuda
@on_sm90
@pytest.mark.parametrize("name", sorted(VT_CASES))
def test_gpu_fp8_vt_wide_slabs_and_slots_real_sizes(name, monkeypatch):
    wide, slots, case = VT_CASES[name]
    monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", wide)
    monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_wide_slabs", True)
    monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_slots", slots)
    planned = dict(PV_FP8=True, P_WORDS=True, VT_COLS=128)
    if slots:
        planned["NUM_BUF"] = slots
    run_case(**case, again=True, planned=planned)


# O's rescale after the P V wait (`SWITCHES.gluon_fp8_rescale_after_pv`), the converter's
# V^T slabs loaded a slab ahead (`gluon_fp8_vt_prefetch`), each and both: head 256's fp8 P V
# on the default 64-key tiles and the wide 128-key ones, e4m3 and e5m2 caches, causal prompts
# to 3,072 keys (many tiles a row: the rescale carried across the loop), chunks after a
# context, a query of one tile (the loop's zero trips), ragged NaN page tails, sinks and a
# window (rows whose max moves late), GQA 1 / 4 / 8, pages of 16 and 64, slack 4 (the lazy
# rescale), rows of unequal norms, each against the oracle and again (eager twice, a CUDA
# graph). name -> (wide tiles, max slack, case)
LATE_RESCALE_CASES = {
    "causal_prompts_gqa_8": (False, None, dict(
        query_lens=[3072, 333], seq_lens=[3072, 333], head_size=256, num_heads=16,
        num_kv_heads=2, paged="cache", nan_tail=True, **E4M3)),
    "wide_causal_prompts_gqa_8": (True, None, dict(
        query_lens=[3072, 333, 17], seq_lens=[3072, 333, 17], head_size=256, num_heads=16,
        num_kv_heads=2, paged="cache", nan_tail=True, q_spread=4, **E4M3)),
    "gqa_1": (False, None, GPU_CASES["fp8_q_head_256"]),
    "wide_chunks_after_context_gqa_4": (True, None, dict(
        query_lens=[700, 64, 1], seq_lens=[2100, 1000, 777], head_size=256, num_heads=16,
        num_kv_heads=4, paged="cache", nan_tail=True, **E4M3)),
    "wide_e5m2_sinks_window_pages_of_64": (True, None, dict(
        query_lens=[500, 300], seq_lens=[900, 300], head_size=256, num_heads=8,
        num_kv_heads=2, paged="cache", sinks=True, window=(200, 0), block_size=64,
        **WIDE_E5M2)),
    "slack_4_chunks_after_context": (False, 4, dict(
        query_lens=[700, 64, 1], seq_lens=[2100, 1000, 777], head_size=256, num_heads=16,
        num_kv_heads=4, paged="cache", nan_tail=True, q_spread=4, **E4M3)),
}


@cuda
@on_sm90
@pytest.mark.parametrize("late, prefetch", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("name", sorted(LATE_RESCALE_CASES))
def test_gpu_fp8_rescale_after_pv_and_vt_prefetch_real_sizes(name, late, prefetch,
                                                             monkeypatch):
    wide, slack, case = LATE_RESCALE_CASES[name]
    monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_wide_tiles", wide)
    monkeypatch.setattr(ag.SWITCHES, "gluon_max_slack", slack)
    monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_rescale_after_pv", late)
    monkeypatch.setattr(ag.SWITCHES, "gluon_fp8_vt_prefetch", prefetch)
    run_case(**case, again=True, planned=dict(
        PV_FP8=True, P_WORDS=True, VT_COLS=128, RESCALE_AFTER_PV=late, VT_PREFETCH=prefetch,
        MAX_SLACK=-1 if slack is None else slack))
