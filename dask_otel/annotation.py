"""The ``otel`` task annotation: the wire contract between client, scheduler and
workers, written and read here only. The story of a block: docs/traces.md, "A
dask_otel.span block" and "One workflow's controls". ``dask_otel.span`` puts it
on every task of its block, beside Dask's own ``span`` annotation::

    {"v": 2,                       # VERSION; absent from version 1 (the first three keys)
     "entered": {dask_span_uuid: client_time_entered, ...},  # its blocks and the enclosing ones
     "exits": True,                # the client announces each block's exit (BLOCK_EXIT)
     "carrier": {"traceparent": "00-...", "baggage": "..."},  # the caller's context, root blocks
     "sampled": True,              # dask_otel.span(sampled=...), from the root block
     "tasks": {"spans": True, "slower-than": 0.5},  # dask_otel.span(tasks=...), key by key
     "workflow": True,             # dask_otel.span(workflow=True), that block only
     "attributes": {"team": "data"}}  # dask_otel.span(attributes=...), key by key

Every key but ``entered`` is optional. The carrier is what the globally configured
propagators write (``OTEL_PROPAGATORS``). Leaving a block, the client sends one
event on topic :data:`BLOCK_EXIT` (``Client.log_event``'s path, without waiting)::

    {"span": {"name": [tag, ...], "ids": [uuid, ...]},  # Dask's span annotation
     "own": n, "otel": {...}, "exited": client_time_exited, "client": client_id,
     "graphs": True}  # the block sent graphs to this scheduler (absent: none, or an old client)

``own``: the last n ids are the spans the block opened. ``graphs``: its Dask spans will
come, however late their graphs (on the client's stream; the exit is an rpc of its own). Readers never trust
either: one of another shape (someone else's ``otel`` key), or one that came with
a task Dask moved onto another workflow's span (the TaskGroup collision), reads
as none. Needs opentelemetry-api only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanContext

from dask_otel.config import KEEP_RULES, parse_labels, parse_task_rules

#: Name of the task annotation
ANNOTATION = "otel"
#: The version of the annotation's shape this client writes (``"v"``); 1, unwritten,
#: is ``carrier``, ``entered`` and ``exits`` alone
VERSION = 2
#: Topic of the event a client sends when it leaves a ``dask_otel.span`` block
BLOCK_EXIT = "dask_otel.block-exit"


@dataclass(frozen=True, slots=True)
class Block:
    """A block's controls as the scheduler reads them, once, from the ``otel``
    annotation of a graph's tasks or of a :data:`BLOCK_EXIT` event, with one
    precedence: the caller and ``sampled`` are the root block's (:func:`_of_root`)"""

    #: Dask span ids and tags, root first (Dask's ``span`` annotation; tags: of an exit)
    ids: tuple[str, ...]
    tags: tuple[Any, ...]
    #: When the client entered its blocks and the enclosing ones (numbers only), by id
    entered: Mapping[str, float]
    #: Of a graph, its client if it announces the blocks' exits; of an exit, its sender
    client: str | None
    #: The root block's: the caller's carrier and ``dask_otel.span(sampled=...)``
    carrier: Mapping[str, str] | None
    sampled: bool | None
    #: Opened with ``workflow=True`` (that block only)
    workflow: bool
    #: Its innermost block's labels, over the enclosing ones' (the valid ones)
    labels: Mapping[str, Any]
    #: Of an exit: the last ``own`` ids are the spans the block opened, left at
    #: ``exited`` (client time)
    own: int = 0
    exited: float = 0.0
    #: The root block's ``keep=`` (valid keys only; None: none)
    keep: Mapping[str, Any] | None = None
    #: Of an exit: its block sent graphs here (its Dask spans will come)
    graphs: bool = False

    @property
    def caller(self) -> SpanContext | None:
        """The caller's span its root continues (None: none)"""
        return remote_parent(self.carrier)

    def names_workflow(self, span_id: str) -> bool:
        """Whether it opened root ``span_id`` with ``workflow=True``"""
        return self.workflow and self.ids[0] == span_id


