"""Dask's own Prometheus families as OpenTelemetry instruments (``otel.metrics.dask``):
an adapter over the collectors Dask serves its ``/metrics`` from, naming no family.
Each collection runs each attached server's collectors once, and every family they
yield becomes an observable instrument by one rule (:func:`family_spec`; what is
left out and why: docs/metrics.md#dasks-own-families).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Observation

from dask_otel.attributes import WORKER_ADDRESS
from dask_otel.export.instruments import COUNTER, GAUGE, Attached, MetricSpec, ProcessInstruments

if TYPE_CHECKING:
    from distributed import Scheduler, Worker
    from distributed.core import Server
    from distributed.http.prometheus import PrometheusCollector
    from prometheus_client import Metric

    from dask_otel.export.telemetry import ServerTelemetry

logger = logging.getLogger("dask_otel")

#: Kinds of the prometheus_client family types an observable instrument can carry
KINDS = {"counter": COUNTER, "gauge": GAUGE}
#: The unit words prometheus_client appends to a family's name, as OTel units:
#: OpenTelemetry's Prometheus translation appends the same words back
UNITS = {"seconds": "s", "bytes": "By"}
#: Attempts at a collector while the event loop changes what it iterates
ATTEMPTS = 3


def families_wanted(own: ServerTelemetry) -> bool:
    """``otel.metrics.dask``, unless metrics also go to the prometheus exporter:
    its endpoint is Dask's own /metrics, which serves these families already
    (twice the same name on one endpoint is an invalid exposition); and only
    where prometheus_client is installed, as for Dask's /metrics"""
    config = own.config
    if not config.dask_families or "prometheus" in config.metrics_exporters:
        return False
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        logger.warning(
            "dask_otel: otel.metrics.dask needs prometheus_client, which Dask's "
            "collectors use; Dask's families are not exported"
        )
        return False
    return True


def family_spec(family: Metric, prefix: str, beside_gauge: bool) -> MetricSpec | None:
    """The instrument of a Dask family, named so that OpenTelemetry's Prometheus
    translation gives Dask's name back (the rule: docs/metrics.md); None for a
    type an observable instrument cannot carry. ``prefix`` is the collector's;
    ``beside_gauge``: a gauge of the same collection has the counter's name"""
    kind = KINDS.get(family.type)
    if kind is None:
        return None
    name = family.name
    rest = name[len(prefix):] if name.startswith(prefix) else name
    head = name[: len(name) - len(rest)].replace("_", ".")
    for word, otel_unit in UNITS.items():
        if rest.endswith("_" + word):
            unit = otel_unit
            if not beside_gauge:
                rest = rest[: -len(word) - 1]
            break
    else:  # a unit of Dask's own (``s``): the name keeps it
        unit = "{%s}" % family.unit if family.unit else ""
    if beside_gauge:
        base, _, last = rest.rpartition("_")
        rest = f"{base}.{last}" if base else rest
    # read: the rounds of FamilyInstruments read all families at once
    return MetricSpec(head + rest, kind, unit, family.documentation, lambda observed: [])


@dataclass(slots=True, eq=False)
class CollectorView:
    """A Dask server, or its SystemMonitor, as Dask's collectors see it through the
    bridge: ``own`` answers first, so that what a collection resets is a copy or does
    nothing. Dask's own scrapes are left unchanged (:func:`server_view`)."""

    target: Any
    #: attribute name -> its value, given the target
    own: dict[str, Callable[[Any], Any]]

    def __getattr__(self, name: str) -> Any:
        make = self.own.get(name)
        return getattr(self.target, name) if make is None else make(self.target)


def server_view(server: Server) -> CollectorView:
    """A collection clears or pops the tick-duration maximum: it gets a copy (a
    defaultdict's copy is made in C, holding the GIL: consistent). A scrape calls the
    monitor's ``update()`` (from distributed 2024.8), which would add a sample to its
    history: the bridge reads the latest sample, taken by the server or by a scrape"""
    monitor = CollectorView(server.monitor, {"update": lambda _: dict})
    return CollectorView(server, {"digests_max": lambda s: copy.copy(s.digests_max),
                                  "monitor": lambda _: monitor})


