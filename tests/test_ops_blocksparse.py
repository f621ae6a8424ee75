"""Block-sparse ops against the float64 oracle with the pattern's dense mask: the prefill module
(`LocalStridedBlockSparseAttn`) and the paged decode (`blocksparse_paged_attention`) over the
v0 cache, on the PyTorch provider and the Triton kernels (interpreter on CPU, GPU with CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before pagedattn.ops.triton defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import reference as ref
from conftest import FP8_TOLERANCE, assert_close, cu_seqlens, poison
from pagedattn.ops import LocalStridedBlockSparseAttn, blocksparse_paged_attention
from pagedattn.ops.paged_attn import PagedAttention
from pagedattn.ops.providers import use_provider

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROVIDERS = ["torch", "triton"]
# (local_blocks, vert_stride, block_size, head_sliding_step): step 0 is homo_head, < 0 is
# homo_head_group (per KV head); 24 is a block size that is not a power of two.
PATTERNS = [(2, 3, 16, 1), (1, 4, 16, 0), (0, 2, 16, -1), (3, 8, 32, 2), (1, 2, 24, 1)]


@pytest.fixture(params=PROVIDERS)
def provider(request, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", request.param)
    return request.param


def head_mask(num_heads, num_kv_heads, head_base, step, block_size, local_blocks, vert_stride):
    """The oracle's per-head mask for this rank's heads (head_base = first global head)."""
    group = num_heads // num_kv_heads

    def mask(h, q_pos, k_pos):
        offset = ref.blocksparse_offset(head_base + h, group, step)
        return ref.blocksparse_visible(q_pos, k_pos, offset=offset, block_size=block_size,
                                       local_blocks=local_blocks, vert_stride=vert_stride)
    return mask


def run_prefill(q_lens, k_lens, num_heads, num_kv_heads, head_size, pattern, dtype=torch.float32,
                n_heads_total=None, head_range=None, seed=0):
    local_blocks, vert_stride, block_size, step = pattern
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), num_heads, head_size, generator=g).to(dtype)
    k = torch.randn(sum(k_lens), num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(sum(k_lens), num_kv_heads, head_size, generator=g).to(dtype)
    attn = LocalStridedBlockSparseAttn(n_heads_total or num_heads, 4096, local_blocks,
                                       vert_stride, block_size, active_head_range=head_range,
                                       head_sliding_step=step)
    out = poison(q.shape, dtype, DEVICE)
    result = attn(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu_seqlens(k_lens, DEVICE),
                  cu_seqlens(q_lens, DEVICE), sm_scale=head_size ** -0.5, out=out)
    assert result is out
    mask = head_mask(num_heads, num_kv_heads, attn.active_head_range[0], step, block_size,
                     local_blocks, vert_stride)
    want, _ = ref.varlen_attention(q, k, v, q_lens, k_lens, scale=head_size ** -0.5,
                                   head_mask=mask)
    assert_close(out, want, dtype)
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
def test_prefill_patterns(provider, pattern):
    # Queries are the last q_len positions: sequence 1 starts mid-block, sequence 2 is short.
    run_prefill([40, 21, 5], [40, 53, 5], num_heads=2, num_kv_heads=1, head_size=64,
                pattern=pattern)


@pytest.mark.parametrize("heads,head_size,dtype", [((2, 2), 128, torch.float32),
                                                   ((4, 2), 64, torch.bfloat16)])
def test_prefill_mha_gqa_head_sizes_dtypes(provider, heads, head_size, dtype):
    run_prefill([33, 18], [33, 18], *heads, head_size, (1, 3, 16, 1), dtype=dtype)


def test_prefill_tensor_parallel_rank_sees_its_global_heads(provider):
    # Rank 1 of 2 holds heads 4..7 of 8: its offsets are those of global heads 4..7.
    for step in (1, -1):
        run_prefill([40], [40], 4, 2, 32, (1, 4, 8, step), n_heads_total=8, head_range=(4, 8))


@pytest.mark.parametrize("pattern", [(0, 1, 16, 1), (8, 5, 16, 1)])
def test_prefill_dense_limits_equal_causal_attention(provider, pattern):
    out = run_prefill([50, 9], [50, 30], 2, 1, 64, pattern)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, generator=g) for n, h in ((59, 2), (80, 1), (80, 1)))
    want, _ = ref.varlen_attention(q, k, v, [50, 9], [50, 30], scale=0.125)
    assert_close(out, want)


def test_module_defaults_follow_vllm():
    attn = LocalStridedBlockSparseAttn(8, 256, 2, 16, 32)
    assert attn.head_sliding_step == 2 and attn.active_head_range == (0, 8)
    assert LocalStridedBlockSparseAttn(8, 256, 2, 4, 32, homo_head=True).head_sliding_step == 0
    mask = attn.dense_mask(1024)
    assert mask.shape == (8, 1024, 1024) and not mask.triu(1).any()
    assert not torch.equal(mask[0], mask[1])  # heads slide over the vertical blocks


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size=0"), (dict(local_blocks=-1), "local_blocks=-1"),
    (dict(vert_stride=0), "vert_stride=0"), (dict(active_head_range=(4, 9)), "active_head"),
    (dict(q_block_size=24), "q_block_size=24"), (dict(n_heads=0), "n_heads=0")])
def test_module_rejects_bad_arguments(kwargs, match):
    args = dict(n_heads=8, max_seqlen=64, local_blocks=1, vert_stride=2, block_size=16)
    with pytest.raises(ValueError, match=match):
        LocalStridedBlockSparseAttn(**{**args, **kwargs})


def test_module_rejects_bad_inputs():
    attn = LocalStridedBlockSparseAttn(4, 64, 1, 2, 16)
    q, k = torch.randn(10, 4, 64), torch.randn(10, 2, 64)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        attn(q[0], k, k, cu)
    with pytest.raises(ValueError, match="pass cu_seqlens_q"):
        attn(q[:5], k, k, cu)
    with pytest.raises(ValueError, match="active_head_range"):
        attn(torch.randn(10, 2, 64), k, k, cu)
    with pytest.raises(TypeError, match="cu_seqlens_k has dtype torch.int64"):
        attn(q, k, k, cu.long())
    with pytest.raises(ValueError, match=r"out has shape \(10, 2, 64\); expected \(10, 4, 64\)"):
        attn(q, k, k, cu, out=torch.empty(10, 2, 64))
    with pytest.raises(TypeError, match="sm_scale='x' must be a number"):
        attn(q, k, k, cu, sm_scale="x")


# --- decode over the v0 paged cache ---------------------------------------------------------
def v0_batch(seq_lens, num_heads, num_kv_heads, head_size, page, dtype, cache_dtype="auto",
             scales=(1.0, 1.0), seed=0):
    """Query, v0 caches (scattered blocks, written through PagedAttention) and the K/V the
    oracle should see (read back from the cache, so fp8 rounding is the cache's own)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // page) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    storage = {"auto": dtype, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}[cache_dtype]
    kv_cache = torch.full(PagedAttention.get_kv_cache_shape(num_blocks, page, num_kv_heads,
                                                            head_size), float("nan"))
    kv_cache = kv_cache.to(storage).to(DEVICE)
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, num_kv_heads, head_size)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    keys, values, start = [], [], 0
    for r, s in enumerate(seq_lens):
        table[r, :blocks[r]] = perm[start:start + blocks[r]].to(torch.int32)
        start += blocks[r]
        k, v = (torch.randn(s, num_kv_heads, head_size, generator=g).to(dtype) for _ in "kv")
        pos = torch.arange(s)
        slots = table[r].long()[pos // page] * page + pos % page
        with use_provider("torch" if DEVICE == "cpu" else "auto"):  # fast set-up on CPU
            PagedAttention.write_to_paged_cache(k.to(DEVICE), v.to(DEVICE), key_cache,
                                                value_cache, slots.to(DEVICE), cache_dtype,
                                                *scales)
        kc = key_cache[table[r].long()].cpu().double().permute(0, 3, 1, 2, 4)  # [b, page, h, .]
        vc = value_cache[table[r].long()].cpu().double().permute(0, 3, 1, 2)
        keys.append(kc.reshape(-1, num_kv_heads, head_size)[:s] * scales[0])
        values.append(vc.reshape(-1, num_kv_heads, head_size)[:s] * scales[1])
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=g).to(dtype)
    return query, key_cache, value_cache, table.to(DEVICE), keys, values


