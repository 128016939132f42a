"""``dask_otel.status``: every server's status has the same shape, built by one
function (``dask_otel.worker.plugin.server_status``): a scheduler's and a worker's
carry the same server keys, and a worker without ``dask_otel`` installed the same
keys as one with it."""

from __future__ import annotations

import dask_otel
from tests.support.cluster import otel_cluster, wait_until
from tests.support.processes import dask_processes

#: No collector in these tests: nothing to export
NO_EXPORT = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}

#: What every server's status says, whatever its kind
SERVER_KEYS = {"error", "service_name", "config_file", "shared_with", "metrics", "export", "config"}


def test_the_schedulers_and_the_workers_status_carry_the_same_server_keys():
    with otel_cluster() as (client, _):
        status = dask_otel.status(client)
    scheduler = status["scheduler"]
    (worker, *_) = status["workers"].values()
    assert SERVER_KEYS <= set(scheduler), sorted(SERVER_KEYS - set(scheduler))
    assert SERVER_KEYS <= set(worker), sorted(SERVER_KEYS - set(worker))
    # one cluster in the process: its exporters are its own
    assert scheduler["shared_with"] is None and worker["shared_with"] is None
    assert scheduler["service_name"] == worker["service_name"]
    assert scheduler["config_file"] is None and worker["config_file"] is None  # no file


def test_a_worker_without_dask_otel_shows_the_keys_of_a_worker_with_it():
    with dask_processes(NO_EXPORT, n_workers=1) as cluster:
        cluster.add_worker("plain", without_dask_otel=True)
        with cluster.client(n_workers=2) as client:
            workers = wait_until(
                lambda: (s := dask_otel.status(client)["workers"])
                and all(w is not None for w in s.values()) and s,
                what="both worker plugins",
            )
            names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    by_name = {names[address]: status for address, status in workers.items()}
    plain, with_it = by_name["plain"], by_name["worker-0"]
    assert list(plain) == list(with_it)
    assert "dask_otel is not installed on worker" in plain["error"]
    assert plain["config"] is None and plain["shared_with"] is None
    assert with_it["error"] is None and with_it["config"] is not None
