"""What tools/gluon_sass.py and tools/gluon_decode_sass.py share: a kernel variant compiled
for sm_90a by the compile tool, ptxas's note on the wgmma pipeline, and the table both print.

Imports only the standard library (and Triton, for ptxas): the two scripts run with a Python
whose Triton is 3.6.0 and no torch.

- `compile_variant(tool, kernel, kernel_name, variant, spec, dump)` -> `Compiled`: the tool's
  log and where it dumped the stages; `Compiled.failure_row(variant)` is the table row of a
  compile that failed (None when it compiled).
- `serialised(ptx)`: "yes" where ptxas serialised the wgmma pipeline (note C7512 or C7513).
- `variant_table(doc, dump_prefix, header, row_of, names)`: the scripts' shared `main`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Optional

TOOL = "/work/shared/tools/gluon_compile_sm90.py"


@dataclass(frozen=True)
class Compiled:
    """One compile: the tool's stdout and stderr, and the folder of its stages."""

    log: str
    out_dir: str
    kernel_name: str

    def stage(self, suffix: str) -> str:
        """The path of a dumped stage ("sass", "ptx", ...)."""
        return os.path.join(self.out_dir, f"{self.kernel_name}.{suffix}")

    def failure_row(self, variant: str) -> Optional[list[str]]:
        """[variant, "FAILED: " + the log's last lines] where the compile failed, else None."""
        if "COMPILED OK" in self.log:
            return None
        tail = [line for line in self.log.splitlines() if line.strip()][-6:]
        return [variant, "FAILED: " + " / ".join(tail)[:300]]


def compile_variant(tool: str, kernel: str, kernel_name: str, variant: str, spec: dict,
                    dump: str) -> Compiled:
    """`kernel_name` of the file `kernel` compiled with `spec` by the compile tool `tool`, its
    stages dumped under `dump`/<variant as a folder name>."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    out_dir = os.path.join(dump, re.sub(r"\W+", "_", variant))
    r = subprocess.run([sys.executable, tool, os.path.abspath(kernel), kernel_name,
                        "--spec-file", f.name, "--dump", out_dir],
                       capture_output=True, text=True, check=False)
    os.unlink(f.name)
    return Compiled(r.stdout + r.stderr, out_dir, kernel_name)


def serialised(ptx: str) -> str:
    """ptxas's C7512 or C7513 note: the wgmma pipeline serialised (C7512: registers or
    structure; C7513: a non-wgmma instruction defines a wgmma's input registers between the
    start and the end of its pipeline stage, e.g. a copy of a register A operand)."""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                       capture_output=True, text=True, check=False)
    log = r.stdout + r.stderr
    return "yes" if "C7512" in log or "C7513" in log else "no"


def variant_table(doc: str, dump_prefix: str, header: Iterable[str],
                  row_of: Callable[[str, str, str], list[str]], names: Iterable[str],
                  flags: Iterable[tuple[str, str]] = (),
                  choose: Optional[Callable[[argparse.Namespace], tuple]] = None) -> int:
    """Parse --tool, --only and --dump (and `flags`: (flag, help) switches), print `header`
    and `row_of(tool, variant, dump)` of each variant in `names` that --only picks (`choose`,
    given the parsed arguments, may return another (row_of, names)); 0 when every variant
    compiled, else 1."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", default=TOOL)
    ap.add_argument("--only", help="compile the variants whose name contains this")
    ap.add_argument("--dump", default=tempfile.mkdtemp(prefix=dump_prefix))
    for flag, text in flags:
        ap.add_argument(flag, action="store_true", help=text)
    ns = ap.parse_args()
    if choose is not None:
        row_of, names = choose(ns)
    for line in header:
        print(line)
    ok = True
    for name in names:
        if ns.only and ns.only not in name:
            continue
        row = row_of(ns.tool, name, ns.dump)
        ok &= not row[1].startswith("FAILED")
        print("| " + " | ".join(row) + " |", flush=True)
    print(f"\nstages dumped under {ns.dump}")
    return 0 if ok else 1
