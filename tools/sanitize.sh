#!/usr/bin/env bash
# compute-sanitizer over pagedattn's GPU kernels, in one device call (H100; docs/dev/RELIABILITY.md):
#   bash tools/sanitize.sh
# - memcheck over every case of tools/sanitize_cases.py (each kernel family once, small sizes,
#   checked against the float64 oracle);
# - racecheck and synccheck over the cases whose kernels stage data through shared memory
#   behind barriers (the Hopper prefill pass: TMA + mbarriers; the portable prefill pass);
# - the same three tools over `tools/bench_gluon.py --racecheck` when the Gluon pass
#   (src/pagedattn/ops/triton/attention_gluon.py) exists;
# - racecheck and synccheck over the Gluon decode pass's case (`--only gluon_decode`).
# Exact allocations (PYTORCH_NO_CUDA_MEMORY_CACHING=1, so memcheck sees each tensor's bounds),
# no CUDA graphs. Each run has a time limit (MEMCHECK_S ... below), so a hang fails by name.
# Logs go to $OUT (default sanitize_out/): <cases|gluon>_<tool>.log and summary.txt, one line
# per run ("ERROR SUMMARY: 0 errors") and the cases' results. Exit status 0 only if every run
# ended with 0 errors (the Gluon pass's racecheck: no report but the `warp_specialize`
# dispatch one, which `dispatch_only` below recognises by its source lines) and every case
# matched the oracle. A carried Triton cache (.tcache/,
# tools/gpu_suite.sh's parts) skips the compiles; carried wheels (.whl/) are installed.
# SANITIZER_ARGS adds options to every run (e.g. "--report-api-errors no").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-sanitize_out}
mkdir -p "$OUT"
. tools/device_env.sh
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

