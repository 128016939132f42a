"""Where a mirrored span meets the SDK (dask_otel.export.sink): the SDK's span
limits applied to the mirror's attributes. End to end: the limit tests of
tests/test_spans.py."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("value", [
    1, 1.5, True, "x" * 8, "x" * 9, (), ("a", "b"), (1, 2), (1.0,), (True, False),
    ("a", 1), (1, 1.5), ("x" * 9,), [1], None, (None,), b"x", {"a": 1}, 2**70,
    type("S", (str,), {})("s"),
])
def test_attributes_skip_the_sdks_checks_only_when_they_would_change_nothing(value):
    """SpanSink.bounded hands the mirror's dict on as it is only if the SDK's
    BoundedAttributes would keep every value unchanged (limit 8 characters)"""
    from opentelemetry.attributes import BoundedAttributes

    from dask_otel.export.sink import within_limits

    if within_limits([value], 8):
        checked = BoundedAttributes(16, {"a": value}, immutable=True, max_value_len=8)
        assert dict(checked) == {"a": value} and checked.dropped == 0
