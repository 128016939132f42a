"""A worker killed hard (SIGKILL, as the OOM killer does) loses the task spans its
batch span processor still held, and only those: docs/traces.md, "A worker killed
hard". Real ``dask scheduler`` and ``dask worker`` processes, a real OTLP receiver."""

from __future__ import annotations

import time

import pytest

import dask_otel
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import dask_processes
from tests.support.tasks import inc

TASKS = 4


def _kill_after_tasks(worker_delay_ms: int, wait: float) -> tuple[list, list]:
    """Task spans on, the worker's batch delay ``worker_delay_ms``; SIGKILL the
    worker ``wait`` s after its tasks finished. Returns the task spans and the
    mirrored Dask spans that arrived."""
    env = {"DASK_OTEL__TASKS__SPANS": "true"}
    with OTLPReceiver("grpc") as receiver:
        with dask_processes({**receiver.env(), **env}, n_workers=0) as cluster:
            worker = cluster.add_worker(
                "worker-0", env={"OTEL_BSP_SCHEDULE_DELAY": str(worker_delay_ms)}
            )
            with cluster.client(n_workers=1) as client:
                with dask_otel.span("killed"):
                    client.gather(client.map(inc, range(TASKS)))
                time.sleep(wait)
                worker.kill()
                worker.wait()
                # the scheduler's mirrored span still arrives: it is the worker's loss
                receiver.wait_for(lambda r: r.spans("killed"), timeout=60)
                time.sleep(1)
        tasks = [s for s in receiver.spans("run/inc") if s.resource.get("process.pid") == worker.pid]
        return tasks, receiver.spans("killed")


@pytest.mark.timeout(180)
def test_a_worker_killed_hard_loses_the_task_spans_its_batch_processor_held():
    task_spans, mirrored = _kill_after_tasks(worker_delay_ms=60_000, wait=1.0)
    assert mirrored and task_spans == []


@pytest.mark.timeout(180)
def test_a_shorter_batch_delay_on_workers_bounds_the_loss():
    task_spans, mirrored = _kill_after_tasks(worker_delay_ms=200, wait=2.0)
    assert mirrored and len(task_spans) == TASKS
