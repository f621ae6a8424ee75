"""Draw one block-sparse pattern: which keys each query position sees, one panel per head.

    PYTHONPATH=src python tools/plot_blocksparse_pattern.py [--out FILE.png]

The mask comes from `LocalStridedBlockSparseAttn.dense_mask`, i.e. the same head offsets the
kernels use (needs matplotlib; CPU only). It writes blocksparse_pattern.png in the working
directory; the README's picture is regenerated on purpose, with its defaults, by
`--out docs/blocksparse_pattern.png`.
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pagedattn.ops.blocksparse_prefill import LocalStridedBlockSparseAttn  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="blocksparse_pattern.png",
                        help="PNG to write (the tracked docs/blocksparse_pattern.png is only "
                             "overwritten when named here)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--local-blocks", type=int, default=2)
    parser.add_argument("--vert-stride", type=int, default=4)
    args = parser.parse_args()
    attn = LocalStridedBlockSparseAttn(args.heads, args.seq_len, args.local_blocks,
                                       args.vert_stride, args.block_size)
    mask = attn.dense_mask(args.seq_len)
    fig, axes = plt.subplots(1, args.heads, figsize=(3.2 * args.heads, 3.6))
    for h, ax in enumerate(axes):
        density = mask[h].sum().item() / (args.seq_len * (args.seq_len + 1) / 2)
        ax.imshow(mask[h].numpy(), cmap="Greys", interpolation="nearest")
        ax.set_title(f"head {h}: offset {h * attn.head_sliding_step + 1}, "
                     f"density {density:.2f}", fontsize=9)
        ax.set_xlabel("key position")
        if h == 0:
            ax.set_ylabel("query position")
    fig.suptitle(f"local_blocks={args.local_blocks}, vert_stride={args.vert_stride}, "
                 f"block_size={args.block_size}, head_sliding_step={attn.head_sliding_step} "
                 "(black: attended)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
