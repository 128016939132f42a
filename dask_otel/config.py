"""The ``otel:`` dask config namespace: each key's validation, which processes
read it (its :class:`OtelConfig` field's ``read_in``), and the exporters by name.
Defaults in ``otel.yaml``, meanings in ``otel-schema.yaml``; together they are the
README's configuration table (README.md, "Configuration"). Where telemetry goes
(``OTEL_*``) the SDK reads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cache, partial
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import dask.config
import yaml
from dask.utils import parse_timedelta

from dask_otel.log import logger  # the bridge's lines, set up as Dask's own

with open(Path(__file__).with_name("otel.yaml")) as f:
    DEFAULTS: dict = yaml.safe_load(f)
# For `dask config list` and friends. The bridge itself never relies on these being
# in dask config: applications and test fixtures (distributed's gen_cluster) restore
# dask config to snapshots taken before this import; see get().
dask.config.update_defaults(DEFAULTS)

#: The exporter names the bridge knows, by signal (others: installed entry points)
EXPORTERS = {"TRACES": ("otlp", "console", "memory", "none"),
             "METRICS": ("otlp", "prometheus", "console", "memory", "none"),
             "LOGS": ("otlp", "console", "memory", "none")}
#: Protocols of ``OTEL_EXPORTER_OTLP_PROTOCOL`` that the Python SDK implements
OTLP_PROTOCOLS = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}


class ConfigError(ValueError):
    """A value under ``otel:`` or in an ``OTEL_*`` variable that the bridge cannot
    use; the message names the key and the value at fault"""

    def __init__(self, key: str, value: Any, expected: str):
        self.key, self.value = key, value
        super().__init__(f"{key}: expected {expected}, got {value!r}")


def get(key: str) -> Any:
    """``dask.config.get(key)``, or the shipped default (otel.yaml) when the key is
    absent: the application may have reset dask config since this module was
    imported, which must not switch the bridge off."""
    return dask.config.get(key, default=dask.config.get(key, config=DEFAULTS))


def _warn_unknown_keys(given: Any, defaults: dict, prefix: str) -> None:
    if not isinstance(given, dict):
        raise ConfigError(prefix, given, "a mapping")
    for key, value in given.items():
        canonical = key.replace("_", "-")
        if canonical not in defaults:
            logger.warning("Unknown dask config key %s.%s; ignored", prefix, key)
        elif isinstance(defaults[canonical], dict):
            _warn_unknown_keys(value, defaults[canonical], f"{prefix}.{canonical}")


# The parsers: each validates ``value``, given for dask config ``key`` (or, by
# parse_task_rules, for a block's argument), as the bridge uses it
def _bool(key: str, value: Any) -> bool:
    # DASK_OTEL__ENABLED=false: dask 2024.1's collect_env keeps 'false' a string
    # (later dask reads YAML's true/false from the environment as booleans)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false")
    return value


def _choice(key: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigError(key, value, " or ".join(map(repr, choices)))
    return value


def _seconds(key: str, value: Any, positive: bool = False, optional: bool = False
             ) -> float | None:
    if optional and value is None:  # no such rule
        return None
    try:
        out = parse_timedelta(value)
    except Exception:
        out = None
    if isinstance(value, bool) or out is None or out < 0 or (positive and out == 0):
        raise ConfigError(key, value, "a positive duration like '500ms' or '2s'")
    return out


def _ratio(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(key, value, "a number from 0 to 1")
    return float(value)


def _level(key: str, value: Any) -> int:
    """A logging level by name (``INFO``, any case) or number"""
    if isinstance(value, str):
        level = logging.getLevelName(value.strip().upper())
        if isinstance(level, int):
            return level
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError(key, value, "a logging level like INFO or WARNING")


def _names(key: str, value: Any, what: str = "a list of event topic names") -> frozenset[str]:
    """Names (event topics, fnmatch patterns): a list, or a comma-separated string"""
    if isinstance(value, str):
        value = [v for v in (v.strip() for v in value.split(",")) if v]
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, str) and v.strip() for v in value
    ):
        raise ConfigError(key, value, what)
    return frozenset(v.strip() for v in value)


def _exporters(key: str, value: Any) -> tuple[str, ...]:
    """Exporter names of ``otel.<signal>.exporter``; its default, the name of
    OTEL_<signal>_EXPORTER, reads that variable (unset: ``otlp``, ``none`` for logs).
    None (``null``, or ``none`` in a DASK_* variable) is ``none``."""
    signal = key.split(".")[1].upper()
    env, known, source = f"OTEL_{signal}_EXPORTER", EXPORTERS[signal], key
    if value == env:
        value, source = os.environ.get(env, "none" if signal == "LOGS" else "otlp"), env
    if isinstance(value, str) or value is None:
        value = [v for v in (v.strip() for v in (value or "none").split(",")) if v]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(source, value, "a list of exporter names")
    installed = installed_entry_points(f"opentelemetry_{signal.lower()}_exporter")
    for name in value:
        if name not in known and name not in installed:
            raise ConfigError(source, name, f"one of {', '.join(known)}")
    names = tuple(dict.fromkeys(value))
    if "otlp" in names:
        otlp_entry_point(signal)  # validates OTEL_EXPORTER_OTLP_*PROTOCOL now
    return tuple(n for n in names if n != "none")


@cache
def installed_entry_points(group: str) -> dict[str, Any]:
    """The entry points of ``group`` by name, looked up once per process: each
    lookup reads every installed distribution's metadata (tens of ms), and every
    Dask server that starts builds its exporters"""
    return {ep.name: ep for ep in entry_points(group=group)}


def otlp_entry_point(signal: str) -> str:
    """The exporter entry point for ``otlp``, by OTEL_EXPORTER_OTLP_[signal_]PROTOCOL
    (the SDK's exporters read the rest themselves)"""
    for var in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if protocol := os.environ.get(var, "").strip():
            if protocol not in OTLP_PROTOCOLS:
                raise ConfigError(var, protocol, " or ".join(OTLP_PROTOCOLS))
            return OTLP_PROTOCOLS[protocol]
    return OTLP_PROTOCOLS["grpc"]


#: The processes that read a key, by where it takes effect: the "read in" column of
#: the README's config table
CLIENT, SCHEDULER, WORKERS = "client", "scheduler", "workers"


def _key(name: str, parse: Callable[[str, Any], Any], *read_in: str) -> Any:
    """A field of :class:`OtelConfig`: dask config key ``name``, validated by
    ``parse``, which each process in ``read_in`` reads from its own dask config"""
    return field(metadata={"key": name, "parse": parse, "read_in": read_in})


@dataclass(frozen=True)
class OtelConfig:
    """A validated snapshot of the ``otel:`` dask config namespace, as one process
    reads it (each process of a cluster has its own): durations in seconds"""

    enabled: bool = _key("otel.enabled", _bool, CLIENT, SCHEDULER, WORKERS)
    flush_timeout: float = _key("otel.flush-timeout", _seconds, SCHEDULER, WORKERS)
    #: the SDK's retries for every batch during an outage, instead of probes
    retry_during_outage: bool = _key("otel.export.retry-during-outage", _bool, SCHEDULER,
                                     WORKERS)
    traces_exporters: tuple[str, ...] = _key("otel.traces.exporter", _exporters, SCHEDULER,
                                             WORKERS)
    #: keep a run the sampler dropped if it erred, or lasted longer (seconds; None: no such rule)
    keep_erred: bool = _key("otel.traces.keep.erred", _bool, SCHEDULER, WORKERS)
    keep_slower_than: float | None = _key("otel.traces.keep.slower-than",
                                          partial(_seconds, optional=True), SCHEDULER)
    poll_interval: float = _key("otel.spans.poll-interval", partial(_seconds, positive=True),
                                SCHEDULER)
    export_delay: float = _key("otel.spans.export-delay", _seconds, SCHEDULER)
    metrics_timeout: float = _key("otel.spans.metrics-timeout", _seconds, SCHEDULER)
    span_totals: str = _key("otel.spans.totals", partial(_choice, choices=("subtree", "own")),
                            SCHEDULER)
    export_code: bool = _key("otel.spans.code", _bool, SCHEDULER)
    metrics_exporters: tuple[str, ...] = _key("otel.metrics.exporter", _exporters, SCHEDULER,
                                              WORKERS)
    span_label: bool = _key("otel.metrics.span-label", _bool, SCHEDULER)
    #: Dask's own Prometheus families over OTLP (docs/metrics.md#dasks-own-families)
    dask_families: bool = _key("otel.metrics.dask", _bool, SCHEDULER, WORKERS)
    #: root span names that ``dask.workflow.*`` count by name
    #: (:mod:`dask_otel.scheduler.outcomes`)
    workflows: frozenset[str] = _key(
        "otel.metrics.workflows", partial(_names, what="a list of fnmatch patterns of span names"),
        SCHEDULER)
    #: the labels (``dask_otel.span(attributes=...)``) on ``dask.workflow.*``
    metric_labels: frozenset[str] = _key(
        "otel.metrics.labels", partial(_names, what="a list of attribute names"), SCHEDULER)
    task_spans: bool = _key("otel.tasks.spans", _bool, WORKERS)
    task_sample_ratio: float = _key("otel.tasks.sample-ratio", _ratio, WORKERS)
    #: seconds; None: no such rule
    task_slower_than: float | None = _key("otel.tasks.slower-than",
                                          partial(_seconds, optional=True), WORKERS)
    task_erred: bool = _key("otel.tasks.erred", _bool, WORKERS)
    logs_exporters: tuple[str, ...] = _key("otel.logs.exporter", _exporters, SCHEDULER, WORKERS)
    logs_level: int = _key("otel.logs.level", _level, SCHEDULER, WORKERS)
    #: the Dask events exported as log records (dask_otel.scheduler.events)
    event_topics: frozenset[str] = _key("otel.events.topics", _names, SCHEDULER)
    errors_messages: bool = _key("otel.errors.messages", _bool, SCHEDULER, WORKERS)

    def effective(self, process: str) -> dict[str, Any]:
        """The values of the keys that ``process`` (:data:`SCHEDULER` or
        :data:`WORKERS`) reads, by key, as the bridge uses them: durations in
        seconds, exporters resolved against ``OTEL_*_EXPORTER``, the level by name"""
        values = {}
        for f in fields(self):
            if process in f.metadata["read_in"]:
                value = getattr(self, f.name)
                if f.name == "logs_level":
                    value = logging.getLevelName(value)
                if isinstance(value, frozenset):
                    value = sorted(value)
                values[f.metadata["key"]] = list(value) if isinstance(value, tuple) else value
        return values


def enabled() -> bool:
    """``otel.enabled`` in this process's dask config (ConfigError if it is not
    true or false)"""
    return _bool("otel.enabled", get("otel.enabled"))


def read_config() -> OtelConfig:
    """Read and validate ``otel.*`` from dask config; ConfigError names the first
    key (or ``OTEL_*`` variable) whose value is unusable"""
    _warn_unknown_keys(dask.config.get("otel", default={}), DEFAULTS["otel"], "otel")
    # In field order: the first bad key is the one named
    return OtelConfig(**{f.name: f.metadata["parse"](f.metadata["key"], get(f.metadata["key"]))
                         for f in fields(OtelConfig)})


#: The ``otel.tasks.*`` keys, by their last part, with their parsers: the ones a
#: ``dask_otel.span(tasks=...)`` block may set for its own tasks
TASK_RULES: dict[str, Callable[..., Any]] = {
    f.metadata["key"].removeprefix("otel.tasks."): f.metadata["parse"]
    for f in fields(OtelConfig) if f.metadata["key"].startswith("otel.tasks.")
}
#: The ``otel.traces.keep.*`` keys, as :data:`TASK_RULES`: a root block's ``keep=``
KEEP_RULES: dict[str, Callable[..., Any]] = {
    f.metadata["key"].removeprefix("otel.traces.keep."): f.metadata["parse"]
    for f in fields(OtelConfig) if f.metadata["key"].startswith("otel.traces.keep.")
}


def parse_task_rules(given: Any, *, strict: bool = True, table: Mapping[str, Callable[..., Any]]
                     = TASK_RULES, arg: str = "tasks") -> dict[str, Any]:
    """A ``dask_otel.span(tasks=...)`` block's ``otel.tasks.*`` values
    (``{"spans": True, "slower-than": "500ms"}``) by the keys' own parsers: the one
    validator of a block's task rules, at the call and where they are read.
    ``strict``: a bad one raises (TypeError if ``given`` is no mapping, else a
    ConfigError naming it); else it is left out (an annotation is never trusted).
    ``table``, ``arg``: :data:`KEEP_RULES`, ``keep`` for a root block's ``keep=``."""
    if not isinstance(given, Mapping):
        if strict:
            raise TypeError(f"{arg}: expected a mapping of {', '.join(table)}, got {given!r}")
        return {}
    rules = {}
    for short, value in given.items():
        name = short.replace("_", "-") if isinstance(short, str) else short
        try:
            if name not in table:
                raise ConfigError(arg, short, f"keys among {', '.join(table)}")
            rules[name] = table[name](f"{arg}[{short!r}]", value)
        except ConfigError:
            if strict:
                raise
    return rules


def parse_labels(given: Any, *, strict: bool = True) -> dict[str, Any]:
    """A ``dask_otel.span(attributes=...)`` block's labels, OTel attribute values, by
    :func:`parse_task_rules`' rule (``strict``: a bad one raises, naming it)"""
    if strict and not isinstance(given, Mapping):
        raise TypeError(f"attributes: expected a mapping of names to values, got {given!r}")
    labels = {}
    for key, value in given.items() if isinstance(given, Mapping) else ():
        values = value if isinstance(value, (list, tuple)) else [value]
        ours = not isinstance(key, str) or not key or key.startswith(("dask.", "otel."))
        if not ours and len(types := set(map(type, values))) < 2 and types <= {str, bool, int, float}:
            labels[key] = list(values) if values is value else value
        elif strict:  # the bridge's own attributes' names, or a value OTel takes not
            raise (ConfigError("attributes", key, "a name outside dask.* and otel.*") if ours else
                   TypeError(f"attributes[{key!r}]: expected a str, bool, int or float, or a "
                             f"list of one of them, got {value!r}"))
    return labels
