"""Span links across workflows (dask_otel.links): a workflow that consumes what
another workflow produced links to the producer's span."""

from __future__ import annotations

from distributed import span, wait

from tests.support.cluster import otel_cluster
from tests.support.tasks import inc, total


def test_a_workflow_reusing_another_workflows_data_links_to_it():
    with otel_cluster() as (client, mirrored):
        with span("load") as producer_id:
            parts = client.map(inc, range(4), key=[f"loaded-{i}" for i in range(4)])
            wait(parts)
        producer = mirrored.by_dask_id(producer_id)
        with span("report") as consumer_id:
            assert client.submit(total, parts, key="report-0").result() == 10
        consumer = mirrored.by_dask_id(consumer_id)
    (link,) = consumer.links
    assert link.context.trace_id == producer.context.trace_id
    assert link.context.span_id == producer.context.span_id
    assert link.attributes["dask.span.id"] == producer_id
    assert link.attributes["dask.span.name"] == ("load",)
    assert not producer.links


def test_producers_in_the_same_trace_are_not_linked():
    with otel_cluster() as (client, mirrored):
        with span("workflow") as root_id:
            with span("load"):
                parts = client.map(inc, range(4), key=[f"loaded-{i}" for i in range(4)])
            with span("sum") as consumer_id:
                assert client.submit(total, parts, key="summed-0").result() == 10
        mirrored.by_dask_id(root_id)
        assert not mirrored.by_dask_id(consumer_id).links


#: docs/traces.md, "Links": at most 16 per Dask span (the number written there, not
#: the code's constant, which a change would move with it)
MAX_LINKS = 16


def test_links_per_span_are_bounded():
    with otel_cluster() as (client, mirrored):
        producers = []
        for i in range(MAX_LINKS + 4):
            with span(f"load {i}"):
                producers.append(client.submit(inc, i, key=f"part{i}-0"))
        wait(producers)
        with span("report") as consumer_id:
            assert client.submit(total, producers, key="report-0").result() == sum(
                range(1, MAX_LINKS + 5)
            )
        consumer = mirrored.by_dask_id(consumer_id)
    assert len(consumer.links) == MAX_LINKS
    assert len({link.context.span_id for link in consumer.links}) == MAX_LINKS


def test_a_workflow_reusing_a_persisted_collection_links_to_the_one_that_made_it():
    import dask.bag as db

    with otel_cluster(processes=True) as (client, mirrored):
        with span("make dataset") as producer_id:
            dataset = db.from_sequence(range(8), npartitions=4).map(inc).persist()
            wait(dataset)
        producer = mirrored.by_dask_id(producer_id)
        with span("nightly report") as consumer_id:
            assert dataset.sum().compute() == sum(range(1, 9))
        consumer = mirrored.by_dask_id(consumer_id)
    assert [(link.context.trace_id, link.context.span_id) for link in consumer.links] == [
        (producer.context.trace_id, producer.context.span_id)
    ]
