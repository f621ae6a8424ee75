"""The Triton provider: CUDA kernels (and the CPU under TRITON_INTERPRET=1, for tests).

The provider functions have the signatures of `pagedattn.ops.torch`: `varlen_attention`
(op_plans.py), `reshape_and_cache` (cache_write.py), `merge_attn_states` (merge.py);
the block-sparse and DCP ops import `blocksparse` and `context_parallel` themselves.

The attention family is cut by reason to change, kernels apart from their host side:
- tile_math.py: the math every kernel here shares (LOG2E, the online-softmax step, the
  empty-row / LSE epilogue, the LSE merge weights, the program -> sequence search);
- tile_loop.py: the key-tile loop of the three attention passes, and their key ranges;
- attention.py (the decode and portable prefill passes, one kernel), attention_hopper.py
  (the Hopper prefill pass), reduce.py (the split-KV reduce): kernels, no host code but the
  reduce's own launcher;
- attention_args.py (the kernels' arguments by name), launch.py (tiles, split counts and
  switches), attention_plan.py (`plan_attention`, `TritonAttentionPlan.run`), op_plans.py (the
  provider function `varlen_attention` and the plans it keeps for the calls after the
  first), pass_launch.py (one planned pass), layer_plan.py (a step's
  cache write and attention planned for one layer's caches and tensors: `TritonLayerPlan.run`
  reads only the call's own), fast_launch.py (launches without re-specialising);
- batch-invariant mode (issue 44): invariant.py (its fixed splits, their fold and the fold
  kernel, and `fold_own_splits` for split programs that fold their own splits; the pass
  itself is attention.py's `invariant_attention_kernel` and `invariant_self_fold_kernel`),
  invariant_config.py (its tiles, splits and arithmetic, from launch.py's switches),
  invariant_plan.py (its launches), gluon_invariant.py (the Gluon prompt consumer),
  gluon_invariant_tile.py (the Gluon kernels' per-tile step), gluon_invariant_fold.py (their
  split fold), gluon_decode_fold.py (the Gluon
  decode kernel's self-folding split programs), matmul.py and row_mean.py (a matmul and a
  mean whose rows do not depend on the others, for the model-op overrides of
  `integrations/batch_invariant_ops.py`).
The Gluon prefill pass (issue 23; Gluon, not `tl`, so it has its own math) is
attention_gluon.py (plan), gluon_launch.py (launch), gluon_prefill.py (the kernel: shared
memory, barriers, partitions), gluon_consumer.py, gluon_producer.py and gluon_convert.py (the
partitions), gluon_softmax.py (the consumers' online softmax), gluon_operands.py (how Q, P and
V enter their wgmmas), gluon_schedule.py (the schedule they share) and gluon_args.py (the
structures they take). The smaller kernels sit beside
their launchers: cache_write.py, merge.py, context_parallel.py, blocksparse.py and
blocksparse_decode.py (which share tile_math and reduce.py).
"""

from pagedattn.ops.triton.cache_write import reshape_and_cache
from pagedattn.ops.triton.merge import merge_attn_states
from pagedattn.ops.triton.op_plans import varlen_attention

__all__ = ["merge_attn_states", "reshape_and_cache", "varlen_attention"]
