"""Batch-invariant mode (issue 44): a request's attention rows, bit for bit, whatever else is
in its batch, however its prompt is cut into chunks, wherever its context blocks lie, and
whether a token runs inside a prompt or as a decode step.

Each example draws a layer and a world of requests (queries and keys over one paged cache,
every request's keys stored twice at scattered blocks: a run that reads the other copy reads
blocks another request wrote, as a prefix-cache hit does). The target request runs alone as
one prompt (checked against the oracle), then chunk by chunk and token by token as decodes,
each inside a random batch of other requests' chunks and decodes in random order, with
random split schedules; every one of its rows and LSEs must have the alone run's bits. CPU:
the PyTorch provider and the Triton kernels under the interpreter (small splits, so that
rows fold several); GPU (`cuda`): the kernels at real sizes from a short list of layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference as ref
from conftest import (
    FP8_TOLERANCE,
    TOLERANCE,
    LayerRunner,
    assert_close,
    check_step,
    cu_seqlens,
    make_layers,
)
from pagedattn import EngineConfig, envs
from pagedattn.backends.flash_attn import FlashAttentionBackend
from pagedattn.backends.flashinfer import FlashInferBackend
from pagedattn.config import batch_invariant_mode
from pagedattn.ops import flash_attn_varlen_func
from pagedattn.ops.batch_invariant import batch_invariant, batch_invariant_enabled
from pagedattn.ops.providers import use_provider
from pagedattn.ops.triton import invariant_config as ic
from pagedattn.ops.triton import launch

FP8 = torch.float8_e4m3fn
KV_SCALE = 0.25  # the fp8 caches' descale


@dataclass(frozen=True)
class Layer:
    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    block_size: int
    window: int = 0  # keys a query sees, itself included; 0: no window
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False

    @property
    def features(self) -> dict:
        """The oracle's keyword arguments (and the op's, by other names)."""
        h = self.num_heads
        return dict(scale=self.head_size ** -0.5,
                    window=(self.window - 1, 0) if self.window else (-1, -1),
                    softcap=self.softcap,
                    alibi_slopes=[2.0 ** -(i + 1) for i in range(h)] if self.alibi else None,
                    sinks=[0.3 * i - 0.5 for i in range(h)] if self.sinks else None)


class World:
    """Requests of given lengths: queries, and keys in a paged cache, each request's twice."""

    def __init__(self, layer: Layer, lengths: list[int], device: str, seed: int):
        self.layer, self.lengths, self.device = layer, lengths, device
        g = torch.Generator().manual_seed(seed)
        bs = layer.block_size
        blocks = [max(1, math.ceil(n / bs)) for n in lengths]
        num_blocks = 2 * sum(blocks) + 1
        perm = torch.randperm(num_blocks, generator=g).tolist()
        width = max(blocks)
        # tables[copy][request]: that copy's blocks (unused columns: block 0)
        self.tables = [torch.zeros(len(lengths), width, dtype=torch.int32) for _ in range(2)]
        self.q = []
        shape = (num_blocks, bs, layer.num_kv_heads)
        k_cache = torch.zeros(*shape, layer.head_size)
        v_cache = torch.zeros(*shape, layer.head_size_v)
        for r, n in enumerate(lengths):
            self.q.append(torch.randn(n, layer.num_heads, layer.head_size, generator=g)
                          .to(layer.dtype))
            k = torch.randn(n, layer.num_kv_heads, layer.head_size, generator=g)
            v = torch.randn(n, layer.num_kv_heads, layer.head_size_v, generator=g)
            for table in self.tables:
                ids = [perm.pop() for _ in range(blocks[r])]
                table[r, :blocks[r]] = torch.tensor(ids, dtype=torch.int32)
                pos = torch.arange(n)
                k_cache[table[r, pos // bs].long(), pos % bs] = k
                v_cache[table[r, pos // bs].long(), pos % bs] = v
        fp8 = layer.cache_dtype == FP8
        self.k_cache, self.v_cache = (
            (c / KV_SCALE).to(FP8) if fp8 else c.to(layer.cache_dtype) for c in (k_cache, v_cache))
        self.k_cache, self.v_cache = self.k_cache.to(device), self.v_cache.to(device)
        self.tables = [t.to(device) for t in self.tables]

    def run(self, parts: list[tuple[int, int, int, int]], num_splits: int = 0
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One batch-invariant call over `parts` (request, copy, first, end): the queries of
        tokens [first, end) of a request, its keys [0, end) read from copy `copy`. Each
        part's (out rows, LSE rows [heads, rows]), on the CPU."""
        layer, f = self.layer, self.layer.features
        q = torch.cat([self.q[r][a:b] for r, _, a, b in parts]).to(self.device)
        table = torch.stack([self.tables[c][r] for r, c, _, _ in parts])
        seq_lens = torch.tensor([b for _, _, _, b in parts], dtype=torch.int32,
                                device=self.device)
        query_lens = [b - a for _, _, a, b in parts]
        out = torch.full((q.shape[0], layer.num_heads, layer.head_size_v), float("nan"),
                         dtype=layer.dtype, device=self.device)
        descale = None
        if layer.cache_dtype == FP8:
            descale = torch.full((len(parts), layer.num_kv_heads), KV_SCALE, device=self.device)
        per_head = {name: None if f[name] is None else torch.tensor(f[name], device=self.device)
                    for name in ("alibi_slopes", "sinks")}
        out, lse = flash_attn_varlen_func(
            q, self.k_cache, self.v_cache, max(query_lens), cu_seqlens(query_lens, self.device),
            int(seq_lens.max()), seqused_k=seq_lens, block_table=table,
            softmax_scale=f["scale"], causal=True, window_size=f["window"],
            softcap=f["softcap"], alibi_slopes=per_head["alibi_slopes"],
            s_aux=per_head["sinks"], k_descale=descale, v_descale=descale, out=out,
            return_softmax_lse=True, num_splits=num_splits, batch_invariant=True)
        rows, start = [], 0
        for n in query_lens:
            rows.append((out[start:start + n].cpu(), lse[:, start:start + n].cpu()))
            start += n
        return rows

    def oracle(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r as one prompt, float64."""
        scale = KV_SCALE if self.layer.cache_dtype == FP8 else 1.0
        return ref.paged_attention(
            self.q[r], self.k_cache.cpu(), self.v_cache.cpu(), [self.lengths[r]],
            [self.lengths[r]], self.tables[0][r:r + 1].cpu(), k_scale=scale, v_scale=scale,
            **self.layer.features)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def assert_same_bits(rows: tuple, alone: tuple, first: int, what: str) -> None:
    """rows (out, lse) of tokens [first, first + n) against the alone run's."""
    out, lse = rows
    n = out.shape[0]
    for name, got, want in (("output", out, alone[0][first:first + n]),
                            ("LSE", lse, alone[1][:, first:first + n])):
        same = bits(got) == bits(want)
        if not same.all():
            bad = (~same).nonzero()[0].tolist()
            raise AssertionError(
                f"{what}: {name} of token {first + (bad[0] if name == 'output' else bad[1])} "
                f"differs from the request alone ({(~same).sum().item()} elements), e.g. "
                f"{got[tuple(bad)].item()} vs {want[tuple(bad)].item()}")


@st.composite
def parts_of_others(draw, world: World, count: int) -> list:
    """Up to `count` parts of the other requests: chunks (with their contexts) or decodes."""
    parts = []
    for _ in range(draw(st.integers(0, count))):
        r = draw(st.integers(1, len(world.lengths) - 1))
        end = draw(st.integers(1, world.lengths[r]))
        first = end - 1 if draw(st.booleans()) else draw(st.integers(0, end - 1))
        parts.append((r, draw(st.integers(0, 1)), first, end))
    return parts


def check_target(data, world: World, max_others: int, split_choices: tuple) -> None:
    """The target (request 0) alone, against the oracle; then its chunks and decodes inside
    random batches, against the alone run's bits."""
    layer, n = world.layer, world.lengths[0]
    alone = world.run([(0, 0, 0, n)])[0]
    want_out, want_lse = world.oracle(0)
    tol = FP8_TOLERANCE if layer.cache_dtype == FP8 else TOLERANCE[layer.dtype]
    assert_close(alone[0], want_out, **tol)
    assert_close(alone[1], want_lse, **TOLERANCE[torch.float32 if layer.dtype ==
                                                  torch.float32 else torch.float16])
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=3)))) if n > 1 else []
    chunks = list(zip([0] + cuts, cuts + [n]))
    decodes = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3, unique=True))
    for first, end in chunks + [(p, p + 1) for p in decodes]:
        others = data.draw(parts_of_others(world, max_others))
        at = data.draw(st.integers(0, len(others)))
        parts = others[:at] + [(0, data.draw(st.integers(0, 1)), first, end)] + others[at:]
        splits = data.draw(st.sampled_from(split_choices))
        rows = world.run(parts, num_splits=splits)[at]
        what = (f"tokens [{first}, {end}) beside {len(others)} other parts at {at}, "
                f"num_splits={splits}")
        assert_same_bits(rows, alone, first, what)


