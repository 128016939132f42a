"""A ``dask worker --preload`` module: a worker whose clock offset Dask misjudges.

Dask moves a worker's task times onto the scheduler's clock by adding
``Worker.scheduler_delay``, which it estimates from heartbeats. This preload adds
``DASK_OTEL_TEST_SKEW`` seconds to every estimate, so the worker reports task
times that far off, as a worker whose clock drifted since its last heartbeat, or
one whose estimate a slow network spoilt, would. Its tasks still run when the
scheduler sends them: only the reported times move.
"""

from __future__ import annotations

import os
from typing import Any

#: Seconds added to the worker's estimated offset
SKEW = float(os.environ.get("DASK_OTEL_TEST_SKEW", "0"))


class _SkewedOffset:
    """``Worker.scheduler_delay`` as a data descriptor (which wins over the
    instance's own attribute): what Dask stores, plus the skew"""

    def __get__(self, worker: Any, owner: type | None = None) -> float:
        if worker is None:
            return self  # type: ignore[return-value]
        return worker.__dict__.get("_true_scheduler_delay", 0.0) + SKEW

    def __set__(self, worker: Any, value: float) -> None:
        worker.__dict__["_true_scheduler_delay"] = value


def dask_setup(worker: Any) -> None:
    true_delay = worker.__dict__.pop("scheduler_delay", 0.0)
    worker.__class__ = type("SkewedWorker", (type(worker),), {"scheduler_delay": _SkewedOffset()})
    worker.scheduler_delay = true_delay
