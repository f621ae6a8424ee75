"""The Hopper prefill pass (ops/triton/attention_hopper.py) against the float64 oracle.

On a CPU the pass is forced on under TRITON_INTERPRET=1 (tensor descriptors run in the
interpreter) at small sizes, fp16; on an H100 it is the default prefill pass and the `cuda`
cases run it at real sizes, bf16, one per feature. Paged plans read the new tokens' keys and
values as dense rows (`k_new` / `v_new`) and the cached context page by page; dense varlen
plans read every key by descriptor. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import reference as ref  # noqa: E402
from conftest import assert_close, cu_seqlens, make_paged_batch, poison, randn  # noqa: E402
from pagedattn.ops.triton import launch  # noqa: E402
from pagedattn.ops.triton.attention_plan import plan_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.cuda
LSE_TOL = dict(atol=5e-2, rtol=2e-2)


@pytest.fixture(autouse=True, params=[False, True], ids=["per_head", "packed_gqa"])
def _hopper_pass(request, monkeypatch):
    """Forced on (the CPU's interpreter has no sm_90); on a GPU the default decides, with the
    Gluon pass (which would take its place there) off. Each test runs with one query head per
    program and with a KV head's query heads packed."""
    if DEVICE == "cpu":
        monkeypatch.setattr(launch.SWITCHES, "hopper_prefill", True)
    monkeypatch.setattr(launch.SWITCHES, "gluon_prefill", False)
    monkeypatch.setattr(launch.SWITCHES, "hopper_pack_gqa", request.param)


def _new_rows(cache: torch.Tensor, block_table, query_lens, seq_lens) -> torch.Tensor:
    """The new tokens' rows of a paged cache, in query order: what the layer just wrote."""
    rows = []
    for r, (n, s) in enumerate(zip(query_lens, seq_lens)):
        rows.append(ref.gather_paged(cache, block_table[r], s)[s - n:])
    return torch.cat(rows)


def _plan(b, *, paged, num_heads, num_kv_heads, head_size, head_size_v, dtype, causal,
          window, softcap, alibi, sinks, key_lens=None):
    total_q = sum(b.query_lens)
    return plan_attention(
        device=torch.device(DEVICE), cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k,
        cu_seqlens_k=None if paged else cu_seqlens(key_lens, DEVICE),
        block_table=b.block_table if paged else None, batch=len(b.query_lens),
        total_q=total_q, max_seqlen_q=max(b.query_lens), max_seqlen_k=max(b.seq_lens),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        head_size_v=head_size_v, page_size=b.k_cache.shape[1] if paged else 1, q_dtype=dtype,
        kv_dtype=dtype, out_dtype=dtype, softmax_scale=head_size ** -0.5,
        causal=causal, window_left=window[0], window_right=window[1], softcap=softcap,
        use_alibi=alibi, use_sinks=sinks, use_q_descale=False, use_kv_descale=False,
        write_lse=True, dense_new_kv=paged)


def check(query_lens, seq_lens, *, paged=True, num_heads=4, num_kv_heads=2, head_size=64,
          head_size_v=None, block_size=16, dtype=torch.float16, causal=True, window=(-1, -1),
          softcap=0.0, alibi=False, sinks=False, seed=0):
    head_size_v = head_size_v or head_size
    b = make_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
                         dtype, head_size_v, device=DEVICE, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    slopes = torch.rand(num_heads, generator=g) * 0.5 if alibi else None
    sink = torch.randn(num_heads, generator=g) * 2 if sinks else None
    total_q = sum(query_lens)
    scale = head_size ** -0.5
    if paged:
        k = _new_rows(b.k_cache, b.block_table, query_lens, seq_lens)
        v = _new_rows(b.v_cache, b.block_table, query_lens, seq_lens)
        kv = (b.k_cache, b.v_cache)
    else:  # dense varlen: every key of a sequence in rows of its own
        k = randn(sum(seq_lens), num_kv_heads, head_size, dtype=dtype, device=DEVICE, generator=g)
        v = randn(sum(seq_lens), num_kv_heads, head_size_v, dtype=dtype, device=DEVICE,
                  generator=g)
        kv = (k, v)
    plan = _plan(b, paged=paged, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_size=head_size, head_size_v=head_size_v, dtype=dtype, causal=causal,
                 window=window, softcap=softcap, alibi=alibi, sinks=sinks, key_lens=seq_lens)
    assert any(p.name == "hopper" for p in plan.launches), "the Hopper pass did not run"
    out = poison((total_q, num_heads, head_size_v), dtype, DEVICE)
    lse = poison((num_heads, total_q), torch.float32, DEVICE)
    plan.run(b.q, *kv, out, lse, None if slopes is None else slopes.to(DEVICE),
             None if sink is None else sink.to(DEVICE), k_new=k, v_new=v)
    features = dict(scale=scale, causal=causal, window=window, softcap=softcap,
                    alibi_slopes=slopes, sinks=sink)
    if paged:
        exp_out, exp_lse = ref.paged_attention(
            b.q.cpu(), b.k_cache.cpu(), b.v_cache.cpu(), query_lens, seq_lens,
            b.block_table.cpu(), **features)
    else:
        exp_out, exp_lse = ref.varlen_attention(b.q.cpu(), k.cpu(), v.cpu(), query_lens,
                                                seq_lens, **features)
    assert_close(out, exp_out, dtype)
    assert_close(lse, exp_lse, **LSE_TOL)


# --- CPU (interpreter) and GPU, small sizes --------------------------------------------------
def test_prompts_with_and_without_context_and_a_decode_beside():
    # the 1-token request belongs to the decode pass; the others to the Hopper pass
    check([40, 1, 23], [40, 30, 70])


def test_dense_varlen_keys_longer_than_queries():
    check([33, 20], [33, 50], paged=False)


def test_dense_varlen_keys_fewer_than_queries():
    # Bottom-right causal alignment: the first query rows of the second request see no key
    # (0 output, LSE -inf); no key before the request's first may be read for them.
    check([33, 40], [33, 25], paged=False)


def test_window_softcap_alibi_sinks_gqa():
    check([37, 24], [60, 24], num_heads=4, num_kv_heads=1, window=(9, 0), softcap=5.0,
          alibi=True, sinks=True)


def test_non_causal_with_wider_values():
    check([20, 17], [20, 40], causal=False, head_size_v=128, paged=False)


def test_chunks_over_a_long_context_take_the_portable_pass():
    b = make_paged_batch([40, 33], [400, 300], 4, 2, 64, 16, torch.float16, device=DEVICE)
    kinds = lambda plan: [p.name for p in plan.launches]  # noqa: E731
    common = dict(paged=True, num_heads=4, num_kv_heads=2, head_size=64, head_size_v=64,
                  dtype=torch.float16, causal=True, window=(-1, -1), softcap=0.0, alibi=False,
                  sinks=False)
    assert kinds(_plan(b, **common)) == ["prefill"]  # 400 keys >= 4 x 40 queries
    b = make_paged_batch([40, 33], [150, 33], 4, 2, 64, 16, torch.float16, device=DEVICE)
    assert kinds(_plan(b, **common)) == ["hopper"]


# --- GPU, real sizes: one case per feature ---------------------------------------------------
GPU_CASES = {
    "causal_prompts": dict(query_lens=[4096, 1000, 129], seq_lens=[4096, 1000, 129]),
    "context_plus_new": dict(query_lens=[2048, 300], seq_lens=[6000, 5300]),
    "sliding_window": dict(query_lens=[3000], seq_lens=[3500], window=(1024, 0)),
    "alibi": dict(query_lens=[1500], seq_lens=[1700], alibi=True),
    "softcap": dict(query_lens=[1500], seq_lens=[1500], softcap=30.0),
    "sinks": dict(query_lens=[1500, 700], seq_lens=[1500, 900], sinks=True),
    "head_64": dict(query_lens=[2000], seq_lens=[2500], head_size=64),
    "head_256": dict(query_lens=[1200, 300], seq_lens=[1200, 800], head_size=256),
    "mqa": dict(query_lens=[1024], seq_lens=[1024], num_kv_heads=1),
    "short_prompts": dict(query_lens=[512] * 5 + [77], seq_lens=[512] * 5 + [300]),
    "dense_varlen": dict(query_lens=[1000, 2000], seq_lens=[1500, 2000], paged=False),
    "fp16": dict(query_lens=[1000], seq_lens=[1200], dtype=torch.float16),
}


@cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_real_sizes(name):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper pass runs on sm_90")
    from pagedattn.ops.triton import fast_launch

    case = dict(dict(num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16),
                **GPU_CASES[name])
    check(**case)
    check(**case)  # launched directly this time (fast_launch), with the same result
    assert fast_launch.fast_path_enabled()


# --- the engine path: Attention layers hand their new K/V to the pass ------------------------
def test_attention_layer_steps_read_new_tokens_densely(monkeypatch):
    from conftest import LayerRunner, check_step, make_layers
    from pagedattn.backends.flash_attn import FlashAttentionBackend
    from pagedattn.ops.triton import attention_plan

    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    chosen = []

    def spy(**kw):
        cfg = hopper_prefill_config(**kw)
        chosen.append(cfg is not None)
        return cfg
    hopper_prefill_config = attention_plan.hopper_prefill_config
    monkeypatch.setattr(attention_plan, "hopper_prefill_config", spy)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    layers = make_layers(FlashAttentionBackend, 2, 4, 2, head_size=64, dtype=dtype)
    for layer in layers.values():
        layer.to(DEVICE)
    run = LayerRunner(layers, num_blocks=64, dtype=dtype, device=DEVICE)
    check_step(run.step([0, 1], [37, 20]), dtype)  # prompts
    check_step(run.step([0, 1], [1, 1]), dtype)  # decodes (no prefill pass)
    check_step(run.step([0, 1, 2], [18, 1, 25]), dtype)  # a chunk over context, a new prompt
    assert chosen and all(chosen), "every prefill pass should have been the Hopper pass"
