"""The documents point only at files that are in the repository.

Every file name the Markdown documents mention (`ops/triton/gluon_prefill.py`, `bench_host.py`,
`docs/dev/RELIABILITY.md`, ...) must name a file of the checkout: a path by its trailing
components, a bare name by its basename. Names a command writes (after `--out`, `--plot`,
`--dump` or `>`) are not files of the repository. Every relative Markdown link must resolve
from its document's folder, and its `#anchor`, if any, name a heading of the target.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/*.md"),
               *ROOT.glob("tools/*.md")])
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__"}
NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.(?:py|md|sh|toml|png|json|cfg|ini))\b")
WRITTEN = re.compile(r"(--out|--plot|--dump|>)\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.M)


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


def anchors(markdown: str) -> list[str]:
    """GitHub's anchors for a document's headings: lower case, punctuation but `-` and `_`
    dropped, spaces as `-`; a repeated heading gets `-1`, `-2`, ... (code blocks skipped)."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    seen: dict[str, int] = {}
    found = []
    for heading in HEADING.findall(text):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.append(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(doc: pathlib.Path) -> list[str]:
    text = doc.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(target)
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(ROOT)} links to what is not there: {broken}"


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n## The `x` part (two)\n## Title\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md) [ok](a.md#the-x-part-two) [ok](a.md#title-1) [ok](#here)\n"
                   "# Here\n[web](https://example.com/x.md) ![pic](nowhere.png) "
                   "[bad](a.md#nothing) [bad](#there)\n")
    assert broken_links(doc) == ["nowhere.png", "a.md#nothing", "#there"]


def layout_modules(design: str) -> list[str]:
    """The modules DESIGN.md's "Layout" section names, as paths under src/pagedattn/: each
    bullet starts with its folder in backticks, then names that folder's modules in
    backticks (`name.py`)."""
    section = design.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    bullets = re.split(r"\n(?=- )", section)
    named = []
    for bullet in bullets:
        tokens = re.findall(r"`([^`]+)`", bullet) if bullet.startswith("- ") else []
        if not tokens or not tokens[0].endswith("/"):
            continue
        folder = tokens[0].removeprefix("src/pagedattn/")
        named += [folder + t for t in tokens[1:] if re.fullmatch(r"\w+\.py", t)]
    return named


def test_design_names_every_module_once_and_no_other():
    package = ROOT / "src" / "pagedattn"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    named = layout_modules((ROOT / "docs" / "DESIGN.md").read_text())
    missing = sorted(modules - set(named))
    stale = sorted(set(named) - modules)
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not missing, f"docs/DESIGN.md's Layout does not name {missing}: add each to its folder"
    assert not stale, f"docs/DESIGN.md's Layout names modules that do not exist: {stale}"
    assert not twice, f"docs/DESIGN.md's Layout names these more than once: {twice}"


def test_the_layout_check_reads_folders_and_modules():
    design = ("# d\n## Layout\nintro `x.py`\n- `src/pagedattn/`: `a.py` (the `A` class), `b.py`\n"
              "  and `c.py`.\n- `ops/torch/`: `d.py`; see `ops/`\n## Next\n- `e/`: `f.py`\n")
    assert layout_modules(design) == ["a.py", "b.py", "c.py", "ops/torch/d.py"]


@pytest.mark.parametrize("folder", ["benchmarks", "tools"])
def test_every_script_has_a_line_in_its_folders_readme(folder):
    readme = (ROOT / folder / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / folder).iterdir() if p.suffix in (".py", ".sh"))
    unlisted = [name for name in scripts if f"`{name}`" not in readme]
    assert not unlisted, f"{folder}/README.md has no line for {unlisted}"