def read_block(otel: Any, ids: Any, client: str | None = None, tags: Any = (), own: int = 0,
               exited: float = 0.0, graphs: bool = False) -> Block | None:
    """The :class:`Block` of Dask span ``ids`` that ``otel`` annotates (None: none,
    or another shape; one without ``entered``, as none entered)"""
    if not isinstance(otel, Mapping) or not ids:
        return None
    if not isinstance(entered := otel.get("entered"), Mapping):
        entered = {}
    return Block(tuple(ids), tuple(tags),
                 {i: t for i, t in entered.items() if isinstance(t, (int, float))},
                 client if own or otel.get("exits") is True else None,
                 root_carrier(otel, ids[0]), forced_sampling(otel, ids[0]),
                 otel.get("workflow") is True, labels(otel), own, exited,
                 keep_rules(otel, ids[0]), graphs)


def otel_of(annotations: Mapping[str, Any] | None) -> Any:
    """A task's ``otel`` annotation as it came (None: none), from its
    ``TaskState.annotations``; read it with the functions below"""
    return annotations.get(ANNOTATION) if annotations else None


def write_annotation(outer: Mapping[str, Any], new_ids: Sequence[str], entered_at: float,
                     caller: otel_context.Context, *, sampled: bool | None = None,
                     tasks: Mapping[str, Any] | None = None, workflow: bool = False,
                     attributes: Mapping[str, Any] | None = None,
                     keep: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``otel`` annotation of a block that opened Dask spans ``new_ids`` at
    ``entered_at``: the enclosing block's (in ``outer``, the annotations around
    it) extended, with a carrier if it is a root block under a valid current span
    in ``caller``, and the block's own controls (validated by the caller)"""
    inherited = outer.get(ANNOTATION) or {}
    entered = {**inherited.get("entered", {}), **dict.fromkeys(new_ids, entered_at)}
    annotation: dict[str, Any] = {"v": VERSION, "entered": entered, "exits": True}
    if (forced := inherited.get("sampled", sampled)) is not None:
        annotation["sampled"] = forced
    if tasks or inherited.get("tasks"):
        annotation["tasks"] = {**inherited.get("tasks", {}), **(tasks or {})}
    if workflow:
        annotation["workflow"] = True
    if (kept := inherited.get("keep", keep)) is not None:
        annotation["keep"] = kept
    if attributes or inherited.get("attributes"):
        annotation["attributes"] = {**inherited.get("attributes", {}), **(attributes or {})}
    if "span" in outer:
        if "carrier" in inherited:
            annotation["carrier"] = inherited["carrier"]
    elif trace.get_current_span(caller).get_span_context().is_valid:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=caller)
        if carrier:
            annotation["carrier"] = carrier
    return annotation


def _of_root(otel: Any, root_id: str) -> Mapping[str, Any]:
    """``otel`` if the block that opened root Dask span ``root_id`` wrote it (the
    root is among its ``entered``), else empty: the rule every process applies to
    the carrier and ``sampled``, so that they agree on every task's trace"""
    entered = otel.get("entered") if isinstance(otel, Mapping) else None
    return otel if isinstance(entered, Mapping) and root_id in entered else {}


def root_carrier(otel: Any, root_id: str) -> Mapping[str, str] | None:
    """The caller's carrier in a task's ``otel`` annotation, by :func:`_of_root`"""
    carrier = _of_root(otel, root_id).get("carrier")
    return carrier if isinstance(carrier, Mapping) else None


def forced_sampling(otel: Any, root_id: str) -> bool | None:
    """Whether the client forced the trace of root Dask span ``root_id`` kept
    (True) or dropped (False), by :func:`_of_root`; None: the sampler decides"""
    sampled = _of_root(otel, root_id).get("sampled")
    return sampled if isinstance(sampled, bool) else None


