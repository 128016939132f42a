"""The package's layout, as CONTRIBUTING.md draws it: imports flow one way.

Read statically from the source (what each module imports at any depth of its
code), so that a lazy import inside a function counts too: no import loops
between modules, no module reaching into the package ``__init__``, nothing on
the workers' side importing the scheduler's, a client that uses
``dask_otel.span`` loads no OpenTelemetry SDK module, and a Dask span's trip to
the SDK enters each file once (no stop of it imports an earlier one).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dask_otel

PACKAGE = Path(dask_otel.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(runtime: bool = False) -> dict[str, set[str]]:
    """For each module of the package, the modules of the package it imports;
    with ``runtime``, less those under ``if TYPE_CHECKING:`` (names for
    annotations, never called)"""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if runtime and isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        out[name] = {m for m in found if m in modules and m != name}
    return out


def test_no_import_loops():
    graph = imports()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "import loop: " + " -> ".join((*path, name))
        if name in done:
            return
        for dependency in graph[name]:
            visit(dependency, (*path, name))
        done.add(name)

    for name in graph:
        visit(name, ())


def test_no_module_imports_the_package_init():
    for name, imported in imports().items():
        if name != "dask_otel":
            assert "dask_otel" not in imported, f"{name} imports the package __init__"


def test_the_workers_side_imports_nothing_of_the_schedulers():
    for name, imported in imports().items():
        if name.startswith("dask_otel.worker"):
            scheduler_side = {
                m for m in imported if m.startswith("dask_otel.scheduler") or m == "dask_otel.spans"
            }
            assert not scheduler_side, (name, scheduler_side)


def test_the_registered_worker_plugin_imports_nothing_of_dask_otel_at_module_level():
    # It is pickled by value, for workers where dask_otel is not installed
    tree = ast.parse((PACKAGE / "worker" / "plugin.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any(n.startswith("dask_otel") for n in names), ast.unparse(node)


def test_a_client_using_dask_otel_span_loads_no_sdk_module():
    code = (
        "import sys, dask_otel\n"
        "from distributed import Client, LocalCluster\n"
        "with dask_otel.span('x'):\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def reachable(graph: dict[str, set[str]], name: str) -> set[str]:
    """Every module ``name`` imports, directly or through others"""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dependency in graph[todo.pop()] - seen:
            seen.add(dependency)
            todo.append(dependency)
    return seen


#: A Dask span's trip to the SDK, in order, as dask_otel/spans.py draws it
CORRIDOR = (
    "dask_otel.spans",
    "dask_otel.scheduler.ledger",
    "dask_otel.scheduler.record",
    "dask_otel.scheduler.totals",
    "dask_otel.span_context",
    "dask_otel.scheduler.builder",
    "dask_otel.export.sink",
)


def test_a_dask_spans_trip_to_the_sdk_enters_each_file_once():
    """No stop of the corridor can call back into one before it: none imports an
    earlier stop, at any depth, when it runs. So the builder takes what the mirror
    worked out (the record, the figures) and never goes back to the totals, the
    ledger or the mirror; the sink knows nothing of the scheduler."""
    graph = imports(runtime=True)
    for i, stop in enumerate(CORRIDOR):
        back = reachable(graph, stop) & set(CORRIDOR[:i])
        assert not back, f"{stop} reaches back to {sorted(back)}"
    sink = reachable(graph, "dask_otel.export.sink")
    assert not {m for m in sink if m.startswith(("dask_otel.scheduler", "dask_otel.worker"))}


def test_the_spans_docstring_draws_the_corridor_the_test_checks():
    doc = (PACKAGE / "spans.py").read_text().split('"""')[1]
    drawn = doc.split("::", 1)[1]
    positions = [drawn.find(stop.replace("dask_otel.spans", "here:")) for stop in CORRIDOR]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), positions


def test_the_client_side_needs_only_the_opentelemetry_api():
    """dask_otel.span runs where only opentelemetry-api is installed: the client's
    modules import no attribute table (opentelemetry.semconv comes with the SDK)"""
    graph = imports(runtime=True)
    for name in ("dask_otel.client", "dask_otel.annotation", "dask_otel.span_context"):
        assert "dask_otel.attributes" not in reachable(graph, name) | {name}, name
