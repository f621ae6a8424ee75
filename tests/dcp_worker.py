"""One rank of the multi-process DCP / TP checks: spawned by tests/test_distributed.py (gloo,
CPU), or run on GPUs with NCCL:  torchrun --nproc-per-node 2 tests/dcp_worker.py

Every rank runs the same steps (mixed batches of chunked prefills and decodes) through
Attention layers twice: once as a single process would (all heads, the whole cache), once
with its TP heads over its DCP shard of the cache. Its heads of the two outputs must match.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from conftest import FP8_TOLERANCE, assert_close, make_layers, randn  # noqa: E402
from pagedattn import (  # noqa: E402
    AttentionSpec,
    BlockAllocator,
    BlockTable,
    CommonAttentionMetadata,
    EngineConfig,
    set_forward_context,
)
from pagedattn import distributed as pd  # noqa: E402
from pagedattn.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from pagedattn.backends.flash_attn_diffkv import FlashAttentionDiffKVBackend  # noqa: E402
from pagedattn.backends.torch_sdpa import TorchSDPABackend  # noqa: E402
from pagedattn.kv_cache import allocate_kv_caches, bind_kv_cache  # noqa: E402
from pagedattn.kv_sharding import KVSharding  # noqa: E402

# (request ids, query lengths) per step: prefills, then chunked prefills mixed with decodes.
STEPS = [(["a", "b", "c"], [21, 40, 5]),
         (["a", "b", "c", "d"], [1, 17, 1, 9]),
         (["d", "a", "b", "c"], [4, 1, 1, 1])]


@contextlib.contextmanager
def single_process():
    """Build layers as one process would (the reference), whatever groups are set up."""
    saved = dict(pd._groups)
    pd._groups.update(pd._SINGLE)
    try:
        yield
    finally:
        pd._groups.update(saved)


class Runner:
    """A set of layers over its own paged cache: builds each step's metadata and runs it."""

    def __init__(self, layers: dict, block_size: int, dtype, device, config: EngineConfig,
                 sharding: KVSharding):
        self.layers, self.block_size, self.device, self.sharding = layers, block_size, \
            device, sharding
        self.table = BlockTable(BlockAllocator(64), block_size, sharding)
        for layer in layers.values():
            layer.to(device)  # its scales
        bind_kv_cache(allocate_kv_caches(layers, 64, device, dtype), layers)
        first = next(iter(layers.values()))
        spec = AttentionSpec(block_size, first.num_kv_heads, first.head_size, dtype,
                             first.kv_cache_dtype)
        self.builder = first.attn_backend.get_builder_cls()(spec, list(layers), config, device)

    def step(self, req_ids, query_lens, inputs):
        for r, n in zip(req_ids, query_lens):
            if r not in self.table.blocks:
                self.table.add_request(r)
            self.table.append_tokens(r, n)
        common = CommonAttentionMetadata.from_lengths(
            query_lens, [self.table.num_tokens[r] for r in req_ids], self.table.tensor(req_ids),
            self.block_size, self.device, sharding=self.sharding)
        with set_forward_context(self.builder.build(0, common)):
            return {name: layer(*(x.to(self.device) for x in inputs[name]))
                    for name, layer in self.layers.items()}


def local_heads(x: torch.Tensor, total: int, local: int, kv: bool) -> torch.Tensor:
    """This TP rank's heads of x [T, total * d]."""
    tp, rank = pd.get_tensor_model_parallel_world_size(), pd.get_tensor_model_parallel_rank()
    first = rank * local if not kv or tp <= total else rank // (tp // total)
    return x.view(x.shape[0], total, -1)[:, first:first + local].flatten(1)


def run_case(case: dict, device) -> int:
    """One layer configuration over STEPS; returns how many outputs were compared."""
    tp, dcp = pd.get_tensor_model_parallel_world_size(), pd.get_decode_context_parallel_world_size()
    heads, kv_heads, d = case["heads"], case["kv_heads"], case.get("head_size", 32)
    dtype, block_size = case.get("dtype", torch.float32), case.get("block_size", 16)
    backend = FlashAttentionDiffKVBackend if case.get("head_size_v") else FlashAttentionBackend
    if case.get("head_size_v"):
        FlashAttentionDiffKVBackend.set_head_size_v(case["head_size_v"])
    dv = case.get("head_size_v") or d
    extra = dict(n=1, head_size=d, block_size=block_size, dtype=dtype,
                 cache_dtype=case.get("cache_dtype", "auto"),
                 logits_soft_cap=case.get("softcap"),
                 per_layer_sliding_window=case.get("window"))
    if case.get("alibi"):
        extra["alibi_slopes"] = [2.0 ** -(h + 1) for h in range(heads)]
    if case.get("sinks"):
        extra["sinks"] = torch.linspace(-1.0, 2.0, heads)  # all heads: sliced per TP rank
    with single_process():
        ref_layers = make_layers(backend, num_heads=heads, num_kv_heads=kv_heads, **extra)
    local, local_kv = pd.tp_attention_heads(heads, kv_heads)
    layers = make_layers(backend, num_heads=local, num_kv_heads=local_kv, **extra)
    single = Runner(ref_layers, block_size, dtype, device, EngineConfig(enable_cascade=False),
                    KVSharding())
    sharding = KVSharding(dcp, pd.get_decode_context_parallel_rank(), case.get("interleave", 1))
    config = EngineConfig(enable_cascade=False, tensor_parallel_size=tp,
                          decode_context_parallel_size=dcp,
                          dcp_kv_cache_interleave_size=sharding.interleave)
    sharded = Runner(layers, block_size, dtype, device, config, sharding)
    g = torch.Generator().manual_seed(case.get("seed", 0))  # the same inputs on every rank
    compared = 0
    for req_ids, query_lens in STEPS:
        t = sum(query_lens)
        inputs = {name: (randn(t, heads * d, dtype=dtype, generator=g),
                         randn(t, kv_heads * d, dtype=dtype, generator=g),
                         randn(t, kv_heads * dv, dtype=dtype, generator=g))
                  for name in ref_layers}
        want = single.step(req_ids, query_lens, inputs)
        got = sharded.step(req_ids, query_lens, {
            name: (local_heads(q, heads, local, False), local_heads(k, kv_heads, local_kv, True),
                   local_heads(v, kv_heads, local_kv, True)) for name, (q, k, v) in inputs.items()})
        for name in ref_layers:
            tol = FP8_TOLERANCE if case.get("cache_dtype", "auto").startswith("fp8") else {}
            assert_close(got[name], local_heads(want[name], heads, local, False), dtype,
                         **({"atol": 1e-3, "rtol": 1e-3} if tol else {}))
            compared += 1
    return compared


