"""Running a `WrapperPlan`: cache views, fp8 scales, one provider call, FlashInfer's LSE.

Per call this does host-int shape checks and runs the provider's plan that plan() made
(`ops.plan`: Triton on CUDA, PyTorch elsewhere; configs, grids, splits and scratch decided
there): no planning, no host sync, and allocations only of a size the plan fixes (the output
when none is given), so a captured CUDA graph replays it.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from pagedattn.ops.flashinfer.plan import LOG2E, Cache, WrapperPlan

Scale = Union[float, torch.Tensor, None]


def cache_views(cache: Cache, layout: str, plan: WrapperPlan,
                memo: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`split_cache`, remembered per cache tensor (address, shape, strides, dtype) in `memo`,
    which the wrapper empties at every plan(): each layer runs the same cache every step, and
    making and checking the views costs more host time than the rest of run()."""
    parts = cache if isinstance(cache, (tuple, list)) else (cache,)
    if not all(isinstance(t, torch.Tensor) for t in parts):
        return split_cache(cache, layout, plan)  # raises, naming what it got
    key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in parts)
    views = memo.get(key)
    if views is None:
        views = split_cache(cache, layout, plan)
        if len(memo) >= 1024:
            memo.clear()
        memo[key] = views
    return views


def split_cache(cache: Cache, layout: str, plan: WrapperPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's paged cache -> logical [num_pages, page_size, num_kv_heads, head_dim] K and
    V views (no copy): one (num_pages, 2, ...) tensor or a (k_cache, v_cache) tuple, NHD or HND."""
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2 or any(not isinstance(c, torch.Tensor) or c.dim() != 4 for c in cache):
            raise ValueError("paged_kv_cache as a tuple must be (k_cache, v_cache), each 4-D")
        k, v = cache
    elif isinstance(cache, torch.Tensor) and cache.dim() == 5 and cache.shape[1] == 2:
        k, v = cache[:, 0], cache[:, 1]
    else:
        raise ValueError("paged_kv_cache must be a (num_pages, 2, ...) tensor or a (k_cache, "
                         f"v_cache) tuple; got {_describe(cache)}")
    if layout == "HND":  # (pages, heads, page_size, dim) -> the provider's token-major view
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    if k.dtype == torch.uint8 and plan.kv_dtype.itemsize == 1:  # fp8 kept as bytes
        k, v = k.view(plan.kv_dtype), v.view(plan.kv_dtype)
    page, heads = plan.page_size, plan.num_kv_heads
    for name, x, dim in (("k", k, plan.head_dim_qk), ("v", v, plan.head_dim_vo)):
        if tuple(x.shape[1:]) != (page, heads, dim):
            want = (page, heads, dim) if layout == "NHD" else (heads, page, dim)
            raise ValueError(f"paged_kv_cache {name} pages are {tuple(_in_layout(x, layout))}"
                             f" ({layout}); the plan expects {want}")
        if x.dtype != plan.kv_dtype:
            raise ValueError(f"paged_kv_cache has dtype {x.dtype}; the plan's kv_data_type is "
                             f"{plan.kv_dtype}")
    device = plan.seq_lens.device
    if k.device != device or v.device != device:
        raise ValueError(f"paged_kv_cache is on {k.device}; the plan is on {device} (the "
                         "workspace buffer's device)")
    if k.shape[0] != v.shape[0] or plan.max_page >= k.shape[0]:
        raise ValueError(f"the plan reads page {plan.max_page} but the cache has "
                         f"{min(k.shape[0], v.shape[0])} pages")
    return k, v


def _in_layout(x: torch.Tensor, layout: str) -> torch.Size:
    return x.shape[1:] if layout == "NHD" else x.permute(0, 2, 1, 3).shape[1:]


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def descales(k_scale: Scale, v_scale: Scale, plan: WrapperPlan, device: torch.device,
             scalars: dict, memo: dict) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Host float scales as [batch, num_kv_heads] views of device scalars made once per value
    (`scalars`), the views remembered per plan (`memo`), so repeated runs allocate nothing; a
    1-element float32 tensor is used as is."""
    if k_scale is None and v_scale is None:
        return None, None
    floats = not isinstance(k_scale, torch.Tensor) and not isinstance(v_scale, torch.Tensor)
    key = ("scales", k_scale, v_scale)
    if floats and key in memo:
        return memo[key]
    shape = (plan.seq_lens.shape[0], plan.num_kv_heads)
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, torch.Tensor):
            if s.numel() != 1 or s.dtype != torch.float32 or s.device != device:
                raise ValueError(f"{name} as a tensor must be one float32 value on {device}")
            out.append(s.reshape(1, 1).expand(shape))
            continue
        value = 1.0 if s is None else float(s)
        t = scalars.get(value)
        if t is None:
            t = scalars[value] = torch.full((1, 1), value, dtype=torch.float32, device=device)
        out.append(t.expand(shape))
    if floats:
        memo[key] = (out[0], out[1])
    return out[0], out[1]


