"""A step's Triton plans for one layer: its cache write and attention, run with only the
call's own tensors read.

`TritonAttentionPlan.run` reads every tensor it gets on every call: strides, dtypes and
pointers of the query, the output, the caches, ALiBi slopes, sinks and descales, then builds
the layer's argument section by name (`LayerArgs`) and the call key; the cache write's `run`
does the same for its caches and scales. For a layer that runs the same plans step after
step (decode steps share their plans, and so do steps of one size), all but the query, the
output and the new rows are the same each call: `plan_layer` reads them once
(`TritonAttentionPlan.plan_layer`, `TritonCacheWritePlan.plan_layer`), and the layer's
`TritonLayerPlan.run` checks only the call's tensors and launches. The portable passes and
the Gluon passes are planned so (the Hopper `tl` pass builds host descriptors of each call's
tensors), for 2-D rows (the layer's) and no LSE: the Gluon prefill pass, the Gluon decode
pass (`GluonDecodeLaunch.plan_layer`) or both (`GluonLayerPlans`), before the `tl` launches,
as `run` orders them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedattn.ops.triton.attention_args import LayerArgs, Outputs
from pagedattn.ops.triton.cache_write import LayerWrite

# The per-call fields of the layer's section: the output and LSE, the query, its row stride.
_Q = LayerArgs._fields.index("Q")
_STRIDE_QT = LayerArgs._fields.index("stride_qt")
assert Outputs._fields == LayerArgs._fields[:_Q], "the layer's section starts with Outputs"


class LayerAttention:
    """A `TritonAttentionPlan` for one layer's caches and per-layer tensors
    (`TritonAttentionPlan.plan_layer`): the launches with what each takes after the query,
    and the Gluon pass planned for the layer (`gluon_launch.GluonLayerPlan`, the decode
    pass's `gluon_decode_layer.DecodeLayerPlan`, or both: `GluonLayerPlans`), which runs
    first, as `run` does."""

    def __init__(self, launches: tuple, layer_args: Optional[LayerArgs], call_key_tail: tuple,
                 q_dtype: torch.dtype, out_dtype: torch.dtype, gluon: Any = None):
        """launches: the plan's `PassLaunch`es; layer_args: the layer's section built by name
        with this layer's tensors and strides (its Out, Lse, Q and stride_qt unused; None
        without launches); call_key_tail: the plan's call key after the query's row
        stride."""
        self.q_dtype, self.out_dtype, self.call_key_tail = q_dtype, out_dtype, call_key_tail
        self.gluon = gluon
        self.inputs = () if layer_args is None else layer_args[_Q + 1:_STRIDE_QT]
        strides = () if layer_args is None else layer_args[_STRIDE_QT + 1:]
        # Per pass: (launch, whether it reduces splits, the plan's partial states or None,
        # what follows the query's row stride): a reduce pass takes the outputs, then its
        # batch section; a split pass writes the partial states instead of the outputs.
        self.passes = tuple(
            (launch, launch.name == "reduce", launch.partials,
             launch.batch if launch.name == "reduce" else strides + launch.batch)
            for launch in launches)


class GluonLayerPlans:
    """The Gluon prefill pass's and the Gluon decode pass's layer plans of one step, run in
    `run`'s order (prefill, then decode: disjoint tokens), as one Gluon plan of the layer."""

    def __init__(self, *plans: Any):
        self.plans = plans

    def call_args(self, query: torch.Tensor, output: torch.Tensor,
                  key: Optional[torch.Tensor], value: Optional[torch.Tensor]
                  ) -> Optional[tuple]:
        """Each plan's part of the call's arguments, or None where one leaves it to `run`."""
        parts = tuple(p.call_args(query, output, key, value) for p in self.plans)
        return None if any(part is None for part in parts) else parts

    def run(self, parts: tuple) -> None:
        """Launch each plan with its part (`call_args`), in order."""
        for plan, part in zip(self.plans, parts):
            plan.run(part)


class TritonLayerPlan:
    """One layer's cache write (or none) and attention for a step (`plan_layer`)."""

    def __init__(self, write: Optional[LayerWrite], attend: LayerAttention, num_tokens: int):
        self.write, self.num_tokens, self.gluon = write, num_tokens, attend.gluon
        self.q_dtype, self.out_dtype = attend.q_dtype, attend.out_dtype
        self.call_key_tail, self.inputs, self.passes = (
            attend.call_key_tail, attend.inputs, attend.passes)

    def run(self, query: torch.Tensor, key: Optional[torch.Tensor],
            value: Optional[torch.Tensor], output: torch.Tensor) -> bool:
        """Write key / value [T, H_kv * D(v)] into the cache, then attend query [T, H * D]
        into output [T, H * Dv], where T is the planned token count, every tensor 2-D rows
        of unit column stride and the planned dtype, 16-byte aligned, output contiguous
        (and the new rows so too where the Gluon pass reads them). Anything else returns
        False having launched nothing: the plans' own `run` takes it."""
        qs = query.stride()
        if query.shape[0] != self.num_tokens or len(qs) != 2 or qs[1] != 1 or \
                query.dtype is not self.q_dtype or output.dtype is not self.out_dtype or \
                not output.is_contiguous() or (query.data_ptr() | output.data_ptr()) % 16:
            return False
        gluon = None
        if self.gluon is not None:  # its checks of the query, output and new rows
            gluon = self.gluon.call_args(query, output, key, value)
            if gluon is None:
                return False
        write = self.write
        if write is not None:
            if key is None:
                return False
            ks, vs = key.stride(), value.stride()
            if key.shape[0] < write.num_slots or len(ks) != 2 or len(vs) != 2 or \
                    ks[1] != 1 or vs[1] != 1 or value.dtype is not key.dtype or \
                    (key.data_ptr() | value.data_ptr()) % 16:
                return False
            ks, vs = (ks[0], write.head_size, 1), (vs[0], write.head_size_v, 1)
            write.launch((key, value) + write.tensors + (ks[0], ks[1], vs[0], vs[1])
                         + write.cache_strides, (key.dtype, ks, vs) + write.key_tail)
        if gluon is not None:
            self.gluon.run(gluon)
        row = (qs[0],)
        call_key = row + self.call_key_tail
        for launch, reduce, partials, tail in self.passes:
            if reduce:
                launch((output, None) + tail, call_key)
            else:
                launch((partials or (output, None)) + (query,) + self.inputs + row + tail,
                       call_key)
        return True


def plan_layer(attend: Any, write: Any, key_cache: torch.Tensor, value_cache: torch.Tensor,
               k_scale: torch.Tensor, v_scale: torch.Tensor,
               alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
               q_descale: Optional[torch.Tensor], k_descale: Optional[torch.Tensor],
               v_descale: Optional[torch.Tensor], num_tokens: int
               ) -> Optional[TritonLayerPlan]:
    """A `TritonAttentionPlan` and its `TritonCacheWritePlan` (or None) for one layer's
    caches and tensors (`ops.plan.plan_layer`); None where either plan must take every call
    itself."""
    attention = attend.plan_layer(key_cache, value_cache, alibi_slopes, sinks, q_descale,
                                  k_descale, v_descale)
    writing = None if write is None else write.plan_layer(key_cache, value_cache, k_scale,
                                                          v_scale)
    if attention is None or (write is not None and writing is None):
        return None
    return TritonLayerPlan(writing, attention, num_tokens)
