"""The documents point only at files that are in the repository.

Every file name the Markdown documents mention (`ops/triton/gluon_prefill.py`, `bench_host.py`,
`docs/RELIABILITY.md`, ...) must name a file of the checkout: a path by its trailing
components, a bare name by its basename. Names a command writes (after `--out`, `--plot`,
`--dump` or `>`) are not files of the repository.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/*.md")])
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__"}
NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.(?:py|md|sh|toml|png|json|cfg|ini))\b")
WRITTEN = re.compile(r"(--out|--plot|--dump|>)\s*$")


def _repo_files() -> list[str]:
    """The checkout's files, relative paths; hidden files, and hidden and build folders (a
    `.venv` in the checkout, `.git`), are left out, the folders pruned rather than walked."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        rel = pathlib.Path(folder).relative_to(ROOT)
        files.extend((rel / name).as_posix() for name in names if not name.startswith("."))
    return files


FILES = _repo_files()
BASENAMES = {f.rsplit("/", 1)[-1] for f in FILES}


def _exists(name: str) -> bool:
    name = name.removeprefix("./")
    if "/" not in name:
        return name in BASENAMES
    parts = [p for p in name.split("/") if p not in ("", "..")]
    tail = "/".join(parts)
    return any(f == tail or f.endswith("/" + tail) for f in FILES)


def _mentions(text: str):
    for line in text.splitlines():
        for m in NAME.finditer(line):
            name = m.group(1)
            if name.startswith(("http", "www.")) or WRITTEN.search(line[:m.start()]):
                continue
            yield name


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_file_a_document_names_is_in_the_repository(doc):
    missing = sorted({n for n in _mentions(doc.read_text()) if not _exists(n)})
    assert not missing, f"{doc.relative_to(ROOT)} names files not in the repository: {missing}"


def test_the_check_finds_a_missing_file_and_accepts_real_ones():
    assert _exists("ops/triton/gluon_prefill.py") and _exists("bench_host.py")
    assert not _exists("ops/triton/no_such_module.py") and not _exists("nowhere.md")
    assert list(_mentions("run `--out results.md` then `--plot FILE.png`")) == []
    assert list(_mentions("see `docs/notes.md` and DESIGN.md")) == ["docs/notes.md", "DESIGN.md"]
