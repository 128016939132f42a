"""``dask_otel.status``: why the bridge is off, and the ``otel.*`` values each process
uses. Config is read per process: the scheduler and each worker from their own dask
config, and ``instrument()`` from the client's."""

from __future__ import annotations

import dask
import pytest
from distributed import span

import dask_otel
from dask_otel.config import ConfigError
from tests.support.cluster import otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import DaskProcesses, dask_processes

#: No collector in these tests: nothing to export
NO_EXPORT = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}


def test_status_names_otel_enabled_on_the_scheduler():
    with otel_cluster({"otel.enabled": False}) as (client, _):
        status = dask_otel.status(client)
        address = client.scheduler.address
    assert status["scheduler"]["error"] == f"disabled by otel.enabled on scheduler {address}"
    assert status["scheduler"]["traces"] is False and status["scheduler"]["config"] is None
    # the scheduler hands the workers no bridge
    assert all(worker is None for worker in status["workers"].values())


def test_status_names_otel_enabled_on_a_worker():
    with dask_processes(NO_EXPORT, n_workers=1) as cluster:
        cluster.add_worker("off", env={"DASK_OTEL__ENABLED": "false"})
        with cluster.client(n_workers=2) as client:
            workers = wait_until(lambda: bridges_started(client), what="the worker plugins")
            names = client.run(lambda dask_worker: dask_worker.name)
    (off,) = [address for address, name in names.items() if name == "off"]
    assert workers[off]["error"] == f"disabled by otel.enabled on worker {off}"
    assert workers[off]["config"] is None
    (on,) = set(workers) - {off}
    assert workers[on]["error"] is None and workers[on]["config"]["otel.enabled"] is True


def bridges_started(client) -> dict | None:
    """The workers' status, once every worker has the plugin"""
    workers = dask_otel.status(client)["workers"]
    return workers if all(w is not None for w in workers.values()) else None


def test_a_worker_side_key_set_only_on_the_scheduler_shows_in_status():
    """``DASK_OTEL__TASKS__SPANS=true`` for ``dask scheduler`` alone gives no task
    spans: status shows each worker's own value, and the scheduler's keys"""
    env = {**NO_EXPORT, "DASK_OTEL__TASKS__SPANS": "true"}
    with dask_processes(env, n_workers=0) as cluster:
        cluster.add_worker("without", env={"DASK_OTEL__TASKS__SPANS": "false"})
        cluster.add_worker("with")
        with cluster.client(n_workers=2) as client:
            workers = wait_until(lambda: bridges_started(client), what="the worker plugins")
            names = client.run(lambda dask_worker: dask_worker.name)
            scheduler = dask_otel.status(client)["scheduler"]
    by_name = {names[address]: status["config"] for address, status in workers.items()}
    assert by_name["without"]["otel.tasks.spans"] is False
    assert by_name["with"]["otel.tasks.spans"] is True
    assert by_name["without"]["otel.tasks.sample-ratio"] == 1.0
    # the scheduler shows the keys it reads, and otel.tasks.* is not among them
    assert scheduler["config"]["otel.spans.export-delay"] == 0.3  # processes.FAST_ENV
    assert not any(key.startswith("otel.tasks.") for key in scheduler["config"])


def test_status_shows_the_scheduler_keys_and_each_workers_keys():
    config = {"otel.spans.totals": "own", "otel.tasks.slower-than": "1s", "otel.logs.level": "warning"}
    with otel_cluster(config) as (client, _):
        status = dask_otel.status(client)
    scheduler = status["scheduler"]["config"]
    assert scheduler["otel.spans.totals"] == "own"
    assert scheduler["otel.traces.exporter"] == ["memory"]
    assert scheduler["otel.logs.level"] == "WARNING"
    for worker in status["workers"].values():
        assert worker["config"]["otel.tasks.slower-than"] == 1.0
        assert "otel.spans.totals" not in worker["config"]


def test_instrument_honours_the_clients_otel_enabled():
    """A client with ``otel.enabled: false`` leaves a remote scheduler untouched;
    otherwise the scheduler reads its own config"""
    with DaskProcesses(NO_EXPORT, n_workers=1) as cluster, cluster.client() as client:
        with dask.config.set({"otel.enabled": False}):
            dask_otel.instrument(client)
        assert dask_otel.status(client)["scheduler"] is None
        with dask.config.set({"otel.enabled": "maybe"}), pytest.raises(ConfigError, match="maybe"):
            dask_otel.instrument(client)
        dask_otel.instrument(client)
        status = dask_otel.status(client)
    assert status["scheduler"]["error"] is None and status["scheduler"]["config"]


def test_exporter_none_in_the_environment_exports_nothing():
    """``DASK_OTEL__{TRACES,METRICS,LOGS}__EXPORTER=none`` (the spelling the bridge's
    outage WARNING gives) on ``dask scheduler`` and ``dask worker``, with a collector
    at OTEL_EXPORTER_OTLP_ENDPOINT and ``OTEL_*_EXPORTER=otlp``: the collector gets
    no span, point or log record while a workload runs and the cluster closes, and
    status() says the signals are off. Dask reads ``none`` in a variable as None."""
    signals = ("TRACES", "METRICS", "LOGS")
    env = {**{f"DASK_OTEL__{s}__EXPORTER": "none" for s in signals},
           **{f"OTEL_{s}_EXPORTER": "otlp" for s in signals}}
    with OTLPReceiver("grpc") as receiver:
        with dask_processes({**receiver.env(), **env}, n_workers=1) as cluster:
            with cluster.client() as client:
                workers = wait_until(lambda: bridges_started(client), what="the worker plugin")
                with span("workload"):
                    assert client.submit(sum, [1, 2]).result() == 3
                status = dask_otel.status(client)
        received = (len(receiver.spans()), len(receiver.metric_points()), len(receiver.logs()))
    assert received == (0, 0, 0), receiver.summary()
    scheduler = status["scheduler"]
    assert scheduler["error"] is None
    assert (scheduler["traces"], scheduler["metrics"]) == (False, False)
    (worker,) = workers.values()
    assert worker["error"] is None and worker["metrics"] is False
    for config in (scheduler["config"], worker["config"]):
        assert [config[f"otel.{s.lower()}.exporter"] for s in signals] == [[], [], []]
