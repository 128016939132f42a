"""The telemetry contract as a registry (model/, OpenTelemetry Weaver's format): it
passes Weaver's default rules (tests.support.registry), every name a real run emits
with everything on is in it (tests.support.capture), each scope the bridge creates
names it by its schema_url, and the docs' tables say what it says."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dask_otel.attributes import SCHEMA_URL
from tests.support.capture import captured, emitted
from tests.support.registry import (MODEL, OTLP_KIND, SEMCONV_EVENTS, check_attributes,
                                    check_registry, load, prometheus_name, semconv_attributes)

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: The scopes the bridge creates, by signal (a log record of a Python logger has
#: that logger's name as its scope: opentelemetry's LoggingHandler makes it)
OUR_SCOPES = {("spans", "dask_otel"), ("metrics", "dask_otel"), ("logs", "dask_otel.events")}
#: What names each kind of span, and the group it is (docs/traces.md, "Span names")
SPAN_KINDS = (("taskgroup/", "span.dask.taskgroup"), ("run/", "span.dask.task"))


def dask_families() -> set[str]:
    """The metrics docs/metrics.md lists as Dask's own families (otel.metrics.dask):
    Dask's names by the bridge's rule, not the registry's"""
    text = (DOCS / "metrics.md").read_text()
    section = text.split("## Dask's own families", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(dask\.[a-z_.]+)` \|", section, re.M))


def test_the_registry_passes_weavers_rules():
    registry = load()
    assert check_registry(registry) == []
    assert registry.manifest["schema_url"] == SCHEMA_URL
    assert len(registry.metrics) >= 20 and len(registry.events) >= 10


def test_the_rules_find_what_weaver_finds(tmp_path):
    """The checker is not blind: the names this registry had before issue 38 fail it"""
    for path in MODEL.glob("*.yaml"):
        text = path.read_text()
        text = text.replace("dask.tasks.running_count", "dask.tasks.running.count")
        text = text.replace("dask.spill.memory.keys", "dask.spill.memory.count")
        text = text.replace("id: dask.tasks.no_worker", "id: dask.tasks.no-worker")
        (tmp_path / path.name).write_text(text)
    found = check_registry(load(tmp_path))
    assert any(f.startswith("naming_convention_attribute_namespace_collision: "
                            "'dask.tasks.running'") for f in found), found
    assert any(f.startswith("promtool_reserved_suffix: 'dask.spill.memory.count'")
               for f in found), found
    assert any(f.startswith("naming_convention_attribute_name: 'dask.tasks.no-worker'")
               for f in found), found


def test_every_name_a_run_emits_is_in_the_registry(monkeypatch, tmp_path):
    """Traces, metrics and logs over OTLP from a LocalCluster of worker processes with
    task spans, events, spill, a stall and a lost worker: every span, span event,
    metric (name, unit, instrument), log event and attribute is the registry's"""
    registry = load()
    with captured(monkeypatch, tmp_path) as receiver:
        got = emitted(receiver)
    found: list[str] = []
    types = got.types
    # scopes: the bridge's name the registry
    for signal, name, schema_url in sorted(got.scopes):
        if (signal, name) in OUR_SCOPES and schema_url != SCHEMA_URL:
            found.append(f"schema_url: {signal} scope {name!r} has {schema_url!r}")
    assert {(s, n) for s, n, _ in got.scopes} >= OUR_SCOPES, got.scopes
    # spans, by kind
    for span_name, keys in sorted(got.spans.items()):
        group = next((g for prefix, g in SPAN_KINDS if span_name.startswith(prefix)),
                     "span.dask.span")
        allowed = {a.get("ref") or a["id"] for a in registry.spans[group]["attributes"]}
        found += check_attributes(registry, f"span {span_name!r}",
                                  {k: types[k] for k in keys}, allowed)
        for a in registry.spans[group]["attributes"]:
            if a.get("requirement_level") == "required" and a["ref"] not in keys:
                found.append(f"required_attribute_not_present: {a['ref']!r} on {span_name!r}")
    # span events and log events
    for where, events in (("span event", got.span_events), ("log event", got.logs)):
        for event_name, keys in sorted(events.items()):
            values = {k: types[k] for k in keys}
            if event_name == "" or (event_name in SEMCONV_EVENTS  # a plain log record
                                    and event_name not in registry.events):  # or refined
                found += [f"missing_attribute: {k!r} on {where} {event_name!r}"
                          for k in keys if k not in semconv_attributes()]
            elif event_name not in registry.events:
                found.append(f"missing_event: {where} {event_name!r}")
            else:
                allowed = {a["ref"] for a in registry.events[event_name].get("attributes", ())}
                found += check_attributes(registry, f"{where} {event_name!r}", values, allowed)
    # metrics: name, instrument, unit, attributes
    families = dask_families()
    for (name, unit, kind, monotonic), keys in sorted(got.metrics.items()):
        if name in families or name.startswith("otel.sdk."):  # Dask's; the SDK's own (semconv)
            continue
        metric = registry.metrics.get(name)
        if metric is None:
            found.append(f"missing_metric: {name!r}")
            continue
        if OTLP_KIND[metric["instrument"]] != (kind, monotonic):
            found.append(f"unexpected_instrument: {name!r} is {kind}, "
                         f"registry says {metric['instrument']}")
        if metric["unit"] != unit:
            found.append(f"unit_mismatch: {name!r} is {unit!r}, registry says {metric['unit']!r}")
        allowed = {a["ref"] for a in metric.get("attributes", ())}
        found += check_attributes(registry, f"metric {name!r}", {k: types[k] for k in keys},
                                  allowed)
    found += check_attributes(registry, "the resource", {k: types[k] for k in got.resource})
    # enum values (Weaver's undefined_enum_variant)
    for key, values in sorted(got.values.items()):
        a = registry.attributes.get(key)
        if a is not None and isinstance(a["type"], dict):
            members = {m["value"] for m in a["type"]["members"]}
            found += [f"undefined_enum_variant: {key!r} is {v!r}" for v in values - members]
    assert found == [], "\n".join(found)
    # the run had what it was for
    assert {"dask.event_loop.blocked", "dask.worker.lost", "exception"} <= set(got.span_events)
    assert {"dask.worker.removed", "dask.task.print", "dask.event"} <= set(got.logs)
    assert "dask.event.stock_level" in got.logs["dask.event"]  # a user's field, snake_case
    assert any(n.startswith("dask.spill.disk") for n, *_ in got.metrics)


def test_weaver_registry_check():
    """Weaver itself, where it is installed"""
    weaver = shutil.which("weaver")
    if weaver is None:
        pytest.skip("no weaver binary on PATH (the rules run in Python above)")
    proc = subprocess.run([weaver, "registry", "check", "-r", str(MODEL)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The rows of each markdown table whose header line starts with ``header``"""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith(header):
            inside = True
            continue
        if inside and line.startswith("|---"):
            continue
        if inside and line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        else:
            inside = False
    return rows


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_docs_tables_say_what_the_registry_says():
    """docs/metrics.md's instruments (type, unit, attributes, Prometheus name) and enum values,
    docs/traces.md's attributes (type) and docs/events.md's event names"""
    registry = load()
    kinds = {"gauge": "gauge", "counter": "counter", "histogram": "histogram"}
    rows = _table_rows((DOCS / "metrics.md").read_text(),
                       "| name | type | unit | attributes | meaning | prometheus name |")
    assert {_code(r[0])[0] for r in rows} == set(registry.metrics)
    for name_cell, kind, unit, attributes, _, prom in rows:
        (name,) = _code(name_cell)
        metric = registry.metrics[name]
        assert kinds[kind] == metric["instrument"], name
        assert (_code(unit) or [""])[0] == metric["unit"], name
        assert set(_code(attributes)) == {a["ref"] for a in metric.get("attributes", ())}, name
        expected = prometheus_name(metric)
        assert _code(prom)[0] == (expected + "_bucket" if kind == "histogram" else expected)
    types = {"string": "string", "string[]": "string[]", "int": "int", "double": "double",
             "bool": "boolean"}
    text = (DOCS / "traces.md").read_text()
    rows = (_table_rows(text, "| attribute | type | on | meaning |")
            + _table_rows(text, "| attribute | type | meaning |"))
    assert rows
    for row in rows:
        (key,) = _code(row[0])
        a = registry.attribute(key.replace("<context>.<activity>.<unit>", "x.y.z")
                               .replace("<state>", "total"))
        assert a is not None, key
        if a.get("type") is not None:
            declared = str(a["type"])
            if declared.startswith("template["):
                declared = declared[len("template["):-1]
            assert types[row[1]] == declared, key
    metrics_md = (DOCS / "metrics.md").read_text()
    for row in _table_rows(metrics_md, "| attribute | values |"):
        for key in _code(row[0]):
            a = registry.attribute(key)
            assert a is not None, key
            if isinstance(a["type"], dict):
                members = {m["value"] for m in a["type"]["members"]}
                assert set(_code(row[1])) <= members, key
    reasons = {_code(r[0])[0] for r in _table_rows(metrics_md, "| reason | when |")}
    assert reasons == {m["value"] for m in
                       registry.attributes["dask.worker.removed.reason"]["type"]["members"]}
    rows = _table_rows((DOCS / "events.md").read_text(),
                       "| event | `event_name` | where Dask logs it | severity | body |")
    assert {_code(r[1])[0] for r in rows} <= set(registry.events)
