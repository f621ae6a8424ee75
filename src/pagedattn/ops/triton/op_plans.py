"""The public op's plans, kept for the calls after the first.

`varlen_attention` (what `flash_attn_varlen_func` and the vLLM drop-in run once per layer)
used to plan its batch on every call: tens of microseconds of Python and a few small device
allocations before the launch, which a short prompt's kernel cannot hide (issue 40: fp8
32 x 512, the op at 0.77x the engine path, which plans once per step). A model calls it once
per layer with the same metadata tensors and host ints, so `plan_for(**kwargs)` keeps the
last OP_PLANS plans it made and returns the one `plan_attention(**kwargs)` would make again.

A plan is a function of its arguments and the switches, never of a device value, so its key is:
- every argument but the tensors, as given (ints, floats, dtypes, flags, the device, a tile
  override);
- each metadata tensor's data pointer, shape, strides and dtype: a kept plan holds its
  tensors, so a tensor described the same is a view of the same memory, whose values the
  kernels read when they run (a later step's lengths in the same buffers run right);
- `launch.switch_state()` and whether the interpreter runs: a flipped switch plans again;
- the device's current stream: a plan's scratch (the Gluon pass's descriptors, a dynamic
  launch's item counters, a split pass's partial states) is shared by its launches in
  stream order only.
Nothing is kept or reused while a CUDA graph is being captured (the graph would keep the
addresses of a plan's scratch, which a kept plan evicted later frees): each captured call
plans its own, as before; nor where a switch holds an unhashable value (a dict of per-head
tiles). Kept plans hold their scratch and metadata tensors alive: `clear()` lets them go.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops.triton import attention_plan, launch
from pagedattn.ops.triton.attention_plan import TritonAttentionPlan
from pagedattn.ops.triton.fast_launch import stream_key
from pagedattn.ops.triton.launch import AttnConfig

# Plans kept (the oldest first out): a step's layers share one; a cascade's prefix
# and suffix passes, or a few engines in one process, take one each. 0: plan every call.
OP_PLANS = 4
# plan_attention's tensor arguments (the rest are ints, floats, flags, dtypes, the device)
METADATA = ("cu_seqlens_q", "seqused_k", "cu_seqlens_k", "block_table")
_kept: dict = {}  # key -> plan, in the order they were made


def plan_for(**kwargs) -> TritonAttentionPlan:
    """`plan_attention(**kwargs)`, or the plan an earlier call with the same key made (see
    the module doc): the same launches, scratch and kernel arguments, so the same bits."""
    plan_attention = attention_plan.plan_attention  # read per call: a test's spy sees it
    key = plan_key(kwargs)
    if key is None:
        return plan_attention(**kwargs)
    try:
        plan = _kept.get(key)  # one hash of the key: a hit is the op's every later call
    except TypeError:  # a switch holds a dict or a list
        return plan_attention(**kwargs)
    if plan is None:
        plan = _kept[key] = plan_attention(**kwargs)
        while len(_kept) > max(OP_PLANS, 0):  # the oldest first out
            del _kept[next(iter(_kept))]
    return plan


def plan_key(kwargs: dict) -> Optional[tuple]:
    """What `plan_attention(**kwargs)` depends on, or None where its plan must not be kept
    (OP_PLANS 0, a CUDA graph being captured on the device's current stream)."""
    if OP_PLANS <= 0:
        return None
    device = kwargs["device"]
    stream = None
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        stream = stream_key(device)
    described = dict(kwargs)
    for name in METADATA:  # (isinstance on each argument would cost several us a call)
        t = described.get(name)
        if t is not None:
            described[name] = (t.data_ptr(), t.shape, t.stride(), t.dtype)
    return (tuple(described), tuple(described.values()), launch.switch_state(),
            launch.interpreting(), stream)


def varlen_attention(q, k, v, out, *, cu_seqlens_q, seqused_k, cu_seqlens_k, block_table,
                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                     window_right, softcap, alibi_slopes, sinks, q_descale, k_descale,
                     v_descale, softmax_lse, num_splits=0,
                     config: Optional[AttnConfig] = None, batch_invariant: bool = False) -> None:
    """Same contract as `pagedattn.ops.torch.varlen_attention`; `config` overrides the tiles.

    Plans the batch (`plan_for`: the kept plan where an earlier call made it) and runs it.
    num_splits: 0 chooses each pass's split-KV count (`launch.decode_config`,
    `launch.prefill_splits`: split only where the pass's programs cannot fill the SMs);
    n > 0 forces n splits in both the decode and the prefill pass. The result does not
    depend on it. batch_invariant: `plan_attention`'s.
    """
    paged = block_table is not None
    plan = plan_for(
        device=q.device, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
        cu_seqlens_k=cu_seqlens_k, block_table=block_table, batch=seqused_k.shape[0],
        total_q=q.shape[0], max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        num_heads=q.shape[1], num_kv_heads=k.shape[-2], head_size=q.shape[2],
        head_size_v=v.shape[-1], page_size=k.shape[1] if paged else 1, q_dtype=q.dtype,
        kv_dtype=k.dtype, out_dtype=out.dtype, softmax_scale=softmax_scale, causal=causal,
        window_left=window_left, window_right=window_right, softcap=softcap,
        use_alibi=alibi_slopes is not None, use_sinks=sinks is not None,
        use_q_descale=q_descale is not None,
        use_kv_descale=k_descale is not None or v_descale is not None,
        write_lse=softmax_lse is not None, num_splits=num_splits, config=config,
        batch_invariant=batch_invariant)
    plan.run(q, k, v, out, softmax_lse, alibi_slopes, sinks, q_descale, k_descale, v_descale)


def kept() -> int:
    """How many plans are kept now."""
    return len(_kept)


def clear() -> None:
    """Let every kept plan go (its scratch returns to PyTorch's allocator)."""
    _kept.clear()
