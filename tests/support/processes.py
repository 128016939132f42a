"""A Dask cluster of real ``dask scheduler`` and ``dask worker`` processes, configured
only through environment variables, as a user deploys one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from distributed import Client

from tests.support import oracle

#: The repository root: ``tests.support.tasks`` is importable from it
REPO = Path(__file__).resolve().parents[2]

#: What a user exports to switch the bridge on
PRELOAD_ENV = {"DASK_DISTRIBUTED__SCHEDULER__PRELOAD": "dask_otel"}
#: Faster than the defaults, so that tests do not wait: spans exported 300 ms after
#: they finish, batches sent every 200 ms, metrics every 500 ms
FAST_ENV = {
    "DASK_OTEL__SPANS__EXPORT_DELAY": "300ms",
    "DASK_OTEL__SPANS__POLL_INTERVAL": "100ms",
    "OTEL_BSP_SCHEDULE_DELAY": "200",
    "OTEL_METRIC_EXPORT_INTERVAL": "500",
}


def _dask(*args: str, without_dask_otel: bool = False) -> list[str]:
    if without_dask_otel:
        # As if dask_otel were not installed in this process's environment
        code = (
            "import sys; sys.modules['dask_otel'] = None; "
            f"from distributed.cli.dask_{args[0]} import main; main()"
        )
        return [sys.executable, "-c", code, *args[1:]]
    return [sys.executable, "-m", "distributed.cli.dask_" + args[0], *args[1:]]


def scheduler_address(scheduler_file: str | Path) -> str | None:
    """The scheduler's address from its ``--scheduler-file``; None while the file is
    missing, empty or half written (Dask opens it, then dumps its JSON into it)"""
    try:
        with open(scheduler_file) as f:
            return json.load(f)["address"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


class DaskProcesses:
    """``dask scheduler`` + ``dask worker`` subprocesses on 127.0.0.1"""

    def __init__(self, env: dict[str, str], n_workers: int = 2, worker_args: tuple = ()):
        # Task functions (tests.support.tasks) are pickled by reference
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        # the transition log the oracle reads, long enough for a test
        self.env = {**os.environ, "PYTHONPATH": pythonpath,
                    "DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": str(oracle.LOG_LENGTH), **env}
        self.n_workers = n_workers
        self.worker_args = worker_args
        self.dir = tempfile.TemporaryDirectory()
        self.scheduler_file = str(Path(self.dir.name) / "scheduler.json")
        self.logs: dict[str, Path] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = Path(self.dir.name) / f"{name}.log"
        self.logs[name] = log
        proc = subprocess.Popen(
            cmd, env=self.env, stdout=log.open("w"), stderr=subprocess.STDOUT,
            cwd=self.dir.name,
        )
        self.procs[name] = proc
        return proc

    def start(self) -> DaskProcesses:
        self._spawn(
            "scheduler",
            _dask("scheduler", "--host", "127.0.0.1", "--port", "0",
                  "--dashboard-address", "127.0.0.1:0",
                  "--scheduler-file", self.scheduler_file),
        )
        # The file exists before its JSON is written: wait until it parses
        deadline = time.monotonic() + 60
        while self._read_address() is None:
            if time.monotonic() > deadline or self.procs["scheduler"].poll() is not None:
                raise RuntimeError(f"scheduler did not start:\n{self.log('scheduler')}")
            time.sleep(0.1)
        for i in range(self.n_workers):
            self.add_worker(f"worker-{i}")
        return self

    def add_worker(
        self, name: str, env: dict[str, str] | None = None, without_dask_otel: bool = False,
        nanny: bool = False,
    ) -> subprocess.Popen:
        cmd = _dask("worker", "--scheduler-file", self.scheduler_file, "--nthreads", "1",
                    "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0",
                    "--nanny" if nanny else "--no-nanny", "--name", name, *self.worker_args,
                    without_dask_otel=without_dask_otel)
        if env is None:
            return self._spawn(name, cmd)
        old, self.env = self.env, {**self.env, **env}
        try:
            return self._spawn(name, cmd)
        finally:
            self.env = old

    def _read_address(self) -> str | None:
        return scheduler_address(self.scheduler_file)

    @property
    def address(self) -> str:
        address = self._read_address()
        assert address is not None, f"{self.scheduler_file} holds no address"
        return address

    def client(self, n_workers: int | None = None) -> Client:
        client = Client(self.address, timeout=30)
        client.wait_for_workers(self.n_workers if n_workers is None else n_workers, timeout=60)
        return client

    def log(self, name: str) -> str:
        return self.logs[name].read_text() if name in self.logs else ""

    def stop(self) -> None:
        """SIGINT, as a user's Ctrl-C or an orchestrator's stop: the scheduler closes
        cleanly, running dask_teardown and flushing pending spans.

        The workers first, then the scheduler once they are gone: a `dask worker
        --no-nanny` that gets its SIGINT just after its scheduler's close message can
        hang for ever, with or without the bridge (Dask's CLI cancels the close that
        message started, and Worker.close then waits on it: 6 of 19 simultaneous
        Ctrl-Cs on distributed 2026.8 without the bridge)."""
        workers = [p for name, p in self.procs.items() if name != "scheduler"]
        for group in (workers, [self.procs["scheduler"]] if "scheduler" in self.procs else []):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc in group:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def __enter__(self) -> DaskProcesses:
        try:
            return self.start()
        except BaseException:
            self.stop()
            self.dir.cleanup()
            raise

    def __exit__(self, *exc) -> None:
        address = self._read_address() if self.procs["scheduler"].poll() is None else None
        dask = oracle.read_remote(address) if address and exc[0] is None else None
        self.stop()
        if exc[0] is not None:
            # pytest shows a failed test's captured output: the processes' logs with it
            for name in self.logs:
                print(f"----- {name}.log -----\n{self.log(name)}", file=sys.stderr)
        self.dir.cleanup()
        if exc[0] is None:
            oracle.processes_closed(dask, self.env, f"dask scheduler {address}")


@contextlib.contextmanager
def dask_processes(env: dict[str, str], **kwargs) -> Iterator[DaskProcesses]:
    with DaskProcesses({**PRELOAD_ENV, **FAST_ENV, **env}, **kwargs) as procs:
        yield procs
