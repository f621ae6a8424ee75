"""Batch-invariant prompts and decodes whose Gluon kernels skip O's rescale where no row of
a warp moved its max (`SWITCHES.invariant_lazy_rescale`; KERNEL_NOTES v45, v50).

Schedule only: the invariant softmax step gives alpha exactly 1 where a row's max holds
(`tile_math.exact_softmax_step`) and O times 1 is O under round-to-nearest without a flush
of subnormals, so skipping those multiplies keeps every bit. CPU: the switch reaches the
prompt consumer and the decode kernel as MAX_SLACK 0 in batch-invariant launches alone (a
max slack as itself, at 64- and 128-key tiles), is refused when not a bool, and the
rescale's PTX rounds to nearest (the default consumer's text unchanged). GPU (`cuda`, sm_90
with Triton 3.6's Gluon): prompts and decodes bit-equal to the `tl` pass's with the switch
on (decodes also at 128-key tiles, with the switch or slack 8), and the mode's shared check
(alone, in random batches, chunked, as decodes).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import assert_same_but, needs_gluon_sm90  # noqa: E402
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import gluon_decode_invariant_launch as gdi  # noqa: E402
from pagedattn.ops.triton import gluon_softmax, launch  # noqa: E402
from test_batch_invariant import check_gpu_layer  # noqa: E402
from test_invariant_gluon import (  # noqa: E402
    GLUON_LAYERS,
    SCHEDULE,
    _layer_id,
    _one_schedule,
)
from test_invariant_gluon import (  # noqa: E402 - renamed: collected once, in its own module
    test_gpu_gluon_prompts_have_the_tl_passes_bits as prompts_have_the_tl_passes_bits,
)
from test_invariant_gluon_decode import GLUON_LAYERS as DECODE_LAYERS  # noqa: E402
from test_invariant_gluon_decode import _plan, _route  # noqa: E402
from test_invariant_gluon_decode import (  # noqa: E402 - renamed: collected in its own module
    test_gpu_gluon_decodes_have_the_tl_passes_bits as decodes_have_the_tl_passes_bits,
)

on_sm90 = needs_gluon_sm90()


@pytest.fixture(autouse=True)
def _no_max_slack(monkeypatch):
    """The switch as it stands alone: no max slack (`invariant_max_slack` 0; since the slack's
    default is 8 it turns the rescale's skip on by itself, and the lazy switch is not read)."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_max_slack", 0)


def test_the_switch_is_off_by_default_and_reaches_invariant_launches_alone(monkeypatch):
    """Off (with the max slack 0): the invariant consumer rescales O every tile (MAX_SLACK
    -1). On: MAX_SLACK 0 in batch-invariant launches, every other constexpr as before; the
    default consumer's own slack is left to `SWITCHES.gluon_max_slack`."""
    assert launch.SWITCHES.invariant_lazy_rescale is False
    off = ag.launch_config(**SCHEDULE).constexprs
    default_off = ag.launch_config(**dict(SCHEDULE, invariant=None)).constexprs
    assert off["MAX_SLACK"] == -1
    monkeypatch.setattr(launch.SWITCHES, "invariant_lazy_rescale", True)
    on = ag.launch_config(**SCHEDULE).constexprs
    assert on["MAX_SLACK"] == 0
    assert_same_but(on, off, "MAX_SLACK")
    assert ag.launch_config(**dict(SCHEDULE, invariant=None)).constexprs == default_off


@pytest.mark.parametrize("tiles_128", [None, True])
@pytest.mark.parametrize("slack, lazy, want", [(0, False, -1), (0, True, 0), (8, False, 8),
                                               (4, True, 4)])
def test_the_decode_kernel_takes_the_prompt_consumers_max_slack(slack, lazy, want, tiles_128,
                                                                monkeypatch):
    """The Gluon decode launch's MAX_SLACK is the prompt consumer's (`invariant_gluon_slack`:
    the slack, else 0 with the lazy rescale, else -1), in unsplit programs and split ones,
    at 64-key tiles and at `invariant_tiles_128`'s (BLOCK_N 128, the unsplit programs' fold
    in memory); every other constexpr is what it was with both switches off."""
    _route(monkeypatch)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", tiles_128)
    off = {n: _plan(*shape)[0].constexprs for n, shape in (("unsplit", (32, 1, 3000)),
                                                            ("split", (1, 1, 3000)))}
    monkeypatch.setattr(launch.SWITCHES, "invariant_max_slack", slack)
    monkeypatch.setattr(launch.SWITCHES, "invariant_lazy_rescale", lazy)
    on = {n: _plan(*shape)[0].constexprs for n, shape in (("unsplit", (32, 1, 3000)),
                                                           ("split", (1, 1, 3000)))}
    assert ag.launch_config(**SCHEDULE).constexprs["MAX_SLACK"] == want  # the prompts'
    for name in ("unsplit", "split"):
        assert (off[name]["MAX_SLACK"], on[name]["MAX_SLACK"]) == (-1, want)
        assert on[name]["BLOCK_N"] == (128 if tiles_128 else 64)
        assert on[name]["SPLIT_KV"] is (name == "split")
        assert_same_but(on[name], off[name], "MAX_SLACK")
    assert on["unsplit"]["FOLD_MEM"] is bool(tiles_128)


@pytest.mark.parametrize("value", [-2, 9, 0.0, True, None])
def test_the_decode_constexprs_refuse_a_max_slack_out_of_range(value):
    with pytest.raises(ValueError, match=r"max_slack=.*: -1 \(O rescaled every tile\), 0 "
                                         r"\(skipped where no row moved its max\) or a slack "
                                         r"of 1-8"):
        gdi.decode_constexprs(
            num_heads=32, num_kv_heads=8, head_size=128, page_size=16, decode_queries=16,
            kv_fp8=False, q_fp8=False, dot_f16=False, causal=True, window_left=-1,
            window_right=-1, softcap=0.0, split=False, split_keys=1024, max_slack=value)


@pytest.mark.parametrize("value", [1, 0, None, "yes"])
def test_a_switch_that_is_not_a_bool_is_refused(value, monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_lazy_rescale", value)
    with pytest.raises(ValueError, match=r"SWITCHES.invariant_lazy_rescale=.* must be True or "
                                         r"False"):
        ag.launch_config(**SCHEDULE)


def test_the_rescale_rounds_to_nearest_only_where_asked():
    """The invariant consumer's multiplies are `mul.rn.f32` (never fused, never flushed: x *
    1 is x), the default consumer's text is what it was."""
    n = 64
    plain, rn = gluon_softmax.rescale_asm(n), gluon_softmax.rescale_asm(n, True)
    assert plain.count("mul.f32 ") == n and "mul.rn.f32" not in plain
    assert rn.count("mul.rn.f32 ") == n and "mul.f32 " not in rn
    assert rn.replace("mul.rn.f32", "mul.f32") == plain
    # the skip: no lane's two rows moved (alpha exactly 1.0 on both), a warp-uniform branch
    assert "setp.neu.f32 %lz_a, $128, 0f3F800000;" in rn
    assert "vote.sync.any.pred" in rn and "bra.uni" in rn


def test_times_one_is_the_identity_on_every_float32_class():
    """What the skip relies on, over normal, subnormal, signed-zero and infinite values:
    float32 x * 1.0 keeps x's bits (round to nearest, subnormals kept, as `mul.rn.f32`)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g) * torch.logspace(-45, 38, 4096).float()
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45,
                                    1.1754942e-38])])
    assert (x * 1.0).view(torch.int32).equal(x.view(torch.int32))


# --- GPU: the same bits as the `tl` pass, and the guarantee -------------------------------
@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("layer", GLUON_LAYERS, ids=_layer_id)
def test_gpu_lazy_rescale_keeps_the_tl_passes_bits(layer, monkeypatch):
    """`test_invariant_gluon.test_gpu_gluon_prompts_have_the_tl_passes_bits` with the switch
    on (its random rows move their max in some tiles and not in others, so both sides of the
    skip run): outputs and float32 LSEs bit for bit."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_lazy_rescale", True)
    prompts_have_the_tl_passes_bits(layer, monkeypatch)


@pytest.mark.cuda
@on_sm90
def test_gpu_rows_are_the_same_bits_with_the_lazy_rescale(monkeypatch):
    _one_schedule(monkeypatch)
    monkeypatch.setattr(launch.SWITCHES, "invariant_lazy_rescale", True)
    check_gpu_layer(GLUON_LAYERS[0])


# Decodes on the Gluon decode kernel with the switch on: `test_invariant_gluon_decode`'s
# layers (bf16 / fp16 / e4m3 caches, heads 64 / 128, GQA 4 / 1 / 8, soft cap, windows,
# sinks), one request over 3 splits, 32 over 1 to 3, decodes beside prompts
@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("scenario", ["batch 1", "batch 32", "mixed"])
@pytest.mark.parametrize("layer", DECODE_LAYERS, ids=_layer_id)
def test_gpu_lazy_rescale_keeps_the_decodes_tl_bits(layer, scenario, monkeypatch):
    """`test_invariant_gluon_decode.test_gpu_gluon_decodes_have_the_tl_passes_bits` with the
    switch on (random keys move a row's max in a split's early tiles and rarely later, so
    both sides of the skip run): outputs and float32 LSEs bit for bit."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_lazy_rescale", True)
    decodes_have_the_tl_passes_bits(layer, scenario, monkeypatch)


# 128-key tiles for every pass (`invariant_tiles_128`: the decode kernel's unsplit programs
# fold in memory) with the lazy rescale, or with slack 8 (the `tl` pass then lags alike)
TILES_128_CASES = [("lazy", 0, "batch 32"), ("lazy", 3, "mixed"), ("lazy", 4, "batch 1"),
                   ("slack 8", 0, "batch 32"), ("slack 8", 3, "mixed"),
                   ("slack 8", 2, "batch 1")]
TILES_128_SWITCHES = {"lazy": dict(invariant_lazy_rescale=True, invariant_max_slack=0),
                      "slack 8": dict(invariant_max_slack=8)}


@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("switch, layer, scenario",
                         [(c, DECODE_LAYERS[i], s) for c, i, s in TILES_128_CASES],
                         ids=[f"{c}-{_layer_id(DECODE_LAYERS[i])}-{s}"
                              for c, i, s in TILES_128_CASES])
def test_gpu_128_key_decodes_skipping_the_rescale_keep_the_tl_bits(switch, layer, scenario,
                                                                    monkeypatch):
    """The same at 128-key tiles (the `tl` pass under the same switches)."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    for field, value in TILES_128_SWITCHES[switch].items():
        monkeypatch.setattr(launch.SWITCHES, field, value)
    decodes_have_the_tl_passes_bits(layer, scenario, monkeypatch)


@pytest.mark.cuda
@on_sm90
def test_gpu_rows_are_the_same_bits_with_the_lazy_rescale_at_128_key_tiles(monkeypatch):
    """The mode's shared check (prompts on the Gluon consumer, decodes on the Gluon decode
    kernel, both skipping) with every pass in 128-key tiles."""
    _one_schedule(monkeypatch)
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles_128", True)
    monkeypatch.setattr(launch.SWITCHES, "invariant_lazy_rescale", True)
    check_gpu_layer(DECODE_LAYERS[3])
