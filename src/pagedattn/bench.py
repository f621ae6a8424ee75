"""`pagedattn bench`: attention throughput versus context length, per backend, on this device.

Each point times one `Attention.forward` (cache write + paged attention) of a uniform batch
through the backend's own builder and impl, as a model layer would run it. Decode: every
request adds one token to a context of `L`; prefill: every request brings all `L` tokens.
Prints a table and, when asked (`plot`, needs matplotlib), saves a PNG of tokens/s against
context length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn import info, selector
from pagedattn.config import CacheConfig, EngineConfig
from pagedattn.cpu_threads import ThreadPolicy
from pagedattn.forward_context import model_scope, set_forward_context
from pagedattn.kv_cache import allocate_kv_caches, bind_kv_cache
from pagedattn.layer import Attention
from pagedattn.metadata import AttentionSpec, CommonAttentionMetadata
from pagedattn.types import AttentionRequest


@dataclass
class BenchConfig:
    backends: Optional[list[str]] = None  # None: every backend that can serve the request
    mode: str = "decode"  # or "prefill"
    batch_size: Optional[int] = None
    context_lens: Optional[list[int]] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_size: Optional[int] = None
    dtype: Optional[torch.dtype] = None
    block_size: int = 16
    plot: Optional[str] = None  # an image path (its extension says the format); None: no plot
    head_size_v: Optional[int] = None  # V's head size (FLASH_ATTN_DIFFKV); None: head_size

    def resolved(self, device: str) -> BenchConfig:
        """Fill the unset (None) fields: small shapes on CPU, serving-sized ones on a GPU."""
        gpu = device == "cuda"
        prefill = self.mode == "prefill"
        defaults = dict(
            batch_size=max(1, (64 if gpu else 4) // (8 if prefill else 1)),
            context_lens=([1024, 2048, 4096, 8192, 16384, 32768] if gpu else
                          [64, 128, 256, 512, 1024]),
            num_heads=32 if gpu else 8, num_kv_heads=8 if gpu else 2,
            head_size=128 if gpu else 64, dtype=torch.bfloat16 if gpu else torch.float32)
        cfg = dataclasses.replace(self, **{name: value for name, value in defaults.items()
                                           if getattr(self, name) is None})
        if cfg.head_size_v is None:
            cfg.head_size_v = cfg.head_size
        return cfg

    def check(self) -> None:
        """A resolved config's sizes: positive, and query heads in whole KV-head groups."""
        for name in ("batch_size", "num_heads", "num_kv_heads", "head_size", "head_size_v",
                     "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not self.context_lens or min(self.context_lens) <= 0:
            raise ValueError(f"context_lens={self.context_lens!r} must be positive integers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                             f"{self.num_kv_heads}: each KV head serves a whole group of query "
                             "heads")


@dataclass
class BenchPoint:
    backend: str
    context_len: int
    seconds: float  # per forward: the median sample
    tokens: int  # query tokens per forward
    spread: float = 0.0  # (slowest - fastest sample) / median

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def runnable_backends(cfg: BenchConfig, device: str) -> list[str]:
    """The backends to time (a resolved config): the named ones, which must serve its
    layer when forced, or else every backend the selector could choose for it."""
    head_size_v = None if cfg.head_size_v in (None, cfg.head_size) else cfg.head_size_v
    request = AttentionRequest(cfg.head_size, cfg.dtype, "auto", cfg.block_size,
                               device_type=device, head_size_v=head_size_v)
    with _diffkv_head_size(cfg):
        reasons = selector.explain(request)
        if not cfg.backends:
            # Backends merely not auto-chosen on this device (FLASH_ATTN on a CPU runs the
            # PyTorch provider) are timed too; ones that refuse the request are not.
            on_device = f"never chosen automatically on {device}"
            return [name for name, why in reasons.items() if not set(why) - {on_device}]
        unknown = [b for b in cfg.backends if b not in reasons]
        if unknown:
            raise ValueError(f"unknown backend(s) {unknown}; known: {list(reasons)}")
        refused = {b: _refusals(b, request, reasons[b]) for b in cfg.backends}
    refused = {b: why for b, why in refused.items() if why}
    if refused:
        raise ValueError("cannot time " + "; ".join(
            f"{b}: {', '.join(why)}" for b, why in refused.items()))
    return cfg.backends


def _refusals(name: str, request: AttentionRequest, reasons: list[str]) -> list[str]:
    """Why a named backend cannot time the request when forced: what it cannot serve, and
    block-sparse layers (the bench's layer is dense)."""
    try:
        caps = selector.load_backend(name).capabilities
    except ImportError:
        return reasons  # "not available in this build"
    return caps.why_not(request) + (caps.why_not_automatic(request) if caps.sparse_only else [])


@contextlib.contextmanager
def _diffkv_head_size(cfg: BenchConfig) -> Iterator[None]:
    """FLASH_ATTN_DIFFKV takes V's head size from its class: the config's, for the block."""
    backend = selector.load_backend("FLASH_ATTN_DIFFKV")
    previous = backend.head_size_v
    backend.set_head_size_v(cfg.head_size_v or cfg.head_size)
    try:
        yield
    finally:
        backend.set_head_size_v(previous)


def tokens_in_batch(cfg: BenchConfig, context_len: int) -> int:
    return cfg.batch_size * (1 if cfg.mode == "decode" else context_len)


SAMPLES = 5  # timed samples per point: the median is reported, the spread warns
SPREAD_WARNING = 0.2


def time_forward(backend_name: str, cfg: BenchConfig, context_len: int, device: str,
                 min_seconds: float = 0.2) -> BenchPoint:
    with _diffkv_head_size(cfg):
        return _time_forward(selector.load_backend(backend_name), cfg, context_len, device,
                             min_seconds)


def _time_forward(backend, cfg: BenchConfig, context_len: int, device: str,
                  min_seconds: float) -> BenchPoint:
    decode = cfg.mode == "decode"
    q_len = 1 if decode else context_len
    batch = cfg.batch_size
    blocks_per_req = -(-context_len // cfg.block_size)
    with model_scope(), _default_dtype(cfg.dtype):
        layer = Attention(cfg.num_heads, cfg.head_size, cfg.head_size ** -0.5, cfg.num_kv_heads,
                          cache_config=CacheConfig(block_size=cfg.block_size),
                          prefix="bench.attn", attn_backend=backend).to(device)
    layers = {"bench.attn": layer}
    caches = allocate_kv_caches(layers, batch * blocks_per_req + 1, device, cfg.dtype)
    for cache in caches.values():
        cache.normal_()
    bind_kv_cache(caches, layers)
    # Requests get interleaved blocks, as a busy cache would hand them out.
    table = torch.arange(batch * blocks_per_req, dtype=torch.int32).view(blocks_per_req, batch).T
    common = CommonAttentionMetadata.from_lengths([q_len] * batch, [context_len] * batch,
                                                  table.contiguous(), cfg.block_size, device)
    builder = backend.get_builder_cls()(
        AttentionSpec(cfg.block_size, cfg.num_kv_heads, cfg.head_size, cfg.dtype),
        ["bench.attn"], EngineConfig(max_num_seqs=batch, max_model_len=context_len,
                                     max_num_batched_tokens=tokens_in_batch(cfg, context_len)),
        torch.device(device))
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
    tokens = batch * q_len
    q = torch.randn(tokens, cfg.num_heads * cfg.head_size, dtype=cfg.dtype, device=device)
    k = torch.randn(tokens, cfg.num_kv_heads * cfg.head_size, dtype=cfg.dtype, device=device)
    v = torch.randn(tokens, cfg.num_kv_heads * layer.head_size_v, dtype=cfg.dtype,
                    device=device)
    with set_forward_context(metadata), torch.inference_mode():
        layer(q, k, v)  # warm-up: compiles Triton kernels, touches the cache
        runs = max(1, round(min_seconds / SAMPLES / max(_seconds(layer, q, k, v, 1, device),
                                                         1e-7)))
        # (a first sample untimed: the caches and the allocator warm up over it)
        samples = [_seconds(layer, q, k, v, runs, device) for _ in range(SAMPLES + 1)][1:]
    seconds = statistics.median(samples)
    return BenchPoint(backend.get_name(), context_len, seconds, tokens,
                      (max(samples) - min(samples)) / seconds)


def _seconds(layer, q, k, v, runs: int, device: str) -> float:
    """Seconds per call of `runs` calls in a row."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(runs):
        layer(q, k, v)
    _sync(device)
    return (time.perf_counter() - start) / runs


def run(cfg: BenchConfig, say=print, threads: Optional[ThreadPolicy] = None
        ) -> list[BenchPoint]:
    """Time every point and print the table; on a CPU with the thread count `threads`
    chooses (measured once at the start: the points are then comparable)."""
    device = selector.current_device_type()
    cfg = cfg.resolved(device)
    cfg.check()
    names = runnable_backends(cfg, device)
    dv = f" (V {cfg.head_size_v})" if cfg.head_size_v != cfg.head_size else ""
    where = device
    threads_used = contextlib.nullcontext()
    if device == "cpu":
        threads = threads or ThreadPolicy()
        threads.measure()
        threads_used = threads.applied()
        where = f"cpu, {threads.describe()}"
    say(f"{cfg.mode} on {where}: batch {cfg.batch_size}, {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads, head size {cfg.head_size}{dv}, "
        f"{info.DTYPE_NAMES.get(cfg.dtype, cfg.dtype)}, block size {cfg.block_size}; "
        f"backends {names}")
    with threads_used:
        points = [time_forward(name, cfg, n, device) for n in cfg.context_lens
                  for name in names]
    header = ["context", *(f"{n} tok/s" for n in names), *(f"{n} ms" for n in names),
              *(f"{n} spread" for n in names)]
    rows = []
    for n in cfg.context_lens:
        at = {p.backend: p for p in points if p.context_len == n}
        rows.append([str(n), *(f"{at[b].tokens_per_second:,.0f}" for b in names),
                     *(f"{at[b].seconds * 1e3:.3f}" for b in names),
                     *(f"{at[b].spread:.0%}" for b in names)])
    say(info.format_table(header, rows))
    say(f"(ms: the median of {SAMPLES} samples; spread: (slowest - fastest) / median)")
    for line in spread_warnings(points):
        say(line)
    if cfg.plot:
        say(save_plot(points, cfg, device))
    return points


def spread_warnings(points: list[BenchPoint]) -> list[str]:
    """A warning per point whose samples spread more than SPREAD_WARNING."""
    return [f"warning: {p.backend} at context {p.context_len}: the samples spread "
            f"{p.spread:.0%} (over {SPREAD_WARNING:.0%}): other work on this machine, or too "
            "short a timing; compare such figures with care"
            for p in points if p.spread > SPREAD_WARNING]


def plot_formats() -> dict[str, str]:
    """The image formats a plot can be saved in, by file extension (needs matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return FigureCanvasAgg.get_supported_filetypes()


def save_plot(points: list[BenchPoint], cfg: BenchConfig, device: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: pip install matplotlib (the bench extra)"
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(p.backend for p in points):
        mine = [p for p in points if p.backend == name]
        ax.plot([p.context_len for p in mine], [p.tokens_per_second for p in mine], "o-",
                label=name)
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
           ylabel="query tokens / s", title=f"pagedattn {cfg.mode} on {device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(cfg.plot, dpi=120)
    plt.close(fig)
    return f"plot saved to {cfg.plot}"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _default_dtype:
    def __init__(self, dtype: torch.dtype):
        self.dtype, self.previous = dtype, torch.get_default_dtype()

    def __enter__(self) -> None:
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc) -> None:
        torch.set_default_dtype(self.previous)