def check_decode(seq_lens, pattern, num_heads=2, num_kv_heads=1, head_size=64, page=8,
                 dtype=torch.float32, cache_dtype="auto", scales=(1.0, 1.0), tp_rank=0,
                 alibi=False, kernel_args=None, **tol):
    """The public op (or, with kernel_args such as num_splits / tiles, the Triton provider's
    paged_decode itself) against the oracle with the pattern's mask."""
    local_blocks, vert_stride, block_size, step = pattern
    query, key_cache, value_cache, table, keys, values = v0_batch(
        seq_lens, num_heads, num_kv_heads, head_size, page, dtype, cache_dtype, scales)
    slopes = torch.linspace(-0.3, 0.2, num_heads) if alibi else None
    out = poison(query.shape, dtype, DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    if kernel_args is None:
        blocksparse_paged_attention(
            query.to(DEVICE), key_cache, value_cache, table, lens, 0.125, local_blocks,
            vert_stride, block_size, step, kv_cache_dtype=cache_dtype,
            num_kv_heads=num_kv_heads, alibi_slopes=None if slopes is None else slopes.to(DEVICE),
            k_scale=scales[0], v_scale=scales[1], tp_rank=tp_rank, out=out)
    else:
        from pagedattn.ops.triton.blocksparse_decode import paged_decode
        fp8_scales = [None if cache_dtype == "auto" else torch.tensor(x, device=DEVICE)
                      for x in scales]
        paged_decode(query.to(DEVICE), key_cache, value_cache, out, block_tables=table,
                     seq_lens=lens, scale=0.125, head_base=tp_rank * num_heads,
                     head_sliding_step=step, block_size=block_size, local_blocks=local_blocks,
                     vert_stride=vert_stride, alibi_slopes=None if slopes is None else
                     slopes.to(DEVICE), k_scale=fp8_scales[0], v_scale=fp8_scales[1],
                     max_seq_len=max(seq_lens), **kernel_args)
    mask = head_mask(num_heads, num_kv_heads, tp_rank * num_heads, step, block_size,
                     local_blocks, vert_stride)
    want = torch.cat([ref.attend_one_sequence(
        query[r:r + 1], keys[r], values[r], scale=0.125, head_mask=mask,
        alibi_slopes=None if slopes is None else slopes.tolist())[0]
        for r in range(len(seq_lens))])
    assert_close(out, want, dtype, **tol)


# Positions either side of the sparse-block edges (16 and 32): the query's own block changes.
EDGES = [1, 16, 17, 32, 33]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_decode_patterns_at_block_edges(provider, pattern):
    block_size = pattern[2]
    check_decode([block_size, block_size + 1, 2 * block_size - 1, 2 * block_size + 1], pattern)


def test_decode_dtypes_alibi_gqa_and_head_128(provider):
    # 4 heads per KV head, 3 vertical classes: heads 0 and 3 share theirs.
    check_decode([17, 40], (1, 3, 16, 1), num_heads=8, num_kv_heads=2, dtype=torch.bfloat16,
                 alibi=True)
    check_decode([5, 40], (2, 2, 16, -1), num_heads=4, num_kv_heads=2, head_size=128,
                 dtype=torch.float16)


def test_decode_fp8_cache(provider):
    check_decode([16, 33], (1, 2, 16, 1), dtype=torch.float16, cache_dtype="fp8_e4m3",
                 scales=(0.05, 0.02), **FP8_TOLERANCE)


@pytest.mark.parametrize("step", [1, -1])
def test_decode_tensor_parallel_rank_offsets_heads(provider, step):
    check_decode([40, 63], (1, 4, 16, step), num_heads=4, num_kv_heads=2, tp_rank=1)


@pytest.mark.parametrize("pattern", [(0, 1, 8, 1), (100, 7, 16, 1)])
def test_decode_dense_limits_equal_causal_attention(provider, pattern):
    check_decode(EDGES, pattern)


@pytest.mark.parametrize("pattern", [(1, 3, 8, 1), (0, 2, 16, -1), (2, 4, 8, 0)])
def test_decode_kernel_splits_and_wide_tiles_equal_the_oracle(pattern):
    # Tiles of several sparse blocks (with dead chunks past the window), split-KV into the
    # builder-style workspace and its reduce, and the peeled last tile in every split layout.
    from pagedattn.ops.triton.blocksparse_decode import decode_workspace
    workspace = decode_workspace(torch.device(DEVICE), 4, 8, 2, 64)
    for kernel_args in (dict(tiles=(32, 4, 1)), dict(num_splits=3, workspace=workspace),
                        dict(num_splits=2, tiles=(32, 4, 1))):
        check_decode([1, 8, 45, 70], pattern, num_heads=8, num_kv_heads=2,
                     kernel_args=kernel_args)


def test_decode_wave_splits_follow_the_dense_rule_where_programs_fill_the_sms(monkeypatch):
    from pagedattn.ops.triton import launch
    from pagedattn.ops.triton.blocksparse_decode import decode_workspace, split_count
    cpu = torch.device("cpu")  # launch.sm_count: 4 SMs off CUDA
    args = (cpu, 2, 8, 2, 1500, 1, 16, 1, 3)  # 2 seqs x 2 KV heads: 4 programs, 1 a SM
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_splits", None)
    assert split_count(*args) == 1
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_splits", "waves")
    assert split_count(*args) == launch.decode_splits(4, 4, 1500) == 2
    assert split_count(*args, kv_bytes=1) == launch.decode_splits(4, 4, 1500, 1)
    assert split_count(cpu, 1, 8, 2, 1500, 1, 16, 1, 3) == 4  # below the SMs: auto_splits
    rows = decode_workspace(cpu, 2, 8, 2, 64)[1].shape[0]
    assert rows >= split_count(*args, kv_bytes=1) * 2 * 8
    for bad in ("dense", 0, launch.MAX_SPLITS + 1, True, 2.0):
        monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_splits", bad)
        with pytest.raises(ValueError, match=rf"blocksparse_decode_splits={bad!r} must be "
                                             r"None, one of \('waves', 'short fill'\) or an "
                                             r"int in \[1, 64\]"):
            split_count(*args)


def test_decode_short_fill_and_forced_splits(monkeypatch):
    # "short fill": the wave model with a one-tile fill, which splits B64 L16k's homo-head
    # programs (512 of 2,368 keys over 132 SMs: 1.29 waves unsplit) where "waves" does not;
    # an int forces the count, and the scratch follows the rule in force.
    from pagedattn.ops.triton import blocksparse_schedule, launch
    from pagedattn.ops.triton.blocksparse_decode import decode_workspace, split_count
    assert launch.decode_splits(132, 512, 2368) == 1
    assert launch.decode_splits(132, 512, 2368, fill_keys=128) == 2
    assert launch.decode_splits(132, 256, 4416, fill_keys=128) == 1  # B32 L32k: unchanged
    cpu = torch.device("cpu")  # 4 SMs: 16 programs of 600 keys
    args = (cpu, 8, 8, 2, 4800, 0, 64, 4, 8)
    keys = (4 + 1) * 64 + 4800 // 8
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_splits", "short fill")
    assert split_count(*args) == launch.decode_splits(
        4, 16, keys, fill_keys=blocksparse_schedule.SHORT_FILL_KEYS)
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_splits", 3)
    assert split_count(*args) == split_count(cpu, 1, 8, 2, 64, 1, 16, 0, 1) == 3
    assert decode_workspace(cpu, 8, 8, 2, 64)[1].shape[0] == 3 * 8 * 8


@pytest.mark.parametrize("case", [
    dict(pattern=(2, 4, 16, 0), splits=3),  # homo head, forced splits
    dict(pattern=(1, 3, 16, 1), splits="short fill"),  # per head, 3 classes of 4 heads
    dict(pattern=(0, 2, 8, -1), splits="waves"),
])
def test_decode_split_rules_equal_the_oracle(monkeypatch, case):
    # The split rules of v31's A/B variants through the public op (GQA 4, one and several
    # vertical classes).
    from pagedattn.ops.triton import launch
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_splits", case["splits"])
    check_decode([1, 64, 1500, 1203], case["pattern"], num_heads=8, num_kv_heads=2)


@pytest.mark.parametrize("pattern", [(1, 3, 16, 1), (0, 1, 8, 1)])
def test_decode_switched_tiles_and_wave_splits_equal_the_oracle(monkeypatch, pattern):
    # The A/B variants of tools/ab_blocksparse_decode.py through the public op: wider tiles
    # with a register cap (which the interpreter ignores) and the wave rule's two splits.
    from pagedattn.ops.triton import launch
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_tiles", (32, 4, 1, 168))
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_splits", "waves")
    check_decode([1500, 1203], pattern, num_heads=8, num_kv_heads=2)


@pytest.mark.parametrize("case", [
    dict(pattern=(1, 3, 16, 1), tiles=(32, 4, 1)),  # 4 pages a tile, 2 sparse blocks
    dict(pattern=(0, 2, 8, -1), tiles=(32, 4, 1), num_splits=3),  # 1-page chunks, split
    dict(pattern=(2, 4, 32, 0), tiles=(16, 4, 1), head_size=80),  # padded head: masked K
    dict(pattern=(1, 2, 16, 1), dtype=torch.float16, cache_dtype="fp8_e4m3",
         scales=(0.05, 0.02), **FP8_TOLERANCE),  # the public op: X = 16, descaled
])
def test_decode_key_lines_equal_the_oracle(monkeypatch, case):
    # SWITCHES.blocksparse_decode_key_lines: K gathered page by page as [pages, D / X,
    # PAGE x X] runs and reshaped (full tiles and the peeled last one, keys past the end of
    # its last page masked); a cache block of 32 over 16-key tiles keeps the [D, N] load.
    # Page lines off: an entry a key, as the key loop widens and reduces it.
    from pagedattn.ops.triton import launch
    from pagedattn.ops.triton.blocksparse_decode import decode_workspace
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_key_lines", True)
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_page_lines", False)
    case = dict(case)
    pattern, tiles, splits = case.pop("pattern"), case.pop("tiles", None), case.pop(
        "num_splits", 0)
    kernel_args = None if tiles is None else dict(tiles=tiles, num_splits=splits)
    if splits:
        kernel_args["workspace"] = decode_workspace(torch.device(DEVICE), 4, 8, 2,
                                                    case.get("head_size", 64))
    check_decode([1, 8, 45, 70], pattern, num_heads=8, num_kv_heads=2, kernel_args=kernel_args,
                 **case)
    if pattern[2] % 32 == 0:
        check_decode([3, 40], pattern, num_heads=4, num_kv_heads=2, page=32,
                     kernel_args=kernel_args, **case)


def check_decode_forms(case: dict) -> None:
    """A switch test's case (the switches already set) against the oracle: unsplit or split
    as the case says, pages of 8 and of 16, fp8 caches within their quantisation bound."""
    from pagedattn.ops.triton.blocksparse_decode import decode_workspace
    pattern, (heads, kv_heads) = case.pop("pattern"), case.pop("heads")
    tiles, splits = case.pop("tiles", (16, 4, 1)), case.pop("num_splits", 1)
    head_size = case.pop("head_size", 64)
    fp8 = case.get("cache_dtype", "auto") != "auto"
    tol = dict(FP8_TOLERANCE, scales=(0.05, 0.02)) if fp8 else {}
    kernel_args = dict(tiles=tiles, num_splits=splits, workspace=decode_workspace(
        torch.device(DEVICE), 4, heads, kv_heads, head_size))
    check_decode([1, 8, 45, 70], pattern, num_heads=heads, num_kv_heads=kv_heads,
                 head_size=head_size, kernel_args=kernel_args, **tol, **case)
    check_decode([3, 40], pattern, num_heads=heads, num_kv_heads=kv_heads, page=16,
                 head_size=head_size, kernel_args=kernel_args, **tol, **case)


@pytest.mark.parametrize("case", [
    dict(pattern=(1, 3, 16, 1), heads=(8, 2)),  # per head, GQA 4, 2 pages a chunk
    dict(pattern=(2, 8, 16, 1), heads=(8, 1), tiles=(32, 4, 1), num_splits=3),  # GQA 8
    dict(pattern=(2, 4, 32, 0), heads=(8, 2), tiles=(32, 4, 1), num_splits=2),  # homo head
    dict(pattern=(1, 2, 16, -1), heads=(2, 2), head_size=80),  # GQA 1, padded head
    dict(pattern=(1, 4, 16, 1), heads=(8, 2), dtype=torch.float16, cache_dtype="fp8_e4m3"),
    dict(pattern=(2, 8, 16, 0), heads=(8, 1), tiles=(32, 4, 1), num_splits=3,
         dtype=torch.float16, cache_dtype="fp8_e4m3"),
    dict(pattern=(1, 4, 16, 1), heads=(8, 2), tiles=(32, 4, 1), num_splits=2,
         dtype=torch.bfloat16, cache_dtype="fp8_e5m2"),
    dict(pattern=(2, 2, 32, -1), heads=(2, 2), dtype=torch.float16, cache_dtype="fp8_e5m2"),
    # a bf16 cache in the GPU's four-an-SM tiles: 64 keys (4 pages), head 128, sparse block 64
    dict(pattern=(1, 8, 64, 1), heads=(8, 2), tiles=(64, 4, 2, 128), head_size=128,
         dtype=torch.bfloat16),
    # V by key over 16-bit and fp8 caches (value_lines off), lines by default
    dict(pattern=(1, 8, 64, 1), heads=(8, 2), tiles=(64, 4, 2, 128), head_size=128,
         dtype=torch.bfloat16, value_lines=False),
    dict(pattern=(2, 4, 32, 0), heads=(8, 2), tiles=(32, 4, 1), num_splits=2, head_size=80,
         value_lines=None),
    dict(pattern=(2, 8, 16, 0), heads=(8, 1), tiles=(32, 4, 1), num_splits=3,
         dtype=torch.float16, cache_dtype="fp8_e4m3", value_lines=False),
])
def test_decode_page_lines_equal_the_oracle(monkeypatch, case):
    # SWITCHES.blocksparse_decode_page_lines: one block-table entry a page, K gathered as
    # whole lines from them and V too (by key with `value_lines` off), the peeled last
    # tile's pages clamped to the last one, V past the end zeroed over NaN slots; per-head
    # and homo-head patterns, GQA 1 / 4 / 8, unsplit and split, 16-bit and fp8 caches
    # (descaled).
    from pagedattn.ops.triton import launch
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_page_lines", True)
    case = dict(case)
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_value_lines",
                        case.pop("value_lines", None))
    check_decode_forms(case)


