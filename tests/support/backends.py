"""Harness for real third-party backends used by the tests.

Everything here talks to 127.0.0.1 only.

Prometheus (Debian's ``prometheus`` package, installed by ``.ci/install-backends``)::

    with PrometheusServer(["127.0.0.1:8787", ("127.0.0.1:9000", {"job": "worker"})]) as prom:
        prom.wait_for_query('up{job="worker"} == 1')
        rows = prom.query("dask_otel_spill_bytes")   # [{"metric": {...}, "value": [ts, "1.5"]}]

Built from their Go modules by ``.ci/install-backends`` into ``$DASK_OTEL_BACKENDS/bin``
(default ``/opt/dask-otel-backends/bin``, see :func:`require_backend`)::

    with JaegerServer() as jaeger:                       # Jaeger v2, in-memory storage
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_grpc_endpoint}
        ...
        spans = jaeger.wait_for_trace(trace_id, count=5)  # normalised dicts, hex ids
        jaeger.operations("dask")                         # the UI's operation list

    with CollectorServer(path, {"otlp_grpc/jaeger": jaeger.otlp_grpc_endpoint, ...}) as col:
        ...   # col.otlp_grpc_endpoint, col.prometheus_exporter ("127.0.0.1:port")
    collector_validate(path)                             # otelcol validate --config

    with PrometheusServer([], binary=require_backend("prometheus"),
                          otlp=PROMETHEUS3_OTLP, extra_args=PROMETHEUS3_OTLP_ARGS) as prom:
        ...   # prom.otlp_endpoint: OTLP/HTTP metrics straight into Prometheus 3

Binaries that are missing make a test skip locally but fail under CI (env ``CI`` set),
see :func:`require_binary` and :func:`require_backend`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

__all__ = [
    "BACKENDS_ENV",
    "BackendError",
    "CollectorServer",
    "DEFAULT_BACKENDS",
    "JaegerServer",
    "PROMETHEUS3_OTLP",
    "PROMETHEUS3_OTLP_ARGS",
    "backends_dir",
    "collector_config",
    "collector_validate",
    "normalise_jaeger_span",
    "require_backend",
    "PrometheusServer",
    "free_port",
    "http_get_json",
    "in_ci",
    "prometheus_config",
    "promtool_check_config",
    "promtool_check_rules",
    "require_binary",
    "wait_until",
]

#: Where .ci/install-backends puts the backends it builds from Go modules
BACKENDS_ENV = "DASK_OTEL_BACKENDS"
DEFAULT_BACKENDS = "/opt/dask-otel-backends"


class BackendError(RuntimeError):
    """A backend failed to start, or answered with an error."""


# --------------------------------------------------------------------------- helpers


def in_ci() -> bool:
    """True when running under CI (env ``CI`` set to anything but ''/0/false/no)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _missing(message: str) -> None:
    if in_ci():
        pytest.fail(f"{message} (CI is set, so backend tests must run: see .ci/install-backends)")
    pytest.skip(message)


def require_binary(name: str) -> str:
    """Return the path of executable ``name``; skip the test if missing, fail under CI."""
    path = shutil.which(name)
    if path is None:
        _missing(f"{name!r} not found on PATH; run .ci/install-backends")
    return path  # type: ignore[return-value]


def backends_dir() -> Path:
    return Path(os.environ.get(BACKENDS_ENV) or DEFAULT_BACKENDS)


