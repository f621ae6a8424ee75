"""When cascade attention pays: `use_cascade_attention`, a cost model of KV-tile loads per SM
(fitted on an H100, docs/PERFORMANCE.md). One reason to change: the kernels' speed."""

from __future__ import annotations

from collections.abc import Sequence

# Cost model (use_cascade_attention), in KV-tile loads per SM; fitted on an H100 (PERFORMANCE.md)
MIN_PREFIX_TOKENS = 256  # a shorter prefix saves less than the extra passes cost
MIN_REQS = 8  # with fewer requests, the prefix is read few times anyway
TILE_ROWS = 64  # query rows (tokens x GQA group) one attention program covers
KV_TILE = 64  # keys one program streams per step
LATENCY_FACTOR = 3  # a program alone on an SM streams a tile ~3x slower than a busy SM does
PLAIN_SPLITS = 64  # plain decodes split each sequence's keys over up to this many programs
PREFIX_KEYS_PER_SPLIT = 512  # the prefix pass splits like ops/triton's prefill pass
EXTRA_PASS_TILES = 16  # the suffix pass, the split reduce and the merge: ~20 us on an H100


def use_cascade_attention(common_prefix_len: int, query_lens: Sequence[int],
                          num_query_heads: int, num_kv_heads: int, use_alibi: bool,
                          use_sliding_window: bool, use_local_attention: bool,
                          num_sms: int) -> bool:
    """Whether cascade attention is both correct and faster for this batch.

    Correct: never with ALiBi, sliding windows or local (chunked) attention, whose masks and
    biases depend on each query's position, which the shared prefix pass gives up.

    Faster: attention over a long prefix is bound by streaming its K/V tiles. A program covers
    TILE_ROWS query rows (tokens x the GQA group) of one KV head, so plain attention loads each
    prefix tile once per (request, query tile, KV head), and the prefix pass of cascade once per
    (query tile of the whole batch, KV head): 64 decodes, 64 programs per KV head vs 4. A
    schedule takes the longer of its throughput time (its tile loads over the SMs) and its
    critical path (a program's share of the prefix, streamed LATENCY_FACTOR times slower alone,
    over its key splits: both passes split when their programs cannot fill the SMs), cascade
    plus EXTRA_PASS_TILES (suffix pass, merge). It wins once enough requests read the prefix
    (8 decodes over 8k keys, 64 over 2k). Prefills gain nothing: a long query already shares
    each tile among its TILE_ROWS rows.
    """
    if use_alibi or use_sliding_window or use_local_attention:
        return False
    lens = [int(q) for q in query_lens]
    if common_prefix_len < MIN_PREFIX_TOKENS or len(lens) < MIN_REQS:
        return False
    group = max(1, num_query_heads // num_kv_heads)
    tiles = -(-common_prefix_len // KV_TILE)
    plain_programs = num_kv_heads * sum(-(-q * group // TILE_ROWS) for q in lens)
    cascade_programs = num_kv_heads * -(-sum(lens) * group // TILE_ROWS)
    prefix_splits = max(1, min(-(-2 * num_sms // cascade_programs), PLAIN_SPLITS,
                               common_prefix_len // PREFIX_KEYS_PER_SPLIT))  # < 2 per SM

    def time(programs: int, splits: int) -> int:
        throughput = -(-programs * tiles // max(1, num_sms))
        return max(throughput, -(-tiles * LATENCY_FACTOR // splits))

    cascade = time(cascade_programs, prefix_splits) + EXTRA_PASS_TILES
    return cascade < time(plain_programs, PLAIN_SPLITS)