@pytest.mark.parametrize("case", [
    # bf16, page lines, the GPU's four-an-SM tiles (64 keys, head 128, sparse block 64)
    dict(pattern=(1, 8, 64, 1), heads=(8, 2), tiles=(64, 4, 2, 128), head_size=128,
         dtype=torch.bfloat16, page_lines=True),
    dict(pattern=(1, 3, 16, 1), heads=(8, 2), tiles=(32, 4, 1), num_splits=3,
         page_lines=False),  # an entry a key, splits that see no tile (l = 0, LSE -inf)
    dict(pattern=(2, 4, 32, 0), heads=(8, 2), num_splits=2, head_size=80,
         page_lines=True),  # homo head, padded head, 16-key tiles: many rescales
    dict(pattern=(0, 2, 16, -1), heads=(4, 2), alibi=True, page_lines=False),
    dict(pattern=(1, 4, 16, 1), heads=(8, 2), tiles=(32, 4, 1), dtype=torch.float16,
         cache_dtype="fp8_e4m3", page_lines=None),  # page lines by default
])
def test_decode_slot_sums_equal_the_oracle(monkeypatch, case):
    # SWITCHES.blocksparse_decode_slot_sums: each key slot's running sum rescaled with the
    # row's max and the slots summed once after the loop, over the key loop's forms (page
    # lines or an entry a key; full tiles and the peeled last one; split and unsplit).
    from pagedattn.ops.triton import launch
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_slot_sums", True)
    case = dict(case)
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_page_lines",
                        case.pop("page_lines"))
    check_decode_forms(case)


