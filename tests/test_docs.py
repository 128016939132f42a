"""The documents say what the code does: their tables are compared with the code
and with what a real cluster emits, so that they cannot drift.

README.md: the config table (put together from otel-schema.yaml, otel.yaml and
config.py) and its value forms, the resource attributes, the ``--preload`` rule and
what ``instrument`` does not export. CONTRIBUTING.md: every benchmark.
docs/traces.md: the span attribute table and the task span attribute table (what a
real cluster emits). docs/metrics.md's instrument table is checked by
tests/test_metrics.py."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import logging
import re
import time
from pathlib import Path

import dask
import pytest
import yaml
from distributed import Client, LocalCluster, Scheduler, span, wait

import dask_otel
import dask_otel.config
from tests.support import oracle
from tests.support.cluster import (
    UNINSTRUMENTED_CONFIG,
    Mirrored,
    cluster_kwargs,
    otel_cluster,
    wait_until,
)
from tests.support.deploy_checks import dotted
from tests.support.tasks import fail, inc

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
TRACES = ROOT / "docs" / "traces.md"


def markdown_table(text: str, marker: str) -> list[list[str]]:
    """Rows of the first table after ``<!-- marker``, cells stripped, header dropped"""
    after = text.split(f"<!-- {marker}", 1)[1].splitlines()[1:]
    rows = []
    for line in after:
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[2:]


def code(cell: str) -> str:
    return re.fullmatch(r"`([^`]*)`", cell).group(1)


SCHEMA = ROOT / "dask_otel" / "otel-schema.yaml"


def schema_descriptions(node: dict, prefix: str = "") -> dict[str, str]:
    """Each key of otel-schema.yaml, dotted, with its description on one line"""
    out = {}
    for name, entry in node["properties"].items():
        key = f"{prefix}{name}"
        if "properties" in entry:
            out.update(schema_descriptions(entry, key + "."))
        else:
            out[key] = " ".join(entry["description"].split())
    return out


def read_in() -> dict[str, tuple[str, ...]]:
    """Each key of OtelConfig, with the processes that read it"""
    return {f.metadata["key"]: f.metadata["read_in"]
            for f in dataclasses.fields(dask_otel.config.OtelConfig)}


def config_table() -> list[str]:
    """The README's config table, put together from the one copy of each fact: the
    key's meaning (otel-schema.yaml), its default (otel.yaml) and the processes
    that read it (dask_otel/config.py)"""
    meanings = schema_descriptions(yaml.safe_load(SCHEMA.read_text()))
    read_in_by_key = read_in()
    lines = ["| key | default | read in | meaning |", "|---|---|---|---|"]
    for key, value in dotted(dask_otel.config.DEFAULTS).items():
        default = yaml.safe_dump(value).splitlines()[0].removesuffix(" ...")
        lines.append(f"| `{key}` | `{default}` | {', '.join(read_in_by_key[key])} | {meanings[key]} |")
    return lines


def test_the_schema_describes_every_key_of_otel_yaml_and_no_other():
    meanings = schema_descriptions(yaml.safe_load(SCHEMA.read_text()))
    assert set(meanings) == set(dotted(dask_otel.config.DEFAULTS))
    assert set(meanings) == set(read_in())
    assert all(meanings.values())


def test_the_readme_config_table_is_the_schema_the_defaults_and_read_in():
    """Every key, default, "read in" and meaning of the README's table is the one
    in otel.yaml, config.py and otel-schema.yaml. To mend the README, paste the
    table this test prints."""
    text = README.read_text().split("<!-- config-table", 1)[1].splitlines()[1:]
    documented = [line for line in text[: text.index("")]] if "" in text else text
    expected = config_table()
    assert documented == expected, "the README's config table should be:\n" + "\n".join(expected)


@pytest.mark.parametrize(
    "key, given, field, read",
    [
        ("otel.traces.exporter", "console, memory", "traces_exporters", ("console", "memory")),
        ("otel.metrics.exporter", "memory,none", "metrics_exporters", ("memory",)),
        ("otel.logs.exporter", "console , memory", "logs_exporters", ("console", "memory")),
        ("otel.events.topics", "dask, my-topic", "event_topics", frozenset({"dask", "my-topic"})),
        ("otel.logs.level", 30, "logs_level", logging.WARNING),
        ("otel.logs.level", "warning", "logs_level", logging.WARNING),
    ],
)
def test_the_config_tables_value_forms_are_read(key, given, field, read):
    """The table's "a list or a comma-separated string" and "a logging level name or
    number", read as the bridge uses them"""
    with dask.config.set({key: given}):
        assert getattr(dask_otel.config.read_config(), field) == read


