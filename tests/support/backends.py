"""Harness for real third-party backends used by the tests.

Everything here talks to 127.0.0.1 only.

Prometheus (Debian's ``prometheus`` package, installed by ``.ci/install-backends``)::

    with PrometheusServer(["127.0.0.1:8787", ("127.0.0.1:9000", {"job": "worker"})]) as prom:
        prom.wait_for_query('up{job="worker"} == 1')
        rows = prom.query("dask_otel_spill_bytes")   # [{"metric": {...}, "value": [ts, "1.5"]}]

Arize Phoenix (an OTLP trace store with a REST API, installed in its own venv by
``.ci/install-backends``; path overridable with ``DASK_OTEL_PHOENIX_VENV``)::

    with PhoenixServer() as phx:
        exporter = OTLPSpanExporter(endpoint=phx.otlp_traces_url)   # OTLP/HTTP protobuf
        ...
        spans = phx.wait_for_spans(count=4)   # normalised dicts, hex ids

Binaries that are missing make a test skip locally but fail under CI (env ``CI`` set),
see :func:`require_binary` and :func:`require_phoenix`.
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "BackendError",
    "PHOENIX_VENV_ENV",
    "DEFAULT_PHOENIX_VENV",
    "PhoenixServer",
    "PrometheusServer",
    "free_port",
    "http_get_json",
    "in_ci",
    "normalise_phoenix_span",
    "phoenix_executable",
    "phoenix_venv",
    "prometheus_config",
    "promtool_check_config",
    "promtool_check_rules",
    "require_binary",
    "require_phoenix",
    "span_children",
    "wait_until",
]

PHOENIX_VENV_ENV = "DASK_OTEL_PHOENIX_VENV"
DEFAULT_PHOENIX_VENV = "/opt/dask-otel-phoenix"


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


def phoenix_venv() -> Path:
    return Path(os.environ.get(PHOENIX_VENV_ENV) or DEFAULT_PHOENIX_VENV)


def phoenix_executable() -> Path | None:
    exe = phoenix_venv() / "bin" / "phoenix"
    return exe if os.access(exe, os.X_OK) else None


def require_phoenix() -> Path:
    """Return the ``phoenix`` executable of the Phoenix venv; skip if missing, fail under CI."""
    exe = phoenix_executable()
    if exe is None:
        _missing(
            f"Arize Phoenix not installed at {phoenix_venv()} (set {PHOENIX_VENV_ENV}); "
            "run .ci/install-backends"
        )
    return exe  # type: ignore[return-value]


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
    ) -> None:
        self.config = prometheus_config(
            list(targets),
            scrape_interval,
            rule_files,
            job=job,
            metrics_path=metrics_path,
            scrape_timeout=scrape_timeout,
            honor_labels=honor_labels,
        )
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.port: int | None = None

    # -- lifecycle
    def _executable(self) -> str:
        return require_binary("prometheus")

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


# --------------------------------------------------------------------------- Phoenix

# Environment variables that must not leak from the test process into Phoenix's venv.
_PHOENIX_ENV_DROP_PREFIXES = ("PHOENIX_", "OTEL_", "PYTHON", "VIRTUAL_ENV", "CONDA_")

_PHOENIX_BASE_ENV = {
    # No analytics pixels, web fonts, WASM sandbox download, ...: no internet on its own.
    "PHOENIX_TELEMETRY_ENABLED": "false",
    "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    # Features we do not need.
    "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
    "PHOENIX_AGENTS_DISABLE_BASH": "true",
    "PHOENIX_AGENTS_DISABLE_WEB_ACCESS": "true",
    "PHOENIX_ENABLE_MCP_SERVER": "false",
    # The migrations otherwise log every SQL statement (thousands of lines).
    "PHOENIX_LOG_MIGRATIONS": "false",
    "PYTHONUNBUFFERED": "1",
}


def _iso_to_unix_nano(value: str | None) -> int | None:
    """Phoenix returns ISO-8601 times with microsecond precision; exact integer ns."""
    if not value:
        return None
    dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    delta = dt - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000


def _hex_id(value: str | None, width: int) -> str | None:
    if not value:
        return None
    return value.lower().removeprefix("0x").zfill(width)


def normalise_phoenix_span(raw: Mapping[str, Any]) -> dict[str, Any]:
    """One span of ``GET /v1/projects/{p}/spans`` -> a flat dict:

    ``trace_id`` (32 hex), ``span_id`` (16 hex), ``parent_id`` (16 hex or None), ``name``,
    ``start_time_unix_nano``/``end_time_unix_nano`` (int, microsecond resolution),
    ``start_time``/``end_time`` (ISO strings as returned), ``attributes`` (dotted keys,
    plain JSON values; sequences as lists), ``status_code`` ("UNSET"/"OK"/"ERROR"),
    ``status_message``, ``events`` (``[{"name", "timestamp", "attributes"}]``),
    ``span_kind`` (OpenInference kind, "UNKNOWN" for non-LLM spans), ``phoenix_id``."""
    ctx = raw.get("context") or {}
    return {
        "trace_id": _hex_id(ctx.get("trace_id"), 32),
        "span_id": _hex_id(ctx.get("span_id"), 16),
        "parent_id": _hex_id(raw.get("parent_id"), 16),
        "name": raw.get("name"),
        "start_time_unix_nano": _iso_to_unix_nano(raw.get("start_time")),
        "end_time_unix_nano": _iso_to_unix_nano(raw.get("end_time")),
        "start_time": raw.get("start_time"),
        "end_time": raw.get("end_time"),
        "attributes": dict(raw.get("attributes") or {}),
        "status_code": raw.get("status_code"),
        "status_message": raw.get("status_message") or "",
        "events": list(raw.get("events") or []),
        "span_kind": raw.get("span_kind"),
        "phoenix_id": raw.get("id"),
    }


def span_children(spans: Iterable[Mapping[str, Any]]) -> dict[str | None, list[Mapping[str, Any]]]:
    """Group spans by ``parent_id`` (None = roots), each list sorted by start time."""
    out: dict[str | None, list[Mapping[str, Any]]] = {}
    for s in spans:
        out.setdefault(s["parent_id"], []).append(s)
    for lst in out.values():
        lst.sort(key=lambda s: (s.get("start_time_unix_nano") or 0, s["span_id"]))
    return out


class PhoenixServer(_ServerProcess):
    """A real Arize Phoenix server (OTLP trace store) from its own venv, bound to
    127.0.0.1 on free ports, with its SQLite DB in a temporary working dir.

    - ``otlp_http_endpoint``: base URL; OTLP/HTTP protobuf goes to ``<base>/v1/traces``
      (``otlp_traces_url``). Only traces: Phoenix accepts no OTLP metrics or logs.
    - ``otlp_grpc_endpoint``: ``http://127.0.0.1:<port>`` for the OTLP/gRPC exporter
      (pitfall: Phoenix binds its gRPC port on all interfaces, ``[::]``, not PHOENIX_HOST).
    - Spans land in project ``default`` unless the *resource* attribute
      ``openinference.project.name`` names another one (``service.name`` is ignored).
    - Ingestion is asynchronous (a queue flushed about every second): use
      :meth:`wait_for_spans`.
    """

    name = "phoenix"
    health_path = "/healthz"

    def __init__(
        self,
        *,
        venv: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        self.venv = Path(venv) if venv else None
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.grpc_port: int | None = None

    @property
    def otlp_http_endpoint(self) -> str:
        return self.url

    @property
    def otlp_traces_url(self) -> str:
        return self.url + "/v1/traces"

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    # -- lifecycle
    def _executable(self) -> str:
        if self.venv is None:
            return str(require_phoenix())
        exe = self.venv / "bin" / "phoenix"
        if not os.access(exe, os.X_OK):
            _missing(f"no Phoenix executable at {exe}")
        return str(exe)

    def _command(self, executable: str) -> list[str]:
        self.port, self.grpc_port = free_port(), free_port()
        while self.grpc_port == self.port:
            self.grpc_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        return [executable, "serve"]

    def _env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(_PHOENIX_ENV_DROP_PREFIXES)
        }
        env.update(_PHOENIX_BASE_ENV)
        env.update(
            PHOENIX_HOST="127.0.0.1",
            PHOENIX_PORT=str(self.port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            PHOENIX_WORKING_DIR=str(self.workdir),
        )
        env.update(self.extra_env)
        return env

    # -- REST API
    def version(self) -> str:
        with urllib.request.urlopen(self.url + "/arize_phoenix_version", timeout=10) as resp:
            return resp.read().decode().strip()

    def projects(self) -> list[str]:
        """Names of all projects (``default`` always exists)."""
        names: list[str] = []
        cursor = None
        while True:
            params = {"limit": 100, **({"cursor": cursor} if cursor else {})}
            body = http_get_json(self.url + "/v1/projects", params)
            names += [p["name"] for p in body["data"]]
            cursor = body.get("next_cursor")
            if not cursor:
                return names

    def raw_spans(
        self,
        project: str = "default",
        *,
        trace_id: str | Sequence[str] | None = None,
        name: str | Sequence[str] | None = None,
        page_size: int = 1000,
    ) -> list[dict[str, Any]]:
        """All spans of ``project`` as Phoenix returns them (``GET
        /v1/projects/{project}/spans``, following ``next_cursor``), oldest first.
        An unknown project (created only when its first span arrives) gives []."""
        params: dict[str, Any] = {"limit": page_size, "sort": "id", "order": "asc"}
        if trace_id:
            params["trace_id"] = [trace_id] if isinstance(trace_id, str) else list(trace_id)
        if name:
            params["name"] = [name] if isinstance(name, str) else list(name)
        path = f"{self.url}/v1/projects/{urllib.parse.quote(project, safe='')}/spans"
        out: list[dict[str, Any]] = []
        while True:
            try:
                body = http_get_json(path, params)
            except urllib.error.HTTPError as exc:
                if exc.code == 404 and not out:
                    return []
                raise BackendError(
                    f"GET {path} -> HTTP {exc.code}: {getattr(exc, 'body', '')}"
                ) from None
            out += body["data"]
            cursor = body.get("next_cursor")
            if not cursor:
                return out
            params["cursor"] = cursor

    def spans(
        self,
        project: str = "default",
        *,
        trace_id: str | Sequence[str] | None = None,
        name: str | Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        """Spans of ``project`` normalised by :func:`normalise_phoenix_span`, oldest first."""
        return [
            normalise_phoenix_span(s)
            for s in self.raw_spans(project, trace_id=trace_id, name=name)
        ]

    def wait_for_spans(
        self,
        project: str = "default",
        count: int | None = None,
        predicate: Callable[[list[dict[str, Any]]], bool] | None = None,
        timeout: float = 30.0,
        interval: float = 0.25,
        **filters: Any,
    ) -> list[dict[str, Any]]:
        """Poll :meth:`spans` until at least ``count`` spans exist and ``predicate(spans)``
        holds (default: non-empty); return the spans. Raises TimeoutError with what was
        there."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(project, **filters)
            if (count is None or len(spans) >= count) and (predicate or bool)(spans):
                return spans
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"Phoenix project {project!r}: wanted count={count} predicate={predicate} "
                    f"within {timeout}s, have {len(spans)} spans: "
                    f"{[(s['name'], s['span_id'], s['parent_id']) for s in spans]!r}"
                )
            time.sleep(interval)
