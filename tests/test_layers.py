"""The import contract, checked on the real import graph of the source tree.

Layers, bottom up: `diffq.core` (the base) < `diffq.producer`, `diffq.worker`,
`diffq.results` (independent of each other) < `diffq.app` (composes them).
An import that runs upward or across fails here, and so does an import cycle
between modules at module level (imports inside functions are deferred on purpose:
the CLI keeps torch and Celery out of commands that do not need them). `bench/` sits
on top of everything; it may import any layer, but none of its modules may come back
round to itself, not even through an import inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each package lives in the tree (pyproject's package-dir remaps two of them).
FOLDERS = {"diffq": ROOT / "diffq", "diffq.producer": ROOT / "producer", "diffq.worker": ROOT / "worker",
           "bench": ROOT / "bench"}

LAYER = {"diffq.core": 0, "diffq.producer": 1, "diffq.worker": 1, "diffq.results": 1, "diffq.app": 2, "diffq": 3,
         "bench": 4}
# What each layer may import besides itself; the root package (`diffq`, which holds
# only `__version__`) is open to all.
ALLOWED = {
    "diffq.core": {"diffq", "diffq.core"},
    "diffq.producer": {"diffq", "diffq.core"},
    "diffq.worker": {"diffq", "diffq.core"},
    "diffq.results": {"diffq", "diffq.core"},
    "diffq.app": {"diffq", "diffq.core", "diffq.producer", "diffq.worker", "diffq.results"},
    "diffq": set(LAYER) - {"bench"},
    "bench": set(LAYER),
}
OURS = ("diffq", "bench")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if package == "diffq" and parts and parts[0] in ("producer", "worker"):
                continue
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> str:
    for name in sorted(LAYER, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    raise AssertionError(module)


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(module: str, path: Path, *, top_level_only: bool) -> set[str]:
    """The diffq and bench modules `module` imports (a `from pkg import name` counts `pkg.name`
    when that is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # module level includes `if`/`try` blocks, not function bodies
        stack, nodes = list(tree.body), []
        while stack:
            node = stack.pop()
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try)):
                stack.extend(ast.iter_child_nodes(node))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in OURS or name.startswith(tuple(f"{o}." for o in OURS)))
    found.discard(module)
    return found


def test_the_tree_is_read():
    assert {"diffq.core.contract", "diffq.producer.submit", "diffq.worker.sink.store", "diffq.results.status",
            "diffq.app.cli"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_or_sideways_import(module):
    mine = layer_of(module)
    bad = sorted(target for target in imports(module, MODULES[module], top_level_only=False)
                 if target in MODULES and layer_of(target) not in ALLOWED[mine] | {mine})
    assert not bad, f"{module} ({mine}) imports {bad}"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph` (module -> the modules it imports): its strongly
    connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_at_module_level():
    # A package's __init__ is imported by its submodules implicitly; only explicit edges count.
    graph = {module: {t for t in imports(module, path, top_level_only=True) if t in MODULES}
             for module, path in MODULES.items()}
    assert not (found := cycles(graph)), f"import cycles: {found}"


def test_bench_has_no_import_cycles_even_inside_functions():
    """bench/ shares its helpers through bench/common.py (and the stand-in's stamps
    through bench/stamps.py) instead of importing back and forth."""
    bench = {module: path for module, path in MODULES.items() if layer_of(module) == "bench"}
    assert {"bench.common", "bench.device", "bench.phases", "bench.standin", "bench.scale"} <= set(bench)
    graph = {module: {t for t in imports(module, path, top_level_only=False) if t in bench}
             for module, path in bench.items()}
    assert not (found := cycles(graph)), f"import cycles in bench/: {found}"


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_contract_catches_an_upward_import(tmp_path):
    """The check can fail: a base module importing the worker is reported."""
    path = tmp_path / "bad.py"
    path.write_text("from diffq.worker import sink\n")
    targets = imports("diffq.core.bad", path, top_level_only=False)
    assert "diffq.worker.sink" in targets and layer_of("diffq.worker.sink") not in ALLOWED["diffq.core"]


def test_every_api_name_resolves():
    """The Python API's lazy names point at modules that exist after any move."""
    from diffq import api

    for name in api.__all__:
        assert callable(getattr(api, name)), name
