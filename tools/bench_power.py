"""SM clock, board power and energy per call of prefill rows run back to back.

    PYTHONPATH=src python3 tools/bench_power.py [--seconds 3.5] [--out FILE]

A kernel whose board sits at its power limit (`nvidia-smi`'s throttle reason 0x4, the
software power cap) lowers its clocks until it fits: its time is then its energy over the
cap, and only less energy per call makes it faster. Each row runs back to back for
`--seconds` (no L2 flush between calls, unlike `do_bench`) while `nvidia-smi` samples the SM
clock and the board's power every 50 ms; the table gives ms per call (CUDA events), the
median clock and power over all but the first second, mJ per call (power x time) and
GFLOP per joule on visible FLOPs. Rows: the engine path and SDPA cuDNN on two prompt
batches, and the chunk of 2,048 tokens after 30,720 cached over a bf16 cache and an e4m3
cache (a bf16 q, and the fp8 q a FLASH_ATTN layer makes for it). Needs a CUDA device and
`nvidia-smi` on the PATH.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:  # bench_prefill and timing, run from any folder
    sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_prefill import Prefill  # noqa: E402
from timing import Emitter  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def ours(query_lens, seq_lens, cache_dtype=BF16, q_dtype=BF16):
    """The engine path's call and its visible FLOPs."""
    p = Prefill(query_lens, seq_lens, cache_dtype=cache_dtype, q_dtype=q_dtype)
    return p.engine()[0], p.flops()


def cudnn(batch, length, heads=32, d=128):
    """SDPA's cuDNN kernel on dense causal prompts (KV heads expanded) and its FLOPs."""
    q, k, v = (torch.randn(batch, heads, length, d, device="cuda", dtype=BF16)
               for _ in range(3))

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return call, 4.0 * heads * d * batch * length * (length + 1) / 2


ROWS = (
    ("1 x 8192, engine", functools.partial(ours, [8192], [8192])),
    ("1 x 8192, SDPA cuDNN", functools.partial(cudnn, 1, 8192)),
    ("8 x 2048, engine", functools.partial(ours, [2048] * 8, [2048] * 8)),
    ("8 x 2048, SDPA cuDNN", functools.partial(cudnn, 8, 2048)),
    ("2048 after 30720, bf16 cache", functools.partial(ours, [2048], [32768])),
    ("2048 after 30720, e4m3 cache, bf16 q", functools.partial(ours, [2048], [32768], E4M3)),
    ("2048 after 30720, e4m3 cache, fp8 q",
     functools.partial(ours, [2048], [32768], E4M3, E4M3)),
)


def back_to_back(call, seconds):
    """(ms per call, start, end): wall-clock window of the calls, its first second dropped
    (clocks settle)."""
    call()
    torch.cuda.synchronize()
    start = time.time()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    n = 0
    while time.time() - start < seconds:
        for _ in range(20):
            call()
        n += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / n, start + 1.0, time.time()


def samples(path):
    """nvidia-smi's lines -> (epoch seconds, MHz, W, throttle reasons)."""
    out = []
    for line in open(path):
        fields = [x.strip() for x in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((stamp, float(fields[1]), float(fields[2]), fields[3]))
        except (ValueError, IndexError):  # a header, a cut-off last line
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    emit = Emitter()
    emit.to_file(args.out)
    log = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=log)
    windows = []
    try:
        for label, make in ROWS:
            call, flops = make()
            windows.append((label, flops, *back_to_back(call, args.seconds)))
            time.sleep(0.8)  # a gap between rows: each window's samples are its own
    finally:
        smi.terminate()
        smi.wait()
        log.close()
    got = samples(log.name)
    os.unlink(log.name)
    emit(f"\n{torch.cuda.get_device_name()}, rows back to back for {args.seconds} s each\n")
    emit("| row | ms/call | TFLOP/s | SM MHz | W | mJ/call | GFLOP/J | throttle reasons |")
    emit("|---|---:|---:|---:|---:|---:|---:|---|")
    for label, flops, ms, start, end in windows:
        emit(row_line(label, flops, ms, [s for s in got if start <= s[0] <= end]))


def row_line(label, flops, ms, mine):
    """One table line from a row's FLOPs, ms per call and its window's samples."""
    if not mine:
        return f"| {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | n/a | n/a | n/a | n/a | |"
    mhz = statistics.median(s[1] for s in mine)
    watts = statistics.median(s[2] for s in mine)
    reasons = ", ".join(sorted({s[3] for s in mine}))
    return (f"| {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {mhz:.0f} | {watts:.0f} | "
            f"{watts * ms:.0f} | {flops / (watts * ms * 1e-3) / 1e9:.0f} | {reasons} |")


if __name__ == "__main__":
    main()
