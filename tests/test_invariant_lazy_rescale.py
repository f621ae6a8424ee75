"""Batch-invariant prompts whose Gluon consumer skips O's rescale where no row of a warp
moved its max (`SWITCHES.invariant_lazy_rescale`; KERNEL_NOTES v45).

Schedule only: the invariant softmax step gives alpha exactly 1 where a row's max holds
(`tile_math.exact_softmax_step`) and O times 1 is O under round-to-nearest without a flush
of subnormals, so skipping those multiplies keeps every bit. CPU: the switch reaches the
kernel as MAX_SLACK 0 in batch-invariant launches alone, is refused when not a bool, and
the rescale's PTX rounds to nearest (the default consumer's text unchanged). GPU (`cuda`,
sm_90 with Triton 3.6's Gluon): prompts bit-equal to the `tl` pass's with the switch on, and
the mode's shared check (alone, in random batches, chunked, as decodes).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import needs_gluon_sm90  # noqa: E402
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
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

on_sm90 = needs_gluon_sm90()


def test_the_switch_is_off_by_default_and_reaches_invariant_launches_alone(monkeypatch):
    """Off: the invariant consumer rescales O every tile (MAX_SLACK -1, today's kernel). On:
    MAX_SLACK 0 in batch-invariant launches, every other constexpr as before; the default
    consumer's own slack is left to `SWITCHES.gluon_max_slack`."""
    assert launch.SWITCHES.invariant_lazy_rescale is False
    off = ag.launch_config(**SCHEDULE).constexprs
    default_off = ag.launch_config(**dict(SCHEDULE, invariant=None)).constexprs
    assert off["MAX_SLACK"] == -1
    monkeypatch.setattr(launch.SWITCHES, "invariant_lazy_rescale", True)
    on = ag.launch_config(**SCHEDULE).constexprs
    assert on["MAX_SLACK"] == 0
    assert {k: v for k, v in on.items() if k != "MAX_SLACK"} == \
        {k: v for k, v in off.items() if k != "MAX_SLACK"}
    assert ag.launch_config(**dict(SCHEDULE, invariant=None)).constexprs == default_off


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
