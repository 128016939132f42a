"""The telemetry registry in model/ (OpenTelemetry Weaver's format) and Weaver's default
rules, in Python: :func:`check_registry` runs the rules of ``weaver registry check``
with the opentelemetry-weaver-packages ``naming_conventions`` and ``stability`` policies
and semantic-conventions' ``brief.rego``; :func:`check_emitted` runs those of ``weaver
registry live-check`` (``defaults/policies/live_check_advice/otel.rego`` and its
type, instrument and unit advisors) on a capture (:mod:`tests.support.capture`).
Each finding is ``"<rule id>: <what>"``. Attributes outside model/ resolve in the
dependency, OpenTelemetry's semantic conventions, as the installed
``opentelemetry-semantic-conventions`` spells them (stable: ``opentelemetry.semconv.attributes``;
development: ``._incubating``)."""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

MODEL = Path(__file__).resolve().parents[2] / "model"

#: Weaver's name rule (names.rego, live_check_advice/otel.rego)
NAME = re.compile(r"^[a-z][a-z0-9]*([._][a-z0-9]+)*$")
#: An attribute's namespace (names.rego)
HAS_NAMESPACE = re.compile(r"^[a-z0-9_]+\.([a-z0-9._]+)+$")
STABILITY_RANK = {"development": 1, "experimental": 1, "alpha": 2, "beta": 3,
                  "release_candidate": 4, "stable": 5}
INSTRUMENTS = {"counter", "updowncounter", "gauge", "histogram"}
#: UCUM units used by semantic conventions; ``{...}`` annotations are also UCUM
UCUM = {"1", "%", "s", "ms", "us", "ns", "min", "h", "d", "By", "KiBy", "MiBy", "GiBy",
        "bit", "Hz", "Cel", "W", "J", "A", "V", "m", "By/s", "bit/s", "1/s"}
ANNOTATION = re.compile(r"^\{[a-z][a-z0-9_.]*\}$")
#: Unit words that belong in ``unit``, not in a metric's name (semantic conventions)
UNIT_WORDS = {"seconds", "second", "milliseconds", "bytes", "byte", "percent", "total"}
#: OTLP data kind of each instrument: (kind, monotonic)
OTLP_KIND = {"counter": ("sum", True), "updowncounter": ("sum", False),
             "gauge": ("gauge", None), "histogram": ("histogram", None)}
#: Prometheus' unit suffixes (opentelemetry-exporter-prometheus, the collector)
PROM_UNIT = {"s": "_seconds", "By": "_bytes", "1": "_ratio", "ms": "_milliseconds"}


@dataclass
class Registry:
    manifest: dict[str, Any]
    #: key -> definition (``id``, ``type``, ``stability``, ``brief``, ...)
    attributes: dict[str, dict] = field(default_factory=dict)
    metrics: dict[str, dict] = field(default_factory=dict)
    events: dict[str, dict] = field(default_factory=dict)
    spans: dict[str, dict] = field(default_factory=dict)
    groups: list[dict] = field(default_factory=list)

    @property
    def templates(self) -> set[str]:
        return {k for k, a in self.attributes.items() if is_template(a)}

    def attribute(self, key: str) -> dict | None:
        """The definition ``key`` resolves to: its own, a template's (the longest prefix),
        or the semantic conventions' (``{"stability": ..., "semconv": True}``)"""
        if key in self.attributes:
            return self.attributes[key]
        for template in sorted(self.templates, key=len, reverse=True):
            if key.startswith(template + "."):
                return self.attributes[template]
        stability = semconv_attributes().get(key)
        return None if stability is None else {"id": key, "stability": stability,
                                                "semconv": True, "type": None}


def is_template(attribute: dict) -> bool:
    return str(attribute.get("type")).startswith("template[")


def load(model: Path = MODEL) -> Registry:
    registry = Registry(manifest=yaml.safe_load((model / "manifest.yaml").read_text()))
    for path in sorted(model.glob("*.yaml")):
        if path.name == "manifest.yaml":
            continue
        for group in yaml.safe_load(path.read_text())["groups"]:
            registry.groups.append(group)
            for attribute in group.get("attributes", ()):
                if "id" in attribute:
                    registry.attributes[attribute["id"]] = attribute
            if group["type"] == "metric":
                registry.metrics[group["metric_name"]] = group
            elif group["type"] == "event":
                registry.events[group["name"]] = group
            elif group["type"] == "span":
                registry.spans[group["id"]] = group
    return registry


