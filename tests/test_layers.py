"""The import contract, checked on the real import graph of the source tree.

Layers, bottom up: `diffq.core` (the base) < `diffq.producer`, `diffq.worker`,
`diffq.results` (independent of each other) < `diffq.app` (composes them).
An import that runs upward or across fails here, and so does an import cycle
between modules, imports inside functions counted (those are deferred on purpose: the
CLI keeps torch and Celery out of commands that do not need them; deferring an import
is allowed, coming back round to itself is not); `if TYPE_CHECKING:` blocks are not
imports at run time and are left out. `bench/` sits on top of everything; it may import
any layer.

Inside `diffq.worker` its packages are ordered too, bottom up (`WORKER_ORDER`): a
module imports only its own package and those below it, even inside a function, so no
two worker packages import each other. `diffq.app` reaches the worker only through
`diffq.worker.api`. `diffq.testing` (the loopback servers) is for the suite and bench/
only, and bench/ imports nothing from tests/.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each package lives in the tree: pyproject's package-dir (which puts
# diffq.producer in producer/ and diffq.worker in worker/), and bench/.
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
FOLDERS = {**{package: ROOT / folder for package, folder in PACKAGE_DIR.items()}, "bench": ROOT / "bench"}

LAYER = {"diffq.core": 0, "diffq.producer": 1, "diffq.worker": 1, "diffq.results": 1, "diffq.app": 2, "diffq": 3,
         "bench": 4, "diffq.testing": 5}
# What each layer may import besides itself; the root package (`diffq`, which holds
# only `__version__`) is open to all.
ALLOWED = {
    "diffq.core": {"diffq", "diffq.core"},
    "diffq.producer": {"diffq", "diffq.core"},
    "diffq.worker": {"diffq", "diffq.core"},
    "diffq.results": {"diffq", "diffq.core"},
    "diffq.app": {"diffq", "diffq.core", "diffq.producer", "diffq.worker", "diffq.results"},
    "diffq": set(LAYER) - {"bench", "diffq.testing"},
    "bench": set(LAYER),
    # The loopback servers the suite and bench/ share: outside the runtime layers (none
    # of them may import it), importing none of them.
    "diffq.testing": {"diffq.testing"},
}
OURS = ("diffq", "bench")
# The worker's packages, bottom up: what a process says and keeps about itself; the
# device; the sink (stores what the device made); a batch's delivery (lives a batch
# on the device and the sink); the processes (compose the rest into a worker).
WORKER_ORDER = ("observe", "device", "sink", "delivery", "process")
WORKER_SURFACE = "diffq.worker.api"


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            # setuptools takes a remapped package from its own folder only (diffq.worker from
            # worker/, never from a diffq/worker/ that may lie about).
            owner = max((p for p in FOLDERS if name == p or name.startswith(p + ".")), key=len)
            if not path.is_relative_to(FOLDERS[owner]):
                continue
            found[name] = path
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


def _type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports for annotations only."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, path: Path, *, type_checking: bool = True) -> set[str]:
    """The diffq and bench modules `module` imports, inside functions too (a `from pkg import
    name` counts `pkg.name` when that is a module). `type_checking=False` leaves out
    `if TYPE_CHECKING:` blocks (their `else` still runs)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    stack, nodes = list(tree.body), []
    while stack:
        node = stack.pop()
        nodes.append(node)
        if not type_checking and _type_checking(node):
            stack.extend(node.orelse)
        else:
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
    bad = sorted(target for target in imports(module, MODULES[module])
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


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports among `modules`, inside functions too, `TYPE_CHECKING` left out.
    (A package's __init__ is imported by its submodules implicitly; only explicit edges count.)"""
    return {module: {t for t in imports(module, path, type_checking=False) if t in modules}
            for module, path in modules.items()}


def test_no_import_cycles_even_inside_functions():
    """Over diffq/, producer/, worker/ and bench/ as installed (pyproject's package-dir):
    the transport table points at the broker classes and the Celery app that reads it
    (diffq/core/brokers/app.py) sits above both; Celery's adapter imports a batch's life
    (worker/delivery/tasks.py), which asks brokers/app.py, not the adapter, to stop."""
    assert {"diffq.producer.submit", "diffq.worker.delivery.tasks", "bench.fleet"} <= set(MODULES)
    assert MODULES["diffq.worker.delivery.tasks"].relative_to(ROOT).parts[0] == "worker"
    assert not (found := cycles(import_graph(MODULES))), f"import cycles: {found}"


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_planted_cycle_through_a_function_is_found(tmp_path):
    """The circle this check was written for (make_celery importing the table inside a
    function, the table importing the broker classes) is found; the same import under
    `if TYPE_CHECKING:` is not an edge."""
    (tmp_path / "base.py").write_text("def make_celery():\n    from diffq.core.transports import transport_for\n")
    (tmp_path / "transports.py").write_text("from diffq.core.brokers.base import Broker\n")
    (tmp_path / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from diffq.core.transports import transport_for\nelse:\n    import os\n")
    planted = {"diffq.core.brokers.base": tmp_path / "base.py", "diffq.core.transports": tmp_path / "transports.py"}
    assert cycles(import_graph(planted)) == [["diffq.core.brokers.base", "diffq.core.transports"]]
    planted["diffq.core.brokers.base"] = tmp_path / "typed.py"
    assert not cycles(import_graph(planted))


def test_the_contract_catches_an_upward_import(tmp_path):
    """The check can fail: a base module importing the worker is reported."""
    path = tmp_path / "bad.py"
    path.write_text("from diffq.worker import sink\n")
    targets = imports("diffq.core.bad", path)
    assert "diffq.worker.sink" in targets and layer_of("diffq.worker.sink") not in ALLOWED["diffq.core"]


def test_every_api_name_resolves():
    """The Python API's lazy names point at modules that exist after any move."""
    from diffq import api

    for name in api.__all__:
        assert callable(getattr(api, name)), name


def worker_package(module: str) -> str | None:
    """The worker package `module` is in (`diffq.worker.<package>...`), else None."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["diffq", "worker"] and len(parts) > 2 and parts[2] in WORKER_ORDER else None


def worker_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The pairs (package, package it imports) between the worker's packages in `graph`."""
    return {(worker_package(a), worker_package(b)) for a, targets in graph.items() for b in targets
            if worker_package(a) and worker_package(b) and worker_package(a) != worker_package(b)}


def worker_order_faults(graph: dict[str, set[str]]) -> list[str]:
    """Every import in `graph` from a worker package to one above it, and every pair of
    worker packages that import each other."""
    rank = {package: i for i, package in enumerate(WORKER_ORDER)}
    edges = worker_edges(graph)
    faults = [f"{a} imports {b} both ways" for a, b in sorted(edges) if a < b and (b, a) in edges]
    faults += [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets)
               if worker_package(a) and worker_package(b) and rank[worker_package(a)] < rank[worker_package(b)]]
    return faults


def test_the_worker_packages_are_all_ordered():
    found = {path.name for path in FOLDERS["diffq.worker"].iterdir() if (path / "__init__.py").exists()}
    assert found == set(WORKER_ORDER)


def test_worker_packages_import_in_one_direction():
    graph = {module: {t for t in imports(module, path) if t in MODULES}
             for module, path in MODULES.items() if worker_package(module)}
    assert not (faults := worker_order_faults(graph)), faults


def test_the_worker_order_check_can_fail():
    """Run over edges the tree had before the order: each two-way pair is reported."""
    before = {"diffq.worker.process.runtime": {"diffq.worker.delivery.lease", "diffq.worker.sink.helper"},
              "diffq.worker.delivery.tasks": {"diffq.worker.process.runtime"},
              "diffq.worker.device.pipeline_host": {"diffq.worker.delivery.faults"},
              "diffq.worker.delivery.hooks": {"diffq.worker.device.models"},
              "diffq.worker.sink.helper": {"diffq.worker.process.heap"},
              "diffq.worker.device.qualify": {"diffq.worker.sink.store", "diffq.worker.process.spec"},
              "diffq.worker.sink.store": {"diffq.worker.device.backends"},
              "diffq.worker.process.child": {"diffq.worker.device.pipeline_host"}}
    faults = worker_order_faults(before)
    assert {"delivery imports process both ways", "delivery imports device both ways",
            "device imports sink both ways", "process imports sink both ways",
            "device imports process both ways"} <= set(faults)
    assert "diffq.worker.delivery.tasks -> diffq.worker.process.runtime" in faults
    assert not worker_order_faults({"diffq.worker.process.child": {"diffq.worker.delivery.runtime"}})


def app_reaches_into_worker(module: str, path: Path) -> list[str]:
    """The worker modules other than its public surface that `module` imports."""
    return sorted(t for t in imports(module, path)
                  if layer_of(t) == "diffq.worker" and t not in (WORKER_SURFACE, "diffq.worker"))


def test_the_app_reaches_the_worker_only_through_its_surface():
    app = {module: path for module, path in MODULES.items() if layer_of(module) == "diffq.app"}
    bad = {module: found for module, path in app.items() if (found := app_reaches_into_worker(module, path))}
    assert not bad, f"import the worker through {WORKER_SURFACE}: {bad}"


def test_the_surface_check_can_fail(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from diffq.worker.process.supervisor import Supervisor\n")
    assert app_reaches_into_worker("diffq.app.bad", path) == ["diffq.worker.process.supervisor"]


def test_every_worker_surface_name_resolves():
    """The surface's names point at what exists after any move inside the worker."""
    import importlib

    from diffq.worker import api

    assert set(api.__all__) == {*api.SURFACE, "QUALIFY_MAIN"}
    for name in api.SURFACE:
        assert getattr(api, name) is not None, name
    assert importlib.util.find_spec(api.QUALIFY_MAIN) is not None


def imports_of_tests(path: Path) -> list[str]:
    """The `tests` modules `path` imports, even inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found += [name for name in names if name == "tests" or name.startswith("tests.")]
    return found


def test_bench_imports_nothing_from_tests(tmp_path):
    bench = {module: path for module, path in MODULES.items() if layer_of(module) == "bench"}
    bad = {module: found for module, path in bench.items() if (found := imports_of_tests(path))}
    assert not bad, f"bench/ shares the test servers through diffq.testing, not tests/: {bad}"
    (tmp_path / "bad.py").write_text("def f():\n    from tests.servers import RedisServer\n")
    assert imports_of_tests(tmp_path / "bad.py") == ["tests.servers"]  # the check can fail


# -- one class per store ------------------------------------------------------------------
STORE_SCHEMES = {"s3", "gs", "s3://", "gs://"}
STORAGE_PACKAGE = "diffq.core.storage"


def scheme_branches(source: str) -> list[str]:
    """Where `source` tells object stores apart by their URL scheme: a comparison with or a
    `startswith` of "s3"/"gs"/"s3://"/"gs://" (alone or in a tuple), or a storage's `.scheme`
    read. Only core/storage/ may (one class per store: `open_storage`, `is_bucket_url`)."""
    def named(node: ast.AST) -> bool:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(item, ast.Constant) and item.value in STORE_SCHEMES for item in items)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(named(n) for n in (node.left, *node.comparators)):
            found.append(f"line {node.lineno}: compares a scheme")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "removeprefix") and any(named(a) for a in node.args)):
            found.append(f"line {node.lineno}: .{node.func.attr}({ast.unparse(node.args[0])})")
        elif isinstance(node, ast.Attribute) and node.attr == "scheme" and "stor" in ast.unparse(node.value).lower():
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_storage_package_tells_stores_apart_by_scheme():
    product = {m: p for m, p in MODULES.items() if layer_of(m) not in ("bench", "diffq.testing")
               and not (m == STORAGE_PACKAGE or m.startswith(STORAGE_PACKAGE + "."))}
    assert {"diffq.core.model_store", "diffq.worker.device.model_fetch", "diffq.app.fleet"} <= set(product)
    bad = {m: found for m, p in product.items() if (found := scheme_branches(p.read_text()))}
    assert not bad, f"a storage scheme branch outside {STORAGE_PACKAGE}: {bad}"


def test_the_scheme_check_can_fail():
    """Each branch this house had before its stores were one class each is found."""
    assert scheme_branches('def f(s):\n    return _S3 if s.scheme == "s3" else _GCS\n')  # model_fetch.py's
    assert scheme_branches('def f(storage):\n    return storage.scheme\n')
    assert scheme_branches('if url.startswith("s3://"):\n    pass\n')  # model_store.py's
    assert scheme_branches('ok = model.startswith(("s3://", "gs://"))\n')
    assert scheme_branches('if scheme in ("s3", "gs"):\n    pass\n')  # fleet.py's normalise_out_prefix
    assert not scheme_branches('if transport.name == "redis":\n    pass\nx = urlsplit(u).scheme\n')
