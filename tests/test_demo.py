"""The README's main job: ``dask-otel demo``, as a newcomer runs it"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.otlp_receiver import OTLPReceiver

TREE = [
    "Alice's workflow",
    "  data load",
    "    taskgroup/load_partition",
    "  train",
    "    evaluate",
    "      taskgroup/evaluate",
    "    taskgroup/fit",
]


def run_demo(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "dask_otel", "demo", *args],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def tree_of(stdout: str) -> tuple[str, list[str]]:
    trace_id = re.search(r"^trace ([0-9a-f]{32})$", stdout, re.M).group(1)
    lines = stdout.split(f"trace {trace_id}\n", 1)[1].splitlines()
    names = [re.match(r"^( *\S.*?)\s+[\d.]+ ms \|", line).group(1) for line in lines if " ms |" in line]
    return trace_id, names


def children_by_parent(names: list[str]) -> dict[str, list[str]]:
    """``{parent line: sorted child lines}`` of an indented tree: siblings are
    printed by start time, and a sub-span and a TaskGroup that start in the same
    millisecond (``evaluate`` and ``fit`` under ``train``) may come either way"""
    out: dict[str, list[str]] = {}
    path: list[str] = []
    for name in names:
        depth = (len(name) - len(name.lstrip())) // 2
        del path[depth:]
        out.setdefault(path[-1] if path else "", []).append(name.strip())
        path.append(name.strip())
    return {parent: sorted(children) for parent, children in out.items()}


def test_demo_prints_the_workflow_as_a_waterfall():
    stdout = run_demo()
    trace_id, names = tree_of(stdout)
    assert children_by_parent(names) == children_by_parent(TREE)
    assert f"-> OTel trace id {trace_id}" in stdout
    # Each span's task count covers its subtree, each task once
    # (each line of the tree is unique by its indentation)
    tasks = dict(zip(names, (int(n) for n in re.findall(r"tasks=(\d+)", stdout))))
    root, load, partitions, train, evaluate, evaluate_group, fit = (tasks[n] for n in TREE)
    assert root == load + train and load == partitions
    assert train == evaluate + fit and evaluate == evaluate_group == 1


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_demo_sends_the_same_tree_to_a_collector(protocol):
    with OTLPReceiver(protocol) as receiver:
        stdout = run_demo("--endpoint", receiver.endpoint, "--protocol", protocol)
        trace_id, names = tree_of(stdout)
        spans = receiver.wait_for(
            lambda r: len(t := [s for s in r.spans() if s.trace_id == trace_id]) >= 7 and t,
            timeout=30,
        )
    assert sorted(s.name for s in spans) == sorted(n.strip() for n in names)
    root = next(s for s in spans if s.parent_span_id is None)
    assert root.name == "Alice's workflow" and root.span_id == trace_id[-16:]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_demo_sends_a_traces_only_backend_only_traces(protocol):
    """Phoenix and Jaeger take OTLP traces only: the demo sends what it shows"""
    with OTLPReceiver(protocol) as receiver:
        receiver.refuse = {"metrics", "logs"}
        out = subprocess.run(
            [sys.executable, "-m", "dask_otel", "demo", "--endpoint", receiver.endpoint,
             "--protocol", protocol],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        trace_id, names = tree_of(out.stdout)
        receiver.wait_for(lambda r: len([s for s in r.spans() if s.trace_id == trace_id]) >= 7)
    assert receiver.rejected == 0 and not receiver.metric_points()
    assert "dask_otel:" not in out.stderr, out.stderr


def test_demo_asked_for_metrics_says_the_backend_refuses_them_and_how_to_stop():
    with OTLPReceiver("http/protobuf") as receiver:
        receiver.refuse = {"metrics"}
        out = subprocess.run(
            [sys.executable, "-m", "dask_otel", "demo", "--endpoint", receiver.endpoint,
             "--protocol", "http/protobuf", "--metrics"],
            capture_output=True, text=True, timeout=120,
        )
    assert out.returncode == 0, out.stdout + out.stderr
    refused = [line for line in out.stderr.splitlines() if "does not accept metrics" in line]
    # once per process that exports metrics: the scheduler's and each worker's
    assert 1 <= len(refused) <= 3, out.stderr
    assert all("OTEL_METRICS_EXPORTER=none" in line for line in refused)
    # A refusal for good cannot be told from an outage on the SDK's public surface
    # (issue 24): it is an outage of that signal, whose one WARNING says both
    assert all("refuses them for good" in line for line in refused)