def sides_using(attribute: str) -> set[str]:
    """The sides of the package whose code reads ``<something>.<attribute>``:
    scheduler (scheduler/, spans.py), workers (worker/, spill.py), or both (the rest)"""
    package = Path(dask_otel.config.__file__).parent
    sides = set()
    for path in package.rglob("*.py"):
        if path.name == "config.py":
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Attribute) and n.attr == attribute for n in ast.walk(tree)):
            part = path.relative_to(package).parts[0]
            if part in ("scheduler", "spans.py"):
                sides.add("scheduler")
            elif part in ("worker", "spill.py"):
                sides.add("workers")
            else:
                sides.update(("scheduler", "workers"))
    return sides


def test_each_key_is_used_only_in_the_processes_that_read_it():
    """OtelConfig's "read in" (the table's column) against the code: a key read in
    the scheduler alone is used by scheduler-side code only, and so on"""
    for field in dataclasses.fields(dask_otel.config.OtelConfig):
        read_in = set(field.metadata["read_in"]) - {"client"}
        assert sides_using(field.name) == read_in, field.metadata["key"]


def attribute_patterns(marker: str = "span-attributes-table") -> list[tuple[str, re.Pattern]]:
    rows = markdown_table(TRACES.read_text(), marker)
    patterns = []
    for name, *_ in rows:
        name = code(name)
        regex = re.sub(r"<[a-z]+>", "[^.]+", re.escape(name).replace(r"\<", "<").replace(r"\>", ">"))
        patterns.append((name, re.compile(regex + "$")))
    return patterns


#: The table's "type" column, as the SDK stores attribute values
TYPES = {
    "string": lambda v: isinstance(v, str),
    "string[]": lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "double": lambda v: isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
}


def documented_row(attribute: str, table: list[tuple[re.Pattern, list[str]]]) -> list[str] | None:
    """The first row of the attribute table whose name pattern matches"""
    return next((row for pattern, row in table if pattern.match(attribute)), None)


def row_fits(row: list[str], span, value) -> bool:
    """The value has the row's type, and the span is of the row's "on" kind"""
    _, type_, on, *_ = row
    taskgroup = "dask.taskgroup.name" in span.attributes
    kind_ok = {"all": True, "Dask spans": not taskgroup, "TaskGroup spans": taskgroup}[on]
    return TYPES[type_](value) and kind_ok


def documented_resource() -> list[str]:
    """The resource attributes the README promises on every span: the names quoted
    in the paragraph after ``<!-- resource-attributes``, before ", which" """
    paragraph = README.read_text().split("<!-- resource-attributes", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"`([^`]+)`", paragraph.split(", which", 1)[0])


