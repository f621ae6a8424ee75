"""Shared test helpers: random paged batches, poisoned outputs, tolerances per dtype."""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import reference as ref

# Tolerances against the float64 oracle (DESIGN.md): fp32 ~1e-5, half types ~1e-2 relative.
TOLERANCE = {
    torch.float32: dict(atol=3e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
FP8_TOLERANCE = dict(atol=0.15, rtol=0.1)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32,
                 **tol) -> None:
    """actual (any dtype) against a float64 reference; NaN (an unwritten poisoned element)
    always fails."""
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    assert not torch.isnan(actual).any(), "output has NaN: an element was not written"
    torch.testing.assert_close(actual, expected, **(tol or TOLERANCE[dtype]))


def assert_within_fp8_p_bound(actual: torch.Tensor, expected: torch.Tensor,
                              mean_abs_v: torch.Tensor, rel: float, atol: float,
                              rtol: float) -> None:
    """An fp8 P V's outputs against the float64 oracle: P rounded to e4m3 puts each weight
    within `rel` of itself (2^-4), so each output lies within rel x the oracle's weighted
    mean of |V| (`mean_abs_v`: the oracle over |V|) beyond atol + rtol x |expected|; NaN (an
    unwritten poisoned element) always fails."""
    err = (actual.detach().cpu().double() - expected).abs()
    assert not torch.isnan(err).any(), "output has NaN: an element was not written"
    limit = rel * mean_abs_v + atol + rtol * expected.abs()
    assert (err <= limit).all(), f"{int((err > limit).sum())} outputs past fp8 P's bound"


def assert_same_but(on: dict, off: dict, *changed: str) -> None:
    """Two launches' constexprs equal but for the named ones: a switch reached its own
    constexprs and nothing else."""
    assert {k: v for k, v in on.items() if k not in changed} == \
        {k: v for k, v in off.items() if k not in changed}


def poison(shape: Sequence[int], dtype: torch.dtype, device="cpu") -> torch.Tensor:
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


def randn(*shape, dtype=torch.float32, device="cpu", generator=None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)


@dataclass
class PagedBatch:
    """A random batch over a paged cache whose blocks are scattered (shuffled)."""

    query_lens: list[int]
    seq_lens: list[int]
    q: torch.Tensor  # [total_q, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] logical view
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, Dv]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    seqused_k: torch.Tensor  # [num_reqs] int32

    @property
    def total_q(self) -> int:
        return sum(self.query_lens)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seq_lens, default=0)

    def plan_args(self, **overrides) -> dict:
        """`plan_attention`'s keyword arguments for this batch: its lengths, block table,
        head counts and sizes, page size and dtypes (out: q's), scale 1/sqrt(head size),
        causal, no window, softcap, alibi, sinks, descales or LSE; `overrides` replace any."""
        head_size = self.q.shape[2]
        return dict(
            device=self.q.device, cu_seqlens_q=self.cu_seqlens_q, seqused_k=self.seqused_k,
            cu_seqlens_k=None, block_table=self.block_table, batch=len(self.query_lens),
            total_q=self.total_q, max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
            num_heads=self.q.shape[1], num_kv_heads=self.k_cache.shape[2], head_size=head_size,
            head_size_v=self.v_cache.shape[3], page_size=self.k_cache.shape[1],
            q_dtype=self.q.dtype, kv_dtype=self.k_cache.dtype, out_dtype=self.q.dtype,
            softmax_scale=head_size ** -0.5, causal=True, window_left=-1, window_right=-1,
            softcap=0.0, use_alibi=False, use_sinks=False, use_q_descale=False,
            use_kv_descale=False, write_lse=False) | overrides