@pytest.mark.parametrize("switch", [None, 1, "on"])
def test_decode_slot_sums_must_be_a_bool(monkeypatch, switch):
    from pagedattn.ops.triton import launch
    from pagedattn.ops.triton.blocksparse_schedule import slot_sums
    assert slot_sums() is False  # off until measured
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_slot_sums", switch)
    with pytest.raises(ValueError, match=r"SWITCHES.blocksparse_decode_slot_sums=.* must be "
                                         r"a bool"):
        slot_sums()


@pytest.mark.parametrize("switch", [1, "on"])
@pytest.mark.parametrize("name", ["key_lines", "page_lines", "value_lines"])
def test_decode_line_switches_are_on_unless_set_and_must_be_none_or_a_bool(monkeypatch, name,
                                                                          switch):
    # Each line form is on by default over every cache, off where set False, and refused
    # where set to anything but None or a bool (`blocksparse_schedule.on_unless_set`)
    from pagedattn.ops.triton import blocksparse_schedule as bs
    from pagedattn.ops.triton import launch
    form = {"key_lines": bs.key_lines, "value_lines": bs.value_lines,
            "page_lines": lambda: bs.page_lines(64, 16, 64)}[name]
    assert form() is True
    monkeypatch.setattr(launch.SWITCHES, f"blocksparse_decode_{name}", False)
    assert form() is False
    monkeypatch.setattr(launch.SWITCHES, f"blocksparse_decode_{name}", switch)
    with pytest.raises(ValueError, match=rf"SWITCHES.blocksparse_decode_{name}=.* must be "
                                         r"None \(on\) or a bool"):
        form()