def test_span_attribute_table_matches_what_is_emitted():
    """Every attribute emitted is in the table, and every row of the table is emitted;
    likewise for task spans and their table, and every span carries the resource
    attributes the README lists"""
    config = {
        "otel.spans.code": True,
        "otel.tasks.spans": True,
        "distributed.diagnostics.computations.nframes": 1,
    }
    with otel_cluster(config) as (client, mirrored):
        with span("documented") as sid:
            done = client.map(inc, range(3))
            client.gather(done)
            wait(client.map(fail, range(2)))
        mirrored.by_dask_id(sid)
        with span("collided") as collided:  # its task joins inc's TaskGroup: Dask makes no span
            client.submit(inc, 3).result()
        mirrored.by_dask_id(collided)
        # an unfinished span, exported when the scheduler closes
        with span("cut short"):
            running = client.submit(__import__("time").sleep, 3)
            tasks = mirrored.cluster.scheduler.tasks
            wait_until(lambda: getattr(tasks.get(running.key), "state", "") == "processing")
            # what the scheduler does on close, run on its event loop, and its
            # release's drain of the builder
            client.run_on_scheduler(
                lambda dask_scheduler: (m := dask_scheduler.plugins["dask-otel"].mirror).flush()
                or m.builder.drain(10)
            )
            del running
        every_span = mirrored.spans()

    resource = documented_resource()
    assert len(resource) >= 4, resource
    lacking = {s.name: sorted(set(resource) - set(s.resource.attributes)) for s in every_span}
    assert not any(lacking.values()), f"spans without the README's resource attributes: {lacking}"

    task_spans = [s for s in every_span if "dask.task.key" in s.attributes]
    spans = [s for s in every_span if "dask.task.key" not in s.attributes]
    assert task_spans and spans
    check_task_spans(task_spans)
    emitted = {k for s in spans for k in s.attributes}

    table = [(pattern, row) for (_, pattern), row in zip(
        attribute_patterns(), markdown_table(TRACES.read_text(), "span-attributes-table"))]
    wrong = [
        f"{s.name}: {name} = {value!r}"
        for s in spans for name, value in s.attributes.items()
        if (row := documented_row(name, table)) is not None and not row_fits(row, s, value)
    ]
    assert not wrong, f"emitted with another type, or on other spans, than the table says: {wrong}"

    patterns = attribute_patterns()
    undocumented = {a for a in emitted if not any(p.match(a) for _, p in patterns)}
    assert not undocumented, f"emitted but not in docs/traces.md's table: {sorted(undocumented)}"
    never = [name for name, p in patterns if not any(p.match(a) for a in emitted)]
    assert not never, f"in docs/traces.md's table but never emitted: {never}"


def check_task_spans(task_spans) -> None:
    """docs/traces.md's task span table: the same checks, on the spans of tasks"""
    rows = {code(name): type_ for name, type_, _ in
            markdown_table(TRACES.read_text(), "task-span-attributes-table")}
    emitted = {k: v for s in task_spans for k, v in s.attributes.items()}
    undocumented = set(emitted) - set(rows)
    assert not undocumented, f"task spans carry attributes not in the table: {sorted(undocumented)}"
    never = set(rows) - set(emitted)
    assert not never, f"in the task span table but never emitted: {sorted(never)}"
    wrong = [f"{s.name}: {k} = {v!r}" for s in task_spans for k, v in s.attributes.items()
             if not TYPES[rows[k]](v)]
    assert not wrong, f"task span attributes of another type than the table says: {wrong}"


def scheduler_plugins(preload: list[str]) -> set[str]:
    """The plugins of a scheduler started as ``dask scheduler --preload ...`` starts
    it (the command line hands its ``--preload`` values to ``Scheduler(preload=)``)"""

    async def start() -> set[str]:
        async with Scheduler(dashboard=False, port=0, preload=preload) as scheduler:
            return set(scheduler.plugins)

    return asyncio.run(start())


def test_a_command_line_preload_needs_dask_otel_named_too(tmp_path):
    """README, "Turn it on": ``--preload`` of something else makes Dask ignore the
    config preload; naming both on the command line turns the bridge on"""
    other = tmp_path / "my_plugin.py"
    other.write_text("def dask_setup(scheduler):\n    pass\n")
    config = {
        "distributed.scheduler.preload": ["dask_otel"],
        "otel.traces.exporter": "memory",
        "otel.metrics.exporter": "none",
    }
    with dask.config.set(config):
        assert "dask-otel" in scheduler_plugins([])
        assert "dask-otel" not in scheduler_plugins([str(other)])
        assert "dask-otel" in scheduler_plugins(["dask_otel", str(other)])


