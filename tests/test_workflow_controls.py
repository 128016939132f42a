"""Per-workflow controls from the client: ``dask_otel.span(sampled=, tasks=,
workflow=)`` (docs/traces.md, "One workflow's controls"). Real worker processes
(``LocalCluster(processes=True)``) exporting over OTLP/gRPC to the test receiver,
workers' config ``otel.tasks.spans: false``; the preload and
``dask_otel.instrument(client)`` paths; bad values raise at the call."""

from __future__ import annotations

import time

import dask
import pytest
from distributed import Client, LocalCluster, wait
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

import dask_otel
from dask_otel.annotation import read_block, task_rules
from dask_otel.worker.task_spans import key_chosen
from tests.support.cluster import UNINSTRUMENTED_CONFIG, cluster_kwargs, otel_cluster
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.tasks import fail, nap

#: Every process exports over OTLP; task spans off in the workers' config
OTLP = {
    "otel.traces.exporter": "otlp",
    "otel.tasks.spans": False,
    "otel.flush-timeout": "5s",
}


def sampled_here(_=None) -> bool:
    """A task: whether the context it runs in is sampled"""
    return trace.get_current_span().get_span_context().trace_flags.sampled


def task_span_keys(receiver: OTLPReceiver, trace_id: str | None = None) -> set[str]:
    return {
        s.attributes["dask.task.key"] for s in receiver.spans()
        if "dask.task.key" in s.attributes and (trace_id is None or s.trace_id == trace_id)
    }


@pytest.fixture
def receiver(monkeypatch):
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_BSP_SCHEDULE_DELAY": "100"})
        yield receiver


def run(client: Client, name: str, n: int = 3, **controls) -> tuple[list, list[bool]]:
    """A workflow of ``n`` tasks in a ``dask_otel.span(name, **controls)`` block"""
    with dask_otel.span(name, **controls):
        futures = client.map(sampled_here, range(n), key=[f"task_{name}-{i}" for i in range(n)])
        return futures, client.gather(futures)


def wait_settled(receiver: OTLPReceiver, names: list[str]) -> None:
    receiver.wait_for(lambda r: all(r.spans(n) for n in names), timeout=60)
    time.sleep(1.0)  # anything the workers still held has arrived


def test_a_run_with_task_spans_on_exports_them_while_its_sibling_exports_none(receiver):
    with otel_cluster(OTLP, processes=True) as (client, _):
        traced, _ = run(client, "traced", tasks={"spans": True})
        plain, _ = run(client, "plain")
        receiver.wait_for(lambda r: len(task_span_keys(r)) >= 3, timeout=60)
        wait_settled(receiver, ["traced", "plain"])
        # status() counts the spans a block asked for, otel.tasks.spans off
        workers = dask_otel.status(client)["workers"].values()
        assert sum(w["task_spans"] for w in workers) == len(traced)
    assert task_span_keys(receiver) == {str(f.key) for f in traced}
    (traced_span,) = receiver.spans("traced")
    assert task_span_keys(receiver, traced_span.trace_id) == {str(f.key) for f in traced}
    assert plain  # its tasks ran, and exported no span


@pytest.mark.parametrize(
    ("sampler", "sampled"), [("always_off", True), ("always_on", False)],
    ids=["sampled=True under always_off", "sampled=False under always_on"],
)
def test_sampled_overrides_the_sampler_for_the_whole_trace(receiver, monkeypatch, sampler, sampled):
    """The forced run and a sibling the sampler decides, both asking for task spans:
    only the kept one exports anything, its Dask span and its task spans"""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    with otel_cluster(OTLP, processes=True) as (client, _):
        with dask_otel.span("forced", sampled=sampled, tasks={"spans": True}):
            in_block = trace.get_current_span().get_span_context().trace_flags.sampled
            forced, in_forced = run(client, "forced_run")
        sibling, in_sibling = run(client, "sibling", tasks={"spans": True})
        kept = forced if sampled else sibling
        receiver.wait_for(lambda r: len(task_span_keys(r)) >= 3, timeout=60)
        wait_settled(receiver, ["forced" if sampled else "sibling"])
    assert in_block is sampled
    assert set(in_forced) == {sampled} and set(in_sibling) == {not sampled}
    assert bool(receiver.spans("forced")) is sampled
    assert bool(receiver.spans("sibling")) is not sampled
    assert task_span_keys(receiver) == {str(f.key) for f in kept}