def keep_rules(otel: Any, root_id: str) -> dict[str, Any] | None:
    """The root block's ``keep=``, its valid keys, by :func:`_of_root` (None: none)"""
    keep = _of_root(otel, root_id).get("keep")
    return parse_task_rules(keep, strict=False, table=KEEP_RULES) if isinstance(
        keep, Mapping) else None


def task_rules(otel: Any) -> dict[str, Any] | None:
    """The ``otel.tasks.*`` values a task's block set for it (``tasks``), the
    valid ones (:func:`dask_otel.config.parse_task_rules`, the validator the
    client ran); None if it set none"""
    given = otel.get("tasks") if isinstance(otel, Mapping) else None
    return (parse_task_rules(given, strict=False) or None) if given else None


def labels(otel: Any) -> dict[str, Any]:
    """The valid labels in a task's ``otel`` annotation (:func:`dask_otel.config.parse_labels`)"""
    return parse_labels(otel.get("attributes") if isinstance(otel, Mapping) else None, strict=False)


def entered_at(otel: Any, span_id: str) -> float:
    """When the client entered the block of Dask span ``span_id``, by the
    annotation; 0 if it does not say (or says it in another shape)"""
    entered = otel.get("entered") if isinstance(otel, Mapping) else None
    t = entered.get(span_id) if isinstance(entered, Mapping) else None
    return t if isinstance(t, (int, float)) else 0.0


def block_exit(span_annotation: Mapping[str, Any], own: int, otel: Mapping[str, Any],
               exited: float) -> dict[str, Any]:
    """The :data:`BLOCK_EXIT` event of a block that opened the last ``own`` Dask
    spans of ``span_annotation`` and left at ``exited`` (its sender adds ``client``)"""
    span = {"name": list(span_annotation["name"]), "ids": list(span_annotation["ids"])}
    return {"span": span, "own": own, "otel": otel, "exited": exited}


def read_block_exit(msg: Any) -> Block | None:
    """The :class:`Block` of a :data:`BLOCK_EXIT` event, or None for one of another
    shape (never trusted: any client may log on the topic)"""
    if not isinstance(msg, Mapping):
        return None
    own, exited, otel, sender = (msg.get(k) for k in ("own", "exited", "otel", "client"))
    if not ((names := read_span(msg.get("span"))) and isinstance(own, int)
            and 0 < own <= len(names[0]) and isinstance(exited, (int, float))
            and isinstance(otel, Mapping) and isinstance(otel.get("entered"), Mapping)):
        return None
    return read_block(otel, names[0], sender if isinstance(sender, str) else None,
                      names[1], own, float(exited), msg.get("graphs") is True)


def read_span(span: Any) -> tuple[list[str], list[Any]] | None:
    """``(ids, tags)``, root first, of Dask's ``span`` annotation as a client sent it
    (in a :data:`BLOCK_EXIT` event, or a graph's), or None for one of another shape"""
    ids, tags = (span.get("ids"), span.get("name")) if isinstance(span, Mapping) else (0, 0)
    if not (isinstance(ids, (list, tuple)) and isinstance(tags, (list, tuple))
            and 0 < len(ids) == len(tags) and all(isinstance(i, str) for i in ids)):
        return None
    return list(ids), list(tags)


def extract_caller(carrier: Mapping[str, Any] | None
                   ) -> tuple[otel_context.Context | None, SpanContext | None]:
    """The caller's context (with its baggage) and span context (None: it holds
    none) from a carrier, as the globally configured propagators read it"""
    if not carrier:
        return None, None
    carrier = {k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)}
    context = propagate.extract(carrier)
    parent = trace.get_current_span(context).get_span_context()
    return context, parent if parent.is_valid else None


def remote_parent(carrier: Mapping[str, Any] | None) -> SpanContext | None:
    """The caller's span context in a carrier, or None"""
    return extract_caller(carrier)[1]