def require_backend(name: str) -> str:
    """The path of ``name`` (``jaeger``, ``otelcol-dask``, ``prometheus``: Prometheus 3)
    as .ci/install-backends built it; skip the test if missing, fail under CI."""
    path = backends_dir() / "bin" / name
    if not os.access(path, os.X_OK):
        _missing(f"{name!r} not built in {path.parent} (set {BACKENDS_ENV}); "
                 "run .ci/install-backends")
    return str(path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's
    ephemeral range when it can: an outgoing connection or a port-0 bind of another
    test cannot take it before its user binds it, or binds it again (a worker
    restarted on a fixed port once found it taken: "Address already in use")."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(50):
        port = random.randrange(20000, low) if low > 21000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def wait_until(
    fn: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.25,
    message: str = "condition",
) -> Any:
    """Call ``fn`` until it returns something truthy; return that. Exceptions count as
    falsy (the last one is reported on timeout)."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            result = fn()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - reported below
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f"; last error: {last_exc!r}" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout}s waiting for {message}{detail}")
        time.sleep(interval)


def http_get_json(url: str, params: Mapping[str, Any] | None = None, timeout: float = 10.0) -> Any:
    """GET ``url`` and decode JSON. ``params`` values may be lists (repeated keys).

    Raises ``urllib.error.HTTPError`` (with ``.body`` holding the response text) on a
    non-2xx status."""
    if params:
        url = url + "?" + urllib.parse.urlencode(params, doseq=True)
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        try:
            exc.body = exc.read().decode(errors="replace")  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001
            exc.body = ""  # type: ignore[attr-defined]
        raise


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (OSError, urllib.error.URLError):
        return False


def _tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "<no log>"
    return "\n".join(lines[-n:])


def _stop_process(proc: subprocess.Popen | None, timeout: float = 15.0) -> None:
    """SIGTERM the process group we created, then SIGKILL after ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _run_checked(cmd: Sequence[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise BackendError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{output}")
    return output


# ------------------------------------------------------------------------- promtool


def promtool_check_config(path: str | os.PathLike) -> str:
    """``promtool check config PATH`` (also checks the rule files it names); returns its
    output, raises BackendError with the output on failure."""
    promtool = require_binary("promtool")
    return _run_checked([promtool, "check", "config", str(path)], "promtool check config")


def promtool_check_rules(*paths: str | os.PathLike) -> str:
    """``promtool check rules PATH...``; returns its output, raises BackendError on failure."""
    promtool = require_binary("promtool")
    return _run_checked([promtool, "check", "rules", *map(str, paths)], "promtool check rules")


# ------------------------------------------------------------------------ Prometheus

TargetSpec = str | tuple[str, Mapping[str, str]] | Mapping[str, Any]


def _normalise_target(spec: TargetSpec) -> tuple[str, dict[str, str]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping):
        return str(spec["target"]), {str(k): str(v) for k, v in spec.get("labels", {}).items()}
    address, labels = spec
    return str(address), {str(k): str(v) for k, v in labels.items()}


def prometheus_config(
    targets: Iterable[TargetSpec],
    scrape_interval: str = "1s",
    rule_files: Iterable[str | os.PathLike] | None = None,
    *,
    job: str = "dask",
    metrics_path: str = "/metrics",
    scrape_timeout: str | None = None,
    honor_labels: bool = False,
) -> dict[str, Any]:
    """The prometheus.yml content (as a dict; JSON is valid YAML) for ``targets``.

    A target is ``"host:port"``, ``("host:port", {"label": "value"})`` or
    ``{"target": "host:port", "labels": {...}}``. A ``job`` label picks the scrape job
    (``job_name``) of that target; targets without one go to job ``job``. Other labels
    are attached to the target's series."""
    timeout = scrape_timeout or scrape_interval
    jobs: dict[str, list[dict[str, Any]]] = {}
    for spec in targets:
        address, labels = _normalise_target(spec)
        job_name = labels.pop("job", job)
        static: dict[str, Any] = {"targets": [address]}
        if labels:
            static["labels"] = labels
        jobs.setdefault(job_name, []).append(static)
    return {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": timeout,
            "evaluation_interval": scrape_interval,
        },
        "rule_files": [str(Path(p).resolve()) for p in (rule_files or [])],
        "scrape_configs": [
            {
                "job_name": name,
                "metrics_path": metrics_path,
                "scheme": "http",
                "honor_labels": honor_labels,
                "static_configs": statics,
            }
            for name, statics in jobs.items()
        ],
    }


class _ServerProcess:
    """A backend server run as a child process on free 127.0.0.1 ports, with its
    state in a temporary directory; a context manager that waits until the server
    answers ``health_path`` and stops it on exit. Subclasses say how to start it."""

    name = ""
    health_path = ""
    startup_timeout = 60.0
    proc: subprocess.Popen | None = None
    url = ""
    startup_seconds: float | None = None
    _tmp: tempfile.TemporaryDirectory | None = None

    def _executable(self) -> str:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Write what the server reads (workdir and log_path are set)"""

    def _command(self, executable: str) -> list[str]:
        """The command line, on freshly chosen ports (set ``self.url``)"""
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        return None

    def __enter__(self):
        executable = self._executable()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"dask-otel-{self.name}-")
        self.workdir = Path(self._tmp.name)
        self.log_path = self.workdir / f"{self.name}.log"
        try:
            self._prepare()
            self._start(executable)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, executable: str) -> None:
        last_error = ""
        for _attempt in range(3):  # a free port may be taken between probe and bind
            cmd = self._command(executable)
            t0 = time.monotonic()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=self.workdir,  # no stray files from the test's cwd
                    env=self._env(),
                    start_new_session=True,
                )
            deadline = t0 + self.startup_timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if _http_ok(self.url + self.health_path):
                    self.startup_seconds = time.monotonic() - t0
                    return
                time.sleep(0.1)
            last_error = _tail(self.log_path)
            if self.proc.poll() is None:
                _stop_process(self.proc)
                raise BackendError(
                    f"{self.name} not ready after {self.startup_timeout}s on {self.url}\n"
                    f"{last_error}"
                )
            if "address already in use" not in last_error.lower():
                break
        raise BackendError(f"{self.name} exited with {self.proc.returncode}:\n{last_error}")

    def close(self) -> None:
        _stop_process(self.proc)
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self) -> str:
        return _tail(self.log_path, 200)


class PrometheusServer(_ServerProcess):
    """A real ``prometheus`` scraping ``targets``, on a free 127.0.0.1 port, with its TSDB
    in a temporary directory. Use as a context manager; the process is stopped on exit.

    ``binary``: another Prometheus than Debian's on PATH (``require_backend("prometheus")``
    for Prometheus 3); ``otlp``: the config's ``otlp:`` section, for Prometheus 3's
    OTLP receiver (with ``PROMETHEUS3_OTLP_ARGS``).

    Attributes after ``__enter__``: ``url``, ``port``, ``config_path``, ``log_path``,
    ``workdir``, ``config`` (the dict written to ``config_path``)."""

    name = "prometheus"
    health_path = "/-/ready"

    def __init__(
        self,
        targets: Iterable[TargetSpec],
        scrape_interval: str = "1s",
        rule_files: Iterable[str | os.PathLike] | None = None,
        *,
        job: str = "dask",
        metrics_path: str = "/metrics",
        scrape_timeout: str | None = None,
        honor_labels: bool = False,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
        binary: str | None = None,
        otlp: Mapping[str, Any] | None = None,
    ) -> None:
        self.binary = binary
        self.config = prometheus_config(
            list(targets),
            scrape_interval,
            rule_files,
            job=job,
            metrics_path=metrics_path,
            scrape_timeout=scrape_timeout,
            honor_labels=honor_labels,
        )
        if otlp is not None:
            self.config["otlp"] = dict(otlp)
            # What the OTLP receiver's docs ask for: pushed samples may arrive late
            self.config["storage"] = {"tsdb": {"out_of_order_time_window": "30m"}}
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.port: int | None = None

    @property
    def otlp_endpoint(self) -> str:
        """The base of Prometheus 3's OTLP receiver (``--web.enable-otlp-receiver``):
        ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` is this plus ``/v1/metrics``"""
        return self.url + "/api/v1/otlp"

    # -- lifecycle
    def _executable(self) -> str:
        return self.binary or require_binary("prometheus")

    def _prepare(self) -> None:
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(json.dumps(self.config, indent=2))

    def _command(self, executable: str) -> list[str]:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        return [
            executable,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            *self.extra_args,
        ]

    # -- HTTP API
    def _api(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        try:
            body = http_get_json(self.url + path, params)
        except urllib.error.HTTPError as exc:
            text = getattr(exc, "body", "")
            try:
                err = json.loads(text)
                text = f"{err.get('errorType')}: {err.get('error')}"
            except (ValueError, AttributeError):
                pass
            raise BackendError(f"GET {path} {dict(params or {})} -> HTTP {exc.code}: {text}") from None
        if body.get("status") != "success":
            raise BackendError(
                f"GET {path} {dict(params or {})} -> {body.get('errorType')}: {body.get('error')}"
            )
        return body["data"]

    def query(self, promql: str, time: float | None = None) -> list[dict[str, Any]]:
        """Instant query. Returns ``data.result``: for a vector a list of
        ``{"metric": {...}, "value": [ts, "str value"]}``; a scalar/string result is
        wrapped as ``[{"metric": {}, "value": [ts, "v"]}]``. Raises BackendError on error."""
        params: dict[str, Any] = {"query": promql}
        if time is not None:
            params["time"] = time
        data = self._api("/api/v1/query", params)
        if data.get("resultType") in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(
        self, promql: str, start: float, end: float, step: str | float = "1s"
    ) -> list[dict[str, Any]]:
        """Range query: list of ``{"metric": {...}, "values": [[ts, "v"], ...]}``."""
        data = self._api(
            "/api/v1/query_range", {"query": promql, "start": start, "end": end, "step": step}
        )
        return data["result"]

    def wait_for_query(
        self,
        promql: str,
        predicate: Callable[[list[dict[str, Any]]], bool] | None = None,
        timeout: float = 60.0,
        interval: float = 0.5,
    ) -> list[dict[str, Any]]:
        """Poll ``query(promql)`` until ``predicate(result)`` (default: non-empty) holds;
        return that result. On timeout raise TimeoutError with the last result and the
        scrape health of all targets. Query errors (bad PromQL) raise at once."""
        predicate = predicate or bool
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"PromQL {promql!r} did not satisfy the predicate within {timeout}s; "
                    f"last result: {result!r}; targets: {self.target_health()!r}"
                )
            time.sleep(interval)

    @staticmethod
    def values(result: list[dict[str, Any]]) -> list[float]:
        """The sample values of an instant-query result, as floats."""
        return [float(r["value"][1]) for r in result]

    def targets(self) -> dict[str, Any]:
        """``GET /api/v1/targets`` data: ``{"activeTargets": [...], "droppedTargets": [...]}``."""
        return self._api("/api/v1/targets")

    def target_health(self) -> list[dict[str, Any]]:
        """Short scrape-health summary per active target: scrapeUrl, job, health,
        lastError, lastScrape."""
        return [
            {
                "scrapeUrl": t.get("scrapeUrl"),
                "job": t.get("labels", {}).get("job"),
                "health": t.get("health"),
                "lastError": t.get("lastError"),
                "lastScrape": t.get("lastScrape"),
            }
            for t in self.targets().get("activeTargets", [])
        ]

    def wait_for_targets_up(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Wait until every active target has been scraped successfully at least once."""

        def all_up() -> list[dict[str, Any]] | None:
            health = self.target_health()
            return health if health and all(t["health"] == "up" for t in health) else None

        try:
            return wait_until(all_up, timeout=timeout, message="all targets up")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; targets: {self.target_health()!r}") from None

    def rules(self) -> list[dict[str, Any]]:
        """``GET /api/v1/rules`` groups (recording and alerting rules with health)."""
        return self._api("/api/v1/rules")["groups"]

    def alerts(self) -> list[dict[str, Any]]:
        """``GET /api/v1/alerts``: active (pending/firing) alerts."""
        return self._api("/api/v1/alerts")["alerts"]


#: Prometheus 3 as deploy/'s dashboards and rules need it when the bridge pushes OTLP
#: straight to it (docs/deploy.md "Prometheus 3, pushed to directly"): its OTLP
#: receiver, and exemplar storage for the exemplars that come with the points
PROMETHEUS3_OTLP_ARGS = ("--web.enable-otlp-receiver", "--enable-feature=exemplar-storage")
#: The config's ``otlp:`` section of that path (the translation strategy is Prometheus
#: 3's default, written out: the names then carry unit and type suffixes, as the
#: Collector's prometheus exporter gives them)
PROMETHEUS3_OTLP: dict[str, Any] = {"translation_strategy": "UnderscoreEscapingWithSuffixes"}


# ---------------------------------------------------------------------------- Jaeger


def _jaeger_tag(tag: Mapping[str, Any]) -> Any:
    return tag.get("value")


def _hex_id(value: str, width: int) -> str:
    return value.lower().zfill(width)


def normalise_jaeger_span(raw: Mapping[str, Any], processes: Mapping[str, Any]) -> dict[str, Any]:
    """One span of Jaeger's ``GET /api/traces/{id}`` (the UI's JSON) -> a flat dict:

    ``trace_id`` (32 hex), ``span_id`` (16 hex), ``parent_id`` (16 hex or None), ``name``,
    ``start_time_unix_nano``/``end_time_unix_nano`` (int, microsecond resolution),
    ``attributes``, ``status_code`` ("UNSET"/"OK"/"ERROR"), ``status_message``,
    ``events`` (``[{"name", "timestamp", "attributes"}]``), ``links``
    (``[(trace_id, span_id)]``, Jaeger's FOLLOWS_FROM references), ``resource`` (the
    process's tags and ``service.name``), ``kind`` and ``scope``.

    Jaeger keeps microseconds; the OTel status is its ``otel.status_code`` /
    ``otel.status_description`` tags (removed from ``attributes``, as are ``span.kind``,
    ``otel.scope.*`` and the ``error`` flag it derives from an ERROR status); a
    sequence attribute arrives as its JSON text."""
    tags = {t["key"]: _jaeger_tag(t) for t in raw.get("tags") or []}
    parent_id = None
    links = []
    for ref in raw.get("references") or []:
        ids = (_hex_id(ref["traceID"], 32), _hex_id(ref["spanID"], 16))
        if ref["refType"] == "CHILD_OF" and parent_id is None:
            parent_id = ids[1]
        else:
            links.append(ids)
    process = processes.get(raw.get("processID"), {})
    resource = {t["key"]: _jaeger_tag(t) for t in process.get("tags") or []}
    resource["service.name"] = process.get("serviceName")
    start = int(raw["startTime"]) * 1_000
    status = tags.pop("otel.status_code", "UNSET")
    status_message = tags.pop("otel.status_description", "")
    kind = tags.pop("span.kind", "internal")
    scope = tags.pop("otel.scope.name", None)
    for derived in ("error", "otel.scope.version"):
        tags.pop(derived, None)
    return {
        "trace_id": _hex_id(raw["traceID"], 32),
        "span_id": _hex_id(raw["spanID"], 16),
        "parent_id": parent_id,
        "name": raw["operationName"],
        "start_time_unix_nano": start,
        "end_time_unix_nano": start + int(raw["duration"]) * 1_000,
        "attributes": tags,
        "status_code": status,
        "status_message": status_message,
        "events": [
            {
                "name": next((f["value"] for f in log["fields"] if f["key"] == "event"), None),
                "timestamp": int(log["timestamp"]) * 1_000,
                "attributes": {f["key"]: f["value"] for f in log["fields"] if f["key"] != "event"},
            }
            for log in raw.get("logs") or []
        ],
        "links": links,
        "kind": kind,
        "scope": scope,
        "resource": resource,
    }


class JaegerServer(_ServerProcess):
    """A real Jaeger v2 (``cmd/jaeger``, built by .ci/install-backends) with in-memory
    storage: OTLP in (gRPC ``otlp_grpc_endpoint``, HTTP ``otlp_http_endpoint``), its
    query API out on ``url`` (what its UI reads: ``/api/services``,
    ``/api/services/{service}/operations``, ``/api/traces``), every port a free one on
    127.0.0.1. Spans are searchable once the receiver has handed them to storage: use
    :meth:`wait_for_trace`."""

    name = "jaeger"
    health_path = "/api/services"

    def __init__(self, *, startup_timeout: float = 60.0) -> None:
        self.startup_timeout = startup_timeout
        self.grpc_port: int | None = None
        self.http_port: int | None = None

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def otlp_http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _executable(self) -> str:
        return require_backend("jaeger")

    def _command(self, executable: str) -> list[str]:
        ports = set()
        while len(ports) < 4:
            ports.add(free_port())
        query, query_grpc, self.grpc_port, self.http_port = ports
        self.url = f"http://127.0.0.1:{query}"
        config = {
            "service": {
                "extensions": ["jaeger_storage", "jaeger_query"],
                "pipelines": {"traces": {"receivers": ["otlp"],
                                         "exporters": ["jaeger_storage_exporter"]}},
                # Its own metrics would listen on :8888, shared by every test
                "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
            },
            "extensions": {
                "jaeger_query": {
                    "storage": {"traces": "memory"},
                    "http": {"endpoint": f"127.0.0.1:{query}"},
                    "grpc": {"endpoint": f"127.0.0.1:{query_grpc}"},
                },
                "jaeger_storage": {"backends": {"memory": {"memory": {"max_traces": 100_000}}}},
            },
            "receivers": {"otlp": {"protocols": {
                "grpc": {"endpoint": f"127.0.0.1:{self.grpc_port}"},
                "http": {"endpoint": f"127.0.0.1:{self.http_port}"},
            }}},
            "exporters": {"jaeger_storage_exporter": {"trace_storage": "memory"}},
        }
        path = self.workdir / "jaeger.yaml"
        path.write_text(json.dumps(config, indent=2))
        return [executable, "--config", str(path)]

    # -- the query API (the UI's)
    def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        try:
            body = http_get_json(self.url + path, params)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise BackendError(f"GET {path} -> HTTP {exc.code}: {getattr(exc, 'body', '')}") from None
        return body.get("data")

    def services(self) -> list[str]:
        return sorted(self._get("/api/services") or [])

    def operations(self, service: str) -> list[str]:
        """The operation names of ``service``, as the UI's "Operation" list shows them"""
        quoted = urllib.parse.quote(service, safe="")
        return sorted(self._get(f"/api/services/{quoted}/operations") or [])

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        """The spans of one trace (``GET /api/traces/{id}``) by :func:`normalise_jaeger_span`,
        by start time; [] while Jaeger has none"""
        data = self._get(f"/api/traces/{trace_id}") or []
        return sorted(
            (normalise_jaeger_span(span, trace["processes"])
             for trace in data for span in trace["spans"]),
            key=lambda s: (s["start_time_unix_nano"], s["span_id"]),
        )

    def find_traces(self, service: str, operation: str | None = None, *,
                    tags: Mapping[str, str] | None = None, limit: int = 100) -> list[str]:
        """Trace ids of the UI's search (``GET /api/traces?service=...``) over the last hour"""
        params: dict[str, Any] = {"service": service, "limit": limit, "lookback": "1h"}
        if operation:
            params["operation"] = operation
        if tags:
            params["tags"] = json.dumps(dict(tags))
        return [_hex_id(t["traceID"], 32) for t in self._get("/api/traces", params) or []]

    def wait_for_trace(
        self,
        trace_id: str,
        count: int | None = None,
        predicate: Callable[[list[dict[str, Any]]], bool] | None = None,
        timeout: float = 30.0,
    ) -> list[dict[str, Any]]:
        """Poll :meth:`trace` until at least ``count`` spans are there and ``predicate``
        holds (default: non-empty); TimeoutError with what was there"""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            if (count is None or len(spans) >= count) and (predicate or bool)(spans):
                return spans
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"Jaeger trace {trace_id}: wanted count={count} predicate={predicate} "
                    f"within {timeout}s, have {len(spans)} spans: "
                    f"{[(s['name'], s['span_id'], s['parent_id']) for s in spans]!r}\n{self.log()}"
                )
            time.sleep(0.25)


# ------------------------------------------------------------------------- Collector


def collector_validate(path: str | os.PathLike) -> str:
    """``otelcol-dask validate --config PATH``: the real Collector reads the config, as
    at start, without starting it; returns its output, raises BackendError on failure."""
    return _run_checked([require_backend("otelcol-dask"), "validate", f"--config={path}"],
                        "otelcol validate")


def collector_config(path: str | os.PathLike, exporters: Mapping[str, str]) -> dict[str, Any]:
    """A Collector config of deploy/ as one that runs here: every listening endpoint
    moved to a free 127.0.0.1 port, each exporter named in ``exporters`` sent to
    ``exporters[name]`` (``host:port``, ``http://`` or not), the Collector's own metrics off (they would
    listen on :8888, shared by every test). Everything else as shipped."""
    config = yaml.safe_load(Path(path).read_text())
    for name, endpoint in exporters.items():
        config["exporters"][name]["endpoint"] = endpoint.removeprefix("http://")
    listening = [exporter for exporter in config["exporters"].values()
                 if exporter and str(exporter.get("endpoint", "")).startswith("0.0.0.0:")]
    listening += [protocol for receiver in config["receivers"].values()
                  for protocol in (receiver.get("protocols") or {}).values()]
    listening += [extension for extension in config.get("extensions", {}).values()
                  if extension and "endpoint" in extension]
    for item in listening:
        item["endpoint"] = f"127.0.0.1:{free_port()}"
    config["service"].setdefault("telemetry", {})["metrics"] = {"level": "none"}
    return config


class CollectorServer(_ServerProcess):
    """A real OpenTelemetry Collector (``otelcol-dask``, made by .ci/install-backends from
    .ci/otelcol-builder.yaml) running the config at ``path`` as :func:`collector_config`
    makes it run here, ``exporters`` its sending exporters' endpoints by name.

    ``otlp_grpc_endpoint`` / ``otlp_http_endpoint``: its OTLP receiver;
    ``prometheus_exporter``: ``host:port`` of its prometheus exporter, if it has one;
    ``config``: what it runs. Ready when its health_check extension answers."""

    name = "otelcol"
    health_path = "/"

    def __init__(self, path: str | os.PathLike, exporters: Mapping[str, str], *,
                 startup_timeout: float = 60.0) -> None:
        self.path, self.exporters = Path(path), dict(exporters)
        self.startup_timeout = startup_timeout
        self.config: dict[str, Any] = {}

    def _endpoint(self, *path: str) -> str:
        item: Any = self.config
        for key in path:
            item = item[key]
        return item["endpoint"]

    @property
    def otlp_grpc_endpoint(self) -> str:
        return "http://" + self._endpoint("receivers", "otlp", "protocols", "grpc")

    @property
    def otlp_http_endpoint(self) -> str:
        return "http://" + self._endpoint("receivers", "otlp", "protocols", "http")

    @property
    def prometheus_exporter(self) -> str:
        return self._endpoint("exporters", "prometheus")

    def _executable(self) -> str:
        return require_backend("otelcol-dask")

    def _command(self, executable: str) -> list[str]:
        self.config = collector_config(self.path, self.exporters)  # fresh ports each try
        self.url = "http://" + self._endpoint("extensions", "health_check")
        config_path = self.workdir / "config.yaml"
        config_path.write_text(json.dumps(self.config, indent=2))
        return [executable, f"--config={config_path}"]
