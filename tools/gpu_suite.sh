#!/usr/bin/env bash
# The whole GPU test suite in one call, on a GPU machine with no package index:
#   bash tools/gpu_suite.sh [extra pytest args...]
# - installs the wheels carried in .whl/ (pytest-xdist, pytest-timeout, hypothesis) if any;
# - keeps Triton's compile cache in .tcache/ (carry it in; the entries this run compiled or
#   read come back in $OUT as tcache.tgz.00, .01, ... under the 16 MiB a returned file may
#   have: tools/pack_tcache.sh), so a warm run skips compiles: copy the parts back into
#   .tcache/ before the next call;
# - runs `pytest -n 12 -m cuda --timeout 60 --timeout-method thread --durations 15`: a hang
#   fails by name, the slowest tests print last. (The thread method: a test stuck inside a
#   C call, a kernel that never ends under torch.cuda.synchronize, never returns to Python
#   for the signal method's alarm; the thread dumps the stacks and ends the worker, which
#   xdist reports and replaces. Two runs stalled so before it.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
. tools/device_env.sh
start=$(date +%s)
python3 -m pytest -q -n 12 -m cuda --timeout 60 --timeout-method thread --durations 15 -p no:cacheprovider -p no:benchmark "$@" tests \
    2>&1 | tee "$OUT/gpu_suite.log"
rc=${PIPESTATUS[0]}
echo "gpu suite: exit $rc in $(( $(date +%s) - start )) s"
bash tools/pack_tcache.sh "$OUT"
ls -la "$OUT"
exit $rc