def flags_here(_=None) -> int:
    """A task: the trace flags of the context it runs in"""
    return int(trace.get_current_span().get_span_context().trace_flags)


def test_sampled_false_drops_a_run_inside_a_sampled_callers_trace(receiver):
    """A caller's span sampled and random (flags 03); in it a block with
    ``sampled=False`` and a sibling without: the dropped run's block, tasks and
    Dask spans say 02 (the caller's random flag, not sampled) and export nothing,
    task spans asked for included; the sibling, in the same trace, is kept"""
    caller = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True, TraceFlags(0x03))
    with otel_cluster(OTLP, processes=True) as (client, _), trace.use_span(NonRecordingSpan(caller)):
        with dask_otel.span("dropped", sampled=False, tasks={"spans": True}):
            in_block = flags_here()
            dropped = client.map(flags_here, range(3), key=[f"flags_dropped-{i}" for i in range(3)])
            in_dropped = client.gather(dropped)
        with dask_otel.span("kept", tasks={"spans": True}):
            kept = client.map(flags_here, range(3), key=[f"flags_kept-{i}" for i in range(3)])
            in_kept = client.gather(kept)
        receiver.wait_for(lambda r: len(task_span_keys(r)) >= 3, timeout=60)
        wait_settled(receiver, ["kept"])
    assert in_block == 0x02 and set(in_dropped) == {0x02} and set(in_kept) == {0x03}
    assert receiver.spans("dropped") == []
    assert {s.trace_id for s in receiver.spans()} == {f"{caller.trace_id:032x}"}
    assert task_span_keys(receiver) == {str(f.key) for f in kept}


# A block's otel.tasks.* values, each read on worker processes whose own value
# differs: the workers' own are spans false, sample-ratio 1, slower-than none,
# erred false
OWN_RULES = {**OTLP, "otel.tasks.erred": False}


def test_a_blocks_sample_ratio_is_read_on_the_workers(receiver):
    """``sample-ratio: 0.2`` over 200 keys: exactly the keys the hash chooses at
    0.2 (about 40), where the workers' own ratio 1 would export all 200"""
    with otel_cluster(OWN_RULES, processes=True) as (client, _):
        futures, _ = run(client, "fifth", n=200, tasks={"spans": True, "sample-ratio": 0.2})
        chosen = {str(f.key) for f in futures if key_chosen(f.key, 0.2)}
        receiver.wait_for(lambda r: len(task_span_keys(r)) >= len(chosen), timeout=60)
        wait_settled(receiver, ["fifth"])
    assert 20 <= len(chosen) <= 60, len(chosen)
    assert task_span_keys(receiver) == chosen


def test_a_blocks_slower_than_is_read_on_the_workers(receiver):
    """``slower-than: 1s`` (ratio 0): the 1.2-s task, not the 10-ms one, where
    the workers' own rules export neither"""
    rules = {"spans": True, "sample-ratio": 0, "slower-than": "1s"}
    with otel_cluster(OWN_RULES, processes=True) as (client, _):
        with dask_otel.span("naps", tasks=rules):
            wait([client.submit(nap, 0.01, key="nap-fast"), client.submit(nap, 1.2, key="nap-slow")])
        receiver.wait_for(lambda r: task_span_keys(r), timeout=60)
        wait_settled(receiver, ["naps"])
    assert task_span_keys(receiver) == {"nap-slow"}


def test_a_blocks_erred_rule_is_read_on_the_workers(receiver):
    """``erred: true`` (ratio 0): the erred task, not its sibling, where the
    workers' own ``erred: false`` exports neither"""
    rules = {"spans": True, "sample-ratio": 0, "erred": True}
    with otel_cluster(OWN_RULES, processes=True) as (client, _):
        with dask_otel.span("doomed", tasks=rules):
            wait([client.submit(nap, 0, key="nap-ok"), client.submit(fail, 7, key="fail-7")])
        receiver.wait_for(lambda r: task_span_keys(r), timeout=60)
        wait_settled(receiver, ["doomed"])
    assert task_span_keys(receiver) == {"fail-7"}


def test_nested_blocks_inherit_the_task_rules_and_override_them(receiver):
    with otel_cluster(OTLP, processes=True) as (client, _):
        with dask_otel.span("outer", tasks={"spans": True, "erred": False}):
            inherited, _ = run(client, "inherits", tasks={"erred": True})
            overridden, _ = run(client, "overrides", tasks={"spans": False})
        receiver.wait_for(lambda r: len(task_span_keys(r)) >= 3, timeout=60)
        wait_settled(receiver, ["outer"])
    assert task_span_keys(receiver) == {str(f.key) for f in inherited}
    assert overridden