def gluon_sm90() -> bool:
    """Whether the Gluon passes run here: an sm_90 GPU and Triton 3.6's Gluon (Gluon has no
    interpreter, so they run nowhere else)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    from pagedattn.ops.triton.attention_gluon import gluon_available
    return gluon_available()


def needs_gluon_sm90() -> pytest.MarkDecorator:
    """The skip mark of a test that runs a Gluon pass (see `gluon_sm90`)."""
    return pytest.mark.skipif(not gluon_sm90(),
                              reason="needs an sm_90 GPU and Triton 3.6's Gluon")


def plan_as_on_sm90(monkeypatch) -> None:
    """The planners as on an H200 with Triton 3.6's Gluon, on any machine: not interpreting,
    sm_90, 132 SMs (the tiles, device checks and split counts a GPU plan takes)."""
    from pagedattn.ops.triton import attention_gluon, launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    monkeypatch.setattr(attention_gluon, "_sm90", lambda device: True)
    monkeypatch.setattr(attention_gluon, "_sm_count", lambda device: 132)
    monkeypatch.setattr(attention_gluon, "gluon_available", lambda: True)


def served_by(monkeypatch, module, name: str) -> list:
    """Spies on the planner `module.name`: the list gets, per call, whether it served (a
    result other than None)."""
    served = []
    real = getattr(module, name)

    def spy(**kwargs):
        result = real(**kwargs)
        served.append(result is not None)
        return result

    monkeypatch.setattr(module, name, spy)
    return served


def cu_seqlens(lens: Sequence[int], device="cpu") -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(list(lens), dtype=torch.int32), 0)
    return out.to(device)


def scattered_block_table(seq_lens: Sequence[int], block_size: int, num_blocks: int,
                          generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Each request gets distinct random blocks; unused entries point at block 0."""
    need = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    perm = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros(len(seq_lens), max(need, default=1), dtype=torch.int32)
    start = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[start:start + n].to(torch.int32)
        start += n
    return table


def make_paged_batch(query_lens: Sequence[int], seq_lens: Sequence[int], num_heads: int,
                     num_kv_heads: int, head_size: int, block_size: int = 16,
                     dtype: torch.dtype = torch.float32, head_size_v: Optional[int] = None,
                     layout: str = "NHD", cache_dtype: Optional[torch.dtype] = None,
                     device="cpu", seed: int = 0, spare_blocks: int = 3) -> PagedBatch:
    g = torch.Generator().manual_seed(seed)
    head_size_v = head_size_v or head_size
    num_blocks = sum(max(1, math.ceil(s / block_size)) for s in seq_lens) + spare_blocks
    table = scattered_block_table(seq_lens, block_size, num_blocks, g)

    def cache(d: int) -> torch.Tensor:
        x = torch.randn(num_blocks, block_size, num_kv_heads, d, generator=g)
        x = x.to(cache_dtype or dtype)
        if layout == "HND":  # heads before tokens in memory; same logical view
            x = x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        return x.to(device)

    return PagedBatch(
        list(query_lens), list(seq_lens),
        q=randn(sum(query_lens), num_heads, head_size, dtype=dtype, device=device, generator=g),
        k_cache=cache(head_size), v_cache=cache(head_size_v), block_table=table.to(device),
        cu_seqlens_q=cu_seqlens(query_lens, device),
        seqused_k=torch.tensor(list(seq_lens), dtype=torch.int32, device=device))


@pytest.fixture(autouse=True)
def _fresh_env(monkeypatch):
    """No test inherits another's backend or provider choice."""
    for var in ("PAGEDATTN_ATTENTION_BACKEND", "PAGEDATTN_OPS_PROVIDER",
                "PAGEDATTN_KV_CACHE_LAYOUT"):
        monkeypatch.delenv(var, raising=False)
    yield
    _let_kept_op_plans_go()


def _let_kept_op_plans_go() -> None:
    """The Triton op keeps its last plans (ops/triton/op_plans.py): a test that patches a
    planner's internals (not a switch, which is in their key) starts without them."""
    import sys

    op_plans = sys.modules.get("pagedattn.ops.triton.op_plans")
    if op_plans is not None:
        op_plans.clear()


# --- Triton kernels on a CPU ---------------------------------------------------------------
# triton.jit decides at definition time whether a kernel is interpreted, so the interpreter must
# be switched on before any test module imports pagedattn.ops.triton.
def _interpret_triton_without_cuda() -> None:
    import os

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_cuda()


