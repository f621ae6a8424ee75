"""A planned attention bound to one layer's caches and per-layer tensors.

`TritonAttentionPlan.run` reads every tensor it gets on every call: strides, dtypes and
pointers of the query, the output, the caches, ALiBi slopes, sinks and descales, then builds
the layer's argument section by name (`LayerArgs`) and the call key. For a layer that runs
the same plan step after step (decode steps share their plans, and so do steps of one size),
all but the query, the output and the new rows are the same each call:
`TritonAttentionPlan.bind` reads them once, and a call of the `BoundAttention` checks only
its own tensors (`prepare`) and launches (`launch`). The portable passes and the Gluon pass
are bound (the Hopper `tl` pass builds host tensor descriptors of each call's tensors), only
for 2-D rows (the layer's), and no LSE.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedattn.ops.triton.attention_args import LayerArgs, Outputs

# The per-call fields of the layer's section: the output and LSE, the query, its row stride.
_Q = LayerArgs._fields.index("Q")
_STRIDE_QT = LayerArgs._fields.index("stride_qt")
assert Outputs._fields == LayerArgs._fields[:_Q], "the layer's section starts with Outputs"


class BoundAttention:
    """Launches of one plan for one layer: `prepare(q, out, k_new, v_new)`, then
    `launch(prepared)` per call (see the module doc)."""

    def __init__(self, launches: tuple, layer_args: Optional[LayerArgs], call_key_tail: tuple,
                 q_dtype: torch.dtype, out_dtype: torch.dtype, gluon: Any = None):
        """launches: the plan's `PassLaunch`es; layer_args: the layer's section built by name
        with this layer's tensors and strides (its Out, Lse, Q and stride_qt unused; None
        without launches); call_key_tail: the plan's call key after the query's row stride;
        gluon: the plan's Gluon launch bound to the layer (`gluon_launch.BoundGluon`), run
        first, as `run` does."""
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

    def prepare(self, q: torch.Tensor, out: torch.Tensor, k_new: Optional[torch.Tensor] = None,
                v_new: Optional[torch.Tensor] = None) -> Optional[tuple]:
        """(q, out, q's row stride, the Gluon launch's part) where q [T, H * D] and out
        [T, H * Dv] are rows this binding takes (unit column stride, the planned dtypes,
        16-byte aligned, out contiguous) and so are the new rows k_new / v_new where the
        Gluon pass reads them; else None, and the plan's `run` takes the call."""
        if self.gluon is not None:  # its checks of q and out hold these below, and more
            gluon = self.gluon.prepare(q, out, k_new, v_new)
            return None if gluon is None else (q, out, q.stride(0), gluon)
        qs = q.stride()
        if len(qs) != 2 or qs[1] != 1 or q.dtype is not self.q_dtype or \
                out.dtype is not self.out_dtype or not out.is_contiguous() or \
                (q.data_ptr() | out.data_ptr()) % 16:
            return None
        return q, out, qs[0], None

    def launch(self, prepared: tuple) -> None:
        """Launch for a call that `prepare` accepted (it gave `prepared`)."""
        q, out, row_stride, gluon = prepared
        if gluon is not None:
            self.gluon.launch(gluon)
        row = (row_stride,)
        key = row + self.call_key_tail
        for launch, reduce, partials, tail in self.passes:
            if reduce:
                launch((out, None) + tail, key)
            else:
                launch((partials or (out, None)) + (q,) + self.inputs + row + tail, key)