@cache
def semconv_attributes() -> dict[str, str]:
    """Attribute key -> stability, of the installed semantic conventions"""
    out: dict[str, str] = {}
    for package, stability in (("opentelemetry.semconv._incubating.attributes", "development"),
                               ("opentelemetry.semconv.attributes", "stable")):
        root = importlib.import_module(package)
        for info in pkgutil.iter_modules(root.__path__):
            module = importlib.import_module(f"{package}.{info.name}")
            for name, value in vars(module).items():
                if name.isupper() and isinstance(value, str) and "." in value:
                    out[value] = stability
    return out


#: Events of the semantic conventions the bridge emits (the exception span event)
SEMCONV_EVENTS = {"exception"}


def _refs(group: dict) -> list[dict]:
    return [a for a in group.get("attributes", ()) if "ref" in a or "id" in a]


def _key(attribute: dict) -> str:
    return attribute.get("ref") or attribute["id"]


def _is_opt_in(level: Any) -> bool:
    return level == "opt_in" or (isinstance(level, dict) and "opt_in" in level)


def prometheus_name(metric: dict) -> str:
    """The Prometheus name of ``metric`` (the collector's and
    opentelemetry-exporter-prometheus' translation)"""
    name = re.sub(r"[^a-zA-Z0-9_]", "_", metric["metric_name"])
    suffix = PROM_UNIT.get(metric["unit"], "")
    if suffix and not name.endswith(suffix):
        name += suffix
    return name + ("_total" if metric["instrument"] == "counter" else "")


def check_registry(registry: Registry) -> list[str]:
    """Weaver's registry rules; [] when clean"""
    found: list[str] = []
    attributes = registry.attributes
    # names.rego: formats, namespaces
    for key, a in attributes.items():
        if not NAME.match(key):
            found.append(f"naming_convention_attribute_name: {key!r}")
        if not a.get("deprecated") and not HAS_NAMESPACE.match(key):
            found.append(f"naming_convention_attr_has_namespace: {key!r}")
        members = a["type"].get("members", ()) if isinstance(a["type"], dict) else ()
        ids = [m["id"] for m in members]
        values = [m["value"] for m in members]
        for member in ids:
            if not NAME.match(member):
                found.append(f"naming_convention_enum_id: {key!r} member {member!r}")
        if len(set(ids)) < len(ids) or len(set(values)) < len(values):
            found.append(f"naming_convention_enum_member_collision: {key!r}")
    for name in [*registry.metrics, *registry.events]:
        if not NAME.match(name):
            found.append(f"naming_convention_signal_name: {name!r}")
    # attribute_name_collisions.rego, constant_name_collisions.rego, metrics_collisions.rego
    for kind, names in (("attribute", attributes), ("metric", registry.metrics),
                        ("event", registry.events)):
        constants: dict[str, str] = {}
        for name in names:
            other = constants.setdefault(name.replace(".", "_"), name)
            if other != name:
                found.append(f"naming_convention_{kind}_constant_collision: {other!r} {name!r}")
    for kind, names in (("attribute", attributes), ("metric", registry.metrics)):
        for name, definition in names.items():
            exceptions = (definition.get("annotations") or {}).get(
                "naming_conventions", {}).get("policy_exceptions", ())
            if definition.get("deprecated") or f"{kind}_namespace_collision" in exceptions:
                continue
            for other in names:
                if other.startswith(name + "."):
                    found.append(f"naming_convention_{kind}_namespace_collision: "
                                 f"{name!r} is a namespace of {other!r}")
    # brief.rego; metric_brief_format.rego
    for key, a in attributes.items():
        if not str(a.get("brief") or "").strip():
            found.append(f"brief_required: attribute {key!r}")
    for group in registry.groups:
        if group["type"] != "attribute_group" and not str(group.get("brief") or "").strip():
            found.append(f"brief_required: {group['id']}")
    for name, metric in registry.metrics.items():
        if not str(metric.get("brief") or "").strip().endswith("."):
            found.append(f"naming_convention_metric_brief_period: {name!r}")
    # every reference resolves (weaver's resolution); stability.rego; attribute_types.rego
    for group in registry.groups:
        rank = STABILITY_RANK.get(group.get("stability"), 0)
        for ref in _refs(group):
            key = _key(ref)
            a = registry.attribute(key)
            if a is None or ("ref" in ref and key not in attributes
                             and not a.get("semconv")):
                found.append(f"unresolved_attribute_ref: {group['id']} -> {key!r}")
                continue
            if (rank > STABILITY_RANK.get(a.get("stability"), 0)
                    and not _is_opt_in(ref.get("requirement_level"))):
                found.append(f"stability_signal_higher_than_attribute: {group['id']} {key!r}")
            if group["type"] == "metric" and str(a.get("type")) in ("any", "template[any]"):
                found.append(f"naming_convention_attribute_complex_type_violation: "
                             f"{group['id']} {key!r}")
        for event in group.get("events", ()):
            if event not in registry.events and event not in SEMCONV_EVENTS:
                found.append(f"unresolved_event_ref: {group['id']} -> {event!r}")
        if group["type"] != "attribute_group" and group.get("stability") not in STABILITY_RANK:
            found.append(f"invalid_stability: {group['id']}")
    # metrics: instruments, UCUM units, the unit not in the name, durations in s,
    # Prometheus names promtool accepts and no two alike
    promnames: dict[str, str] = {}
    for name, metric in registry.metrics.items():
        unit, instrument = metric.get("unit"), metric.get("instrument")
        if instrument not in INSTRUMENTS:
            found.append(f"invalid_instrument: {name!r} {instrument!r}")
        if unit not in UCUM and not ANNOTATION.match(str(unit)):
            found.append(f"unit_not_ucum: {name!r} {unit!r}")
        if set(re.split(r"[._]", name)) & UNIT_WORDS:
            found.append(f"unit_in_name: {name!r}")
        if name.endswith(".duration") and (unit != "s" or instrument != "histogram"):
            found.append(f"duration_not_a_histogram_in_s: {name!r}")
        prom = prometheus_name(metric)
        if instrument != "histogram" and re.search(r"_(count|sum|bucket)$", prom):
            found.append(f"promtool_reserved_suffix: {name!r} is {prom!r}")
        if (other := promnames.setdefault(prom, name)) != name:
            found.append(f"prometheus_name_collision: {other!r} {name!r} are both {prom!r}")
    return found