SANITIZER=${COMPUTE_SANITIZER:-$(find_cuda_tool compute-sanitizer \
    /opt/nvidia/*/compute-sanitizer/compute-sanitizer)}
if [ -z "$SANITIZER" ]; then
    echo "compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)" \
        | tee "$OUT/summary.txt"
    exit 2
fi
"$SANITIZER" --version | tail -1 | tee "$OUT/summary.txt"

# Time limits (s): the worst case, every run timing out, stays under 10 minutes (585 s).
# (H100, cold Triton cache: the cases' memcheck 58 s, racecheck 9 s, synccheck 8 s; the Gluon
# pass's ten variants compile under memcheck for more than 35 s, its racecheck took 29 s.)
MEMCHECK_S=${MEMCHECK_S:-150} RACECHECK_S=${RACECHECK_S:-60} SYNCCHECK_S=${SYNCCHECK_S:-45}
GLUON_MEMCHECK_S=${GLUON_MEMCHECK_S:-150} GLUON_S=${GLUON_S:-50}
# The Gluon decode case under racecheck / synccheck (its kernels compiled by the memcheck run)
GLUON_DECODE_S=${GLUON_DECODE_S:-40}
status=0
# dispatch_only LOG [MODULE...]: every race in a racecheck log of a Gluon pass has both sides
# on one of the modules' kernel `def` line or its dispatch: a `gl.warp_specialize(` line, or
# the `if` / `else` that picks one of them (with two dispatch sites, the partition-state stores
# take the `if`'s line). That is the report Triton 3.6's dispatch of partition state gives
# (docs/dev/RELIABILITY.md attributes it), and nothing of the kernels' own rings, buffers or
# barriers. Any other location, or a log without races, is false. MODULE: gluon_prefill
# unless named (the Gluon decode case runs gluon_decode's kernels, grid and persistent).
dispatch_only() {
    local log=$1 name src def lines pattern=""
    shift
    for name in "${@:-gluon_prefill}"; do
        src=src/pagedattn/ops/triton/$name.py
        def=$(grep -n "^def ${name}_kernel(" "$src" | cut -d: -f1)
        lines=$(awk '{ text[NR] = $0 } /gl\.warp_specialize\(/ { ws[++n] = NR }
            END { for (i = ws[1] - 1; n && i <= ws[n]; i++)
                      if (text[i] ~ /gl\.warp_specialize\(|^[ \t]*(if .*|else):[ \t]*$/)
                          printf "%s%d", (found++ ? "|" : ""), i }' "$src")
        [ -n "$def" ] && [ -n "$lines" ] || return 1
        pattern="${pattern:+$pattern|}$name\.py:($def|$lines)"
    done
    grep -q 'Race reported' "$log" || return 1
    ! grep -E 'access at ' "$log" | grep -vE "in ($pattern)( |\$)" | grep -q .
}

# run LABEL LIMIT_S TOOL [TOOL OPTIONS] -- COMMAND...: one program under one tool, its output
# (the sanitizer's report and the program's) in $OUT/<label>_<tool>.log.
run() {
    local label=$1 limit=$2 tool=$3
    shift 3
    local log="$OUT/${label}_$tool.log" start rc summary
    start=$(date +%s)
    # shellcheck disable=SC2086  # SANITIZER_ARGS: extra options, word-split on purpose
    timeout --kill-after=10 "$limit" "$SANITIZER" --tool "$tool" --error-exitcode 99 \
        --print-limit 30 ${SANITIZER_ARGS:-} "$@" >"$log" 2>&1
    rc=$?
    summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/^=* *//')
    if [ "$rc" = 99 ] && [ "$tool" = racecheck ] && { { [ "$label" = gluon ] &&
            dispatch_only "$log"; } || { [ "$label" = gluon_decode ] &&
            dispatch_only "$log" gluon_decode gluon_decode_persistent; }; }
    then
        rc=0
        summary="$summary; every one at the warp_specialize dispatch (docs/dev/RELIABILITY.md)"
    fi
    case $rc in
        0) ;;
        124|137) summary="TIMED OUT after $limit s; ${summary:-no summary}"; status=1 ;;
        99) status=1 ;;  # the tool found errors: its summary says how many
        *) summary="${summary:-no summary} (exit $rc: a case failed or the run broke)"
           status=1 ;;
    esac
    printf '%-10s %-7s %s (%d s)\n' "$tool" "$label" "${summary:-no summary}" \
        "$(( $(date +%s) - start ))" | tee -a "$OUT/summary.txt"
}

run cases "$MEMCHECK_S" memcheck python3 tools/sanitize_cases.py
run cases "$RACECHECK_S" racecheck python3 tools/sanitize_cases.py --shared-memory
run cases "$SYNCCHECK_S" synccheck python3 tools/sanitize_cases.py --shared-memory
if [ -f src/pagedattn/ops/triton/attention_gluon.py ] && [ -f tools/bench_gluon.py ]; then
    run gluon "$GLUON_MEMCHECK_S" memcheck python3 tools/bench_gluon.py --racecheck
    for tool in racecheck synccheck; do
        run gluon "$GLUON_S" "$tool" python3 tools/bench_gluon.py --racecheck
    done
else
    echo "gluon: src/pagedattn/ops/triton/attention_gluon.py is not in this tree; not run" \
        | tee -a "$OUT/summary.txt"
fi
# The Gluon decode pass (src/pagedattn/ops/triton/gluon_decode.py): its case alone, under
# racecheck and synccheck too (memcheck ran it among the cases). Off sm_90 it passes unrun.
for tool in racecheck synccheck; do
    run gluon_decode "$GLUON_DECODE_S" "$tool" python3 tools/sanitize_cases.py --only gluon_decode
done
echo "cases (memcheck run):" >>"$OUT/summary.txt"
grep -hE "^(ok|FAILED) |^[0-9]+ passed" "$OUT/cases_memcheck.log" >>"$OUT/summary.txt"
echo "sanitize: exit $status" | tee -a "$OUT/summary.txt"
exit $status