@dataclass(eq=False)
class FamilyInstruments(ProcessInstruments):
    """The instruments of Dask's families on one MeterProvider: those the
    collections of this process's servers have yielded so far. The first
    instrument read runs a round (every attached server's collectors once) and
    the others return their share of it; one read twice starts the next round."""

    table = ()

    #: Dask family (name, type, unit, beside_gauge) -> its instrument's row
    specs: dict[tuple[str, str, str, bool], MetricSpec | None] = field(default_factory=dict)
    #: Rows yielded by a collection, not yet given an instrument
    pending: dict[str, MetricSpec] = field(default_factory=dict)
    #: ``{instrument name: [Observation]}`` of the latest round
    round: dict[str, list[Observation]] = field(default_factory=dict)
    #: Instruments that read :attr:`round` already; None: no round yet
    read_by: set[str] | None = None
    #: Serializes rounds (two readers of one provider may collect at once)
    round_lock: threading.Lock = field(default_factory=threading.Lock)

    def _callback(self, spec: MetricSpec) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(options: CallbackOptions) -> list[Observation]:
            with self.round_lock:
                if self.read_by is None or spec.name in self.read_by:
                    self.round, self.read_by = self.collect_round(), set()
                self.read_by.add(spec.name)
                return self.round.get(spec.name, [])

        return callback

    def collect_round(self) -> dict[str, list[Observation]]:
        out: dict[str, list[Observation]] = {}
        for server in self.attached:
            if server.last_round is not None:  # closed: reported once more
                with self._lock:
                    self._attached.pop(server, None)
            elif not server.active:
                continue
            for name, series in server.collect().items():
                out.setdefault(name, []).extend(
                    Observation(value, {**server.attributes, **labels})
                    for value, labels in series
                )
        return out

    def spec_of(self, family: Metric, prefix: str, beside_gauge: bool) -> MetricSpec | None:
        key = (family.name, family.type, family.unit, beside_gauge)
        if key in self.specs:
            return self.specs[key]
        spec = self.specs[key] = family_spec(family, prefix, beside_gauge)
        if spec is not None:
            with self._lock:
                if spec.name not in self.names:
                    self.pending[spec.name] = spec
        return spec

    def create_pending(self) -> None:
        """An instrument for each family yielded since the last call"""
        with self._lock:
            new, self.pending = list(self.pending.values()), {}
        for spec in new:
            if spec.name not in self.names:
                self.add(spec)


class DaskFamilies(Attached):
    """Exports the families of one Dask server from now until :meth:`close`: a
    scheduler's (Dask's ``COLLECTORS``) or a worker's (the collector its ``/metrics``
    serves from, but for the SpillBuffer's families: :mod:`dask_otel.spill` exports
    the same counters). Imports prometheus_client: only where :func:`families_wanted`"""

    #: The scheduler or worker
    server: Server
    #: Dask's collectors of this server, on its :func:`server_view`
    collectors: list[PrometheusCollector]
    #: Collectors whose failure was logged at WARNING; DEBUG from then on
    failed: set[str]
    #: The instruments this server's families are observed by (kept after
    #: :meth:`close`: the last round still collects)
    family_instruments: FamilyInstruments

    def __init__(self, server: Scheduler | Worker, own: ServerTelemetry):
        from distributed import Scheduler

        if isinstance(server, Scheduler):
            from distributed.http.scheduler.prometheus.core import COLLECTORS as collector_types

            # Dask's label sets exactly, beside the resource naming the scheduler
            super().__init__(dict(own.metric_attributes))
        else:
            from distributed.http.worker.prometheus.core import WorkerMetricCollector

            class WorkerCollector(WorkerMetricCollector):
                def collect_spillbuffer(self) -> Iterator[Metric]:
                    return iter(())

            collector_types = [WorkerCollector]
            # over OTLP every worker shares its scheduler's resource, where
            # Prometheus tells the endpoints apart by ``instance``
            super().__init__({**own.metric_attributes, WORKER_ADDRESS: server.address})
        self.server = server
        view = server_view(server)
        self.collectors = [collector(view) for collector in collector_types]
        self.failed = set()
        instruments = self.family_instruments = FamilyInstruments.of(own.telemetry.meter_provider)
        # Here, on the event loop, the instruments of what Dask yields now are
        # made before the first collection round
        self.collect()
        instruments.create_pending()
        instruments.attach(self)

    def collect(self) -> dict[str, list[tuple[float, dict[str, str]]]]:
        """``{instrument name: [(value, Dask's labels)]}``: one run of the collectors"""
        instruments = self.family_instruments
        out: dict[str, list[tuple[float, dict[str, str]]]] = {}
        for collector in self.collectors:
            prefix = collector.build_name("")
            families = self._families(collector)
            gauges = {f.name for f in families if f.type == "gauge"}
            for family in families:
                beside_gauge = family.type == "counter" and family.name in gauges
                spec = instruments.spec_of(family, prefix, beside_gauge)
                if spec is None:
                    continue
                sample = family.name + "_total" if family.type == "counter" else family.name
                out[spec.name] = [(s.value, s.labels) for s in family.samples if s.name == sample]
        if instruments.pending:
            # not from the reader's thread: it holds the SDK's collection lock
            with contextlib.suppress(RuntimeError):  # the loop is closed: too late
                self.server.io_loop.add_callback(instruments.create_pending)
        return out

    def _families(self, collector: PrometheusCollector) -> list[Metric]:
        # the collectors run in the reader's thread while the event loop changes
        # what they read: retried, then skipped for the round
        for _ in range(ATTEMPTS):
            try:
                return list(collector.collect())
            except RuntimeError:  # a dict changed size during iteration
                continue
            except Exception:
                what = type(collector).__name__
                level = logging.DEBUG if what in self.failed else logging.WARNING
                self.failed.add(what)
                logger.log(level, "dask_otel: Dask's %s failed; skipped", what, exc_info=True)
                return []
        return []
