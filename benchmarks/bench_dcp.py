"""Decode with 128k / 512k / 1M-token contexts on one GPU vs a decode-context-parallel group.

One request, one new token, one attention layer of an MQA model (32 query heads, 1 KV head of
128, bf16, block 16): under TP=2 its KV head is replicated, which is what DCP=2 turns into a
sharded cache. Rows per context:

- one GPU: plain FLASH_ATTN decode (all 32 heads, the whole cache);
- DCP path, world 1: the layer's DCP step over the whole cache with a group of one (the
  builder plans it: `DCPPlanner`), i.e. the DCP algorithm's own cost: context pass with LSE,
  correction, new-token pass, merge;
- one DCP=2 rank's work: the same path over half the cache with the group's 32 gathered heads,
  i.e. what each of 2 GPUs computes, collectives excluded (measured on one GPU);
- under torchrun with 2 processes: the real DCP=2 step, and the collectives of a step alone.

    python benchmarks/bench_dcp.py                          # one GPU (or CPU, tiny sizes)
    torchrun --nproc-per-node 2 benchmarks/bench_dcp.py     # two GPUs, NCCL

Times are medians in ms (`timing.py`): eager (triton.testing.do_bench) and replayed from a
CUDA graph (do_bench_cudagraph); a step that cannot be captured gets NaN and `graph_error`;
"host us" is the host time of one eager step (50 queued without waiting).
The floor is the KV bytes a rank reads / 3.0 TB/s. "Largest context" is KV-cache only: 90%
of the GPU's memory over the per-token KV bytes of all LAYERS layers (weights excluded), per
rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist
from timing import eager_ms, graph_ms, host_us, markdown_table, measure

from pagedattn import (
    Attention,
    AttentionSpec,
    BlockAllocator,
    BlockTable,
    CacheConfig,
    CommonAttentionMetadata,
    EngineConfig,
    model_scope,
    set_forward_context,
)
from pagedattn import distributed as pd
from pagedattn.backends.dcp import DCPPlanner
from pagedattn.backends.flash_attn import FlashAttentionBackend
from pagedattn.kv_cache import allocate_kv_cache
from pagedattn.kv_sharding import KVSharding

HEADS, KV_HEADS, D, BLOCK, LAYERS = 32, 1, 128, 16, 48
BYTES_PER_TOKEN = 2 * KV_HEADS * D * 2  # K and V, bf16, one layer
HBM_BYTES_PER_S = 3.0e12


def times(fn) -> dict:
    """Eager and graph-replay medians of fn (a failed capture: NaN and its error) and the
    host time of one eager step."""
    graph, error = measure(graph_ms, fn)
    return dict(eager=eager_ms(fn), graph=graph, host_us=round(host_us(fn, n=50), 1),
                **({"graph_error": error} if error else {}))


class Decode:
    """One layer, a cache holding `context` tokens of one request (this rank's share), and the
    metadata of a one-token decode step."""

    def __init__(self, heads: int, context: int, device, sharding: KVSharding,
                 config: EngineConfig):
        with model_scope():
            self.layer = Attention(heads, D, D ** -0.5, KV_HEADS,
                                   cache_config=CacheConfig(block_size=BLOCK),
                                   prefix="dcp.attn",
                                   attn_backend=FlashAttentionBackend).to(device)
        blocks = -(-(sharding.local_len(context + 1)) // BLOCK) + 1
        cache = allocate_kv_cache(FlashAttentionBackend, blocks, BLOCK, KV_HEADS, D,
                                  torch.bfloat16, device=device)
        cache.normal_()
        self.layer.kv_cache = [cache]
        self.kv_bytes = sharding.local_len(context) * BYTES_PER_TOKEN
        table = BlockTable(BlockAllocator(blocks), BLOCK, sharding)
        table.add_request(0)
        table.append_tokens(0, context + 1)
        common = CommonAttentionMetadata.from_lengths(
            [1], [context + 1], table.tensor([0]), BLOCK, device, sharding=sharding)
        spec = AttentionSpec(BLOCK, KV_HEADS, D, torch.bfloat16)
        # The builder plans for the layers it is given by name.
        builder = FlashAttentionBackend.get_builder_cls()(spec, ["dcp.attn"], config, device)
        self.md = builder.build(0, common)
        if builder.dcp is None:  # one GPU: also plan the step for a DCP group of one
            dcp_builder = FlashAttentionBackend.get_builder_cls()(spec, ["dcp.attn"], config,
                                                                  device)
            dcp_builder.dcp = DCPPlanner(config, config.max_num_seqs, device)
            self.md_dcp = dcp_builder.build(0, common)
        g = torch.Generator(device=device).manual_seed(0)
        self.q = torch.randn(1, heads * D, device=device, dtype=torch.bfloat16, generator=g)
        self.k = torch.randn(1, KV_HEADS * D, device=device, dtype=torch.bfloat16, generator=g)
        self.v = torch.randn_like(self.k)

    def step(self):
        with set_forward_context(self.md):
            return self.layer(self.q, self.k, self.v)

    def dcp_world1_step(self):
        """The layer's DCP step with a group of one over this whole cache."""
        with set_forward_context(self.md_dcp):
            return self.layer(self.q, self.k, self.v)


def row(name, kv_bytes, timings: dict, **extra) -> dict:
    floor = kv_bytes / HBM_BYTES_PER_S * 1e3
    return dict(setup=name, kv_mib_per_rank=round(kv_bytes / 2**20, 1), floor_ms=round(floor, 4),
                eager_ms=round(timings["eager"], 4), graph_ms=round(timings["graph"], 4),
                **{k: v for k, v in timings.items() if k not in ("eager", "graph")}, **extra)


def single_gpu(contexts, device) -> list[dict]:
    rows = []
    one = KVSharding()
    for context in contexts:
        plain = Decode(HEADS, context, device, one, EngineConfig(max_model_len=context + 16))
        rows.append(row(f"1 GPU, {context // 1024}k", plain.kv_bytes, times(plain.step)))
        rows.append(row(f"DCP path world 1, {context // 1024}k", plain.kv_bytes,
                        times(plain.dcp_world1_step)))
        del plain
        half = Decode(HEADS, context // 2, device, one, EngineConfig(max_model_len=context))
        rows.append(row(f"one DCP=2 rank's work (no collectives), {context // 1024}k",
                        half.kv_bytes, times(half.dcp_world1_step)))
        del half
        torch.cuda.empty_cache()
    return rows


def two_gpus(contexts, device) -> list[dict]:
    pd.init_parallel_groups(2, 2, timeout=datetime.timedelta(seconds=60))
    heads, _ = pd.tp_attention_heads(HEADS, KV_HEADS)
    group = pd.get_dcp_group()
    sharding = KVSharding(2, group.rank_in_group, 1)
    q = torch.randn(1, heads, D, device=device, dtype=torch.bfloat16)
    lse = torch.randn(2 * heads, 1, device=device)
    out = torch.randn(2 * heads, 1, D, device=device)

    def collectives():  # the three collectives of one decode step, same sizes
        pd.all_gather(q, group, dim=1)
        pd.all_gather(lse, group)
        pd.reduce_scatter(out, group, dim=0)

    rows = []
    for context in contexts:
        config = EngineConfig(max_model_len=context + 16, enable_cascade=False,
                              tensor_parallel_size=2, decode_context_parallel_size=2)
        dec = Decode(heads, context, device, sharding, config)
        rows.append(row(f"DCP=2 on 2 GPUs, {context // 1024}k", dec.kv_bytes, times(dec.step),
                        collectives_ms=round(eager_ms(collectives), 4)))
        del dec
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="131072,524288,1048576")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    total = torch.cuda.get_device_properties(device).total_memory
    capacity = int(0.9 * total // (LAYERS * BYTES_PER_TOKEN))
    if world == 1:
        rows = single_gpu(contexts, device)
    else:
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
        rows = two_gpus(contexts, device)
    info = dict(device=torch.cuda.get_device_name(device), world=world,
                date=datetime.date.today().isoformat(), torch=torch.__version__,
                largest_context_tokens=capacity * world, model=f"{HEADS} q heads, {KV_HEADS} "
                f"KV head x {D}, bf16, {LAYERS} layers for capacity")
    if world == 1 or dist.get_rank() == 0:
        print(json.dumps(info))
        for r in rows:
            print(json.dumps(r))
        print("\n".join(markdown_table(
            ("setup", "KV MiB / rank", "floor ms", "graph ms", "eager ms", "host us"),
            [(r["setup"], r["kv_mib_per_rank"], r["floor_ms"], r["graph_ms"], r["eager_ms"],
              r["host_us"]) for r in rows], digits=4)))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"bench_dcp_w{world}.json"), "w") as f:
                json.dump(dict(info=info, rows=rows), f, indent=1)
    if world > 1:
        pd.destroy_parallel_groups()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