def test_instrument_exports_no_dask_span_that_finished_before_it():
    """README, "`instrument` and `status`": Dask spans that finished before the call
    are not exported; those after it are"""
    for check in ("every-span", "every-task"):
        oracle.waive(check, "finished before dask_otel.instrument: not the bridge's", ["before"])
    with dask.config.set(UNINSTRUMENTED_CONFIG):
        with LocalCluster(**cluster_kwargs(n_workers=1)) as cluster, Client(cluster) as client:
            with span("before") as before:
                client.gather(client.map(inc, range(2), key=["before-0", "before-1"]))
            dask_otel.instrument(client)
            with span("after") as after:
                client.gather(client.map(inc, range(2), key=["after-0", "after-1"]))
            mirrored = Mirrored(cluster)
            mirrored.by_dask_id(after)
            time.sleep(1)  # several polls: a span found late would be exported by now
            exported = {s.attributes.get("dask.span.id") for s in mirrored.spans()}
            assert before in cluster.scheduler.extensions["spans"].spans  # Dask has it
    assert after in exported and before not in exported


def test_the_readme_stays_a_manual():
    """The README is the user's manual, at most 250 lines (issue 20): what grows
    goes to docs/, figures to benchmarks/README.md, history to CHANGELOG.md"""
    assert len(README.read_text().splitlines()) <= 250


def test_contributing_lists_every_benchmark():
    """CONTRIBUTING's benchmark table names every script of benchmarks/ (but the
    shared harness and receiver) by its command, and no other"""
    rows = markdown_table((ROOT / "CONTRIBUTING.md").read_text(), "benchmarks")
    listed = {m.group(1) for row in rows if (m := re.match(r"`python -m benchmarks\.(\w+)", row[0]))}
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__", "harness", "receiver"}
    assert listed == scripts