def test_decode_page_lines_only_where_chunks_start_on_pages(monkeypatch):
    from pagedattn.ops.triton import launch
    from pagedattn.ops.triton.blocksparse_schedule import page_lines
    # by default over every cache (the H200 measured them faster over bf16 and e4m3)
    assert page_lines(128, 16, 64) and page_lines(16, 16, 16)
    assert not page_lines(16, 32, 16)  # a cache block larger than the tile's chunks
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_page_lines", False)
    assert not page_lines(128, 16, 64)
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_page_lines", True)
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_key_lines", False)
    assert not page_lines(128, 16, 64)  # the [D, N] K load takes an entry a key


@pytest.mark.parametrize("tiles", [(48, 4, 1), (64, 3, 2), (64, 4), (64, 4, 0), [64, 4, 2]])
def test_decode_tiles_must_be_powers_of_two_and_positive(monkeypatch, tiles):
    from pagedattn.ops.triton import launch
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_tiles", tiles)
    with pytest.raises(ValueError, match=r"SWITCHES.blocksparse_decode_tiles=.* must be "
                                         r"\(BLOCK_N, warps, stages\)"):
        check_decode([20], (1, 2, 16, 1))


def test_decode_cache_blocks_larger_than_a_tile(provider):
    # Cache block 32 over 16-key tiles (the interpreter's): columns by division, not chunks.
    check_decode([1, 31, 33, 100], (1, 2, 32, 1), num_heads=4, num_kv_heads=2, page=32)


