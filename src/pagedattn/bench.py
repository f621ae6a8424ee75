"""`pagedattn bench`: attention throughput versus context length, per backend, on this device.

Each point times one `Attention.forward` (cache write + paged attention) of a uniform batch
through the backend's own builder and impl, as a model layer would run it. Decode: every
request adds one token to a context of `L`; prefill: every request brings all `L` tokens.
Prints a table and, when asked (`plot`, needs matplotlib), saves a PNG of tokens/s against
context length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn import info, selector
from pagedattn.config import CacheConfig, EngineConfig
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
    plot: Optional[str] = None  # a PNG path; None: no plot

    def resolved(self, device: str) -> BenchConfig:
        """Fill the unset fields: small shapes on CPU, serving-sized ones on a GPU."""
        gpu = device == "cuda"
        prefill = self.mode == "prefill"
        return BenchConfig(
            self.backends, self.mode,
            self.batch_size or max(1, (64 if gpu else 4) // (8 if prefill else 1)),
            self.context_lens or ([1024, 2048, 4096, 8192, 16384, 32768] if gpu else
                                  [64, 128, 256, 512, 1024]),
            self.num_heads or (32 if gpu else 8), self.num_kv_heads or (8 if gpu else 2),
            self.head_size or (128 if gpu else 64),
            self.dtype or (torch.bfloat16 if gpu else torch.float32), self.block_size, self.plot)


@dataclass
class BenchPoint:
    backend: str
    context_len: int
    seconds: float  # per forward
    tokens: int  # query tokens per forward

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def runnable_backends(cfg: BenchConfig, device: str) -> list[str]:
    request = AttentionRequest(cfg.head_size, cfg.dtype, "auto", cfg.block_size,
                               device_type=device)
    reasons = selector.explain(request)
    # Backends that are merely not auto-chosen on this device (FLASH_ATTN's Triton kernels on
    # CPU run interpreted) are benchmarked too; ones that refuse the request are not.
    on_device = f"never chosen automatically on {device}"
    refusals = {name: [w for w in why if w != on_device] for name, why in reasons.items()}
    if not cfg.backends:
        return [name for name, why in refusals.items() if not why]
    unknown = [b for b in cfg.backends if b not in reasons]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; known: {list(reasons)}")
    refused = {b: refusals[b] for b in cfg.backends if refusals[b]}
    if refused:
        raise ValueError("cannot time " + "; ".join(
            f"{b}: {', '.join(why)}" for b, why in refused.items()))
    return cfg.backends


def tokens_in_batch(cfg: BenchConfig, context_len: int) -> int:
    return cfg.batch_size * (1 if cfg.mode == "decode" else context_len)


def time_forward(backend_name: str, cfg: BenchConfig, context_len: int, device: str,
                 min_seconds: float = 0.2) -> BenchPoint:
    backend = selector.load_backend(backend_name)
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
    v = torch.randn_like(k)
    with set_forward_context(metadata), torch.inference_mode():
        layer(q, k, v)  # warm-up: compiles Triton kernels, touches the cache
        _sync(device)
        runs, start = 0, time.perf_counter()
        while runs < 3 or time.perf_counter() - start < min_seconds:
            layer(q, k, v)
            runs += 1
        _sync(device)
        seconds = (time.perf_counter() - start) / runs
    return BenchPoint(backend_name, context_len, seconds, tokens)


def run(cfg: BenchConfig, say=print) -> list[BenchPoint]:
    device = selector.current_device_type()
    cfg = cfg.resolved(device)
    names = runnable_backends(cfg, device)
    say(f"{cfg.mode} on {device}: batch {cfg.batch_size}, {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads, head size {cfg.head_size}, "
        f"{info.DTYPE_NAMES.get(cfg.dtype, cfg.dtype)}, block size {cfg.block_size}; "
        f"backends {names}")
    points = [time_forward(name, cfg, n, device) for n in cfg.context_lens for name in names]
    header = ["context", *(f"{n} tok/s" for n in names), *(f"{n} ms" for n in names)]
    rows = []
    for n in cfg.context_lens:
        at = {p.backend: p for p in points if p.context_len == n}
        rows.append([str(n), *(f"{at[b].tokens_per_second:,.0f}" for b in names),
                     *(f"{at[b].seconds * 1e3:.3f}" for b in names)])
    say(info.format_table(header, rows))
    if cfg.plot:
        say(save_plot(points, cfg, device))
    return points


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
