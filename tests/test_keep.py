"""``otel.traces.keep`` (issue 39): a run the sampler dropped that erred, or ran
longer than a threshold, is exported whole as a trace of its own, linked to its
caller's span. docs/traces.md, "Sampling"."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from distributed import span, wait
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

import dask_otel
from dask_otel.span_context import dask_span_context
from tests.support.cluster import otel_cluster, wait_until
from tests.support.tasks import fail, inc, slow

RATIO = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}


def _caller() -> SpanContext:
    """A caller's span the sampler would drop: its flag unset"""
    return SpanContext(random.getrandbits(128) or 1, random.getrandbits(64) or 1, is_remote=False,
                       trace_flags=TraceFlags(0))


def _runs(client, kinds: list[str], delay: float = 3.0, block=dask_otel.span
          ) -> list[tuple[str, str, SpanContext | None]]:
    """One root block per kind (each with a sub-block and one task: ``fail``,
    ``slow`` for ``delay`` or ``inc``), a ``dask_otel.span`` under a caller's span (else
    ``distributed.span``, no caller); (kind, root id, caller)"""
    runs, futures = [], []
    for i, kind in enumerate(kinds):
        caller = _caller() if block is dask_otel.span else None
        token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(caller))) if caller else None
        try:
            with block(f"run {i}") as root_id, block("step"):
                task = {"erred": fail, "slow": slow}.get(kind, inc)
                args = (i, delay) if kind == "slow" else (i,)
                futures.append(client.submit(task, *args, key=f"run{i}-{kind}-0"))
        finally:
            if token is not None:
                otel_context.detach(token)
        runs.append((kind, root_id, caller))
    wait(futures)
    return runs


def _traces(mirrored, runs) -> dict[str, list]:
    """By root Dask span id, the spans of the trace its root was exported in"""
    by_trace: dict[int, list] = {}
    for s in mirrored.spans():
        by_trace.setdefault(s.context.trace_id, []).append(s)
    roots = {s.attributes["dask.span.id"]: s.context.trace_id for s in mirrored.spans()
             if s.name.startswith("run ")}
    return {root_id: by_trace.get(roots.get(root_id), []) for _, root_id, _ in runs}


def _sampled(mirror, root_id: str, caller: SpanContext | None) -> bool:
    """Whether the sampler itself kept the run (1 %), exported as any sampled run: its
    decision on the run's trace, the caller's if it has one (the mirror forgets the
    caller of a run it exported)"""
    name = str(mirror.dask_spans[root_id].name[0])
    return dask_span_context(root_id, root_id, name, caller, mirror.sink.sampler,
                             is_remote=False).trace_flags.sampled


def _assert_whole(spans: list, caller: SpanContext | None, why: str) -> None:
    """Root, sub-span and TaskGroup span, each parent present and around its child;
    the root links to the caller, says why it was kept"""
    assert len(spans) == 3, [s.name for s in spans]
    assert "step" in [s.name for s in spans] and any(s.name.startswith("taskgroup/") for s in spans)
    assert len(spans) == 3 and len({s.context.span_id for s in spans}) == 3
    by_id = {s.context.span_id: s for s in spans}
    (root,) = [s for s in spans if s.parent is None]
    for s in spans:
        assert s.context.trace_flags.sampled
        if s is not root:
            p = by_id[s.parent.span_id]
            assert p.start_time <= s.start_time and s.end_time <= p.end_time
    assert root.attributes["dask.trace.kept"] == why
    assert [(link.context.trace_id, link.context.span_id) for link in root.links] == (
        [(caller.trace_id, caller.span_id)] if caller else [])


