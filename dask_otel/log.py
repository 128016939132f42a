"""Dask's console and the bridge's own log lines (docs/logs.md, "What Dask prints"):
:func:`keep_dask_console` runs distributed's set-up again, once, at import, when
``opentelemetry-instrument``'s handlers on the root logger made it skip Dask's
console; the ``dask_otel`` logger, unless something configured it, follows the
``distributed`` logger. No SDK module is imported here.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys

import dask
# Importing it configures distributed's loggers first. A from-import: once
# distributed is imported, ``distributed.config`` names its config dict, not the module
from distributed.config import initialize_logging

logger = logging.getLogger("dask_otel")

#: The handler classes that export Python log records to OpenTelemetry, as (module,
#: class), the preferred first: opentelemetry-instrumentation-logging's (the SDK
#: recommends it; ``opentelemetry-instrument`` puts one on the root), the SDK's own
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
            with contextlib.suppress(ImportError):
                module = importlib.import_module(module_name)
        if (handler_class := getattr(module, class_name, None)) is not None:
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
    aside, if it skipped Dask's console only because they were all OpenTelemetry
    handlers; True if it did. A new-style or file set-up does not look at the root's
    handlers; a root with any other handler (``basicConfig``) gets Dask's lines."""
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


def sdk_lines_in_dask_format(sdk: logging.Logger = logging.getLogger("opentelemetry")) -> None:
    """The SDK's own lines (a malformed ``OTEL_*`` variable's fallback) on Dask's console
    handlers, in its format, rather than bare on stderr (Python's last resort), when
    nothing else would print them; their level stays the root's"""
    if not (logging.getLogger().handlers or sdk.handlers or sdk.level or not sdk.propagate):
        for handler in logging.getLogger("distributed").handlers:
            sdk.addHandler(handler)


keep_dask_console()
follow_distributed_logging()
sdk_lines_in_dask_format()
