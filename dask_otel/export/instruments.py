"""Observable instruments shared by every Dask server of a process (docs/metrics.md):
one instrument set per metric table and MeterProvider (:class:`ProcessInstruments`),
whose callbacks report on each attached server with the attributes that name it.
Callbacks run in the reader's thread while the event loop changes what they read:
they copy, skip a server for a round on ``RuntimeError``, and never raise.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar
from weakref import WeakKeyDictionary

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import (ObservableCounter, ObservableGauge, ObservableUpDownCounter,
                                       SimpleFixedSizeExemplarReservoir)
from opentelemetry.sdk.metrics.view import View

from dask_otel._compat import series_limit_view_options
from dask_otel._version import __version__
from dask_otel.attributes import SCHEMA_URL

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter, MeterProvider

logger = logging.getLogger("dask_otel")

#: Instrument kinds of :attr:`MetricSpec.kind`
GAUGE = "gauge"
COUNTER = "counter"

#: What a MetricSpec reads from one attached server: ``[(value, attributes)]``,
#: added to the attributes that name the server; or ``(value, attributes,
#: context)``, the context (with a sampled span) an exemplar is taken from
Reading = Iterable[tuple[Any, ...]]


@dataclass(frozen=True)
class MetricSpec:
    """One row of a metric table: the only place a metric name is spelled"""

    #: OpenTelemetry instrument name: dotted lowercase, no unit in it
    name: str
    #: :data:`GAUGE` (a current level) or :data:`COUNTER` (a cumulative total that
    #: only goes up while the process lives)
    kind: str
    #: UCUM unit: ``s``, ``By``, or an annotation such as ``{key}``
    unit: str
    description: str
    #: What one attached server contributes, given its :class:`Attached` handle
    read: Callable[[Any], Reading]


@dataclass(eq=False)
class Attached:
    """One Dask server that a :class:`ProcessInstruments` reports on. ``close()``
    leaves it to the next collection (usually the flush of the last server's close:
    its final values are not lost), then it is forgotten."""

    #: Attributes added to every observation of this server
    attributes: dict[str, Any]
    instruments: ProcessInstruments | None = None
    #: Rows not yet reported since close(); None while the server is open
    last_round: set[str] | None = None
    #: Row name -> (its latest Reading, the observations made of it if it was
    #: returned twice): a read returning the very same Reading gets them again
    observed: dict[str, tuple[Reading, list[Observation]]] = field(default_factory=dict)

    #: False while the server is closing, until close(): it is skipped
    active = True

    def close(self) -> None:
        if self.instruments is not None:
            self.instruments.retire(self)
            self.instruments = None


class LazyExemplarReservoir(SimpleFixedSizeExemplarReservoir):
    """The SDK's default reservoir, passed over at collection when it was offered
    nothing: the SDK looks into every series' reservoir at every collection, and
    only a fine-metrics series that grew carries a sampled span"""

    #: An exemplar was offered since the last collection
    offered = False

    def offer(self, value, time_unix_nano, attributes, context) -> None:
        super().offer(value, time_unix_nano, attributes, context)
        self.offered = True

    def collect(self, point_attributes):
        if not self.offered:
            return []
        self.offered = False
        return super().collect(point_attributes)


#: The series (attribute sets) one stream of the bridge's instruments may have: no
#: SDK limit (1.45.2 folds past 2,000); the bridge bounds its data where it must
#: (the fine metrics' own overflow). docs/metrics.md#series-limits
NO_SERIES_LIMIT = sys.maxsize

#: The views of the bridge's observable instruments: :class:`LazyExemplarReservoir`
#: and :data:`NO_SERIES_LIMIT` (on an SDK that has limits), the same streams
#: otherwise (one view per kind, so that no instrument matches two)
EXEMPLAR_VIEWS = [
    View(meter_name="dask_otel", instrument_type=kind,
         exemplar_reservoir_factory=lambda _: LazyExemplarReservoir,
         **series_limit_view_options(NO_SERIES_LIMIT))
    for kind in (ObservableCounter, ObservableGauge, ObservableUpDownCounter)
]


# provider -> {instruments class (of_provider): its instance}. Weak, so that a
# MeterProvider that was shut down and dropped takes its instruments with it.
_by_provider: WeakKeyDictionary[MeterProvider, dict[type, Any]] = WeakKeyDictionary()
_by_provider_lock = threading.Lock()


def of_provider(cls: type, meter_provider: MeterProvider) -> Any:
    """``cls(meter)``, the instruments of ``cls`` on ``meter_provider``, created on
    first use: every Dask server of the process shares them"""
    with _by_provider_lock:
        per_class = _by_provider.setdefault(meter_provider, {})
        if (instruments := per_class.get(cls)) is None:
            meter = meter_provider.get_meter("dask_otel", __version__, schema_url=SCHEMA_URL)
            instruments = per_class[cls] = cls(meter)
        return instruments


@dataclass(eq=False)
class ProcessInstruments:
    """The instruments of one metric table on one MeterProvider, and the Dask
    servers of this process they currently report on."""

    #: The metric table; one instrument per row
    table: ClassVar[tuple[MetricSpec, ...]]

    #: Where :meth:`add` creates instruments
    _meter: Meter
    _attached: dict[Attached, None] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: Rows whose read failed once already: logged at WARNING once, then DEBUG
    _failed: set[str] = field(default_factory=set)
    #: The name of every row with an instrument: the table's, then those added
    names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for spec in self.table:
            self.add(spec)

    def add(self, spec: MetricSpec) -> None:
        """One more row, observed from the next collection on. Never from inside
        a callback: the SDK registers an instrument under the lock its
        collection holds."""
        create = (self._meter.create_observable_gauge if spec.kind == GAUGE
                  else self._meter.create_observable_counter)
        create(spec.name, callbacks=[self._callback(spec)], unit=spec.unit,
               description=spec.description)
        with self._lock:
            self.names.append(spec.name)

    of = classmethod(of_provider)

    def attach(self, attached: Attached) -> None:
        with self._lock:
            self._attached[attached] = None
        attached.instruments = self

    def retire(self, attached: Attached) -> None:
        """Report ``attached`` at the next collection of each row, then forget it"""
        with self._lock:
            if attached in self._attached:
                attached.last_round = set(self.names)

    @property
    def attached(self) -> list[Attached]:  # a copy, safe to iterate in the reader's thread
        with self._lock:
            return list(self._attached)

    def _callback(self, spec: MetricSpec) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(options: CallbackOptions) -> list[Observation]:
            reporting = []
            for server in self.attached:
                if server.last_round is None:
                    if server.active:
                        reporting.append(server)
                elif spec.name in server.last_round:
                    reporting.append(server)
                    with self._lock:  # once more, then forgotten
                        server.last_round.discard(spec.name)
                        if not server.last_round:
                            self._attached.pop(server, None)
            return [o for server in reporting for o in self._observe(spec, server)]

        return callback

    def _observe(self, spec: MetricSpec, server: Attached) -> list[Observation]:
        base = server.attributes
        try:
            readings = spec.read(server)
            previous = server.observed.get(spec.name)
            again = previous is not None and previous[0] is readings
            if again and previous[1] is not None:
                return previous[1]
            # The SDK copies the attributes it is given: no merge when there is
            # nothing to merge (a scheduler's are empty)
            out = [
                Observation(reading[0], {**base, **reading[1]} if base else reading[1],
                            *reading[2:])
                for reading in readings
            ]
            # kept from the second time on: a reading seen once is usually new
            # at the next collection too
            server.observed[spec.name] = (readings, out if again else None)
            return out
        except RuntimeError:  # "dictionary changed size during iteration": next time
            return []
        except Exception:
            level = logging.DEBUG if spec.name in self._failed else logging.WARNING
            self._failed.add(spec.name)
            logger.log(level, "dask_otel: could not read %s for %s; skipped",
                       spec.name, server.attributes, exc_info=True)
            return []


def copy_mapping(mapping: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """A copy of a mapping that another thread may be changing: ``dict.copy`` runs
    in C holding the GIL (consistent); others are iterated, which may raise
    RuntimeError (the caller skips this round)"""
    if isinstance(mapping, dict):
        return dict.copy(mapping)
    return dict(mapping)