def _type_of(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        inner = {_type_of(v) for v in value} or {"string"}
        return (inner.pop() if len(inner) == 1 else "any") + "[]"
    return {bool: "boolean", int: "int", float: "double", str: "string"}.get(type(value), "any")


def _compatible(seen: str, declared: Any) -> bool:
    """Weaver's ``PrimitiveOrArrayTypeSpec::is_compatible`` (an int is a double)"""
    if isinstance(declared, dict):  # an enum: string or int values
        return seen in ("string", "int")
    declared = str(declared)
    if declared.startswith("template["):
        declared = declared[len("template["):-1]
    return (seen == declared or "any" in (seen, declared)
            or (seen, declared) in {("int", "double"), ("int[]", "double[]")})


def check_attributes(registry: Registry, where: str, values: dict[str, set[str]],
                     allowed: set[str] | None = None) -> list[str]:
    """The live check of attribute samples (key -> the types seen): missing, format,
    namespace, type, enum value; ``allowed``: the keys the signal's group lists"""
    found = []
    for key, seen_types in sorted(values.items()):
        a = registry.attribute(key)
        if a is None:
            found.append(f"missing_attribute: {key!r} on {where}")
            continue
        if not is_template(a) and not NAME.match(key):
            found.append(f"invalid_format: {key!r} on {where}")
        if is_template(a) and not NAME.match(key):
            found.append(f"invalid_format: {key!r} on {where} (a template's instance)")
        if "." not in key:
            found.append(f"missing_namespace: {key!r} on {where}")
        parts = key.split(".")
        for i in range(1, len(parts)):
            namespace = ".".join(parts[:i])
            if namespace in values or (namespace in registry.attributes
                                       and not is_template(registry.attributes[namespace])):
                found.append(f"illegal_namespace: {namespace!r} of {key!r} on {where} "
                             "is an attribute")
        for seen in seen_types:
            if a.get("type") is not None and not _compatible(seen, a["type"]):
                found.append(f"type_mismatch: {key!r} on {where} is {seen}, "
                             f"registry says {a['type']}")
        if allowed is not None:
            owner = key if key in allowed else next(
                (t for t in allowed if key.startswith(t + ".") and t in registry.templates), None)
            if owner is None:
                found.append(f"attribute_not_on_signal: {key!r} on {where}")
    return found
