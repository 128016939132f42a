"""Labels of a run (issue 39 item 4): ``dask_otel.span(..., attributes={...})`` on every
span of the run, and the allow-listed ones (``otel.metrics.labels``) on its outcome
metrics (docs/traces.md "One workflow's controls", docs/metrics.md "Labels of a run").
``dask scheduler``/``dask worker`` processes exporting over OTLP to the test receiver."""

from __future__ import annotations

import importlib.util
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from distributed import span, wait

import dask_otel
from dask_otel.config import ConfigError
from dask_otel.scheduler.outcomes import MAX_LABEL_LENGTH, MAX_WORKFLOW_NAMES, OTHER, Outcomes
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import FAST_ENV, DaskProcesses, dask_processes
from tests.support.tasks import fail


def inc(x: int) -> int:
    return x + 1


def labelled_runs(client) -> dict[str, str]:
    """A named run labelled team=data env=prod, with tasks of its own; a nested block
    that overrides env and adds a list, with no task of its own (its labels come with
    its exit), around a plain ``distributed.span`` that runs tasks (its labels come
    with them) and an empty block with a label of its own; then a run without
    labels. The Dask span ids by name."""
    ids = {}
    etl = {"team": "data", "env": "prod"}
    with dask_otel.span("etl", workflow=True, attributes=etl) as ids["etl"]:
        wait(client.map(inc, range(3), key=[f"load-{i}" for i in range(3)]))
        with dask_otel.span("stage", attributes={"env": "dev", "shards": [1, 2]}) as ids["stage"]:
            with span("step") as ids["step"]:
                wait(client.map(fail, range(2), key=[f"bad-{i}" for i in range(2)]))
            with dask_otel.span("noop", attributes={"step": True}) as ids["noop"]:
                pass
    with dask_otel.span("plain", workflow=True) as ids["plain"]:
        wait(client.map(inc, range(2), key=[f"plain-{i}" for i in range(2)]))
    return ids


def runs_points(receiver: OTLPReceiver, workflow: str) -> list:
    return [p for p in receiver.metric_points("dask.workflow.runs")
            if p.attributes.get("dask.workflow.name") == workflow]


def check_labels(receiver: OTLPReceiver, ids: dict[str, str], allowed: set[str]) -> None:
    """Every span of the labelled run carries its block's labels over the enclosing
    one's; the other run's spans none; the runs metric only the ``allowed`` ones"""
    (root,) = receiver.spans("etl")
    run = [s for s in receiver.spans() if s.trace_id == root.trace_id]
    names = {s.name for s in run}
    assert {"etl", "stage", "step", "noop", "taskgroup/load", "taskgroup/bad", "run/load",
            "run/bad"} <= names, names
    inner = {ids["stage"], ids["step"], ids["noop"]}
    assert len(run) == 11, sorted(names)  # 3 Dask spans, an empty block, 2 TaskGroups, 5 tasks
    for s in run:
        expected = {"team": "data", "env": "dev" if s.attributes["dask.span.id"] in inner else "prod"}
        if s.attributes["dask.span.id"] in inner:
            expected["shards"] = (1, 2)
        if s.attributes["dask.span.id"] == ids["noop"]:
            expected["step"] = True
        got = {k: v for k, v in s.attributes.items() if k in ("team", "env", "shards", "step")}
        assert got == expected, (s.name, s.attributes)
    for s in receiver.spans():
        if s.trace_id != root.trace_id:
            assert not {"team", "env", "shards", "step"} & set(s.attributes), (s.name, s.attributes)
    (etl,) = {tuple(sorted(p.attributes.items())) for p in runs_points(receiver, "etl")}
    assert {k: v for k, v in etl if k in ("team", "env")} == {k: v for k, v in (
        ("team", "data"), ("env", "prod")) if k in allowed}
    (plain,) = {tuple(sorted(p.attributes.items())) for p in runs_points(receiver, "plain")}
    assert not {"team", "env"} & dict(plain).keys()


def wait_for_runs(receiver: OTLPReceiver) -> None:
    receiver.wait_for(lambda r: r.spans("noop") and r.spans("run/bad") and r.spans("run/plain")
                      and runs_points(r, "etl") and runs_points(r, "plain"), timeout=90)
    time.sleep(1.0)  # anything the workers still held has arrived


