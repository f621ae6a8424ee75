"""Batch-invariant mode's running max with a slack (`SWITCHES.invariant_max_slack`;
KERNEL_NOTES v45): a row's max moves only where a tile's exceeds it by more than the slack
(`tile_math.invariant_max`), in every pass alike (the `tl` pass, the Gluon prompt consumer
and the Gluon decode kernel), so the rows get other bits than with slack 0 but one
arithmetic in any batch.

CPU (interpreter): the `tl` pass with the slack keeps the guarantee (each row close to the
oracle and the same bits alone, in any batch, chunked and as decodes, under every split
schedule), its bits differ from slack 0's (the switch reaches the kernel), the switch's
refusals and where it reaches each pass's constexprs. GPU (`cuda`, sm_90 with Triton 3.6's
Gluon): the Gluon prompt consumer and decode kernel bit-equal to the `tl` pass under the
slack, and the mode's shared check.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import cu_seqlens, needs_gluon_sm90  # noqa: E402
from pagedattn.ops.providers import use_provider  # noqa: E402
from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import gluon_decode_invariant_launch as gdi  # noqa: E402
from pagedattn.ops.triton import invariant_config as ic  # noqa: E402
from pagedattn.ops.triton import invariant_plan, launch  # noqa: E402
from test_batch_invariant import (  # noqa: E402
    Layer,
    World,
    bits,
    check_gpu_layer,
    check_target,
    cpu_layers,
)
from test_invariant_gluon import GLUON_LAYERS, SCHEDULE, _layer_id, _one_schedule  # noqa: E402
from test_invariant_gluon import (  # noqa: E402 - renamed: collected once, in its own module
    test_gpu_gluon_prompts_have_the_tl_passes_bits as prompts_have_the_tl_passes_bits,
)

on_sm90 = needs_gluon_sm90()


# --- CPU: the `tl` pass under the interpreter ---------------------------------------------
@pytest.mark.parametrize("slack, scale_in_exp", [(1, True), (8, True), (2, False)])
def test_the_slack_keeps_the_guarantee(slack, scale_in_exp, monkeypatch):
    """Each row close to the oracle (the stale max cancels in the split's division) and of
    the same bits alone, in random batches, chunked and as decodes, under every split
    schedule; with the scale in the exponent and without (soft caps keep scaled scores)."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 32)
    monkeypatch.setattr(launch.SWITCHES, "invariant_scale_in_exp", scale_in_exp)
    monkeypatch.setattr(launch.SWITCHES, "invariant_max_slack", slack)

    @settings(max_examples=3, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data):
        layer = data.draw(cpu_layers("triton"))
        if scale_in_exp:
            layer = dataclasses.replace(layer, softcap=0.0)
        lengths = data.draw(st.lists(st.integers(1, 60), min_size=2, max_size=4))
        world = World(layer, lengths, "cpu", data.draw(st.integers(0, 2 ** 16)))
        with use_provider("triton"):
            check_target(data, world, 3, (0, 1, 3))

    check()


def test_the_slack_changes_the_bits_of_every_pass_alike(monkeypatch):
    """Slack 1 against 0 on one batch: outputs and LSEs within the oracle's tolerance of each
    other but not bit-equal (a row whose max lags sums other weights), so the switch reaches
    the kernel; the switch's default is 8 (the H200 measured it faster on prompts)."""
    assert launch.SWITCHES.invariant_max_slack == 8
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 32)
    layer = Layer(4, 2, 16, 16, torch.float32, torch.float32, 8)
    world = World(layer, [70, 45, 1], "cpu", seed=5)
    parts = [(0, 0, 0, 70), (1, 1, 0, 45), (2, 0, 0, 1)]
    rows = []
    for slack in (0, 1):
        monkeypatch.setattr(launch.SWITCHES, "invariant_max_slack", slack)
        with use_provider("triton"):
            rows.append(world.run(parts))
    for (out_a, lse_a), (out_b, lse_b) in zip(*rows):
        torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse_a, lse_b, atol=1e-5, rtol=1e-5)
    assert any(not torch.equal(bits(a[0]), bits(b[0])) for a, b in zip(*rows))