def _share_cores_between_xdist_workers() -> None:
    """Under `pytest -n N` each worker gets its share of the cores: N processes with a thread
    per core each oversubscribe the host, and the host-side parts of the GPU tests (the
    oracle's gathers, the comparisons) slowed past a minute each on a 16-core machine."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_cores_between_xdist_workers()


def _cpu_thread_policy():
    """On a machine without a GPU and outside xdist, each test runs on the threads
    pagedattn's policy chooses (the cores other processes leave free, measured): torch's
    thread per core made the suite 1.8x slower while another process kept one of 2 cores
    busy (issue 43), each parallel op waiting for the thread on the busy core."""
    import os

    from pagedattn.cpu_threads import ThreadPolicy

    if torch.cuda.is_available() or int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        return None
    return ThreadPolicy()


_THREADS = _cpu_thread_policy()


@pytest.fixture(autouse=True)
def _cpu_threads():
    if _THREADS is None:
        yield
        return
    with _THREADS.applied():
        yield


# --- a GPU test that never ends ends its worker ----------------------------------------------
def watchdog_seconds() -> float:
    """PAGEDATTN_TEST_WATCHDOG_S (seconds, default 150; 0 turns it off): how long a `cuda` test
    may run before faulthandler prints every thread's stack and ends the process."""
    import os

    raw = os.environ.get("PAGEDATTN_TEST_WATCHDOG_S", "150")
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"PAGEDATTN_TEST_WATCHDOG_S={raw!r} is not a number of seconds") from None
    if seconds < 0:
        raise ValueError(f"PAGEDATTN_TEST_WATCHDOG_S={raw!r} must be >= 0 (0: off)")
    return seconds


@pytest.fixture(autouse=True)
def _gpu_watchdog(request):
    """pytest-timeout's thread method is a Python thread: it needs the GIL, and a test stuck
    in a C call that holds it (a launch blocked behind a kernel that never ends) starves it;
    the GPU suite then stalled with one test unreported (KERNEL_NOTES v47). faulthandler's
    watchdog is a C thread: it exits without the GIL, so xdist reports the crashed worker's
    test by name and the suite goes on. Its stacks go to PAGEDATTN_TEST_WATCHDOG_DIR/<worker>
    .log where that is set (pytest captures the test's stderr, lost with the process)."""
    seconds = watchdog_seconds()
    if seconds == 0 or request.node.get_closest_marker("cuda") is None:
        yield
        return
    import faulthandler
    import os
    import sys

    folder = os.environ.get("PAGEDATTN_TEST_WATCHDOG_DIR")
    log = sys.stderr
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        log = open(os.path.join(folder, f"watchdog-{worker}.log"), "w")
        log.write(f"{request.node.nodeid}: stuck past {seconds:.0f} s\n")
        log.flush()
    faulthandler.dump_traceback_later(seconds, exit=True, file=log)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if log is not sys.stderr:  # emptied: a file left with text names a stuck test
            log.truncate(0)
            log.close()