def test_forward_decode_default_is_dense():
    query, key_cache, value_cache, table, keys, values = v0_batch(EDGES, 4, 2, 64, 8,
                                                                  torch.float32)
    seq_lens = torch.tensor(EDGES, dtype=torch.int32, device=DEVICE)
    out = PagedAttention.forward_decode(query.to(DEVICE), key_cache, value_cache, table,
                                        seq_lens, None, "auto", 2, 0.125, None, 1.0, 1.0)
    want = torch.cat([ref.attend_one_sequence(query[r:r + 1], keys[r], values[r],
                                              scale=0.125)[0] for r in range(len(EDGES))])
    assert_close(out, want)


def test_decode_errors():
    query, key_cache, value_cache, table, _, _ = v0_batch([20], 4, 2, 64, 8, torch.float32)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    args = (query.to(DEVICE), key_cache, value_cache, table, lens, 0.125)
    with pytest.raises(ValueError, match="blocksparse_block_size=12 must be a multiple of the "
                                         "cache block size 8"):
        blocksparse_paged_attention(*args, 1, 2, 12, 1)
    with pytest.raises(ValueError, match="blocksparse_vert_stride=-1"):
        blocksparse_paged_attention(*args, 1, -1, 16, 1)
    with pytest.raises(ValueError, match="blocksparse_local_blocks=-2"):
        blocksparse_paged_attention(*args, -2, 2, 16, 1)
    with pytest.raises(ValueError, match="num_kv_heads=4 but key_cache has 2"):
        blocksparse_paged_attention(*args, 1, 2, 16, 1, num_kv_heads=4)
    with pytest.raises(ValueError, match="tp_rank=-1"):
        blocksparse_paged_attention(*args, 1, 2, 16, 1, tp_rank=-1)
    with pytest.raises(TypeError, match="kv_cache_dtype='fp8_e4m3' needs"):
        blocksparse_paged_attention(*args, 1, 2, 16, 1, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="value_cache has shape"):
        blocksparse_paged_attention(*args[:2], value_cache[:, :, :32], *args[3:], 1, 2, 16, 1)
    with pytest.raises(ValueError, match="max_seq_len=99"):
        blocksparse_paged_attention(*args, 1, 2, 16, 1, max_seq_len=99)
    with pytest.raises(TypeError, match="max_seq_len='9' must be an int"):
        blocksparse_paged_attention(*args, 1, 2, 16, 1, max_seq_len="9")
    with pytest.raises(TypeError, match=r"out has dtype torch.float16; allowed: \['torch.float32"):
        blocksparse_paged_attention(*args, 1, 2, 16, 1, out=torch.empty_like(args[0]).half())
    with pytest.raises(TypeError, match="scale='x' must be a number"):
        blocksparse_paged_attention(*args[:5], "x", 1, 2, 16, 1)


