#!/usr/bin/env bash
# Block-sparse decode beside dense decode, under ncu and timed (issue 41's block-sparse
# target), in one device call of under 3 minutes, from the repository root:
#   bash tools/ncu_blocksparse.sh
# 1. ncu (under NCU_S = 95 s): one process profiles the dense decode at B32 L32k and B64
#    L16k and the block-sparse cases of benchmarks/ncu_decode.py's SPARSE_CASES (B32 L32k
#    per head vert_stride 8 and homo_head 8, B64 L16k per head 1, each today and with
#    SWITCHES.blocksparse_decode_key_lines), then one process per case its attention pass's
#    SASS (executed counts, warp stalls) while time is left, most telling first
#    -> $OUT/ncu_blocksparse.md (the summary), the CSV exports and ncu_stalls.py's tables
#    in $OUT/ncu_blocksparse/ (the reports stay in $NCU_REPORTS).
# 2. ab (under AB_S = 80 s, one process a row): tools/ab_blocksparse_decode.py checks each
#    variant against the float64 oracle and times it beside dense decode, 3 rounds
#    -> $OUT/ab_blocksparse_<row>.md.
# Each step runs under `timeout`; a failed or cut-off step prints its log's tail and the
# next one still runs. STEPS picks steps (STEPS=ncu, STEPS=ab).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-ncu_blocksparse_out}
NCU_REPORTS=${NCU_REPORTS:-/tmp/ncu_blocksparse}
NCU_S=${NCU_S:-95}
AB_S=${AB_S:-80}
STEPS=${STEPS:-ncu ab}
CASES=${CASES:-b32_l32k_bf16 bs_b32_l32k_per8 bs_b32_l32k_per8_lines b64_l16k_bf16 \
bs_b64_l16k_per1 bs_b64_l16k_per1_lines bs_b32_l32k_homo8 bs_b32_l32k_homo8_lines}
VARIANTS=${VARIANTS:-today;key lines;key lines, waves;key lines, 128 keys;key lines, 128 keys, waves}
PATTERNS=${PATTERNS:-p1,p8,h8}
d=$OUT/ncu_blocksparse
mkdir -p "$d" "$NCU_REPORTS"
. tools/device_env.sh
start=$(date +%s)
want() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
step_end() {  # name, exit status, log
    echo "$1: exit $2 at $(( $(date +%s) - start )) s"
    [ "$2" = 0 ] || tail -n 8 "$3"
}

NCU=${NCU:-$(find_cuda_tool ncu /opt/nvidia/nsight-compute/*/ncu)}
KERNELS='regex:attention_kernel|reduce_splits_kernel|_decode_kernel'
METRICS=lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,\
lts__t_requests_srcunit_tex_op_read.sum,smsp__inst_executed.sum,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
deadline=$(( start + NCU_S ))
left() { echo $(( deadline - $(date +%s) )); }
profile() {  # extra ncu options...
    timeout "$(left)" "$NCU" --clock-control none --profile-from-start off \
        --kernel-name "$KERNELS" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats \
        --section WarpStateStats "$@" -f -o "$NCU_REPORTS/bs" \
        python3 benchmarks/ncu_decode.py launch --cases "$(echo $CASES | tr ' ' ,)" --runs 1 \
        --manifest "$d/manifest.json"
}
ncu_step() {
    if [ -z "$NCU" ]; then
        echo "ncu not found (set NCU=/path/to/ncu)" | tee "$OUT/ncu_blocksparse.md"
        return 2
    fi
    "$NCU" --version | tail -1
    profile --metrics "$METRICS"
    local rc=$?
    if [ $rc != 0 ] && [ $rc != 124 ]; then  # a metric this ncu lacks: the sections alone
        echo "ncu with --metrics exited $rc; again without them"
        profile
        rc=$?
    fi
    [ $rc = 0 ] || echo "the profiled run exited $rc"
    "$NCU" -i "$NCU_REPORTS/bs.ncu-rep" --page raw --csv --print-units base >"$d/raw.csv" \
        || echo "no raw export"
    for case in $CASES; do
        [ "$(left)" -gt 12 ] || { echo "no time left for the SASS of $case"; continue; }
        timeout "$(left)" "$NCU" --clock-control none --profile-from-start off \
            --kernel-name 'regex:attention_kernel|_decode_kernel' --launch-count 1 \
            --section SourceCounters --section WarpStateStats -f -o "$NCU_REPORTS/sass_$case" \
            python3 benchmarks/ncu_decode.py launch --cases "$case" --runs 1 \
            || { echo "the SASS run of $case exited $?"; continue; }
        "$NCU" -i "$NCU_REPORTS/sass_$case.ncu-rep" --page source --csv --print-source sass \
            >"$d/sass_$case.csv" || echo "no SASS export of $case"
        python3 tools/ncu_stalls.py "$d/sass_$case.csv" --top 12 >"$d/stalls_$case.md" 2>&1
    done
    python3 benchmarks/ncu_decode.py summary --manifest "$d/manifest.json" --raw "$d/raw.csv" \
        --sass-dir "$d" >"$OUT/ncu_blocksparse.md"
}
if want ncu; then
    ncu_step >"$OUT/ncu_blocksparse.log" 2>&1
    step_end ncu $? "$OUT/ncu_blocksparse.log"
fi

if want ab; then  # one process a row: a crash in one keeps the other's table
    ab_deadline=$(( $(date +%s) + AB_S ))
    reserve=25  # the first row leaves the second this much (its kernels are compiled)
    for row in B32L32k B64L16k; do
        ab_left=$(( ab_deadline - $(date +%s) - reserve ))
        reserve=0
        [ "$ab_left" -gt 20 ] || { echo "ab: no time left for $row"; continue; }
        timeout "$ab_left" python3 tools/ab_blocksparse_decode.py --rows "$row" \
            --patterns "$PATTERNS" --variants "$VARIANTS" --rounds 3 \
            --out "$OUT/ab_blocksparse_$row.md" >"$OUT/ab_blocksparse_$row.log" 2>&1
        step_end "ab $row" $? "$OUT/ab_blocksparse_$row.log"
    done
fi

for table in "$OUT/ncu_blocksparse.md" "$OUT"/ab_blocksparse_*.md; do
    [ -f "$table" ] || continue
    echo
    echo "=================== $table"
    cat "$table"
done