# --- CPU: the PyTorch provider and the interpreted Triton kernels ---------------------------
@st.composite
def cpu_layers(draw, provider: str) -> Layer:
    num_kv_heads = draw(st.sampled_from((1, 2)))
    head_size = draw(st.sampled_from((16, 24) if provider == "triton" else (16, 24, 40)))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16)))
    fp8 = dtype != torch.float32 and draw(st.booleans())
    return Layer(
        num_heads=num_kv_heads * draw(st.sampled_from((1, 2, 3, 4))),
        num_kv_heads=num_kv_heads, head_size=head_size,
        head_size_v=head_size if fp8 or draw(st.booleans()) else 16, dtype=dtype,
        cache_dtype=FP8 if fp8 else dtype, block_size=draw(st.sampled_from((4, 8, 16))),
        window=draw(st.sampled_from((0, 0, 5, 20))), softcap=draw(st.sampled_from((0.0, 5.0))),
        alibi=draw(st.booleans()), sinks=draw(st.booleans()))


@pytest.mark.parametrize("provider, examples, max_len", [("torch", 80, 90), ("triton", 6, 60)])
def test_a_requests_rows_are_the_same_bits_in_any_batch_chunking_and_as_decodes(
        provider, examples, max_len, monkeypatch):
    # Splits of 32 keys (2 tiles of the interpreter's 16): contexts here fold several.
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 32)

    @settings(max_examples=examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data):
        layer = data.draw(cpu_layers(provider))
        lengths = data.draw(st.lists(st.integers(1, max_len), min_size=2, max_size=5))
        world = World(layer, lengths, "cpu", data.draw(st.integers(0, 2 ** 16)))
        with use_provider(provider):
            check_target(data, world, 3, (0, 1, 3))

    check()


