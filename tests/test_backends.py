"""Smoke tests: the backend harness in tests/support/backends.py works against the real binaries."""

from __future__ import annotations

import json

import pytest

from tests.support.backends import (
    BackendError,
    JaegerServer,
    PrometheusServer,
    free_port,
    prometheus_config,
    promtool_check_config,
    promtool_check_rules,
    require_binary,
)
from tests.support.span_tree import assert_span_tree

RULES = """\
groups:
  - name: smoke
    interval: 1s
    rules:
      - record: smoke:value:doubled
        expr: dask_otel_smoke_value * 2
"""


@pytest.fixture
def metrics_endpoint():
    """A tiny prometheus_client exporter on 127.0.0.1 with one gauge = 42.5."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    gauge = Gauge("dask_otel_smoke_value", "smoke-test gauge", ["kind"], registry=registry)
    gauge.labels(kind="test").set(42.5)
    port = free_port()
    started = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"127.0.0.1:{port}"
    if isinstance(started, tuple):  # prometheus_client >= 0.17 returns (server, thread)
        server, thread = started
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_prometheus_scrapes_and_queries(metrics_endpoint, tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    target = (metrics_endpoint, {"job": "smoke", "cluster": "c1"})
    with PrometheusServer([target], scrape_interval="1s", rule_files=[rules]) as prom:
        assert prom.url.startswith("http://127.0.0.1:")
        health = prom.wait_for_targets_up(timeout=30)
        assert health[0]["job"] == "smoke", health

        result = prom.wait_for_query('dask_otel_smoke_value{job="smoke"}', timeout=30)
        assert len(result) == 1, result
        metric = result[0]["metric"]
        assert metric["kind"] == "test" and metric["cluster"] == "c1"
        assert metric["instance"] == metrics_endpoint
        assert prom.values(result) == [42.5]

        doubled = prom.wait_for_query("smoke:value:doubled", timeout=30)
        assert prom.values(doubled) == [85.0]
        assert prom.rules()[0]["rules"][0]["health"] == "ok"

        assert prom.values(prom.query("1 + 1")) == [2.0]  # scalar results are wrapped
        with pytest.raises(BackendError, match="parse"):
            prom.query("sum(")
    assert prom.proc is None  # stopped on exit


def test_promtool_accepts_generated_config(tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    assert "SUCCESS" in promtool_check_rules(rules)

    cfg = prometheus_config(
        ["127.0.0.1:8787", ("127.0.0.1:9000", {"job": "workers", "role": "worker"})],
        rule_files=[rules],
    )
    assert [j["job_name"] for j in cfg["scrape_configs"]] == ["dask", "workers"]
    path = tmp_path / "prometheus.yml"
    path.write_text(json.dumps(cfg))
    out = promtool_check_config(path)
    assert "SUCCESS" in out

    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - record: r\n        expr: sum(\n")
    with pytest.raises(BackendError, match="promtool check rules failed"):
        promtool_check_rules(bad)


def test_require_binary_skips_locally_fails_in_ci(monkeypatch):
    assert require_binary("sh")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_binary("definitely-not-a-binary-dask-otel")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        require_binary("definitely-not-a-binary-dask-otel")


@pytest.mark.timeout(120)
def test_jaeger_receives_a_nested_sdk_trace_and_reads_it_back():
    """JaegerServer and normalise_jaeger_span against the real Jaeger: ids, parents,
    a link, an event, attributes of each type, status, resource and operations"""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import Link, Status, StatusCode

    with JaegerServer() as jaeger:
        assert jaeger.trace("0" * 31 + "1") == []
        provider = TracerProvider(resource=Resource.create({"service.name": "dask-otel-smoke"}))
        provider.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=jaeger.otlp_http_endpoint + "/v1/traces", timeout=10)))
        tracer = provider.get_tracer("dask_otel.tests")
        with tracer.start_as_current_span("other") as other:
            linked = other.get_span_context()
        root_attrs = {"dask.key": "('sum', 0)", "dask.n": 3, "ratio": 0.5, "ok": True,
                      "names": ("a", "b")}
        with tracer.start_as_current_span("root", attributes=root_attrs) as root:
            with tracer.start_as_current_span("child", links=[Link(linked)]) as child:
                with tracer.start_as_current_span("grandchild") as grandchild:
                    grandchild.add_event("tick", {"n": 7})
                    grandchild.set_status(Status(StatusCode.ERROR, "broken"))
        provider.shutdown()
        trace_id = f"{root.get_span_context().trace_id:032x}"
        spans = jaeger.wait_for_trace(trace_id, count=3, timeout=30)
        operations = jaeger.operations("dask-otel-smoke")
        assert "dask-otel-smoke" in jaeger.services()
        assert jaeger.find_traces("dask-otel-smoke", "grandchild") == [trace_id]
    assert jaeger.proc is None
    assert operations == ["child", "grandchild", "other", "root"]
    by_name = {s["name"]: s for s in spans}
    ids = {name: f"{span.get_span_context().span_id:016x}"
           for name, span in (("root", root), ("child", child), ("grandchild", grandchild))}
    for name, span_id in ids.items():
        assert by_name[name]["span_id"] == span_id and by_name[name]["trace_id"] == trace_id
    assert by_name["root"]["parent_id"] is None
    assert by_name["child"]["parent_id"] == ids["root"]
    assert by_name["grandchild"]["parent_id"] == ids["child"]
    assert by_name["child"]["links"] == [(f"{linked.trace_id:032x}", f"{linked.span_id:016x}")]
    # a sequence arrives as its JSON text
    assert by_name["root"]["attributes"] == {**root_attrs, "names": '["a","b"]'}
    assert by_name["root"]["resource"]["service.name"] == "dask-otel-smoke"
    assert by_name["root"]["scope"] == "dask_otel.tests"
    (tick,) = by_name["grandchild"]["events"]
    assert tick["name"] == "tick" and tick["attributes"] == {"n": 7}
    assert (by_name["grandchild"]["status_code"], by_name["grandchild"]["status_message"]) == (
        "ERROR", "broken")
    assert by_name["root"]["status_code"] == "UNSET"
    assert_span_tree(spans, one_trace=True)