# --- the v0 cache helper ---------------------------------------------------------------------
def test_v0_cache_views_and_write(provider):
    kv_cache = torch.zeros(PagedAttention.get_kv_cache_shape(3, 4, 2, 16), dtype=torch.float16,
                           device=DEVICE)
    assert kv_cache.shape == (2, 3, 128)
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, 2, 16)
    assert key_cache.shape == (3, 2, 2, 4, 8) and value_cache.shape == (3, 2, 16, 4)
    assert key_cache.data_ptr() == kv_cache.data_ptr()  # views, not copies
    key, value = (torch.randn(3, 2, 16, device=DEVICE).half() for _ in "kv")
    PagedAttention.write_to_paged_cache(key, value, key_cache, value_cache,
                                        torch.tensor([5, -1, 0], device=DEVICE), "auto")
    assert torch.equal(key_cache[1, :, :, 1, :].reshape(2, 16), key[0])  # slot 5: block 1, 1
    assert torch.equal(value_cache[0, :, :, 0], value[2])
    assert kv_cache.count_nonzero() == 2 * 2 * 2 * 16  # the padding token went nowhere
    with pytest.raises(ValueError, match="head_size must be a multiple of x = 16"):
        PagedAttention.split_kv_cache(kv_cache.view(torch.uint8).view(torch.float8_e4m3fn)[
            :, :, :120], 1, 120)


