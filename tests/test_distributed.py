"""Tensor-parallel heads and decode context parallelism across processes (gloo on CPU): every
rank's heads equal the single-process result, through the Attention layer and the builder.
The rank code is tests/dcp_worker.py; on GPUs run it with NCCL (see its docstring)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_worker
from pagedattn import EngineConfig, distributed
from pagedattn.backends.flash_attn import FlashAttentionMetadataBuilder
from pagedattn.metadata import AttentionSpec


def _spawn(world: int, job: str, out_dir: Path, timeout: float = 120.0) -> dict[int, dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=dcp_worker.run_rank,
                         args=(rank, world, f"tcp://127.0.0.1:{port}", str(out_dir), job))
             for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:  # a rank still running after the timeout is a hang: fail, do not wait
        if p.is_alive():
            p.kill()
            pytest.fail(f"rank process {p.pid} hung ({job}, world {world})")
    return {int(f.stem): json.loads(f.read_text()) for f in out_dir.glob("*.json")}


def test_sharded_ranks_equal_the_single_process_result(tmp_path):
    """4 ranks: DCP groups of 2 (tp 2, twice; tp 4 with 2 KV heads) and of 4 (tp 4)."""
    world = 4
    results = _spawn(world, "cases", tmp_path)
    assert sorted(results) == list(range(world))
    for rank, result in results.items():
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["compared"] > 0


def test_a_rank_that_dies_mid_step_fails_the_others_without_a_hang(tmp_path):
    results = _spawn(2, "die", tmp_path, timeout=60.0)
    assert 0 in results and "error" not in results[0], results
    assert results[0]["raised"] == "ParallelGroupError", results[0]
    assert "decode context parallel group" in results[0]["message"]
    assert results[0]["seconds"] < 30


def test_groups_default_to_one_process():
    assert distributed.get_tensor_model_parallel_world_size() == 1
    assert distributed.get_decode_context_parallel_rank() == 0
    assert distributed.tp_attention_heads(8, 2) == (8, 2)
    assert not distributed.parallel_groups_initialized()


def test_parallel_sizes_need_an_initialised_process_group():
    with pytest.raises(distributed.ParallelGroupError, match="init_process_group"):
        distributed.init_parallel_groups(2, 2)
    with pytest.raises(ValueError, match="must divide tensor_parallel_size"):
        distributed.init_parallel_groups(2, 4)


def test_dcp_builder_without_initialised_groups_is_refused():
    config = EngineConfig(enable_cascade=False, tensor_parallel_size=2,
                          decode_context_parallel_size=2)
    spec = AttentionSpec(16, 1, 32, torch.float32)
    with pytest.raises(distributed.ParallelGroupError, match="init_parallel_groups"):
        FlashAttentionMetadataBuilder(spec, [], config, torch.device("cpu"))


def test_cascade_with_dcp_is_refused():
    with pytest.raises(ValueError, match="cascade attention is not exact"):
        EngineConfig(tensor_parallel_size=2, decode_context_parallel_size=2)


@pytest.mark.cuda
def test_nccl_on_two_gpus(tmp_path):
    """The same cases with NCCL on 2 GPUs, launched as torchrun would."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         dcp_worker.__file__], env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert "error" not in result and result["compared"] > 0, result
