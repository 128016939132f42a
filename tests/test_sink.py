"""Where a mirrored span meets the SDK (dask_otel.export.sink): the SDK's span
limits applied to the mirror's attributes. End to end: the limit tests of
tests/test_spans.py."""

from __future__ import annotations

import pytest

#: Attribute values, and whether ``SpanSink.bounded`` hands them on as they are
#: (the fast path) at a length limit of 8: only exact OTel types within the limit.
#: Some the SDK would keep unchanged take the slow path all the same (a subclass
#: of str might be anything; mixed-type tuples): that costs time, never a value.
VALUES = [
    (1, True), (1.5, True), (True, True), ("x" * 8, True), ((), True), (("a", "b"), True),
    ((1, 2), True), ((1.0,), True), ((True, False), True), (2**70, True),
    ("x" * 9, False), (("a", 1), False), ((1, 1.5), False), (("x" * 9,), False),
    ([1], False), (None, False), ((None,), False), (b"x", False), ({"a": 1}, False),
    (type("S", (str,), {})("s"), False),
]


@pytest.fixture
def sink():
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider

    from dask_otel.export.sink import SpanSink

    limits = SpanLimits(max_span_attributes=16, max_span_attribute_length=8)
    return SpanSink(TracerProvider(shutdown_on_exit=False), [], limits)


@pytest.mark.parametrize(("value", "as_is"), VALUES)
def test_attributes_skip_the_sdks_checks_only_when_they_would_change_nothing(sink, value, as_is):
    """SpanSink.bounded hands the mirror's dict on as it is if every value is of an
    exact OTel type within the limits, which the SDK's BoundedAttributes would keep
    unchanged; any other dict goes through BoundedAttributes, as the SDK's own
    spans do, with the same result"""
    from opentelemetry.attributes import BoundedAttributes

    attributes = {"a": value}
    out = sink.bounded(attributes)
    sdk = BoundedAttributes(16, {"a": value}, immutable=True, max_value_len=8)
    if as_is:
        assert out is attributes  # the fast path: no copy, no check
        assert dict(sdk) == attributes and sdk.dropped == 0
    else:
        assert isinstance(out, BoundedAttributes)  # the slow path: the SDK's checks
        assert dict(out) == dict(sdk) and out.dropped == sdk.dropped


def test_more_attributes_than_the_count_limit_take_the_sdks_path(sink):
    attributes = {f"a{i}": i for i in range(17)}
    out = sink.bounded(attributes)
    assert out is not attributes and len(out) == 16 and out.dropped == 1
