"""Smoke tests: the backend harness in tests/support/backends.py works against the real binaries."""

from __future__ import annotations

import json

import pytest

from tests.support.backends import (
    BackendError,
    PhoenixServer,
    PrometheusServer,
    free_port,
    prometheus_config,
    promtool_check_config,
    promtool_check_rules,
    require_binary,
    span_children,
)

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


@pytest.mark.timeout(240)
def test_phoenix_receives_nested_sdk_trace():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    with PhoenixServer() as phx:
        assert phx.otlp_traces_url == phx.otlp_http_endpoint + "/v1/traces"
        assert phx.spans("no-such-project") == []

        sent = {}
        for project in ("default", "dask-otel-smoke"):
            attrs = {"service.name": "dask-otel-smoke"}
            if project != "default":
                attrs["openinference.project.name"] = project
            provider = TracerProvider(resource=Resource.create(attrs))
            provider.add_span_processor(
                SimpleSpanProcessor(OTLPSpanExporter(endpoint=phx.otlp_traces_url, timeout=10))
            )
            tracer = provider.get_tracer("dask_otel.tests")
            ids = {}
            root_attrs = {"dask.key": "('sum', 0)", "dask.n": 3, "ratio": 0.5, "ok": True,
                          "names": ("a", "b")}
            with tracer.start_as_current_span("root", attributes=root_attrs) as root:
                ids["root"] = root.get_span_context()
                with tracer.start_as_current_span("child-1", attributes={"i": 1}) as c1:
                    ids["child-1"] = c1.get_span_context()
                    with tracer.start_as_current_span("grandchild") as g:
                        ids["grandchild"] = g.get_span_context()
                        g.add_event("tick", {"n": 7})
                with tracer.start_as_current_span("child-2", attributes={"i": 2}) as c2:
                    ids["child-2"] = c2.get_span_context()
            provider.shutdown()
            sent[project] = {
                k: (format(v.trace_id, "032x"), format(v.span_id, "016x")) for k, v in ids.items()
            }

        for project, ids in sent.items():
            spans = phx.wait_for_spans(project, count=4, timeout=30)
            by_name = {s["name"]: s for s in spans}
            assert set(by_name) == {"root", "child-1", "child-2", "grandchild"}, spans
            trace_id = ids["root"][0]
            assert {s["trace_id"] for s in spans} == {trace_id}
            for name, (_, span_id) in ids.items():
                assert by_name[name]["span_id"] == span_id
            root_id = ids["root"][1]
            assert by_name["root"]["parent_id"] is None
            assert by_name["child-1"]["parent_id"] == root_id
            assert by_name["child-2"]["parent_id"] == root_id
            assert by_name["grandchild"]["parent_id"] == ids["child-1"][1]
            tree = span_children(spans)
            assert [s["name"] for s in tree[root_id]] == ["child-1", "child-2"]

            root = by_name["root"]
            assert root["attributes"] == {
                "dask.key": "('sum', 0)", "dask.n": 3, "ratio": 0.5, "ok": True,
                "names": ["a", "b"],
            }
            assert by_name["child-2"]["attributes"] == {"i": 2}
            assert by_name["grandchild"]["events"][0]["name"] == "tick"
            assert by_name["grandchild"]["events"][0]["attributes"] == {"n": 7}
            assert len(trace_id) == 32 and len(root_id) == 16
            assert root["start_time_unix_nano"] <= by_name["child-1"]["start_time_unix_nano"]
            assert by_name["child-2"]["end_time_unix_nano"] <= root["end_time_unix_nano"]
            assert root["status_code"] == "UNSET"

        assert "dask-otel-smoke" in phx.projects()
        # service.name alone does not pick a project: the default one got the first trace.
        assert {s["trace_id"] for s in phx.spans()} == {sent["default"]["root"][0]}
    assert phx.proc is None