@pytest.mark.parametrize("value", [-1, 9, 2.0, True, None, "8"])
def test_a_slack_that_is_not_an_int_of_0_to_8_is_refused(value, monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_max_slack", value)
    with pytest.raises(ValueError, match=r"SWITCHES.invariant_max_slack=.* must be an int of "
                                         r"0-8"):
        ic.invariant_max_slack()
    with pytest.raises(ValueError, match="invariant_max_slack"):
        ag.launch_config(**SCHEDULE)


@pytest.mark.parametrize("slack, lazy, prompt, decode", [
    (0, False, -1, -1), (0, True, 0, 0), (4, False, 4, 4), (8, True, 8, 8)])
def test_every_pass_takes_the_slack_alike(slack, lazy, prompt, decode, monkeypatch):
    """The slack reaches the `tl` launch (MAX_SLACK), the Gluon prompt consumer and the
    Gluon decode kernel alike (MAX_SLACK: the slack, else 0 with the lazy rescale, else -1);
    the default consumer keeps its own slack."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_max_slack", slack)
    monkeypatch.setattr(launch.SWITCHES, "invariant_lazy_rescale", lazy)
    args = dict(device=torch.device("cpu"), cu_seqlens_q=cu_seqlens([1, 200]),
                seqused_k=torch.tensor([300, 200], dtype=torch.int32), cu_seqlens_k=None,
                block_table=torch.zeros(2, 20, dtype=torch.int32), batch=2, total_q=201,
                max_seqlen_q=200, max_seqlen_k=300, num_heads=8, num_kv_heads=2,
                head_size=16, head_size_v=16, page_size=16, q_dtype=torch.float32,
                kv_dtype=torch.float32, out_dtype=torch.float32, softmax_scale=0.25,
                causal=True, window_left=-1, window_right=-1, softcap=0.0, num_splits=1,
                dtypes=(torch.float32,) * 3)
    (tl_launch,) = invariant_plan.plan_invariant_launches(**args)
    assert tl_launch.constexprs["MAX_SLACK"] == slack
    assert ag.launch_config(**SCHEDULE).constexprs["MAX_SLACK"] == prompt
    assert ag.launch_config(**dict(SCHEDULE, invariant=None)).constexprs["MAX_SLACK"] == 8
    c = gdi.decode_constexprs(
        num_heads=32, num_kv_heads=8, head_size=128, page_size=16, decode_queries=16,
        kv_fp8=False, q_fp8=False, dot_f16=False, causal=True, window_left=-1,
        window_right=-1, softcap=0.0, split=False, split_keys=1024,
        max_slack=ic.invariant_gluon_slack())
    assert c["MAX_SLACK"] == decode


# --- GPU: the Gluon kernels follow the `tl` pass, and the guarantee ----------------------
@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("layer", GLUON_LAYERS, ids=_layer_id)
@pytest.mark.parametrize("slack", [1, 8])
def test_gpu_the_gluon_kernels_follow_the_tl_pass_under_the_slack(slack, layer, monkeypatch):
    """`test_invariant_gluon.test_gpu_gluon_prompts_have_the_tl_passes_bits` under the slack
    (1: maxima that move past it in some tiles; 8: nearly never past a split's first): the
    prompts on the Gluon consumer and the decodes on the Gluon decode kernel bit for bit
    with the `tl` pass's rows, outputs and float32 LSEs."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_max_slack", slack)
    prompts_have_the_tl_passes_bits(layer, monkeypatch)


@pytest.mark.cuda
@on_sm90
@pytest.mark.parametrize("layer", [GLUON_LAYERS[0], GLUON_LAYERS[3]], ids=_layer_id)
def test_gpu_rows_are_the_same_bits_under_the_slack(layer, monkeypatch):
    _one_schedule(monkeypatch)
    monkeypatch.setattr(launch.SWITCHES, "invariant_max_slack", 8)
    check_gpu_layer(layer)