def test_instrument_client_honours_the_task_rules():
    """The same controls when the bridge is turned on by ``instrument(client)``"""
    config = {**UNINSTRUMENTED_CONFIG, "otel.tasks.spans": False}
    with dask.config.set(config):
        with LocalCluster(**cluster_kwargs()) as cluster, Client(cluster) as client:
            dask_otel.instrument(client)
            traced, _ = run(client, "traced", tasks={"spans": True})
            run(client, "plain")
            (exporter,) = cluster.scheduler.plugins["dask-otel"].telemetry.span_exporters

            def task_spans():
                return [
                    s for s in exporter.get_finished_spans() if "dask.task.key" in s.attributes
                ]

            deadline = time.monotonic() + 20
            while len(task_spans()) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            keys = {s.attributes["dask.task.key"] for s in task_spans()}
    assert keys == {str(f.key) for f in traced}


def test_the_controls_travel_in_the_versioned_annotation():
    with dask_otel.span("nightly", workflow=True, tasks={"slower-than": "500ms"}):
        root = dask.get_annotations()["otel"]
        with dask_otel.span("stage", tasks={"sample-ratio": 0.1}):
            nested = dask.get_annotations()["otel"]
    assert root["v"] == nested["v"] == 2
    ids = list(root["entered"])
    assert read_block(root, ids).workflow and not read_block(nested, ids).workflow
    assert task_rules(root) == {"slower-than": 0.5}
    assert task_rules(nested) == {"slower-than": 0.5, "sample-ratio": 0.1}
    # what clients before version 2 wrote reads as no controls
    assert task_rules({"entered": {}, "exits": True}) is None
    assert not read_block({"entered": {}, "exits": True}, ["x"]).workflow
    # and a hand-made annotation with values of the wrong type, as none
    assert task_rules({"tasks": {"spans": "yes", "sample-ratio": 7}}) is None


@pytest.mark.parametrize(
    ("controls", "error", "named", "value"),
    [
        ({"sampled": "yes"}, TypeError, "sampled", "'yes'"),
        ({"tasks": ["spans"]}, TypeError, "tasks", "['spans']"),
        ({"tasks": {"spans": "maybe"}}, ValueError, "tasks['spans']", "'maybe'"),
        ({"tasks": {"slower-than": "soon"}}, ValueError, "tasks['slower-than']", "'soon'"),
        ({"tasks": {"sample-ratio": 1.5}}, ValueError, "tasks['sample-ratio']", "1.5"),
        ({"tasks": {"spanz": True}}, ValueError, "tasks", "'spanz'"),
        ({"workflow": "nightly"}, TypeError, "workflow", "'nightly'"),
    ],
)
def test_a_bad_value_raises_at_the_call_naming_the_argument(controls, error, named, value):
    with pytest.raises(error) as raised:
        with dask_otel.span("bad", **controls):
            pass
    message = str(raised.value)
    assert message.startswith(f"{named}:") and value in message


def test_a_nested_block_cannot_name_a_workflow_or_change_the_sampling():
    with dask_otel.span("root", sampled=True):
        with pytest.raises(ValueError, match="workflow"):
            with dask_otel.span("nested", workflow=True):
                pass
        with pytest.raises(ValueError, match="sampled"):
            with dask_otel.span("nested", sampled=False):
                pass
        with dask_otel.span("nested", sampled=True):  # repeating it is fine
            assert dask.get_annotations()["otel"]["sampled"] is True


def test_a_block_inside_a_plain_distributed_span_is_nested_too():
    """A ``distributed.span`` root says nothing of sampling or workflows: a
    ``dask_otel.span`` block inside it is nested all the same"""
    from distributed import span as dask_span

    with dask_span("plain root"):
        assert "otel" not in dask.get_annotations()
        with pytest.raises(ValueError, match="workflow=True: only a root block"):
            with dask_otel.span("nested", workflow=True):
                pass
        for sampled in (False, True):
            with pytest.raises(ValueError, match=f"sampled={sampled}: a nested block"):
                with dask_otel.span("nested", sampled=sampled):
                    pass
        with dask_otel.span("nested", workflow=False, sampled=None):  # nothing asked: fine
            assert "sampled" not in dask.get_annotations()["otel"]