def run_rows(plan: WrapperPlan, q: torch.Tensor) -> int:
    """The rows of q, checked: the planned batch's qo_indptr[-1] (FlashInfer's contract), or
    in CUDA-graph mode also the capacity the launches were sized for (a fixed buffer whose
    rows past the batch no request reads)."""
    rows = (plan.batch_q, plan.total_q)
    if q.dim() == 3 and q.shape[0] in rows and \
            tuple(q.shape[1:]) == (plan.num_qo_heads, plan.head_dim_qk):
        return q.shape[0]
    want = f"[{plan.batch_q}, {plan.num_qo_heads}, {plan.head_dim_qk}]"
    if plan.cuda_graph and plan.total_q != plan.batch_q:
        want += f" or, CUDA-graph mode, the buffers' [{plan.total_q}, ...]"
    raise ValueError(f"q has shape {tuple(q.shape)}; the plan expects [qo_indptr[-1], "
                     f"num_qo_heads, head_dim] = {want}")


def launch(plan: WrapperPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           out: Optional[torch.Tensor], k_descale: Optional[torch.Tensor],
           v_descale: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
           write_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention of q over the plan's pages into `out` (allocated when None). Returns out and,
    with write_lse, the natural-log LSE [num_qo_heads, rows of q]: a view of plan.lse, valid
    until the next run of this plan."""
    rows = run_rows(plan, q)
    if q.dtype != plan.q_dtype or q.device != plan.seq_lens.device:
        raise ValueError(f"q is {q.dtype} on {q.device}; the plan's q_data_type is "
                         f"{plan.q_dtype}, its device {plan.seq_lens.device}")
    out_shape = (rows, plan.num_qo_heads, plan.head_dim_vo)
    if out is None:
        out = q.new_empty(out_shape)
    elif tuple(out.shape) != out_shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; expected "
                         f"{q.dtype} {out_shape} on {q.device} (the rows of q)")
    if sinks is not None and tuple(sinks.shape) != (plan.num_qo_heads,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; expected "
                         f"[num_qo_heads] = [{plan.num_qo_heads}]")
    launch, v_scale = plan.launch, None
    if k_descale is not None and plan.kv_dtype.itemsize != 1:
        # Scales of a 16-bit cache: FlashInfer folds k_scale into the scores' scale and
        # v_scale into the output; here around the plan's launch (made without descales).
        q, v_scale = q * k_descale[0, 0], v_descale[0, 0]
        k_descale = v_descale = None
    q_run, out_run = q, out
    if plan.cuda_graph:
        if plan.seq_lens.is_cuda and torch.cuda.is_current_stream_capturing():
            launch.captured = True  # the graph keeps the launch's scratch: so does the wrapper
        # FlashInfer's CUDA-graph callers pass views of fixed buffers cut to each plan's rows,
        # and its graphs replay any later batch up to the latch through them. Where q and out
        # are such views, the capacity's launch runs over the whole buffers (reading and
        # writing only the planned rows, which the Triton kernels find through the buffers'
        # query offsets), so a graph captured here replays the same way.
        if rows < plan.total_q and launch.plan.provider == "triton":
            q_all, out_all = buffer_rows(q, plan.total_q), buffer_rows(out, plan.total_q)
            if q_all is not None and out_all is not None:
                q_run, out_run = q_all, out_all
    # plan.lse [heads, total_q]: the rows the launch writes (its kernels index it by total_q)
    lse = plan.lse[:, :q_run.shape[0]] if write_lse else None
    launch.plan.provider_plan.run(q_run, k, v, out_run, lse, None, sinks, None, k_descale,
                                  v_descale)
    if v_scale is not None:
        out.mul_(v_scale)
    return out, None if lse is None else lse[:, :rows]


def buffer_rows(x: torch.Tensor, rows: int) -> Optional[torch.Tensor]:
    """x [n, ...] as [rows, ...] over the same storage (the fixed buffer behind a view of its
    first n rows), or None where the storage ends sooner or the strides do not allow it."""
    if any(st < 0 for st in x.stride()) or x.stride(0) == 0 or 0 in x.shape[1:]:
        return None
    last = x.storage_offset() + (rows - 1) * x.stride(0) + sum(
        (n - 1) * st for n, st in zip(x.shape[1:], x.stride()[1:]))
    if last >= x.untyped_storage().nbytes() // x.element_size():
        return None
    return x.as_strided((rows, *x.shape[1:]), x.stride())


def base2_lse(natural: torch.Tensor, lse: Optional[torch.Tensor]) -> torch.Tensor:
    """[num_heads, total_q] natural-log LSE -> FlashInfer's [total_q, num_heads] base 2."""
    shape = (natural.shape[1], natural.shape[0])
    if lse is None:
        lse = natural.new_empty(shape)
    elif tuple(lse.shape) != shape or lse.dtype != torch.float32:
        raise ValueError(f"lse is {lse.dtype} {tuple(lse.shape)}; expected float32 "
                         f"[total_q, num_qo_heads] = {list(shape)}")
    return torch.mul(natural.T, LOG2E, out=lse)
