#!/usr/bin/env bash
# Ours beside FlashAttention-3 and the other peers, in one device call (issues 40 and 41):
#   bash tools/gpu_peers.sh
# 1. decode: benchmarks/bench_kernels.py --sections decode (issue 41's rows beside FA3 bf16 and
#    fp8, SDPA cuDNN and vLLM's Triton kernel where installed, graph-replayed and eager,
#    alternated in 3 rounds) -> $OUT/decode.md;
# 2. ncu of our decode pass on B64 L16k and B8 L128k, bf16 and fp8 (benchmarks/ncu_decode.py:
#    one process profiles every case's launches, then one per case its attention pass's SASS)
#    -> $OUT/ncu.md, the CSV exports in $OUT/ncu/ (the reports stay in $NCU_REPORTS), and
#    ncu_stalls.py's stall table of each case's SASS -> $OUT/ncu/stalls_<case>.md;
# 3. prefill: benchmarks/bench_prefill.py --rows main,fp8 (bf16 and e4m3 rows beside FA3 bf16
#    and fp8, our engine and op paths and FA3 alternated in 3 rounds, each row's error against
#    the float64 oracle on sampled query rows; FlexAttention left out: it compiles ~20 s a row)
#    -> $OUT/prefill.md.
# FA3 is the fa3-fwd wheel carried in .whl/ (tools/device_env.sh installs it); a peer that is
# missing is a note above its table. A carried Triton cache (.tcache/) skips compiles. Each
# step has a time limit (DECODE_S, NCU_S seconds; prefill, which compiles the most, gets what
# is left of TOTAL_S, 530 s by default) and writes its rows as they come, so a step cut off
# keeps what it measured. The tables print last, prefill first. STEPS picks steps, e.g.
#   STEPS=ncu bash tools/gpu_peers.sh          (the ncu step alone: under 3 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_peers_out}
NCU_REPORTS=${NCU_REPORTS:-/tmp/gpu_peers_ncu}  # .ncu-rep files: large, not returned
mkdir -p "$OUT/ncu" "$NCU_REPORTS"
. tools/device_env.sh
DECODE_S=${DECODE_S:-150}
NCU_S=${NCU_S:-170}
TOTAL_S=${TOTAL_S:-530}
STEPS=${STEPS:-decode ncu prefill}
start=$(date +%s)
CASES="b64_l16k_bf16 b64_l16k_fp8 b8_l128k_bf16 b8_l128k_fp8"

step_end() {  # name, exit status
    echo "$1: exit $2 at $(( $(date +%s) - start )) s"
    [ "$2" = 0 ] || tail -n 5 "$OUT/$1.log"
}
want() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

if want decode; then
    timeout "$DECODE_S" python3 benchmarks/bench_kernels.py --sections decode \
        --out "$OUT/decode.md" >"$OUT/decode.log" 2>&1
    step_end decode $?
fi

NCU=${NCU:-$(find_cuda_tool ncu /opt/nvidia/nsight-compute/*/ncu)}
deadline=$(( $(date +%s) + NCU_S ))
left() { echo $(( deadline - $(date +%s) )); }
ncu_step() {
    local d=$OUT/ncu r=$NCU_REPORTS
    if [ -z "$NCU" ]; then
        echo "ncu not found (set NCU=/path/to/ncu)" | tee "$OUT/ncu.md"
        return 2
    fi
    "$NCU" --version | tail -1
    timeout "$(left)" "$NCU" --clock-control none --profile-from-start off \
        --kernel-name 'regex:attention_kernel|reduce_splits_kernel' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats \
        -f -o "$r/decode" python3 benchmarks/ncu_decode.py launch --manifest "$d/manifest.json"
    "$NCU" -i "$r/decode.ncu-rep" --page raw --csv --print-units base >"$d/raw.csv"
    for case in $CASES; do
        [ "$(left)" -gt 15 ] || { echo "no time left for the SASS of $case"; continue; }
        timeout "$(left)" "$NCU" --clock-control none --profile-from-start off \
            --kernel-name regex:attention_kernel --launch-count 1 \
            --section SourceCounters --section WarpStateStats -f -o "$r/sass_$case" \
            python3 benchmarks/ncu_decode.py launch --cases "$case" --runs 1
        "$NCU" -i "$r/sass_$case.ncu-rep" --page source --csv --print-source sass \
            >"$d/sass_$case.csv"
        for stalls in tools/ncu_stalls.py benchmarks/ncu_stalls.py; do
            if [ -f "$stalls" ]; then
                python3 "$stalls" "$d/sass_$case.csv" --top 12 >"$d/stalls_$case.md" 2>&1
                break
            fi
        done
    done
    python3 benchmarks/ncu_decode.py summary --manifest "$d/manifest.json" --raw "$d/raw.csv" \
        --sass-dir "$d" >"$OUT/ncu.md"
}
if want ncu; then
    ncu_step >"$OUT/ncu.log" 2>&1
    step_end ncu $?
fi

if want prefill; then
    prefill_s=$(( start + TOTAL_S - $(date +%s) ))
    [ "$prefill_s" -ge 60 ] || prefill_s=60
    timeout "$prefill_s" python3 benchmarks/bench_prefill.py --rows main,fp8 --flex "" \
        --out "$OUT/prefill.md" >"$OUT/prefill.log" 2>&1
    step_end prefill $?
fi

for table in prefill decode ncu; do
    want "$table" || continue
    echo
    echo "=================== $table ($OUT/$table.md)"
    cat "$OUT/$table.md" 2>/dev/null || echo "(no table: see $OUT/$table.log)"
done
