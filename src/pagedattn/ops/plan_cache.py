"""Recently made plans, for callers of `flash_attn_varlen_func` that do not plan themselves.

An engine that calls the public op once per layer passes the same batch tensors (the builder's
persistent buffers) with the same host ints every layer of a step, and often for several
steps. Planning costs more host time than running a plan, so the op looks its plan up here
first. The key is every planning argument, with each tensor by address, shape, strides and
dtype: a plan reads its tensors' memory when it runs, never their values at planning time, so
any tensor over the same memory serves. The cached plans keep their tensors alive, so an
address cannot be reused by other data while its plan is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from pagedattn.ops.plan import VarlenAttentionPlan, plan_varlen_attention
from pagedattn.ops.providers import provider_name

MAX_PLANS = 8  # a plan may hold split-KV scratch: keep only the last few
_plans: OrderedDict[tuple, VarlenAttentionPlan] = OrderedDict()


def cached_plan_varlen_attention(**kwargs: Any) -> VarlenAttentionPlan:
    """`plan_varlen_attention(**kwargs)`, reused while the same arguments come back."""
    device = kwargs["cu_seqlens_q"].device
    key = (provider_name(device), device, *[
        (v.data_ptr(), v.shape, v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v
        for v in kwargs.values()])
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = plan_varlen_attention(**kwargs)
        if len(_plans) > MAX_PLANS:
            _plans.popitem(last=False)
    return plan