def test_relative_links_in_the_documents_resolve():
    """Every relative link in the README, docs/, CONTRIBUTING, the CHANGELOG and
    benchmarks/README.md names a file that exists, and an anchor that is one of its
    headings"""
    import re

    def anchors(path):
        # GitHub's rule: lower case, punctuation but - and _ dropped, spaces -> -
        return {
            re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in path.read_text().splitlines()
            if line.startswith("#")
        }

    broken = []
    documents = [ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"]
    for doc in [README, *sorted((ROOT / "docs").glob("*.md")), *documents]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{doc.name}: {target}")
    assert not broken, broken


def readme_block(marker: str) -> str:
    """The fenced code block after ``<!-- marker`` in the README"""
    after = README.read_text().split(f"<!-- {marker}", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.timeout(180)
def test_the_readmes_healthy_status_is_what_a_healthy_cluster_answers():
    """README, "Is it on?": the block runs as a doctest against a cluster of two
    workers switched on by the preload, after a workflow was exported"""
    import doctest

    from tests.support.otlp_receiver import OTLPReceiver
    from tests.support.processes import dask_processes

    with OTLPReceiver("grpc") as receiver:
        with dask_processes(receiver.env()) as cluster, cluster.client() as client:
            with span("checked") as sid:
                client.submit(inc, 1).result()
            receiver.wait_for(lambda r: [s for s in r.spans("checked")
                                         if s.attributes["dask.span.id"] == sid])
            test = doctest.DocTestParser().get_doctest(
                readme_block("status"), {"dask_otel": dask_otel, "client": client},
                "README.md status", str(README), 0)
            runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
            runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


@pytest.mark.timeout(180)
def test_the_readmes_one_trace_runs_as_pasted(tmp_path):
    """README, "One trace from the request to the task": the block as it is, with
    the test cluster's address for the placeholder, run with the command its comment
    gives (``opentelemetry-instrument python app.py``: the application's SDK; plain
    ``python`` has no TracerProvider), its exporters pointed at the receiver:
    ``POST /reports`` > ``nightly report`` > each task's ``score``, one trace"""
    import shutil
    import subprocess
    import sys

    pytest.importorskip("dask.dataframe")
    from tests.support.otlp_receiver import OTLPReceiver
    from tests.support.processes import dask_processes

    block = readme_block("one-trace")
    assert '"tcp://scheduler:8786"' in block
    app = tmp_path / "app.py"
    command = re.search(r"#[^\n]*?: ((?:[\w-]+ )*)python app\.py$", block, re.M).group(1).split()
    launcher = [*(shutil.which(word) or word for word in command), sys.executable]
    with OTLPReceiver("grpc") as receiver:
        with dask_processes(receiver.env(), n_workers=1) as cluster:
            app.write_text(block.replace('"tcp://scheduler:8786"', repr(cluster.address))
                           + "client.close()\n")
            run = subprocess.run([*launcher, str(app)], env=cluster.env, cwd=tmp_path,
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, run.stderr
            (report,) = receiver.wait_for(lambda r: r.spans("nightly report"))
            # one per partition, in its task (Dask may call it once more on the client)
            scores = receiver.wait_for(lambda r: len(s := r.spans("score")) >= 4 and s)
        requests = receiver.spans("POST /reports")
    assert len(requests) == 1, f"no POST /reports span from {launcher}: {run.stderr[-2000:]}"
    (request,) = requests
    assert report.parent_span_id == request.span_id and report.trace_id == request.trace_id
    assert {(s.trace_id, s.parent_span_id) for s in scores} == {(report.trace_id, report.span_id)}


def test_a_collector_sees_trace_flags_0_on_every_span(monkeypatch):
    """docs/traces.md, "How the trace id is chosen": a Dask-rooted trace's spans say
    sampled and random (03) in the SDK, yet their OTLP ``flags`` field carries only
    the is-remote bits: its low byte, the W3C trace flags, is 0 at a collector"""
    from tests.support.otlp_receiver import OTLPReceiver

    with OTLPReceiver("grpc") as receiver:
        receiver.apply_env(monkeypatch)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        with otel_cluster({"otel.traces.exporter": "otlp"}, n_workers=1) as (client, _):
            with span("flagged") as sid:
                client.submit(inc, 1).result()
            receiver.wait_for(lambda r: [s for s in r.spans("flagged")
                                         if s.attributes["dask.span.id"] == sid])
    flags = [span.flags for kind, message in receiver.raw_requests if kind == "traces"
             for resource in message.resource_spans for scope in resource.scope_spans
             for span in scope.spans]
    assert flags and all(f & 0xFF == 0 for f in flags), sorted(set(flags))
    assert all(f & 0x100 for f in flags)  # the is-remote bits are what it sends


#: The README's one-trace shape, with a LocalCluster, printing what dask-expr warns
EXPR_SHAPE = """
import warnings
import dask, dask.dataframe as dd, distributed
import dask_otel

warnings.simplefilter("error")
with dask.config.set({"distributed.scheduler.preload": ["dask_otel"],
                      "otel.traces.exporter": "none", "otel.metrics.exporter": "none"}):
    with distributed.LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, \\
            distributed.Client(cluster):
        df = dd.from_dict({"x": range(100)}, npartitions=4)
        try:
            with SPAN("nightly report"):
                df.map_partitions(lambda part: part.x * 2, meta=("x", "int64")).sum().compute()
        except UserWarning as warning:
            print(str(warning).split(" detected. ", 1)[1])
        else:
            print("no warning")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("span_", ["distributed.span", "dask_otel.span"])
def test_dask_expr_warns_of_daskss_own_span_annotation_the_same_with_the_bridge(span_):
    """docs/traces.md, "A dask_otel.span block": dask-expr warns that annotations are
    ignored when a collection is built in any Dask span, ``distributed.span`` alone
    too (its ``span`` annotation), once per process; ``dask_otel.span`` gives the same
    warning, no other (the spans are right: test_the_readmes_one_trace_runs_as_pasted).
    Run under ``warnings.simplefilter("error")``, in a fresh process each"""
    import subprocess
    import sys

    dd = pytest.importorskip("dask.dataframe")
    run = subprocess.run([sys.executable, "-c", EXPR_SHAPE.replace("SPAN", span_)],
                         capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    # Dask before dask-expr's query planning (2024.1's legacy dataframes) warns of nothing
    expected = ("Annotations will be ignored when using query-planning."
                if dd._dask_expr_enabled() else "no warning")
    assert run.stdout.splitlines()[-1] == expected