@pytest.mark.parametrize("n, block", [(200, span), (200, dask_otel.span)])
def test_a_ratio_sampler_keeps_every_erred_and_slow_run_whole(monkeypatch, n, block):
    """traceidratio 0.01, 200 runs (``distributed.span`` blocks, or ``dask_otel.span``
    blocks under a caller's span): the 10 that erred and the 10 slower than the
    threshold arrive whole, each a trace of its own (linked to its caller's span, if
    any); of the 180 others a binomially plausible few (1.8 expected; more than 8:
    p < 1e-4)"""
    for k, v in RATIO.items():
        monkeypatch.setenv(k, v)
    kinds = ["erred"] * (n // 20) + ["slow"] * (n // 20) + ["ok"] * (n - n // 10)
    random.Random(39).shuffle(kinds)
    config = {"otel.traces.keep.erred": True, "otel.traces.keep.slower-than": "2s"}
    with otel_cluster(config, n_workers=2, threads_per_worker=8) as (client, mirrored):
        runs = _runs(client, kinds, block=block)
        mirror = mirrored.plugin.mirror
        wait_until(lambda: mirror.mirrored + mirror.sampled_out == 3 * len(kinds)
                   and not (mirror.ledger.records or mirror.ledger.groups),
                   what="every span exported or sampled out", timeout=120)
        traces = _traces(mirrored, runs)
        for kind, root_id, caller in runs:
            if kind != "ok" and not _sampled(mirror, root_id, caller):
                _assert_whole(traces[root_id], caller, "erred" if kind == "erred" else "slow")
            elif kind != "ok":
                assert len(traces[root_id]) == 3
        others = [traces[r] for k, r, _ in runs if k == "ok" and traces[r]]
        assert len(others) <= 8 and all(len(t) == 3 for t in others)
        assert all("dask.trace.kept" not in s.attributes for t in others for s in t)
        assert len(mirrored.spans()) == mirror.mirrored == 3 * (n // 10 + len(others))
        assert mirror.sampled_out == 3 * (n - n // 10 - len(others))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("switch, config, signals", [
    ("preload", "env", "traces"), ("zero-code", "env", "all"), ("client", "file", "traces")])
def test_kept_on_process_clusters_in_every_mode(switch, config, signals, tmp_path):
    """``dask scheduler``/``dask worker`` processes, a real OTLP receiver; the bridge on by
    the preload, ``opentelemetry-instrument`` or ``instrument(client)``; the SDK configured
    by ``OTEL_*`` variables or ``OTEL_CONFIG_FILE``; ``otel.traces.keep.erred`` by its
    environment variable, task spans on (every task chosen). Every trace dropped
    (``always_off``): the erred run arrives whole, in a trace of its own, its erred task's
    span (from a worker) in it; the run that did not err, and its task span, not at all."""
    from tests.test_modes import Cell, CellProcesses, cell_cluster, cell_env

    cell = Cell(switch, config, signals)
    env = {"DASK_OTEL__TRACES__KEEP__ERRED": "true", "OTEL_TRACES_SAMPLER": "always_off",
           "DASK_OTEL__TASKS__SPANS": "true", "DASK_OTEL__TASKS__SAMPLE_RATIO": "1.0"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tests.test_modes.cell_env", lambda *a: {**cell_env(*a), **env})
        mp.setattr("tests.test_modes.config_file", _with_sampler(mp))
        with cell_cluster(cell, tmp_path) as (receiver, procs, client):
            assert isinstance(procs, CellProcesses)
            caller = _caller()
            token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(caller)))
            try:  # the runs continue a caller's trace; the kept one is a trace of its own
                with dask_otel.span("keep-fine"):
                    client.submit(inc, 1, key="keepfine-0").result()
                with dask_otel.span("keep-failed") as root_id:
                    wait(client.submit(fail, 1, key="keepfailed-0"))
            finally:
                otel_context.detach(token)
            wait_until(lambda: receiver.spans("keep-failed"), timeout=60, what="the erred run")
            time.sleep(1.0)
            (root,) = receiver.spans("keep-failed")
            assert root.attributes["dask.trace.kept"] == "erred" and root.parent_span_id is None
            assert root.trace_id == root_id.replace("-", "")
            assert [link[:2] for link in root.links] == [
                (f"{caller.trace_id:032x}", f"{caller.span_id:016x}")]
            wait_until(lambda: receiver.spans("run/keepfailed"), timeout=30,
                       what="the erred task's span, from its worker")
            assert sorted(s.name for s in receiver.spans() if s.trace_id == root.trace_id
                          and s.parent_span_id == root.span_id) == [
                "run/keepfailed", "taskgroup/keepfailed"]
            assert not receiver.spans("keep-fine") and not receiver.spans("run/keepfine")


def _with_sampler(mp):
    """``config_file`` whose tracer provider drops every trace"""
    from tests.test_modes import config_file

    def written(path, receiver, signals):
        out = config_file(path, receiver, signals)
        text = Path(out).read_text().replace("tracer_provider:\n",
                                              "tracer_provider:\n  sampler:\n    always_off:\n")
        Path(out).write_text(text)
        return out
    return written


def test_a_root_blocks_keep_decides_for_its_run(monkeypatch):
    """Every trace dropped (``always_off``), no ``otel.traces.keep`` in the config: each
    root block's ``keep=`` decides for its own run. Slower than its threshold (1 s, a
    task of 2.5 s): kept; one of a task of 0.05 s with the same threshold, or one as slow
    without ``keep=``: not; erred with ``erred``: kept, unless ``sampled=False`` forced
    the drop"""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    runs = {  # name: (keep, sampled, task, args, kept)
        "over": ({"slower-than": "1s"}, None, slow, (1, 2.5), "slow"),
        "under": ({"slower-than": "1s"}, None, slow, (1, 0.05), None),
        "unasked": (None, None, slow, (1, 2.5), None),
        "failed": ({"erred": True}, None, fail, (1,), "erred"),
        "forced": ({"erred": True}, False, fail, (1,), None),
    }
    with otel_cluster(n_workers=1, threads_per_worker=len(runs)) as (client, mirrored):
        futures = []
        for name, (keep, sampled, task, args, _) in runs.items():
            with dask_otel.span(name, keep=keep, sampled=sampled):
                futures.append(client.submit(task, *args, key=f"{name}-0"))
        wait(futures)
        mirror = mirrored.plugin.mirror
        wait_until(lambda: mirror.mirrored + mirror.sampled_out == 2 * len(runs),
                   what="every span exported or sampled out", timeout=60)
        got = {s.name: s.attributes.get("dask.trace.kept") for s in mirrored.spans()
               if not s.name.startswith("taskgroup/")}
        assert got == {name: kept for name, (*_, kept) in runs.items() if kept}
        assert len(mirrored.spans()) == 2 * len(got)


def test_a_bad_keep_raises_at_the_call_naming_it(cluster):
    with pytest.raises(ValueError, match=r"keep\['slower-than'\].*'soon'"):
        with dask_otel.span("bad", keep={"slower-than": "soon"}):
            pass
    with pytest.raises(ValueError, match="keep.*'sometimes'"):
        with dask_otel.span("bad", keep={"sometimes": True}):
            pass
    with pytest.raises(TypeError, match="keep: expected a mapping"):
        with dask_otel.span("bad", keep=True):
            pass
    with dask_otel.span("root"), pytest.raises(ValueError, match="only a root block"):
        with dask_otel.span("nested", keep={"erred": True}):
            pass
