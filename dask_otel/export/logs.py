"""Python log records of the scheduler and workers as OpenTelemetry logs (docs/logs.md):
the process's ``LoggerProvider`` and the handlers that feed it. distributed's loggers
do not propagate, so a handler of ours sits on each of :func:`dask_logger_names` and
on the root, and exports only the records that stop at its logger; where another
OTel handler is on a logger ours stands aside. ``opentelemetry.*`` records are never
exported (an exporter's complaint about exporting would feed back).
"""

from __future__ import annotations

import configparser
import inspect
import logging
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from dask_otel.config import ConfigError, OtelConfig
from dask_otel.log import dask_logging_config, otel_handler_classes

#: The loggers distributed's usual set-up names whatever dask config's ``logging``
#: adds (``_initialize_logging_old_style``): each gets Dask's handler and stops
#: propagation
DISTRIBUTED_LOGGERS = ("distributed", "distributed.client", "distributed.gc", "bokeh", "tornado",
                       "tornado.application")


def dask_logger_names(config: dict | None = None) -> list[str]:
    """The loggers that distributed configures in this process: :data:`DISTRIBUTED_LOGGERS`
    and those dask config's ``logging`` or ``logging-file-config`` (its ``[loggers]``)
    names, under ``distributed:`` first, then at the top level, as distributed does."""
    base = dask_logging_config(config)
    names = list(DISTRIBUTED_LOGGERS)
    if base.get("logging-file-config"):
        parser = configparser.ConfigParser(interpolation=None)
        parser.read(base["logging-file-config"])
        keys = [k.strip() for k in parser.get("loggers", "keys", fallback="").split(",")]
        names += [parser.get(f"logger_{key}", "qualname", fallback=key)
                  for key in keys if key and key != "root"]
    logging_config = base.get("logging") or {}
    if "version" in logging_config:  # new style: its ``loggers``; old style: its keys
        logging_config = logging_config.get("loggers") or {}
    return list(dict.fromkeys([*names, *logging_config]))


def _new_handler(handler_class: type, level: int, provider: Any) -> logging.Handler:
    if "log_code_attributes" in inspect.signature(handler_class).parameters:
        # instrumentation-logging's: code.* attributes (where the line was logged),
        # as the SDK's handler adds them
        return handler_class(level=level, logger_provider=provider, log_code_attributes=True)
    with warnings.catch_warnings():
        # deprecated for opentelemetry-instrumentation-logging's, preferred above
        warnings.simplefilter("ignore", DeprecationWarning)
        return handler_class(level=level, logger_provider=provider)


@dataclass(eq=False)
class _WhereRecordsStop(logging.Filter):
    """Lets through, on the handler of ``logger``, the records that stop at
    ``logger`` (it does not propagate, or it is the root) and that no other OTel
    handler on it exports"""

    logger: logging.Logger
    #: every handler of ours (a live view)
    ours: Collection[logging.Handler]
    otel_classes: tuple

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("opentelemetry"):
            return False
        if self.logger.propagate and self.logger.parent is not None:
            return False
        return not any(isinstance(h, self.otel_classes) and h not in self.ours
                       for h in self.logger.handlers)


class LogExport:
    """The LoggerProvider of one process, built by the recipe of its
    :class:`~dask_otel.export.telemetry.Telemetry`, and the handlers that feed it"""

    #: the SDK's LoggerProvider that the handlers feed (also the one that a
    #: scheduler's other log records, e.g. its events, are emitted through)
    provider: Any
    #: logger -> the handler of ours on it: the root logger (unless another OTel
    #: handler was there first) and each of :func:`dask_logger_names`
    handlers: dict[logging.Logger, logging.Handler]

    def __init__(self, config: OtelConfig, recipe: Any, resource: Any, account: Any):
        # before anything is built: nothing to shut down when it raises
        otel_classes = otel_handler_classes()
        if not otel_classes:
            raise ConfigError("otel.logs.exporter", list(config.logs_exporters),
                              "none, or opentelemetry-instrumentation-logging installed "
                              "(pip install 'dask-otel[logs]'): this SDK has no LoggingHandler")
        self.provider = recipe.logger_provider(resource)
        for processor in recipe.processors("logs", account):
            self.provider.add_log_record_processor(processor)
        self.handlers = {}
        root = logging.getLogger()
        loggers = [logging.getLogger(name) for name in dask_logger_names()]
        if not any(isinstance(h, otel_classes) for h in root.handlers):
            loggers.append(root)
        for target in loggers:
            handler = _new_handler(otel_classes[0], config.logs_level, self.provider)
            handler.addFilter(_WhereRecordsStop(target, self.handlers.values(), otel_classes))
            if not config.errors_messages:  # a record's template (code), not its data: docs/privacy.md
                handler.emit = lambda r, emit=handler.emit: emit(logging.makeLogRecord(  # type: ignore
                    {**r.__dict__, "args": (), "exc_info": None, "exc_text": None, "stack_info": None}))
            self.handlers[target] = handler
        for target, handler in self.handlers.items():
            target.addHandler(handler)

    def shutdown(self) -> None:
        for target, handler in self.handlers.items():
            target.removeHandler(handler)
        self.provider.shutdown()