def test_the_torch_path_relies_on_ops_that_round_an_element_alike_wherever_it_sits():
    """exp, log and tanh give an element the same bits in any tensor (the vectorised body
    and the scalar tail alike), which the PyTorch path's invariance rests on; exp2 and
    sigmoid do not here, so the path avoids them."""
    x = torch.randn(4099) * 4
    for fn in (torch.exp, torch.tanh, lambda t: torch.log(t.abs() + 0.1)):
        whole = fn(x)
        for first, n in ((0, 1), (3, 7), (5, 33), (17, 100), (4000, 99)):
            assert torch.equal(fn(x[first:first + n].clone()), whole[first:first + n])


def test_dense_keys_are_the_same_bits_beside_other_requests():
    """Bidirectional attention over dense keys (an encoder's): a request's rows alone and
    packed after others."""
    g = torch.Generator().manual_seed(1)
    lens = [7, 19, 12]
    q, k, v = (torch.randn(sum(lens), h, 16, generator=g) for h in (4, 2, 2))
    for provider in ("torch", "triton"):
        with use_provider(provider):
            both = flash_attn_varlen_func(q, k, v, 19, cu_seqlens(lens), 19,
                                          cu_seqlens_k=cu_seqlens(lens), batch_invariant=True)
            alone = flash_attn_varlen_func(q[7:26], k[7:26], v[7:26], 19, cu_seqlens([19]), 19,
                                           cu_seqlens_k=cu_seqlens([19]), batch_invariant=True)
        assert torch.equal(bits(both[7:26]), bits(alone)), provider
        assert_close(alone, ref.varlen_attention(q[7:26], k[7:26], v[7:26], [19], [19],
                                                 scale=0.25, causal=False)[0])


