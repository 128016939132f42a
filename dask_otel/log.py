"""The bridge's own log lines: the ``dask_otel`` logger, set up as Dask's own.

distributed configures logging when it is imported, from dask config's ``logging:``
(``distributed/config.py``, ``initialize_logging``): a stream handler with
``distributed.admin.log-format`` on the loggers it names, ``distributed`` at INFO
among them. A logger it does not name has none of that: under ``dask scheduler`` or
``dask worker`` the bridge's records would reach Python's last-resort handler, a
bare line, WARNING and above only.

So, unless something configured ``dask_otel`` already (dask config's
``logging: {dask_otel: debug}``, which distributed honours like any name, or the
application), it takes the ``distributed`` logger's level, handlers and
propagation: its lines go to the same stream, in the same format, filtered at the
same level as Dask's. This happens once, when this module is first imported;
distributed has configured its loggers by then.
"""

from __future__ import annotations

import logging

import distributed.config  # noqa: F401  (configures distributed's loggers first)

logger = logging.getLogger("dask_otel")


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


follow_distributed_logging()
