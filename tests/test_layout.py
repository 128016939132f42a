"""The package's layout, as CONTRIBUTING.md draws it: imports flow one way.

Read statically from the source (what each module imports at any depth of its
code), so that a lazy import inside a function counts too: no import loops
between modules, no module reaching into the package ``__init__``, nothing on
the workers' side importing the scheduler's, a client that uses
``dask_otel.span`` loads no OpenTelemetry SDK module, and no stop of a Dask span's
trip to the SDK imports an earlier one. Calls, followed on a real cluster: on
every call stack of the scheduler, from Dask's hooks to the SDK, each file of the
package is entered once.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import threading
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
    "dask_otel.span_context",
    "dask_otel.scheduler.builder",
    "dask_otel.scheduler.totals",
    "dask_otel.export.sink",
)


def test_no_stop_of_the_corridor_imports_an_earlier_one():
    """Imports, read statically: no stop of :data:`CORRIDOR` imports an earlier stop,
    at any depth, when it runs; the sink imports nothing of the scheduler's or the
    workers'. What it does not see (calls through objects handed over, modules off
    the list): the test below, which follows the calls."""
    graph = imports(runtime=True)
    for i, stop in enumerate(CORRIDOR):
        back = reachable(graph, stop) & set(CORRIDOR[:i])
        assert not back, f"{stop} reaches back to {sorted(back)}"
    sink = reachable(graph, "dask_otel.export.sink")
    assert not {m for m in sink if m.startswith(("dask_otel.scheduler", "dask_otel.worker"))}


#: Where a span reaches the SDK: a span processor's ``on_end``
SDK_ENTRY = ("opentelemetry/sdk/trace/export/__init__.py", "on_end")


class CallStacks:
    """A profile function for the scheduler's threads: on every call of a function
    of the package, the files of the package on the stack, each run of frames of
    one file counted once; notes a file entered again below a file it called, a
    stop of :data:`CORRIDOR` entered below a later one (the builder thread's stacks
    start at the builder), and the thread and files of every stack that reaches the
    SDK's ``on_end``"""

    def __init__(self) -> None:
        self.reentries: set[tuple[str, ...]] = set()
        self.backwards: set[tuple[str, ...]] = set()
        self.trips: set[tuple[str, tuple[str, ...]]] = set()

    @staticmethod
    def files(frame) -> tuple[str, ...]:
        """The package's files from the outermost frame to ``frame``, runs collapsed"""
        out: list[str] = []
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(str(PACKAGE)):
                name = module_name(Path(path))
                if not out or out[-1] != name:
                    out.append(name)
            frame = frame.f_back
        return tuple(reversed(out))

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(str(PACKAGE)):
            files = self.files(frame)
            if len(set(files)) < len(files):
                self.reentries.add(files)
            stops = [CORRIDOR.index(f) for f in files if f in CORRIDOR]
            if stops != sorted(stops):
                self.backwards.add(files)
        elif code.co_filename.endswith(SDK_ENTRY[0]) and code.co_name == SDK_ENTRY[1]:
            self.trips.add((threading.current_thread().name, self.files(frame)))


def test_a_dask_spans_trip_to_the_sdk_enters_each_file_once():
    """Calls, followed as they happen: a real cluster mirrors a workflow (nested
    spans, a sub-span, an erred task, a named workflow) while the scheduler's event
    loop thread and the threads started since (the builder's) are profiled, from
    Dask's hooks into the plugin down to the SDK's span processor. On every call
    stack, each file of the package is entered once: no module calls back into one
    that called it (through a callback, a handed-over object or an import),
    whatever the module, ``_compat`` and the workflow outcomes included; and no stop
    of the corridor calls an earlier one (on the builder thread too). The spans
    reach the SDK on the builder thread, never on the event loop, from the builder
    through the sink."""
    import dask_otel.scheduler.plugin  # noqa: F401 (the profile reads module files)
    from tests.support.cluster import otel_cluster
    from tests.support.tasks import fail, inc

    stacks = STACKS[0] = CallStacks()
    config = {"otel.metrics.exporter": "memory", "otel.metrics.workflows": ["traced"]}
    with otel_cluster(config) as (client, mirrored):
        client.run_on_scheduler(profile, True)
        try:
            with dask_otel.span("traced", workflow=True) as sid:
                with dask_otel.span("step"):
                    client.gather(client.map(inc, range(4)))
                failed = client.submit(fail, 1)
                wait_for_error(failed)
            mirrored.by_dask_id(sid)
        finally:
            client.run_on_scheduler(profile, False)
    assert stacks.trips, "no span reached the SDK's on_end from the scheduler's threads"
    for thread, trip in stacks.trips:
        assert thread == "dask_otel-build", (thread, trip)
        assert trip == ("dask_otel.scheduler.builder", "dask_otel.export.sink"), trip
    assert not stacks.reentries, "\n".join(" -> ".join(s) for s in sorted(stacks.reentries))
    assert not stacks.backwards, "\n".join(" -> ".join(s) for s in sorted(stacks.backwards))


#: The CallStacks of the test running (a function sent to the scheduler is pickled:
#: by reference, so that it profiles into this one)
STACKS: list[CallStacks] = [CallStacks()]


def profile(on: bool) -> None:
    """Run on the scheduler's event loop thread: profile it and the threads started
    from now on with STACKS[0], or stop"""
    sys.setprofile(STACKS[0] if on else None)
    threading.setprofile(STACKS[0] if on else None)


def wait_for_error(future) -> None:
    from distributed import wait

    wait(future)
    assert future.status == "error"


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
