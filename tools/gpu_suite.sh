#!/usr/bin/env bash
# The whole GPU test suite in one call, on a GPU machine with no package index:
#   bash tools/gpu_suite.sh [extra pytest args...]
# - installs the wheels carried in .whl/ (pytest-xdist, pytest-timeout, hypothesis) if any;
# - keeps Triton's compile cache in .tcache/ (carry it in; the entries this run compiled or
#   read come back in $OUT as tcache.txz.00of03, ... under the 16 MiB a returned file may
#   have: tools/pack_tcache.sh), so a warm run skips compiles: copy the parts back into
#   .tcache/ (all of them, and no older ones) before the next call;
# - runs `pytest -v -n 12 -m cuda --timeout 60 --timeout-method thread --durations 15` into
#   $OUT/gpu_suite.log and prints its failures, its summary and the slowest tests. (The thread
#   method: a test stuck inside a C call never returns to Python for the signal method's
#   alarm; the thread dumps the stacks and ends the worker, which xdist reports and replaces.
#   A test stuck in a C call that holds the GIL starves that thread too: tests/conftest.py's
#   faulthandler watchdog then ends it after PAGEDATTN_TEST_WATCHDOG_S (120 s here), its stacks in
#   $OUT/watchdog/.)
# - GPU_SUITE_LIMIT_S (seconds; default none): the suite is ended there, and the cache is
#   still packed, so a caller's limit never loses what the run compiled.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT/watchdog"
OUT=$(cd "$OUT" && pwd)
. tools/device_env.sh
start=$(date +%s)
limit=()
[ -n "${GPU_SUITE_LIMIT_S:-}" ] && limit=(timeout -s KILL "$GPU_SUITE_LIMIT_S")
PAGEDATTN_TEST_WATCHDOG_S=${PAGEDATTN_TEST_WATCHDOG_S:-120} \
PAGEDATTN_TEST_WATCHDOG_DIR=$OUT/watchdog ${limit[@]+"${limit[@]}"} python3 -m pytest -v -n 12 -m cuda \
    --timeout 60 --timeout-method thread --durations 15 -p no:cacheprovider -p no:benchmark \
    "$@" tests > "$OUT/gpu_suite.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR) |crashed|Timeout|INCOMPLETE" "$OUT/gpu_suite.log" | head -40
# pytest's own errors (usage, collection, an internal error): exit 2-4
[ $rc -ge 2 ] && [ $rc -le 4 ] && tail -15 "$OUT/gpu_suite.log"
sed -n '/slowest .*durations/,$p' "$OUT/gpu_suite.log" | tail -22
echo "passed $(grep -c ' PASSED' "$OUT/gpu_suite.log"), skipped $(grep -c ' SKIPPED' "$OUT/gpu_suite.log"), failed $(grep -c ' FAILED' "$OUT/gpu_suite.log")"
# A file left with text names a test in flight when the suite ended (GPU_SUITE_LIMIT_S) or one
# the watchdog ended, with its stacks
for log in "$OUT"/watchdog/*.log; do
    [ -s "$log" ] && { echo "== $log"; head -40 "$log"; }
done
echo "gpu suite: exit $rc in $(( $(date +%s) - start )) s"
bash tools/pack_tcache.sh "$OUT"
ls -la "$OUT"
exit $rc
