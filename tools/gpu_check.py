"""One GPU call: the Triton / custom-op tests at real sizes, then the kernel benchmark.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python tools/gpu_check.py [bench args...]

Logs go to $OUT (or ./gpu_out) as tests.log and bench.md; the benchmark table prints last.
"""

from __future__ import annotations

import os
import subprocess
import sys

OUT = os.environ.get("OUT", "gpu_out")
TESTS = ["tests/test_triton_attention.py", "tests/test_triton_cache.py",
         "tests/test_triton_merge.py", "tests/test_custom_ops.py"]


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    env = dict(os.environ, PYTHONPATH="src" + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tests = [t for t in TESTS if os.path.exists(t)]
    with open(os.path.join(OUT, "tests.log"), "w") as log:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "8", "-rs", *tests],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        log.write(r.stdout)
    print("\n".join(r.stdout.splitlines()[-25:]), flush=True)
    b = subprocess.run([sys.executable, "benchmarks/bench_kernels.py",
                        "--out", os.path.join(OUT, "bench.md"), *sys.argv[1:]], env=env)
    return r.returncode or b.returncode


if __name__ == "__main__":
    sys.exit(main())