def test_labels_on_every_span_of_the_run_and_allow_listed_on_its_metrics():
    """Env vars: task spans on in the workers, ``DASK_OTEL__METRICS__LABELS='["team"]'``
    on the scheduler"""
    with OTLPReceiver("grpc") as receiver:
        env = {**receiver.env(), "DASK_OTEL__TASKS__SPANS": "true",
               "DASK_OTEL__METRICS__LABELS": '["team"]'}
        with dask_processes(env) as cluster, cluster.client() as client:
            ids = labelled_runs(client)
            wait_for_runs(receiver)
        check_labels(receiver, ids, {"team"})


class ZeroCode(DaskProcesses):
    """``dask scheduler``/``dask worker`` under ``opentelemetry-instrument``, no preload"""

    def _spawn(self, name, cmd):
        from tests.test_instrumentor import OPENTELEMETRY_INSTRUMENT

        return super()._spawn(name, [*OPENTELEMETRY_INSTRUMENT, *cmd])


def test_labels_under_opentelemetry_instrument_with_config_files(tmp_path):
    """``opentelemetry-instrument`` turns the bridge on; the allow-list (both labels, a
    comma-separated string) and task spans in a dask config file (``DASK_CONFIG``); the
    SDK from ``OTEL_CONFIG_FILE`` where opentelemetry-configuration is installed"""
    (tmp_path / "dask").mkdir()
    (tmp_path / "dask" / "otel.yaml").write_text(
        "otel:\n  metrics:\n    labels: team, env\n  tasks:\n    spans: true\n")
    with OTLPReceiver("grpc") as receiver:
        env = {**FAST_ENV, **receiver.env(), "DASK_CONFIG": str(tmp_path / "dask"),
               "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "click,asyncio,tornado"}
        if importlib.util.find_spec("opentelemetry.configuration"):
            from tests.test_modes import config_file

            env["OTEL_CONFIG_FILE"] = config_file(tmp_path / "sdk.yaml", receiver,
                                                  ("traces", "metrics"))
        with ZeroCode(env) as cluster, cluster.client() as client:
            ids = labelled_runs(client)
            wait_for_runs(receiver)
        check_labels(receiver, ids, {"team", "env"})


@pytest.mark.parametrize(("given", "error", "names"), [
    ({"dask.span.name": "x"}, ConfigError, "'dask.span.name'"),
    ({"otel.x": 1}, ConfigError, "'otel.x'"),
    ({"": 1}, ConfigError, "''"),
    ({"team": None}, TypeError, "attributes['team']"),
    ({"team": [1, "a"]}, TypeError, "[1, 'a']"),
    (["team"], TypeError, "['team']"),
])
def test_bad_labels_raise_at_the_call_naming_them(given, error, names):
    with pytest.raises(error, match=None) as raised, dask_otel.span("x", attributes=given):
        pass
    assert names in str(raised.value)
    assert issubclass(ConfigError, ValueError)


def test_label_values_on_metrics_are_bounded():
    """Only the allow-listed labels with a str, bool or int value, as strings cut to
    MAX_LABEL_LENGTH; at most MAX_WORKFLOW_NAMES values of each, later ones ``other``,
    a value given keeps its series"""
    outcomes = Outcomes(MeterProvider(), {}, labels=["team", "size"])  # type: ignore[arg-type]
    teams = [outcomes.labels_of({"team": f"t{i}"}) for i in range(MAX_WORKFLOW_NAMES + 5)]
    assert teams[:MAX_WORKFLOW_NAMES] == [{"team": f"t{i}"} for i in range(MAX_WORKFLOW_NAMES)]
    assert teams[MAX_WORKFLOW_NAMES:] == [{"team": OTHER}] * 5
    assert outcomes.labels_of({"team": "t0", "env": "prod", "size": 3}) == {"team": "t0", "size": "3"}
    assert outcomes.labels_of({"size": True}) == {"size": "true"}
    assert outcomes.labels_of({"size": "x" * 100}) == {"size": "x" * MAX_LABEL_LENGTH}
    assert outcomes.labels_of({"size": 1.5, "team": ["a"]}) == {}
