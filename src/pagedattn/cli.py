"""The `pagedattn` command: `demo`, `info` and `bench`. Argument parsing only; the work is in
pagedattn.demo, pagedattn.info and pagedattn.bench (imported when their command runs)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Optional

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DESCRIPTION = ("Paged attention for LLM inference. 'demo' serves a stream of chat requests "
               "through pagedattn and checks them against transformers; 'info' shows the "
               "device, the versions, the environment variables and which backend serves a "
               "layer; 'bench' times one attention layer call per backend and context length.")
EPILOG = "Run 'pagedattn COMMAND --help' for a command's options."

# The `hf` extra (pyproject.toml): what the demo's models and weights need. The README installs
# pagedattn from its checkout, so the hint is the checkout's command.
HF_EXTRA = ("transformers", "accelerate", "gguf", "tqdm")
HF_INSTALL = 'pip install -e ".[hf]"   (in the pagedattn checkout)'


def _demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("transformers") is None:
        return _needs_hf("transformers")
    from pagedattn.demo import DemoConfig, run

    try:
        result = run(DemoConfig(model=args.model, num_requests=args.requests,
                                max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                                check=not args.no_check, device=args.device))
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in HF_EXTRA:
            raise
        return _needs_hf(e.name)
    return 0 if result.matches in (None, args.requests) else 1


def _needs_hf(missing: str) -> int:
    print(f"pagedattn demo runs a Hugging Face model and needs the optional 'hf' dependencies "
          f"({', '.join(HF_EXTRA)}); {missing!r} is not installed.\n"
          f"Install them with:  {HF_INSTALL}", file=sys.stderr)
    return 1


def _info(args: argparse.Namespace) -> int:
    from pagedattn import info
    from pagedattn.selector import current_device_type
    from pagedattn.types import AttentionRequest

    print(info.format_table(["", "value"], [list(r) for r in info.environment()]))
    print("\nbackend x feature (from each backend's declared capabilities)")
    print(info.format_table(*info.capability_matrix()))
    request = AttentionRequest(
        head_size=args.head_size, dtype=DTYPES[args.dtype], kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size, has_sink=args.sinks, use_sparse=args.sparse,
        device_type=args.device or current_device_type())
    print("\nbackend selection (get_attn_backend)")
    print("\n".join(info.selection_lines(info.select(request))))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from pagedattn.bench import BenchConfig, run, runnable_backends
    from pagedattn.selector import current_device_type

    cfg = BenchConfig(backends=args.backends, mode=args.mode, batch_size=args.batch_size,
                      context_lens=args.context_lens, num_heads=args.num_heads,
                      num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                      dtype=DTYPES[args.dtype] if args.dtype else None,
                      block_size=args.block_size, plot=args.plot)
    device = current_device_type()
    try:  # a backend that refuses these shapes is an argument error, not a traceback
        runnable_backends(cfg.resolved(device), device)
    except ValueError as e:
        args.error(str(e))
    run(cfg)
    return 0


def _positive_ints(text: str) -> list[int]:
    """'64,128' -> [64, 128], for --context-lens."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 64,128,256; got {text!r}")
    return values


def _backend_names(text: str) -> list[str]:
    """'torch_sdpa,flash_attn' -> ['TORCH_SDPA', 'FLASH_ATTN'], each a registered backend."""
    from pagedattn.selector import BACKENDS

    names = [b.strip().upper() for b in text.split(",") if b.strip()]
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend(s) {unknown or [text]}; known: {', '.join(BACKENDS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedattn", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="serve a stream of chat requests through pagedattn")
    demo.add_argument("--model", choices=["smollm2", "random-smollm2", "tiny"], default="smollm2")
    demo.add_argument("--requests", type=int, default=12)
    demo.add_argument("--max-new-tokens", type=int, default=32)
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    demo.add_argument("--no-check", action="store_true",
                      help="skip the comparison with transformers' own generate")
    demo.set_defaults(func=_demo)

    info = sub.add_parser("info", help="device, versions, backend x feature matrix, selection")
    info.add_argument("--head-size", type=int, default=128)
    info.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    info.add_argument("--kv-cache-dtype", default="auto")
    info.add_argument("--block-size", type=int, default=16)
    info.add_argument("--sinks", action="store_true", help="the request has attention sinks")
    info.add_argument("--sparse", action="store_true",
                      help="the layer is block-sparse (use_sparse=True)")
    info.add_argument("--device", choices=["cpu", "cuda"], default=None,
                      help="device type to select for (default: this machine's)")
    info.set_defaults(func=_info)

    bench = sub.add_parser("bench", help="attention throughput vs context length, per backend")
    bench.add_argument("--backends", type=_backend_names, default=None,
                       help="comma-separated names (default: all that can run)")
    bench.add_argument("--mode", choices=["decode", "prefill"], default="decode")
    bench.add_argument("--batch-size", type=int, default=None)
    bench.add_argument("--context-lens", type=_positive_ints, default=None,
                       help="comma-separated (default: small on CPU, up to 32k on GPU)")
    bench.add_argument("--num-heads", type=int, default=None)
    bench.add_argument("--num-kv-heads", type=int, default=None)
    bench.add_argument("--head-size", type=int, default=None)
    bench.add_argument("--dtype", choices=list(DTYPES), default=None)
    bench.add_argument("--block-size", type=int, default=16)
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also save a plot of tokens/s there (needs matplotlib)")
    bench.set_defaults(func=_bench, error=bench.error)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
