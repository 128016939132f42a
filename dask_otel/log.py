"""Dask's console and the bridge's own log lines: the ``dask_otel`` logger, set up
as Dask's own.

distributed configures logging when it is imported, from dask config's ``logging:``
(``distributed/config.py``, ``initialize_logging``): a stream handler with
``distributed.admin.log-format`` on the loggers it names, ``distributed`` at INFO
among them, and ``propagate = False`` on them. In the old-style set-up (the
default) it does so only when the root logger has no handler.

**Dask's console.** ``opentelemetry-instrument`` (with
opentelemetry-instrumentation-logging installed, as ``dask-otel[logs]`` and
``opentelemetry-bootstrap`` install it) puts an OpenTelemetry handler on the root
logger at start-up, whatever ``OTEL_LOGS_EXPORTER`` says; a Dask server that
imports distributed after that prints nothing, and sends every line to that
handler instead. So, when this module is first imported, if distributed skipped
its console for that reason alone (the root's handlers are all OpenTelemetry
ones, and the set-up is old style), :func:`keep_dask_console` runs distributed's
own set-up again with those handlers set aside for the call: Dask's console,
format, levels and ``propagate = False`` are what they are without
OpenTelemetry. The package imports this module whenever it is imported (the
instrumentor's entry point too), at once after distributed's set-up. What a
server printed between importing distributed and importing the bridge is not
printed again. The rules this gives for exporting: docs/logs.md.

**The bridge's lines.** A logger distributed does not name has none of that:
under ``dask scheduler`` or ``dask worker`` the bridge's records would reach
Python's last-resort handler, a bare line, WARNING and above only. So, unless
something configured ``dask_otel`` already (dask config's
``logging: {dask_otel: debug}``, which distributed honours like any name, or the
application), it takes the ``distributed`` logger's level, handlers and
propagation: its lines go to the same stream, in the same format, filtered at the
same level as Dask's.

Cost: once per process, at import; nothing per record. No SDK module is imported
here (``import dask_otel`` in a client loads none).
"""

from __future__ import annotations

import importlib
import logging
import sys

import dask
# Importing it configures distributed's loggers first. A from-import: once
# distributed is imported, ``distributed.config`` names its config dict, not the module
from distributed.config import initialize_logging

logger = logging.getLogger("dask_otel")

#: The handler classes that export Python log records to OpenTelemetry, as
#: (module, class), the preferred first: opentelemetry-instrumentation-logging's,
#: which the SDK recommends (``opentelemetry-instrument`` puts one on the root
#: logger), and the SDK's own (deprecated; on the root with
#: ``OTEL_PYTHON_LOGGING_AUTO_INSTRUMENTATION_ENABLED=true``)
OTEL_HANDLERS = (
    ("opentelemetry.instrumentation.logging.handler", "LoggingHandler"),
    ("opentelemetry.sdk._logs", "LoggingHandler"),
)


def otel_handler_classes(import_them: bool = True) -> tuple[type, ...]:
    """The classes of :data:`OTEL_HANDLERS` present in this environment. With
    ``import_them=False``, only those whose module is imported already, which is
    enough to recognise a handler object on a logger and imports no SDK module."""
    classes: list[type] = []
    for module_name, class_name in OTEL_HANDLERS:
        module = sys.modules.get(module_name)
        if module is None and import_them:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
        handler_class = getattr(module, class_name, None)
        if handler_class is not None:
            classes.append(handler_class)
    return tuple(classes)


def dask_logging_config(config: dict | None = None) -> dict:
    """The part of dask config that holds ``logging`` or ``logging-file-config``:
    under ``distributed:`` first, then the top level, as distributed looks it up"""
    config = dask.config.config if config is None else config
    distributed_config = config.get("distributed") or {}
    if {"logging", "logging-file-config"} & distributed_config.keys():
        return distributed_config
    return config


def keep_dask_console() -> bool:
    """Run distributed's logging set-up again with the root logger's handlers set
    aside, if it skipped Dask's console only because they were there and they are
    all OpenTelemetry handlers; True if it did. A new-style (``version: 1``) or
    file set-up does not look at the root's handlers: it is left alone, as is a
    process whose root has any other handler (the application's ``basicConfig``:
    Dask's lines go there, as they would without OpenTelemetry)."""
    root = logging.getLogger()
    theirs = logging.getLogger("distributed")
    base = dask_logging_config()
    if (
        "logging-file-config" in base
        or "version" in (base.get("logging") or {})
        or not root.handlers
        or theirs.handlers
        or not theirs.propagate
    ):
        return False
    otel_classes = otel_handler_classes(import_them=False)
    if not otel_classes or not all(isinstance(h, otel_classes) for h in root.handlers):
        return False
    # distributed looks at the root's handlers, so they step aside for the call
    # only; it runs at import, before the servers log from other threads
    set_aside = list(root.handlers)
    for handler in set_aside:
        root.removeHandler(handler)
    try:
        # distributed's own set-up, as it runs when nothing is on the root logger
        initialize_logging(dask.config.config)
    finally:
        for handler in set_aside:
            root.addHandler(handler)
    return True


def follow_distributed_logging(ours: logging.Logger = logger) -> None:
    """Give ``ours`` the ``distributed`` logger's level, handlers and propagation,
    unless it has a level, a handler or its propagation set already"""
    if ours.level != logging.NOTSET or ours.handlers or not ours.propagate:
        return
    theirs = logging.getLogger("distributed")
    ours.setLevel(theirs.getEffectiveLevel())
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.propagate = theirs.propagate


keep_dask_console()
follow_distributed_logging()