# --- hypothesis profiles --------------------------------------------------------------------
def _load_hypothesis_profile() -> None:
    """HYPOTHESIS_PROFILE=gpu: the GPU fuzzing run (tests/test_property.py, its budget and
    configurations there). No example database (the GPU machine starts bare each time) and no
    shrinking: a failure prints its example and the blob to reproduce it, and shrinking on a
    GPU would spend the call's minutes recompiling nothing new. Other names are hypothesis's."""
    import os

    try:
        from hypothesis import HealthCheck, Phase, settings
    except ImportError:  # a GPU machine without the test extras runs the rest
        return
    settings.register_profile(
        "gpu", deadline=None, database=None, print_blob=True,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    name = os.environ.get("HYPOTHESIS_PROFILE")
    if name:
        settings.load_profile(name)


_load_hypothesis_profile()


# --- running Attention layers over a paged cache, step by step ---------------------------
def scattered_allocator(num_blocks: int, seed: int = 0):
    """A BlockAllocator that hands out blocks in a random order (scattered block tables)."""
    from pagedattn import BlockAllocator

    allocator = BlockAllocator(num_blocks)
    blocks = allocator.allocate(num_blocks)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    allocator.free([blocks[i] for i in order.tolist()])
    return allocator


def layer_features(layer) -> dict:
    """The oracle's keyword arguments for what `layer` is configured with."""
    impl = layer.impl
    window = getattr(impl, "sliding_window", None)
    mask = {} if getattr(impl, "blocksparse_params", None) is None else dict(
        head_mask=blocksparse_head_mask(impl))
    return dict(**mask,
        scale=impl.scale,
        window=tuple(window) if isinstance(window, tuple) else (-1, -1),
        softcap=float(getattr(impl, "logits_soft_cap", 0.0) or 0.0),
        alibi_slopes=None if impl.alibi_slopes is None else impl.alibi_slopes.tolist(),
        sinks=None if getattr(impl, "sinks", None) is None else impl.sinks.float().tolist())


def blocksparse_head_mask(impl):
    """The oracle's head_mask(h, q_pos, k_pos) for a BLOCK_SPARSE_FLASH_ATTN layer."""
    p, group = impl.blocksparse_params, impl.num_heads // impl.num_kv_heads

    def mask(h, q_pos, k_pos):
        offset = ref.blocksparse_offset(p.active_head_range[0] + h, group, p.head_sliding_step)
        return ref.blocksparse_visible(q_pos, k_pos, offset=offset, block_size=p.block_size,
                                       local_blocks=p.local_blocks, vert_stride=p.vert_stride)

    return mask


def cached(x: torch.Tensor, layer, scale: float) -> torch.Tensor:
    """x as the layer's cache holds it (quantized for fp8 caches), in float64."""
    from pagedattn.config import kv_cache_torch_dtype

    dtype = kv_cache_torch_dtype(layer.kv_cache_dtype, x.dtype)
    return ref.dequantize(ref.quantize_for_cache(x, dtype, scale), scale) \
        if dtype in ref.FP8_MAX else x.double()


class LayerRunner:
    """Feeds batches of new tokens through Attention layers over a shared paged cache and
    keeps every token's K/V so the oracle can recompute each step from scratch."""

    def __init__(self, layers: dict, num_blocks: int = 64, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0,
                 engine_config=None):
        from pagedattn import AttentionSpec, BlockTable
        from pagedattn.kv_cache import allocate_kv_caches, bind_kv_cache

        self.layers, self.dtype, self.device = layers, dtype, device
        self.block_size = block_size
        self.table = BlockTable(scattered_allocator(num_blocks, seed), block_size)
        self.caches = allocate_kv_caches(layers, num_blocks, device, dtype)
        bind_kv_cache(self.caches, layers)
        first = next(iter(layers.values()))
        spec = AttentionSpec(block_size, first.num_kv_heads, first.head_size, dtype,
                             first.kv_cache_dtype)
        self.builder = first.attn_backend.get_builder_cls()(
            spec, list(layers), engine_config, torch.device(device))
        self.generator = torch.Generator().manual_seed(seed)
        self.history: dict[object, dict[str, list]] = {}

    def metadata(self, req_ids, query_lens, common_prefix_len: int = 0):
        from pagedattn import CommonAttentionMetadata

        for r, n in zip(req_ids, query_lens):
            if r not in self.table.blocks:
                self.table.add_request(r)
            self.table.append_tokens(r, n)
        seq_lens = [self.table.num_tokens[r] for r in req_ids]
        common = CommonAttentionMetadata.from_lengths(
            query_lens, seq_lens, self.table.tensor(req_ids), self.block_size, self.device)
        return self.builder.build(common_prefix_len, common), seq_lens

    def step(self, req_ids, query_lens, common_prefix_len: int = 0, inputs=None):
        """One forward of every layer; returns {name: (output, expected float64)}."""
        from pagedattn import set_forward_context

        md, seq_lens = self.metadata(req_ids, query_lens, common_prefix_len)
        total = sum(query_lens)
        results = {}
        with set_forward_context(md):
            for name, layer in self.layers.items():
                h, hk, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_size, \
                    layer.head_size_v
                q, k, v = inputs[name] if inputs else (
                    randn(total, h * d, dtype=self.dtype, generator=self.generator),
                    randn(total, hk * d, dtype=self.dtype, generator=self.generator),
                    randn(total, hk * dv, dtype=self.dtype, generator=self.generator))
                out = layer(q.to(self.device), k.to(self.device), v.to(self.device))
                results[name] = (out.view(total, h, dv),
                                 self._expected(name, layer, req_ids, query_lens, q, k, v))
        return results

    def _expected(self, name, layer, req_ids, query_lens, q, k, v):
        hist_name = layer.kv_sharing_target_layer_name or name
        hk, d, dv = layer.num_kv_heads, layer.head_size, layer.head_size_v
        outs, start = [], 0
        # BLOCK_SPARSE_FLASH_ATTN runs a prompt over its own new keys and values (vLLM's v0
        # prefill), not over what an fp8 cache then holds; later steps read the cache.
        prompt_reads_new_kv = getattr(layer.impl, "blocksparse_params", None) is not None
        for r, n in zip(req_ids, query_lens):
            hist = self.history.setdefault((hist_name, r), {"k": [], "v": []})
            prompt = not hist["k"]
            new_k, new_v = k[start:start + n].view(n, hk, d), v[start:start + n].view(n, hk, dv)
            if layer.kv_sharing_target_layer_name is None:
                hist["k"].append(cached(new_k, layer, layer._k_scale_float))
                hist["v"].append(cached(new_v, layer, layer._v_scale_float))
            keys, values = torch.cat(hist["k"]), torch.cat(hist["v"])
            if prompt and prompt_reads_new_kv:
                keys, values = new_k.double(), new_v.double()
            qr = q[start:start + n].view(n, layer.num_heads, d)
            if layer.query_quant_dtype is not None:
                qr = cached(qr, layer, layer._q_scale_float)
            o, _ = ref.attend_one_sequence(qr, keys, values, causal=True, **layer_features(layer))
            outs.append(o)
            start += n
        return torch.cat(outs)

    def finish(self, req_id) -> None:
        self.table.free_request(req_id)


def make_layers(backend, n: int = 1, num_heads: int = 8, num_kv_heads: int = 2,
                head_size: int = 64, block_size: int = 16, cache_dtype: str = "auto",
                dtype: torch.dtype = torch.float32, **kwargs) -> dict:
    """n Attention layers "layers.{i}.attn" on `backend`, built in their own model scope with
    `dtype` as the default dtype (which the layer takes as the model's)."""
    from pagedattn import Attention, CacheConfig, model_scope

    torch.set_default_dtype(dtype)
    try:
        with model_scope():
            return {f"layers.{i}.attn": Attention(
                num_heads, head_size, head_size ** -0.5, num_kv_heads,
                cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
                prefix=f"layers.{i}.attn", attn_backend=backend, **kwargs) for i in range(n)}
    finally:
        torch.set_default_dtype(torch.float32)


def check_step(results: dict, dtype: torch.dtype = torch.float32, **tol) -> None:
    """Every layer's output of a LayerRunner step against its oracle result."""
    for out, want in results.values():
        assert_close(out, want, dtype, **tol)


def set_scales(layer, **scales: float) -> None:
    """Set a layer's q/k/v scales (device tensor and host float together)."""
    for name, s in scales.items():
        getattr(layer, f"_{name}_scale").fill_(s)
        setattr(layer, f"_{name}_scale_float", s)


@pytest.fixture(autouse=True, scope="module")
def _no_layers_from_other_modules():
    """Layers a module left in reference cycles stay in the default (weak) layer registry
    until the next collection, where a later module's builder would find them by name."""
    gc.collect()
    yield