# (tp, dcp) -> layer configurations; a world of 4 ranks has two TP groups at tp = 2.
CASES = {
    (2, 2): [  # one KV head (replicated), two query heads per rank
        dict(heads=4, kv_heads=1, cache_dtype="bfloat16"),  # fp32 model, bf16 cache
        dict(heads=4, kv_heads=1, window=7, interleave=3, block_size=8),
        dict(heads=4, kv_heads=1, alibi=True, softcap=5.0, sinks=True, interleave=16),
        dict(heads=4, kv_heads=1, cache_dtype="fp8_e4m3"),
        dict(heads=4, kv_heads=1, head_size_v=16, interleave=16),
        dict(heads=4, kv_heads=1, dtype=torch.bfloat16, window=11, alibi=True, sinks=True,
             softcap=8.0),
    ],
    (4, 2): [dict(heads=8, kv_heads=2),
             dict(heads=8, kv_heads=2, window=9, alibi=True, interleave=16, sinks=True)],
    (4, 4): [dict(heads=8, kv_heads=1, interleave=4, softcap=3.0)],
}


def check_errors() -> None:
    """Sizes that do not divide the heads, DCP over KV heads that are not replicated, and a
    backend without DCP."""
    for heads, kv_heads, match in ((3, 1, "num_heads=3 is not divisible"),
                                   (4, 2, "needs every KV head on a multiple")):
        try:
            pd.tp_attention_heads(heads, kv_heads)
        except ValueError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"tp_attention_heads({heads}, {kv_heads}) did not raise")
    try:
        make_layers(TorchSDPABackend, num_heads=2, num_kv_heads=1)
    except ValueError as e:
        assert "does not support decode context parallelism" in str(e), str(e)
    else:
        raise AssertionError("a TORCH_SDPA layer was built under DCP")


def run_rank(rank: int, world: int, init_method: str, out_dir: str, job: str,
             backend: str = "gloo", device: str = "cpu") -> None:
    """Entry point of one rank; writes {"compared": n} or {"error": ...} to out_dir/rank.json."""
    result: dict = {}
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=20))
        dev = torch.device(device)
        if job == "cases":
            compared = 0
            for (tp, dcp), cases in CASES.items():
                if world % tp:
                    continue
                pd.init_parallel_groups(tp, dcp, timeout=datetime.timedelta(seconds=20))
                if tp == 2:
                    check_errors()
                for case in cases:
                    compared += run_case(case, dev)
            result["compared"] = compared
        elif job == "die":
            result.update(die_mid_step(rank, dev))
        pd.destroy_parallel_groups()
        dist.destroy_process_group()
    except BaseException as e:  # reported to the parent test
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def die_mid_step(rank: int, device) -> dict:
    """Rank 1 exits just before the step's collectives; rank 0 must fail, not hang."""
    import time

    pd.init_parallel_groups(2, 2, timeout=datetime.timedelta(seconds=5))
    layers = make_layers(FlashAttentionBackend, n=1, num_heads=2, num_kv_heads=1, head_size=32)
    config = EngineConfig(enable_cascade=False, tensor_parallel_size=2,
                          decode_context_parallel_size=2)
    runner = Runner(layers, 16, torch.float32, device, config, KVSharding(2, rank))
    x = randn(3, 64), randn(3, 32), randn(3, 32)
    dist.barrier()
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        runner.step(["a"], [3], {"layers.0.attn": x})
    except pd.ParallelGroupError as e:
        return {"raised": type(e).__name__, "message": str(e)[:300],
                "seconds": time.monotonic() - start}
    return {"raised": None}


if __name__ == "__main__":  # torchrun --nproc-per-node 2 tests/dcp_worker.py
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    out = os.environ.get("OUT", ".")
    run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", out, "cases",
             backend="nccl", device=f"cuda:{local_rank}")
    print(Path(out, f"{os.environ['RANK']}.json").read_text())
