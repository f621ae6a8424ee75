"""Timers and side-by-side tables shared by the benchmarks (never imported by tests).

    from timing import (Emitter, alternate, eager_ms, graph_ms, host_us, markdown_table,
                        measure, safe)

Run a benchmark as a script (`python benchmarks/bench_x.py`): its folder is then on sys.path
(the tools in tools/ that time kernels put it there themselves).

- `eager_ms(fn)`: median ms of eager calls, `triton.testing.do_bench` (CUDA events around
  each call, L2 flushed in between). The flush kernel runs before each call, so host launch
  time shows only where it exceeds the flush (~0.1 ms on an H100): for host cost use
  `host_us`. Without CUDA: the median of wall-clock calls.
- `graph_ms(fn)`: median ms per call replayed from a CUDA graph,
  `triton.testing.do_bench_cudagraph` (calls `fn` once first, so kernels compile outside the
  capture). Raises where `fn` cannot be captured; see `measure` / `safe`.
- `host_us(fn, n)`: host microseconds per call, n calls queued without waiting.
- `kernel_ms(fn)`: GPU kernel time per call, from the profiler.
- `measure(timer, fn)` -> (ms, error): a failed capture or kernel becomes NaN plus its error,
  so the row is still printed and says why; `safe(timer, report)` wraps a timer that way.
- `alternate(columns, rounds)`: peers side by side in one process, their timings alternated
  in rounds (one pass varies 10-20% with clocks and setup): median ms and error per column.
- `capture_graph(fn)` / `replay_rounds(graphs, rounds, replays)`: CUDA graphs captured once,
  then replayed in rounds, the order rotated each round: median ms per replay of each (the
  A/B tools in tools/ that keep each variant's graph and its scratch alive themselves).
- `Emitter`: print a line and append it to an `--out` file (a cut-off run keeps its rows).
- `markdown_table(header, rows)` / `markdown_row(row)`: table lines; floats with a fixed
  number of digits, NaN as "n/a"; `ratio(a, b)` for speed-up columns.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Optional

import torch


def eager_ms(fn: Callable, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds per eager call (`warmup` / `rep` in ms, as do_bench takes them)."""
    if not torch.cuda.is_available():
        return _wall_ms(fn, warmup, rep)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn: Callable, rep: int = 50) -> float:
    """Median milliseconds per call of `fn` replayed from a CUDA graph (`rep` ms of replays)."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA graphs need a CUDA device")
    import triton.testing

    fn()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def host_us(fn: Callable, n: int = 200, warmup: int = 10) -> float:
    """Microseconds of host time per call: `n` calls queued without waiting, after a sync (the
    GPU queue absorbs them), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    _sync()
    return elapsed / n * 1e6


def kernel_ms(fn: Callable, steps: int = 5) -> float:
    """GPU time of `fn` per call: the profiler's CUDA kernel time summed over `steps` calls
    (what a step costs the GPU, whatever the host adds); NaN without CUDA."""
    if not torch.cuda.is_available():
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                for e in prof.key_averages()
                if str(getattr(e, "device_type", "")).endswith("CUDA"))
    return total / steps / 1e3


def error_text(e: BaseException) -> str:
    """One line for a table or a JSON row: the type and the first line of the message."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first[:200]}"


def measure(timer: Callable[[Callable], float], fn: Callable
            ) -> tuple[float, Optional[str]]:
    """(timer(fn), None), or (NaN, error) when the call, its capture or its replay fails."""
    try:
        return timer(fn), None
    except Exception as e:  # noqa: BLE001 - a benchmark row, not a library path
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a failed capture may leave work queued
        return float("nan"), error_text(e)


def safe(timer: Callable[[Callable], float],
         report: Optional[Callable[[str], None]] = None) -> Callable[[Callable], float]:
    """`timer` returning NaN instead of raising; `report` gets "<!-- failed: error -->" (a
    markdown comment beside the row), print by default."""
    report = report or print

    def run(fn: Callable) -> float:
        ms, error = measure(timer, fn)
        if error is not None:
            report(f"<!-- failed: {error} -->")
        return ms

    return run


def alternate(columns: Sequence[tuple[str, Callable[[Callable], float], Callable]],
              rounds: int = 3) -> dict[str, tuple[float, Optional[str]]]:
    """{name: (median ms, error)} of columns (name, timer, fn), timed `rounds` times each:
    every round times each column once, the order rotated by one from the round before, so
    no column always runs first or right after the same neighbour. A column that fails is
    not timed again (its error is the first); one that never succeeded reads NaN."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in columns}
    errors: dict[str, str] = {}
    order = list(columns)
    for r in range(rounds):
        shift = r % max(1, len(order))
        for name, timer, fn in order[shift:] + order[:shift]:
            if name in errors:
                continue
            ms, error = measure(timer, fn)
            if error is None:
                times[name].append(ms)
            else:
                errors[name] = error
    return {name: (statistics.median(t) if t else float("nan"), errors.get(name))
            for name, t in times.items()}


def capture_graph(fn: Callable) -> torch.cuda.CUDAGraph:
    """`fn`'s launches captured in a CUDA graph (called once first: compiles stay outside)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_rounds(graphs: dict, rounds: int, replays: int) -> dict[str, float]:
    """{name: median ms per replay} of `graphs` ({name: CUDAGraph}): each round replays every
    graph once to warm, then `replays` times between CUDA events, the order rotated by one
    from the round before."""
    names = list(graphs)
    times: dict[str, list[float]] = {name: [] for name in names}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            graphs[name].replay()
            start.record()
            for _ in range(replays):
                graphs[name].replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / replays)
    return {name: statistics.median(t) for name, t in times.items()}


class Emitter:
    """`emit(line)`: print it and, once `to_file(path)` was called, append it to that file."""

    def __init__(self) -> None:
        self.path: Optional[str] = None

    def to_file(self, path: Optional[str]) -> None:
        """Start `path` empty (None: print only)."""
        self.path = path
        if path:
            open(path, "w").close()

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def lines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self(line)


def fmt(value, digits: int = 3) -> str:
    """A table cell: floats with `digits` decimals, NaN as "n/a", anything else as str."""
    if isinstance(value, float):
        return "n/a" if value != value else f"{value:.{digits}f}"
    return str(value)


def ratio(base: float, value: float, digits: int = 2) -> str:
    """"1.23x": base / value (a speed-up when both are times), "n/a" where either is NaN."""
    if base != base or value != value or value == 0:
        return "n/a"
    return f"{base / value:.{digits}f}x"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence] = (), digits: int = 3
                   ) -> list[str]:
    """Lines of a markdown table: the first column left-aligned, the others right-aligned.
    Without rows: the two header lines, for a table printed row by row (`markdown_row`)."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return lines + [markdown_row(row, digits) for row in rows]


def markdown_row(row: Sequence, digits: int = 3) -> str:
    return "| " + " | ".join(map(partial(fmt, digits=digits), row)) + " |"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _wall_ms(fn: Callable, warmup_ms: float, rep_ms: float) -> float:
    """do_bench's schedule on the host clock: calls for about warmup_ms, then rep_ms."""
    start = time.perf_counter()
    fn()
    once = max((time.perf_counter() - start) * 1e3, 1e-3)
    for _ in range(int(warmup_ms / once)):
        fn()
    times = []
    for _ in range(max(1, int(rep_ms / once))):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
