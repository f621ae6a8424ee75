"""The persistent Gluon decode grid's work units and split model, from host ints alone.

The persistent form of the Gluon decode kernel (`gluon_decode_persistent.py`) runs
`persistent_programs` programs, each walking work units (request, KV head, split) in the
order `unit_order` describes. Its split count is this module's (`persistent_splits`), not
the `tl` decode pass's `launch.decode_splits`: that one models three `tl` programs an SM,
each drawing a third of the SM's bandwidth and paying its pipeline fill per program; here
a program keeps its rings full across its units, so what counts is how evenly the units
fill the programs. Imports nothing but the standard library (the plan and the CPU tests
read it without a GPU).
"""

from __future__ import annotations

import functools

# A split streams at least this many keys (the Gluon decode pass's floor: shorter splits
# lost to the `tl` pass, v29; `gluon_decode_launch.GLUON_DECODE_MIN_KEYS` is this value).
MIN_KEYS = 1024
MAX_SPLITS = 64  # the `tl` pass's bound (`launch.MAX_SPLITS`): the reduce's scratch
# What one unit costs beyond its keys, in keys: the Q load, the state's start and the
# epilogue's stores, which the carried rings do not hide (not measured yet: a guess of a
# quarter of a 1,024-key split's stream, so that of two counts with the same busiest load
# the one with fewer units wins).
UNIT_KEYS = 256
# The share of an SM's bandwidth one program draws alone, by programs an SM: one program's
# rings fill shared memory (3.75 TB/s with one an SM at B8 L128k, v29: about all of it);
# two an SM have half-size rings each (not measured alone: 0.75 assumed).
DRAW = {1: 1.0, 2: 0.75}


def persistent_programs(units: int, sms: int, per_sm: int) -> int:
    """The grid: one program for each unit up to per_sm x SM count."""
    if units < 0 or sms <= 0 or per_sm not in DRAW:
        raise ValueError(f"units={units} must be >= 0, sms={sms} > 0 and per_sm={per_sm} "
                         f"one of {sorted(DRAW)}")
    return max(1, min(units, per_sm * sms))


def unit_order(unit: int, pairs: int, num_kv: int) -> tuple[int, int, int]:
    """Unit -> (request, KV head, split), as the kernel decodes it: KV heads vary fastest,
    then requests, splits slowest, so the units of one round are different (request, KV
    head) pairs wherever the batch has as many pairs as programs, and a long request's
    splits go to different programs."""
    return (unit // num_kv) % (pairs // num_kv), unit % num_kv, unit // pairs


def program_units(pid: int, programs: int, units: int) -> list[int]:
    """The units program `pid` walks: round k takes unit k x programs + pid in even rounds
    and k x programs + programs - 1 - pid in odd ones (the Gluon prefill pass's static order,
    `gluon_schedule.Items.round`): with every split of a pair in the same position of its
    round, a plain stride would give a pair's every split to one program, and mixed lengths
    would then pile onto some; alternating pairs program p with p's mirror each round."""
    rounds = -(-units // programs)
    order = (k * programs + (pid if k % 2 == 0 else programs - 1 - pid) for k in range(rounds))
    return [u for u in order if u < units]


def persistent_time(splits: int, pairs: int, max_seqlen_k: int, sms: int, per_sm: int
                    ) -> float:
    """The model's time of a launch with `splits` (in keys streamed at one SM's full
    bandwidth): units = pairs x splits over persistent_programs programs; the busiest
    program takes ceil(units / programs) of them, each ceil(keys / splits) keys plus
    UNIT_KEYS; it shares its SM with the SM's other programs (the busiest SM holds
    ceil(programs / sms)), which together draw min(1, k x DRAW) of the SM's bandwidth."""
    units = pairs * splits
    programs = persistent_programs(units, sms, per_sm)
    busiest = -(-units // programs)
    on_sm = -(-programs // sms)
    rate = min(1.0, on_sm * DRAW[per_sm]) / on_sm
    return busiest * (-(-max_seqlen_k // splits) + UNIT_KEYS) / rate


@functools.lru_cache(maxsize=4096)  # a plan a step: 45 us a call uncached, 64 counts tried
def persistent_splits(sms: int, per_sm: int, pairs: int, max_seqlen_k: int,
                      min_keys: int = MIN_KEYS) -> int:
    """The split count of the persistent form: the least model time (`persistent_time`)
    over counts whose splits stream at least min_keys keys (1 always allowed), at most
    MAX_SPLITS; a tie keeps fewer splits (less to reduce). pairs: requests x KV heads."""
    if pairs <= 0 or max_seqlen_k < 0 or min_keys <= 0:
        raise ValueError(f"pairs={pairs} must be > 0, max_seqlen_k={max_seqlen_k} >= 0 and "
                         f"min_keys={min_keys} > 0")
    most = max(1, min(MAX_SPLITS, max_seqlen_k // min_keys))
    best, best_time = 1, float("inf")
    for splits in range(1, most + 1):
        t = persistent_time(splits, pairs, max_seqlen_k, sms, per_sm)
        if t < best_time * (1 - 1e-9):
            best, best_time = splits, t
    return best
