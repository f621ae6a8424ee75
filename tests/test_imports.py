"""The package's import graph, read from the source with `ast`: every import counts, at
module level or inside a function (a function-level import is still an arrow; it only hides
a loop until the function runs). No loops, and no arrow up the layers of docs/DESIGN.md:
ops never import backends, the layer or the selector; the providers (ops/torch, ops/triton)
never import ops' dispatch (the public op modules); backends never import the layer; only
integrations and the command line import integrations."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "pagedattn"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in (SRC / PACKAGE).rglob("*.py")}


def imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports. `from a.b import c` names module a.b.c when c is
    a module, else a.b itself; relative imports resolve against the importing package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported(path, name, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import loop as a path [a, b, ..., a], or [] (depth-first, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_graph_sees_function_level_and_relative_imports():
    modules = all_modules()
    layer = imported(modules["pagedattn.layer"], "pagedattn.layer", modules)
    assert "pagedattn.forward_context" in layer and "pagedattn.ops.custom_ops" in layer
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_loops(graph):
    assert find_cycle(graph) == []


PROVIDERS = ("pagedattn.ops.torch", "pagedattn.ops.triton")
# What a provider may use of ops beyond its own package: argument and index checks.
PROVIDER_HELPERS = ("pagedattn.ops.checks", "pagedattn.ops.index_checks")


@pytest.mark.parametrize("importer, forbidden, allowed", [
    ("pagedattn.ops", ("pagedattn.backends", "pagedattn.layer", "pagedattn.selector"), ()),
    ("pagedattn.ops.torch", ("pagedattn.ops",), PROVIDERS + PROVIDER_HELPERS),
    ("pagedattn.ops.triton", ("pagedattn.ops",), PROVIDERS + PROVIDER_HELPERS),
    ("pagedattn.backends", ("pagedattn.layer", "pagedattn.selector"), ()),
], ids=["ops", "torch provider", "triton provider", "backends"])
def test_no_arrow_up_the_layers(graph, importer, forbidden, allowed):
    up = sorted((m, dep) for m, deps in graph.items() if under(m, importer)
                for dep in deps if under(dep, *forbidden) and not under(dep, *allowed))
    assert up == []


def test_only_integrations_and_the_command_line_import_integrations(graph):
    users = ("pagedattn.integrations", "pagedattn.cli", "pagedattn.demo", "pagedattn.bench")
    up = sorted((m, dep) for m, deps in graph.items() if not under(m, *users)
                for dep in deps if under(dep, "pagedattn.integrations"))
    assert up == []
