"""The ``OTEL_CONFIG_FILE`` recipe (:class:`ConfigFile`): the bridge's providers from
the file, as opentelemetry-sdk builds the application's, ignoring the ``OTEL_*``
variables it ignores (docs/configuration-file.md). It answers what
:class:`~dask_otel.export.exporters.EnvRecipe` answers.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from typing import Any

from dask_otel._compat import (declared_exemplar_filter, declared_log_exporter,
                               declared_metric_exporter, declared_span_exporter,
                               declared_span_limits, declared_view)
from dask_otel.config import ConfigError
from dask_otel.export.exporters import SIGNALS, Account, prometheus_reader, sdk_processors
from dask_otel.log import logger

VARIABLE = "OTEL_CONFIG_FILE"


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """``OTEL_CONFIG_FILE``, read: the package's model of it, and what of it the
    bridge cannot honour"""

    #: the file, as the variable names it
    path: str
    #: ``opentelemetry.configuration.OpenTelemetryConfiguration``
    model: Any
    #: what the file names that the bridge does not do, one phrase each
    ignored: tuple[str, ...]

    @property
    def signals(self) -> set[str]:
        """The signals exported: the providers the file gives processors or readers"""
        if self.model.disabled:
            return set()
        sections = {"spans": ("tracer_provider", "processors"),
                    "metrics": ("meter_provider", "readers"),
                    "logs": ("logger_provider", "processors")}
        return {signal for signal, (section, items) in sections.items()
                if getattr(getattr(self.model, section), items, None)}

    def resource(self, ours: dict[str, Any], service_name: str):
        """The file's resource, beneath Dask's identity (``ours``: host, process,
        the server's addresses); ``service_name`` where the file names none"""
        from opentelemetry.configuration.file import create_resource
        from opentelemetry.sdk.resources import Resource

        resource = create_resource(self.model.resource)
        if self.service_name() is None:
            resource = resource.merge(Resource({"service.name": service_name}))
        return resource.merge(Resource(ours))

    def service_name(self) -> tuple[str, str] | None:
        """The ``service.name`` the file's resource gives, None if it names none
        (the package then says ``unknown_service:<executable>``)"""
        from opentelemetry.configuration.file import create_resource

        name = create_resource(self.model.resource).attributes.get("service.name")
        if name == create_resource(None).attributes.get("service.name"):
            return None
        return str(name), VARIABLE

    def tracer_provider(self, resource: Any, default_length: int):
        """The file's TracerProvider without its processors (:meth:`processors`),
        ``default_length`` where the file sets no length limit; and its SpanLimits"""
        from opentelemetry.configuration.file import create_tracer_provider
        from opentelemetry.configuration.models import SpanLimits

        config = self.model.tracer_provider
        limits = config.limits or SpanLimits()
        global_limits = self.model.attribute_limits
        if limits.attribute_value_length_limit is None and (
            global_limits is None or global_limits.attribute_value_length_limit is None
        ):
            limits = dataclasses.replace(limits, attribute_value_length_limit=default_length)
        config = dataclasses.replace(config, processors=[], limits=limits)
        provider = create_tracer_provider(config, resource, global_limits)
        # The package's providers shut down at exit; the bridge's when the last server
        # closes, within otel.flush-timeout (an exit-time shutdown could hold a dying
        # process on a dead collector)
        atexit.unregister(provider.shutdown)
        return provider, declared_span_limits(limits, global_limits)

    def metric_readers(self, account: Account) -> list:
        """A pull reader serves on Dask's ``/metrics`` (the Prometheus exporter's)"""
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        out = []
        for i, config in enumerate(self.model.meter_provider.readers):
            if config.periodic is None:
                out.append(prometheus_reader())
                continue
            periodic = config.periodic
            interval = _or_default(periodic.interval, "metrics")
            exporter = self._exporter(
                f"meter_provider.readers[{i}]", declared_metric_exporter, periodic.exporter)
            out.append(PeriodicExportingMetricReader(
                account("metrics", exporter, interval / 1000),
                export_interval_millis=interval,
                export_timeout_millis=float(_or_default(periodic.timeout, "timeout")),
            ))
        return out

    def meter_options(self) -> dict[str, Any]:
        """The MeterProvider's arguments from the file besides readers and the
        resource: its views (the bridge's come first) and exemplar filter"""
        config = self.model.meter_provider
        options: dict[str, Any] = {"views": [declared_view(v) for v in config.views or ()]}
        if config.exemplar_filter is not None:
            options["exemplar_filter"] = declared_exemplar_filter(config.exemplar_filter)
        return options

    def logger_provider(self, resource: Any):
        """The file's LoggerProvider (limits, logger configurator) without its
        processors, which :meth:`processors` builds"""
        from opentelemetry.configuration.file import create_logger_provider

        config = dataclasses.replace(self.model.logger_provider, processors=[])
        provider = create_logger_provider(config, resource, self.model.attribute_limits)
        atexit.unregister(provider.shutdown)  # as the TracerProvider's
        return provider

    def processors(self, signal: str, account: Account, meter_provider: Any = None) -> list:
        """The span or log processors of the file, each exporter passed through
        ``account``; a batch's settings the file's, else the spec's defaults. Batch
        processors report their SDK metrics to ``meter_provider``"""
        section, build = {"spans": ("tracer_provider", declared_span_exporter),
                          "logs": ("logger_provider", declared_log_exporter)}[signal]
        batch, simple, _ = sdk_processors(signal)
        sdk_metrics = {"meter_provider": meter_provider} if meter_provider else {}
        out = []
        for i, config in enumerate(getattr(self.model, section).processors):
            where = f"{section}.processors[{i}]"
            if config.batch is None:
                exporter = self._exporter(where, build, config.simple.exporter)
                out.append(simple(account(signal, exporter, None)))
                continue
            b = config.batch
            delay = _or_default(b.schedule_delay, signal)
            exporter = account(signal, self._exporter(where, build, b.exporter), delay / 1000)
            options = {"max_queue_size": b.max_queue_size,
                       "max_export_batch_size": b.max_export_batch_size}
            out.append(batch(
                exporter, schedule_delay_millis=float(delay),
                export_timeout_millis=float(_or_default(b.export_timeout, "timeout")),
                **{k: v for k, v in options.items() if v is not None}, **(sdk_metrics or {}),
            ))
        return out

    def _exporter(self, where: str, build: Any, config: Any) -> Any:
        """An exporter from a section of the file; one it cannot build is a
        ConfigError naming the variable, the file, the section and the exporter"""
        try:
            return build(config)
        except Exception as e:
            names = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) is not None]
            names += list(getattr(config, "additional_properties", None) or ())
            raise ConfigError(VARIABLE, self.path, f"an exporter the SDK can build at "
                              f"{where}.exporter ({', '.join(names) or 'none named'}: "
                              f"{type(e).__name__}: {e})") from None


