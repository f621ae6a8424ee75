"""No module reads another module's private names, and no two things share a name a reader
would confuse, read from the source with `ast`.

A name with one leading underscore is its module's own business: another module that imports
it (`from x import _y`, or a private module `x._z`), or reads it as an attribute (`obj._y`,
`module._y`, `self._y` of a base class defined elsewhere), breaks as soon as its owner
changes. Where two modules need a thing, it gets a public name. The one exception is the
layer's fields that the seeds name themselves and every backend reads (`layer._k_scale` and
its kin: vLLM's attention API passes scales that way)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "pagedattn"
# The Attention layer's fields named by the seeds (vLLM's layer), read by every backend.
SEED_LAYER_FIELDS = frozenset({"_q_scale", "_k_scale", "_v_scale", "_prob_scale",
                               "_q_scale_float", "_k_scale_float", "_v_scale_float",
                               "_o_scale_float"})


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.AST) -> set[str]:
    """Every name a module defines: functions, classes, assigned names and attributes
    (`self._x = ...`), arguments and import aliases."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def violations(source: str, others: set[str], package: str = "pagedattn") -> list[str]:
    """What `source` reads of other modules' private names: imports of private names or
    modules of `package`, and attribute reads of private names defined in another module
    (`others`) and not in this one."""
    tree = ast.parse(source)
    own = defined_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
            if any(is_private(part) for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            found += [f"line {node.lineno}: from {node.module} import {alias.name}"
                      for alias in node.names if is_private(alias.name)]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {alias.name}" for alias in node.names
                      if alias.name.startswith(package)
                      and any(is_private(part) for part in alias.name.split("."))]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and \
                is_private(node.attr) and node.attr not in own and node.attr in others and \
                node.attr not in SEED_LAYER_FIELDS:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_names():
    modules = {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    defined = {path: defined_names(ast.parse(text)) for path, text in modules.items()}
    problems = []
    for path, text in modules.items():
        others = set().union(*(names for p, names in defined.items() if p != path))
        problems += [f"{path.relative_to(PACKAGE.parent)} {v}"
                     for v in violations(text, {n for n in others if is_private(n)})]
    assert problems == [], "\n".join(problems)


def test_the_walk_finds_each_kind_of_private_read():
    source = (
        "from pagedattn.ops._hidden import run\n"
        "from pagedattn.ops.plan import _broadcast, plan_varlen_attention\n"
        "import pagedattn.ops._hidden\n"
        "import torch._C\n"  # another package's business
        "class Impl(Base):\n"
        "    def forward(self, layer, wrapper):\n"
        "        self._mine = 1\n"
        "        return (self._mine, self._inherited, wrapper._window_left,\n"
        "                layer._k_scale, torch._C)\n")
    others = {"_inherited", "_window_left", "_k_scale", "_mine"}
    assert violations(source, others) == [
        "line 1: from pagedattn.ops._hidden import ...",
        "line 2: from pagedattn.ops.plan import _broadcast",
        "line 3: import pagedattn.ops._hidden",
        "line 8: self._inherited",
        "line 8: wrapper._window_left",
    ]


def module_level_names(path: Path) -> tuple[list[str], list[str]]:
    """(every class, the module-level plan_* functions) `path` defines."""
    tree = ast.parse(path.read_text())
    classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    plans = [n.name for n in tree.body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("plan")]
    return classes, plans


def is_provider(path: Path) -> bool:
    return path.parent.name in ("torch", "triton") and path.parent.parent.name == "ops"


def test_no_two_classes_and_no_two_planning_functions_share_a_name():
    """A name says which thing it is: one class per name in the package, one module-level
    plan_* function per name, except an op's and its provider's implementation."""
    classes, plans = defaultdict(list), defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        names = module_level_names(path)
        for name in names[0]:
            classes[name].append(path)
        for name in names[1]:
            plans[name].append(path)
    clashes = [f"class {n}: {[str(p.relative_to(PACKAGE)) for p in paths]}"
               for n, paths in classes.items() if len(paths) > 1]
    for name, paths in plans.items():
        ops = [p for p in paths if not is_provider(p)]
        if len(ops) > 1 or (not ops and len(paths) > 1):
            clashes.append(f"def {name}: {[str(p.relative_to(PACKAGE)) for p in paths]}")
    assert clashes == [], "\n".join(clashes)