# --- block-sparse: batch composition (both providers), decode vs prompt (PyTorch) -----------
def test_block_sparse_rows_are_the_same_bits_beside_other_requests_and_as_decodes():
    """Prompts through `LocalStridedBlockSparseAttn` and decodes through
    `blocksparse_paged_attention`, alone and batched (both providers); on the PyTorch
    provider also a prompt's rows against its tokens decoded one by one. (The Triton
    decode and prefill kernels walk a row's blocks in different orders: not the same bits.)"""
    from pagedattn.ops import LocalStridedBlockSparseAttn, blocksparse_paged_attention
    from pagedattn.ops.paged_attn import PagedAttention

    g = torch.Generator().manual_seed(3)
    lens, heads, kv_heads, d, page = [45, 9, 30], 4, 2, 32, 8
    pattern = dict(local_blocks=1, vert_stride=2, block_size=16, head_sliding_step=1)
    q, k, v = (torch.randn(sum(lens), h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    attn = LocalStridedBlockSparseAttn(heads, 4096, 1, 2, 16, head_sliding_step=1)
    blocks = [-(-n // page) for n in lens]
    kv_cache = torch.zeros(PagedAttention.get_kv_cache_shape(sum(blocks), page, kv_heads, d))
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, kv_heads, d)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    ids = torch.randperm(sum(blocks), generator=g).to(torch.int32).split(blocks)
    starts = cu_seqlens(lens).tolist()
    for r, n in enumerate(lens):
        table[r, :blocks[r]] = ids[r]
        pos = torch.arange(n)
        with use_provider("torch"):
            PagedAttention.write_to_paged_cache(
                k[starts[r]:starts[r + 1]], v[starts[r]:starts[r + 1]], key_cache, value_cache,
                table[r].long()[pos // page] * page + pos % page, "auto", 1.0, 1.0)

    def decode(rows, positions):  # query rows of q at key counts `positions`
        out = blocksparse_paged_attention(
            q[rows], key_cache, value_cache, table[[r for r, _ in positions]],
            torch.tensor([p for _, p in positions], dtype=torch.int32), d ** -0.5,
            num_kv_heads=kv_heads, **{f"blocksparse_{n}": x for n, x in pattern.items()},
            batch_invariant=True)
        return out

    for provider in ("torch", "triton"):
        with use_provider(provider):
            both = attn(q, k, v, cu_seqlens(lens), batch_invariant=True)
            alone = attn(q[:45], k[:45], v[:45], cu_seqlens([45]), batch_invariant=True)
            assert torch.equal(bits(both[:45]), bits(alone)), provider
            # the last token of each request, decoded: batched vs the first one alone
            last = [starts[r + 1] - 1 for r in range(3)]
            batched = decode(last, [(r, n) for r, n in enumerate(lens)])
            single = decode(last[:1], [(0, 45)])
            assert torch.equal(bits(batched[:1]), bits(single)), provider
            if provider == "torch":  # a decode's bits are its prompt row's
                for p in (0, 15, 16, 31, 44):
                    assert torch.equal(bits(decode([p], [(0, p + 1)])), bits(alone[p:p + 1]))


# --- backends: the EngineConfig's mode reaches the plans; no cascade --------------------------
def _shared_prefix_step(backend, config, prefix=64, query_lens=(1, 4, 1)):
    """Request 0 prefills `prefix` tokens; requests 1.. share its blocks, then run one step
    with a common prefix (the cost model bypassed: cascade wherever the builder allows it)."""
    run = LayerRunner(make_layers(backend, 1), num_blocks=128, engine_config=config)
    run.builder.use_cascade_attention = lambda *args, **kwargs: True
    run.step([0], [prefix])
    reqs = list(range(1, len(query_lens) + 1))
    for r in reqs:  # r shares request 0's blocks (a prefix-cache hit)
        run.table.add_request(r, prefix_blocks=run.table.blocks[0])
        for (name, owner), hist in list(run.history.items()):
            if owner == 0:
                run.history[(name, r)] = {"k": list(hist["k"]), "v": list(hist["v"])}
    md, _ = run.metadata(reqs, list(query_lens), common_prefix_len=prefix)
    return run, md


@pytest.mark.parametrize("backend", [FlashAttentionBackend, FlashInferBackend],
                         ids=lambda b: b.get_name())
def test_builders_never_plan_cascade_in_batch_invariant_mode(backend, monkeypatch):
    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT", raising=False)
    for invariant in (False, True):
        _, md = _shared_prefix_step(backend, EngineConfig(batch_invariant=invariant))
        assert md.use_cascade is not invariant
    monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")  # the environment, for every engine
    assert _shared_prefix_step(backend, EngineConfig())[1].use_cascade is False


def _recording(build, built: list):
    """`build` that also appends each metadata it makes to `built`."""
    def record(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]
    return record


def test_builders_plan_the_mode_of_their_engine_config(monkeypatch):
    """Triton plans (the interpreter here) of FLASH_ATTN run the batch-invariant kernel, and
    FLASHINFER's wrappers keep the mode they were planned in, exactly where the config (or
    the environment) asks."""
    from pagedattn.ops.triton.attention import invariant_attention_kernel

    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT", raising=False)
    for invariant in (False, True):
        config = EngineConfig(batch_invariant=invariant)
        for backend in (FlashAttentionBackend, FlashInferBackend):
            run = LayerRunner(make_layers(backend), engine_config=config)
            built = []
            run.builder.build = _recording(run.builder.build, built)
            check_step(run.step([0, 1], [5, 1]))
            check_step(run.step([0, 1], [1, 1]))
            for md in built:
                if backend is FlashAttentionBackend:
                    plan = md.plans.kinds[0].attend.provider_plan  # the Triton plan
                    assert (plan.launches[0].fn is invariant_attention_kernel) is invariant
                else:
                    wrappers = [w for w in (md.decode_wrapper, md.prefill_wrapper) if w]
                    assert wrappers and all(w.planned().batch_invariant is invariant
                                            for w in wrappers)


def _planned_mode(plan) -> bool:
    """Whether a `VarlenAttentionPlan` launches batch-invariant attention (either provider)."""
    from pagedattn.ops.triton.attention import invariant_attention_kernel

    provider_plan = plan.provider_plan
    if plan.provider == "torch":
        return provider_plan.batch["batch_invariant"]
    return any(p.fn is invariant_attention_kernel for p in provider_plan.launches)


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_cascade_is_never_planned_in_the_mode(provider, monkeypatch):
    """plan_cascade_attention plans its passes in the default mode whatever the environment
    says, and a batch-invariant FLASH_ATTN builder plans plain attention for metadata that
    asks for cascade (made by hand: its own builds never do)."""
    import dataclasses

    from pagedattn.backends.paged_plans import CascadePlans, PagedPlans
    from pagedattn.ops.cascade_plan import plan_cascade_attention

    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")
    plan = plan_cascade_attention(
        cu_query_lens=cu_seqlens([1, 2]), max_query_len=2, cu_prefix_query_lens=cu_seqlens([3]),
        prefix_kv_lens=torch.tensor([16], dtype=torch.int32),
        suffix_kv_lens=torch.tensor([3, 5], dtype=torch.int32), max_kv_len=21,
        block_table=torch.zeros(2, 2, dtype=torch.int32), common_prefix_len=16,
        num_tokens=3, num_heads=8, num_kv_heads=2, head_size=32, page_size=16,
        q_dtype=torch.float32, kv_dtype=torch.float32, softmax_scale=0.2)
    assert not _planned_mode(plan.prefix) and not _planned_mode(plan.suffix)
    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT")
    run, md = _shared_prefix_step(FlashAttentionBackend, EngineConfig(batch_invariant=True))
    assert not md.use_cascade and _planned_mode(md.plans.kinds[0].attend)
    asks = dataclasses.replace(md, use_cascade=True, common_prefix_len=64,
                               cu_prefix_query_lens=cu_seqlens([6]),
                               prefix_kv_lens=torch.tensor([64], dtype=torch.int32),
                               suffix_kv_lens=md.seq_lens - 64)
    kind = run.builder.plan(asks).plans.kinds[0]
    assert type(kind) is PagedPlans and _planned_mode(kind.attend)
    default = LayerRunner(make_layers(FlashAttentionBackend, 1), num_blocks=8).builder
    assert type(default.plan(asks).plans.kinds[0]) is CascadePlans


def test_flashinfer_wrappers_plan_the_mode_they_are_given(monkeypatch):
    """plan(batch_invariant=) over the environment and an enclosing block; None: those."""
    from pagedattn.ops.flashinfer import (
        BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper,
    )

    workspace = torch.empty(0, dtype=torch.uint8)
    i32 = dict(dtype=torch.int32)
    indptr, indices, last = (torch.tensor([0, 2, 3], **i32), torch.tensor([4, 1, 7], **i32),
                             torch.tensor([5, 16], **i32))
    qo = torch.tensor([0, 3, 4], **i32)

    def modes(given):
        decode = BatchDecodeWithPagedKVCacheWrapper(workspace)
        decode.plan(indptr, indices, last, 8, 2, 32, 16, q_data_type=torch.float32,
                    batch_invariant=given)
        prefill = BatchPrefillWithPagedKVCacheWrapper(workspace)
        prefill.plan(qo, indptr, indices, last, 8, 2, 32, 16, causal=True,
                     q_data_type=torch.float32, batch_invariant=given)
        ragged = BatchPrefillWithRaggedKVCacheWrapper(workspace)
        ragged.plan(qo, torch.tensor([0, 5, 9], **i32), 8, 2, 32, causal=True,
                    q_data_type=torch.float32, batch_invariant=given)
        planned = [w.planned() for w in (decode, prefill)]
        assert all(_planned_mode(p.launch.plan) is p.batch_invariant for p in planned)
        return [p.batch_invariant for p in planned] + [_planned_mode(ragged._launch)]

    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT", raising=False)
    assert modes(None) == [False] * 3 and modes(True) == [True] * 3
    with batch_invariant():
        assert modes(None) == [True] * 3 and modes(False) == [False] * 3
    monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")
    assert modes(None) == [True] * 3 and modes(False) == [False] * 3


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_block_sparse_plans_carry_the_builders_mode(provider, monkeypatch):
    """BLOCK_SPARSE_FLASH_ATTN's builder plans its decodes in its EngineConfig's mode (one
    split on Triton, whatever split_count would choose) and its plans carry the mode to the
    prompts, which it does not plan; the steps stay right."""
    from pagedattn.backends.blocksparse_attn import BlocksparseFlashAttentionBackend
    from pagedattn.ops.blocksparse_plan import plan_blocksparse_paged_attention
    from pagedattn.ops.triton.blocksparse_decode import split_count

    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT", raising=False)
    params = dict(max_seqlen=256, block_size=16, local_blocks=2, vert_stride=3)
    for invariant in (False, True):
        layers = make_layers(BlocksparseFlashAttentionBackend, n=1, num_heads=4,
                             num_kv_heads=2, block_size=8, use_sparse=True,
                             blocksparse_params=params)
        run = LayerRunner(layers, num_blocks=48, block_size=8,
                          engine_config=EngineConfig(batch_invariant=invariant))
        built = []
        run.builder.build = _recording(run.builder.build, built)
        check_step(run.step([0, 1], [20, 9]))
        check_step(run.step([0, 1], [1, 1]))
        for md in built:
            assert md.plans.batch_invariant is invariant
            for plan in md.plans.decodes.values():
                assert plan.batch["batch_invariant"] is invariant
                if provider == "triton" and invariant:
                    assert plan.splits == 1
    # one long sequence: a split count that follows the batch, unless in the mode
    tables, lens = torch.zeros(1, 512, dtype=torch.int32), torch.tensor([4096], dtype=torch.int32)
    args = dict(block_tables=tables, seq_lens=lens, max_seq_len=4096, num_heads=4,
                num_kv_heads=2, page_size=8, kv_dtype=torch.float32, scale=0.125,
                blocksparse_local_blocks=2, blocksparse_vert_stride=3,
                blocksparse_block_size=16, blocksparse_head_sliding_step=0,
                ops_provider="triton")
    auto = split_count(torch.device("cpu"), 1, 4, 2, 4096, 0, 16, 2, 3)
    assert auto > 1  # (the interpreter's 4 SMs: two KV-head programs leave them idle)
    assert plan_blocksparse_paged_attention(**args, batch_invariant=False).splits == auto
    assert plan_blocksparse_paged_attention(**args, batch_invariant=True).splits == 1


def test_engine_config_checks_the_switch(monkeypatch):
    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT", raising=False)
    with pytest.raises(TypeError, match="batch_invariant=1 must be a bool"):
        EngineConfig(batch_invariant=1)
    with pytest.raises(ValueError, match="not available with decode context parallelism"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2,
                     decode_context_parallel_size=2, enable_cascade=False)
    assert batch_invariant_mode(None) is False
    assert batch_invariant_mode(EngineConfig(batch_invariant=True)) is True
    monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")
    assert batch_invariant_mode(None) is True


# --- the switch ---------------------------------------------------------------------------
def test_the_mode_is_the_argument_else_the_innermost_block_else_the_environment(monkeypatch):
    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT", raising=False)
    assert batch_invariant_enabled() is False
    monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")
    assert envs.PAGEDATTN_BATCH_INVARIANT is True and batch_invariant_enabled() is True
    with batch_invariant(False):
        assert batch_invariant_enabled() is False
        assert batch_invariant_enabled(True) is True
        with batch_invariant():
            assert batch_invariant_enabled() is True
        assert batch_invariant_enabled() is False
    with pytest.raises(TypeError, match="enabled='yes' must be a bool"):
        with batch_invariant("yes"):
            pass


def test_pagedattn_info_lists_the_variable(monkeypatch):
    from pagedattn.info import environment_variables

    monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")
    assert ("PAGEDATTN_BATCH_INVARIANT", "True") in environment_variables()


def test_invariant_split_keys_must_be_a_multiple_of_the_tiles(monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 24)
    with pytest.raises(ValueError, match="invariant_split_keys=24 must be a positive multiple"):
        ic.invariant_split_keys(16)


def test_the_scale_in_the_exponent_keeps_the_guarantee(monkeypatch):
    """`SWITCHES.invariant_scale_in_exp` (p = 2^fma(s, scale, -m) where there is neither a
    soft cap nor ALiBi; the kernel keeps scaled scores where slopes are given): each row
    still close to the oracle and of the same bits alone, in any batch, chunked and as
    decodes, under every split schedule."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 32)
    monkeypatch.setattr(launch.SWITCHES, "invariant_scale_in_exp", True)

    @settings(max_examples=4, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data):
        layer = dataclasses.replace(data.draw(cpu_layers("triton")), softcap=0.0)
        lengths = data.draw(st.lists(st.integers(1, 60), min_size=2, max_size=4))
        world = World(layer, lengths, "cpu", data.draw(st.integers(0, 2 ** 16)))
        with use_provider("triton"):
            check_target(data, world, 3, (0, 1, 3))

    check()
    assert ic.invariant_scale_in_exp(0.1, 0.0, False) is True
    assert [ic.invariant_scale_in_exp(*a) for a in
            ((0.1, 5.0, False), (0.1, 0.0, True), (0.0, 0.0, False))] == [False] * 3
    monkeypatch.setattr(launch.SWITCHES, "invariant_scale_in_exp", False)
    assert ic.invariant_scale_in_exp(0.1, 0.0, False) is False


def test_the_split_schedule_threshold_moves_the_launches_not_the_bits(monkeypatch):
    """invariant_split_below picks programs per split + a fold launch, or folds inside each
    program, for the same batch: both give every row the same bits."""
    from pagedattn.ops.triton import attention_plan

    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 32)
    layer = Layer(4, 2, 16, 16, torch.float32, torch.float32, 8, sinks=True)
    lengths = [70, 45, 1, 90]
    world = World(layer, lengths, "cpu", seed=3)
    parts = [(0, 0, 0, 70), (1, 1, 44, 45), (2, 0, 0, 1), (3, 0, 89, 90)]
    launches, rows = [], []
    real = attention_plan.plan_attention

    def spy(**kwargs):
        plan = real(**kwargs)
        launches.append(tuple(x.name for x in plan.launches))
        return plan

    monkeypatch.setattr(attention_plan, "plan_attention", spy)
    for below in (0.0, 100.0):  # the interpreter's 4 "SMs": never, then always
        monkeypatch.setattr(launch.SWITCHES, "invariant_split_below", below)
        with use_provider("triton"):
            rows.append(world.run(parts))
    assert launches == [("prefill",), ("prefill", "reduce")]
    for (out_a, lse_a), (out_b, lse_b) in zip(*rows):
        assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
        assert not out_a.isnan().any()


def test_the_split_schedule_threshold_is_by_head_size_and_checked(monkeypatch):
    """Head 256 splits below 8 x the SMs by default (its unsplit decode programs hold the
    fold state in memory: KERNEL_NOTES v47, v49), other heads below 1 x; a number or a dict of
    them by head size replaces it; anything else is refused by name."""
    assert launch.SWITCHES.invariant_split_below is None
    assert [ic.invariant_split_below(d) for d in (64, 128, 256, None)] == [1.0, 1.0, 8.0, 1.0]
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_below", 2)
    assert ic.invariant_split_below(256) == 2.0
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_below", {128: 3.0})
    assert (ic.invariant_split_below(128), ic.invariant_split_below(256)) == (3.0, 1.0)
    for bad in (-1.0, "4", True, float("nan"), {256: None}):
        monkeypatch.setattr(launch.SWITCHES, "invariant_split_below", bad)
        with pytest.raises(ValueError, match=r"SWITCHES.invariant_split_below=.* must be a "
                                             r"number >= 0"):
            ic.invariant_split_below(256)


def test_a_step_of_decodes_alone_runs_the_decode_tiles_with_the_same_bits(monkeypatch):
    """Decodes beside decodes run `invariant_decode_tiles`; with a prompt in the step they
    run the one config: the rows' bits agree (the interpreter checks the plumbing; which
    tiles may pair on a GPU is `invariant_tiles_agree`'s, and the GPU tests' below)."""
    from pagedattn.ops.triton import attention_plan

    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", 32)
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles", {16: (16, 2, 1)})
    layer = Layer(4, 2, 16, 16, torch.float32, torch.float32, 8, sinks=True)
    world = World(layer, [70, 45, 90], "cpu", seed=5)
    tiles = []
    real = attention_plan.plan_attention

    def spy(**kwargs):
        plan = real(**kwargs)
        tiles.append([(x.constexprs["BLOCK_M"], x.kwargs["num_warps"]) for x in plan.launches
                      if x.name == "prefill"])
        return plan

    monkeypatch.setattr(attention_plan, "plan_attention", spy)
    decodes = [(0, 0, 69, 70), (1, 1, 44, 45), (2, 0, 89, 90)]
    with use_provider("triton"):
        alone = world.run(decodes)
        beside_a_prompt = world.run(decodes[:2] + [(2, 0, 0, 90)])
    assert tiles == [[(16, 2)], [(16, 4)]]  # the interpreter's one config: 16 rows, 4 warps
    for (out_a, lse_a), (out_b, lse_b) in zip(alone[:2], beside_a_prompt[:2]):
        assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    assert torch.equal(alone[2][0], beside_a_prompt[2][0][-1:])
    assert torch.equal(alone[2][1], beside_a_prompt[2][1][:, -1:])


def test_only_tiles_of_one_instruction_and_warp_layout_may_pair():
    cfg = launch.AttnConfig
    wide, narrow = cfg(128, 64, 8, 2, 1), cfg(64, 64, 4, 3, 1)
    assert ic.invariant_tiles_agree(wide, narrow) == ""
    assert "not wgmma warpgroups" in ic.invariant_tiles_agree(narrow, cfg(16, 64, 4, 2, 1))
    assert "not wgmma warpgroups" in ic.invariant_tiles_agree(cfg(64, 64, 8, 2, 1), narrow)
    assert "key tiles differ" in ic.invariant_tiles_agree(wide, cfg(64, 128, 4, 3, 1))


def test_decode_tiles_that_would_change_the_bits_are_refused_on_a_gpu(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    one = launch.AttnConfig(64, 64, 4, 3, 1)
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles", {128: (16, 4, 2)})
    with pytest.raises(ValueError, match=r"invariant_decode_tiles=\(16, 4, 2\) beside the "
                                         r"tiles \(64, 64, 4 warps\) would change a row's bits"):
        ic.invariant_decode_config(one, 4, 128)
    assert ic.invariant_decode_config(one, 4, 64) is one  # a head size it does not name
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles", (64, 0, 2))
    with pytest.raises(ValueError, match="must be None, .block_m, num_warps, num_stages."):
        ic.invariant_decode_config(one, 4, 128)


def test_head_128_defaults_pair_wide_prefill_tiles_with_64_row_decode_tiles(monkeypatch):
    """On a GPU with both switches None, head 128 runs two m64 warpgroups on prompts and one
    on decodes alone (the same wgmma and order of adds); other head sizes, a group wider
    than the decode rows, or an `invariant_tiles` of the user's keep one config."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    wide = ic.invariant_config(head_size=128, head_size_v=128, group_pad=4)
    assert (wide.block_m, wide.block_n, wide.num_warps, wide.num_stages) == (128, 64, 8, 2)
    dec = ic.invariant_decode_config(wide, 4, 128)
    assert (dec.block_m, dec.block_n, dec.num_warps, dec.num_stages) == (64, 64, 4, 3)
    assert ic.invariant_tiles_agree(wide, dec) == ""
    narrow = ic.invariant_config(head_size=64, head_size_v=64, group_pad=4)
    assert (narrow.block_m, narrow.num_warps) == (64, 4)
    assert ic.invariant_decode_config(narrow, 4, 64) is narrow
    huge_group = ic.invariant_config(head_size=128, head_size_v=128, group_pad=128)
    assert ic.invariant_decode_config(huge_group, 128, 128) is huge_group
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", (64, 64, 4, 3))
    own = ic.invariant_config(head_size=128, head_size_v=128, group_pad=4)
    assert ic.invariant_decode_config(own, 4, 128) is own


def test_invariant_split_keys_may_be_chosen_per_head_size(monkeypatch):
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", {64: 512, 256: 2048})
    assert ic.invariant_split_keys(64, 64) == 512
    assert ic.invariant_split_keys(64, 256) == 2048
    assert ic.invariant_split_keys(64, 128) == 1024  # a head size it does not name
    monkeypatch.setattr(launch.SWITCHES, "invariant_split_keys", {128: 100})
    with pytest.raises(ValueError, match="invariant_split_keys=100 must be a positive multiple"):
        ic.invariant_split_keys(64, 128)


# --- GPU: real sizes ----------------------------------------------------------------------
GPU_LAYERS = [
    Layer(32, 8, 128, 128, torch.bfloat16, torch.bfloat16, 16),
    Layer(32, 8, 128, 128, torch.bfloat16, FP8, 16),
    Layer(16, 2, 64, 64, torch.float16, torch.float16, 32, window=700, sinks=True),
    Layer(8, 8, 128, 128, torch.bfloat16, torch.bfloat16, 16, softcap=30.0, alibi=True),
    Layer(16, 8, 256, 256, torch.bfloat16, FP8, 16, window=1500),
    Layer(12, 4, 128, 64, torch.bfloat16, torch.bfloat16, 16, sinks=True),
]


def check_last_tokens_agree(world: World, lengths: list[int]) -> None:
    """Each request's last token as a decode (alone and beside every other decode, under 0 / 1
    / 4 splits), beside prompts in a mixed batch, and request 9's rows through chunks across
    a split's edge: the same bits, outputs and LSEs, as the request's whole prompt gives.
    lengths: the world's requests (at least 11 of them, request 9 of 3,000 keys)."""
    whole = {r: world.run([(r, 0, 0, n)])[0] for r, n in enumerate(lengths)}
    decodes = [(r, r % 2, n - 1, n) for r, n in enumerate(lengths)]
    for splits in (0, 1, 4):
        for r, rows in enumerate(world.run(decodes, splits)):
            assert_same_bits(rows, whole[r], lengths[r] - 1,
                             f"request {r}'s last token beside decodes, num_splits {splits}")
        for r, part in enumerate(decodes):
            assert_same_bits(world.run([part], splits)[0], whole[r], lengths[r] - 1,
                             f"request {r}'s last token alone, num_splits {splits}")
    mixed = [(0, 1, 1000, 2600), decodes[1], (9, 0, 0, 3000)] + decodes[2:9] + decodes[10:]
    for (r, _, first, _), rows in zip(mixed, world.run(mixed)):
        assert_same_bits(rows, whole[r], first, f"request {r} from {first} in a mixed batch")
    chunks = [(9, 0, 0, 1000), (9, 1, 1000, 1030), (9, 0, 1030, 2999), (9, 1, 2999, 3000)]
    for part in chunks:
        assert_same_bits(world.run([part])[0], whole[9], part[2], f"request 9 chunk {part}")


def check_gpu_layer(layer: Layer) -> None:
    """`check_target` on random requests at real sizes, then the target's last rows as
    decodes in steps of decodes alone (a decode step's own tiles, where any)."""

    @settings(max_examples=4, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data):
        lengths = [data.draw(st.integers(1, 2600))] + data.draw(
            st.lists(st.integers(1, 2000), min_size=1, max_size=8))
        world = World(layer, lengths, "cuda", data.draw(st.integers(0, 2 ** 16)))
        check_target(data, world, 7, (0, 1, 4))
        n = lengths[0]
        alone = world.run([(0, 0, 0, n)])[0]
        for end in range(max(1, n - 2), n + 1):
            parts = [(0, 0, end - 1, end)] + [(r, 0, m - 1, m)
                                              for r, m in enumerate(lengths) if r]
            assert_same_bits(world.run(parts)[0], alone, end - 1,
                             f"token {end - 1} as a decode beside decodes")

    check()


def _layer_id(c: Layer) -> str:
    return (f"h{c.num_heads}/{c.num_kv_heads}-d{c.head_size}-{str(c.cache_dtype)[6:]}"
            f"{'-win' if c.window else ''}{'-sinks' if c.sinks else ''}"
            f"{'-cap' if c.softcap else ''}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer", [c for c in GPU_LAYERS
                                   if max(c.head_size, c.head_size_v) == 128], ids=_layer_id)
def test_gpu_wide_prefill_tiles_beside_decode_tiles_keep_the_bits(layer, monkeypatch):
    """128-row, 8-warp prefill tiles beside 64-row, 4-warp decode tiles (both wgmma
    warpgroups of 16 rows a warp): a request's rows, LSEs included, the same bits alone, in
    batches, chunked and as decodes, decode-only steps among them."""
    monkeypatch.setattr(launch.SWITCHES, "invariant_tiles", {128: (128, 64, 8, 2)})
    monkeypatch.setattr(launch.SWITCHES, "invariant_decode_tiles", {128: (64, 4, 3)})
    check_gpu_layer(layer)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer", GPU_LAYERS, ids=_layer_id)
def test_gpu_rows_are_the_same_bits_in_any_batch_chunking_and_as_decodes(layer):
    """Real sizes: requests up to 2,600 tokens (splits of 1,024 keys fold up to 3), batches
    of up to 8 parts, the split schedule free (in-program folds, split programs). Four
    examples per layer keep it within the GPU suite's minute a test (compiles included)."""
    check_gpu_layer(layer)