def _or_default(value: int | None, what: str) -> int:
    """``value``, else the spec's default in ms: a signal's export interval (the
    SDK's: ``SIGNALS``), or an export's timeout (``timeout``)"""
    return value if value is not None else 30000 if what == "timeout" else SIGNALS[what][3]


def _ignored(model: Any) -> tuple[str, ...]:
    """What the file names that the bridge's providers do not do"""
    out = []
    meter = model.meter_provider
    if meter is not None:
        for i, reader in enumerate(meter.readers or ()):
            if reader.pull is not None:
                out.append(f"meter_provider.readers[{i}].pull: served on Dask's /metrics, "
                           "not on a port of its own")
            elif reader.periodic.cardinality_limits is not None:
                out.append(f"meter_provider.readers[{i}].periodic.cardinality_limits: the "
                           "bridge sets its instruments' limits")
        if meter.meter_configurator_development is not None:
            out.append("meter_provider.meter_configurator/development")
    return tuple(out)


#: (pid, path) -> the file read, see :func:`config_file`
_read: dict[tuple[int, str], ConfigFile] = {}


def config_file() -> ConfigFile | None:
    """``OTEL_CONFIG_FILE`` read and validated (once per process and file), None
    when it is not set; a ConfigError naming the variable when the package is not
    installed or the file cannot be read or is not valid"""
    path = os.environ.get(VARIABLE, "").strip()
    if not path:
        return None
    key = (os.getpid(), path)
    if key in _read:
        return _read[key]
    try:
        from opentelemetry.configuration import ConfigurationError, load_config_file
    except ImportError:
        raise ConfigError(VARIABLE, path, "unset, or opentelemetry-configuration installed "
                          "(pip install 'dask-otel[config]')") from None
    try:
        model = load_config_file(path)
    except (ConfigurationError, OSError) as e:
        raise ConfigError(VARIABLE, path,
                          f"a declarative configuration file the SDK accepts ({e})") from e
    read = _read[key] = ConfigFile(path, model, _ignored(model))
    if read.ignored:
        logger.warning(
            "dask_otel: %s=%s: the bridge's providers follow the file except: %s",
            VARIABLE, path, "; ".join(read.ignored),
        )
    return read