def test_v0_swap_and_copy_blocks():
    src = torch.randn(2, 4, 32)
    dst = torch.zeros(2, 4, 32)
    PagedAttention.swap_blocks(src, dst, {0: 3, 2: 1})
    assert torch.equal(dst[:, 3], src[:, 0]) and torch.equal(dst[:, 1], src[:, 2])
    assert not dst[:, 0].any()
    caches = [torch.randn(2, 4, 32) for _ in range(2)]
    before = [c.clone() for c in caches]
    PagedAttention.copy_blocks(caches, {1: [0, 2]})
    for c, b in zip(caches, before):
        assert torch.equal(c[:, 0], b[:, 1]) and torch.equal(c[:, 2], b[:, 1])
        assert torch.equal(c[:, 3], b[:, 3])


# --- GPU sizes -------------------------------------------------------------------------------
@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("pattern", [(4, 8, 64, 1), (16, 4, 64, -1), (2, 16, 128, 0)])
def test_gpu_sizes_prefill(pattern):
    run_prefill([1500, 600], [1500, 2100], 32, 8, 128, pattern, dtype=torch.bfloat16)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("pattern", [(4, 8, 64, 1), (16, 4, 64, -1)])
def test_gpu_sizes_decode(pattern):
    check_decode([1, 63, 64, 65, 4096, 8191], pattern, num_heads=32, num_kv_heads=8,
                 head_size=128, page=16, dtype=torch.bfloat16)
    check_decode([9000], pattern, num_heads=32, num_kv_heads=8, head_size=128, page=16,
                 dtype=torch.float16, cache_dtype="fp8_e4m3", scales=(0.05, 0.02),
                 **FP8_TOLERANCE)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("tiles", [None, (128, 4, 2, 168)])
@pytest.mark.parametrize("switches", [dict(page_lines=True), dict(slot_sums=True),
                                      dict(page_lines=True, slot_sums=True),
                                      dict(page_lines=True, value_lines=True)])
def test_gpu_sizes_decode_bf16_page_lines_and_slot_sums(monkeypatch, switches, tiles):
    # tools/ab_blocksparse_decode.py's bf16 variants as compiled for the GPU (the default
    # four-an-SM tiles and 128-key tiles capped at 168 registers; page lines with V by key,
    # and as lines), per head and homo head
    from pagedattn.ops.triton import launch
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_tiles", tiles)
    for name, value in switches.items():
        monkeypatch.setattr(launch.SWITCHES, f"blocksparse_decode_{name}", value)
    for pattern in [(4, 8, 64, 1), (4, 8, 64, 0)]:
        check_decode([1, 63, 64, 65, 4096, 8191], pattern, num_heads=32, num_kv_heads=8,
                     head_size=128, page=16, dtype=torch.bfloat16)


def test_four_an_sm_tiles_take_their_own_wave_model(monkeypatch):
    # Over 16-bit caches at head 128 the GPU launches four programs an SM (64-key tiles,
    # 128 registers), which the split model counts with their own draw; on issue 41's rows
    # (132 SMs, 32 q / 8 KV heads, sparse block 64, local 4) it picks the counts the H200
    # measured fastest (KERNEL_NOTES v31): B32 L32k in two splits, B64 L16k unsplit.
    from pagedattn.ops.triton import blocksparse_schedule as bs
    from pagedattn.ops.triton import launch
    from pagedattn.ops.triton.blocksparse_decode import split_count
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    assert bs.default_tiles(128, 2) == bs.FOUR_PER_SM_TILES == (64, 4, 2, 128)
    assert bs.default_tiles(128, 1) == (128, 4, 2, 168)  # e4m3: key lines, 128-key tiles
    assert bs.default_tiles(256, 2) == (64, 4, 2)
    assert bs.programs_per_sm(bs.FOUR_PER_SM_TILES) == (4, bs.FOUR_PER_SM_DRAW)
    assert bs.programs_per_sm((128, 4, 2)) == (launch.DECODE_PROGRAMS_PER_SM, None)
    cuda = torch.device("cpu")  # the device only reaches the patched sm_count
    rows = {  # (batch, context, head_sliding_step, vert_stride): splits
        (32, 32768, 1, 1): 2, (32, 32768, 0, 8): 2, (64, 16384, 0, 8): 1,
        (64, 16384, 1, 1): 1}
    for (batch, ctx, step, vert), want in rows.items():
        assert split_count(cuda, batch, 32, 8, ctx, step, 64, 4, vert) == want, (batch, vert)
    # the three-an-SM model of the other tiles keeps B32 L32k homo head unsplit
    assert split_count(cuda, 32, 32, 8, 32768, 0, 64, 4, 8, 2, 256) == 1
    # and the model itself: two of these programs an SM do not fill its share
    assert launch.decode_splits(132, 256, 4416, fill_keys=128, per_sm=4, draw=0.43) == 2
    assert launch.decode_splits(132, 256, 4416, fill_keys=128) == 1
