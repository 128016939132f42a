"""The otel: config namespace as applications treat dask config: reset, restored,
set partially. The bridge never depends on its defaults still being in dask config."""

from __future__ import annotations

import copy
import logging

import dask
import pytest
from distributed import span

import dask_otel
import dask_otel.export.lifecycle
from dask_otel.config import DEFAULTS, read_config
from tests.support.cluster import MEMORY_CONFIG, otel_cluster


@pytest.fixture
def config_without_otel_defaults():
    """dask config as distributed's gen_cluster or an application restores it: a
    snapshot taken before dask_otel was imported, so without the otel: defaults"""
    config = dask.config.config  # in place, as distributed.utils_test.reset_config does
    saved = copy.deepcopy(config)
    config.pop("otel", None)
    try:
        yield
    finally:
        config.clear()
        config.update(saved)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        out.update(flatten(v, key) if isinstance(v, dict) else {key: v})
    return out


def test_every_key_falls_back_to_its_shipped_default(config_without_otel_defaults):
    assert "otel" not in dask.config.config
    config = read_config()  # no KeyError
    assert config.enabled is True
    assert config.flush_timeout == 5
    assert config.poll_interval == 0.5 and config.export_delay == 2
    assert config.span_totals == "subtree" and config.export_code is False
    # every shipped key is read through the fallback
    for key, default in flatten(DEFAULTS).items():
        assert dask_otel.config.get(key) == default, key


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_cluster_started_after_a_config_reset_exports(
    config_without_otel_defaults, processes, caplog
):
    # Only some otel keys set, as a user would: the rest must come from otel.yaml
    with caplog.at_level(logging.INFO, logger="dask_otel"), otel_cluster(
        processes=processes
    ) as (client, mirrored):
        set_by_test = {f"otel.{k}" for k in flatten(dask.config.config["otel"])}
        assert set_by_test == {k for k in MEMORY_CONFIG if k.startswith("otel.")}
        with span("after a reset") as sid:
            client.submit(sum, [1, 2]).result()
        exported = mirrored.by_dask_id(sid)
        status = dask_otel.status(client)
    assert exported.name == "after a reset"
    assert status["scheduler"]["error"] is None
    assert all(w["error"] is None for w in status["workers"].values())
    assert "is off" not in caplog.text


def test_an_unexpected_startup_failure_is_described_not_a_bare_exception_text(
    monkeypatch, caplog
):

    def broken() -> None:
        raise KeyError("otel")

    monkeypatch.setattr(dask_otel.export.lifecycle, "read_config", broken)
    with caplog.at_level(logging.ERROR, logger="dask_otel"), otel_cluster() as (client, _):
        error = dask_otel.status(client)["scheduler"]["error"]
        assert client.submit(sum, [1, 2]).result() == 3  # the cluster computes on
    assert error == "could not start telemetry: KeyError: 'otel'"
    assert "could not start telemetry" in caplog.text


@pytest.mark.parametrize("text, value", [("false", False), ("True", True), (" true ", True)])
def test_true_and_false_as_text_are_booleans(text, value):
    # dask 2024.1 keeps DASK_OTEL__ENABLED=false from the environment as the text
    with dask.config.set({"otel.enabled": text, "otel.tasks.spans": text}):
        config = read_config()
    assert config.enabled is value and config.task_spans is value


SIGNALS = {"traces": "traces_exporters", "metrics": "metrics_exporters", "logs": "logs_exporters"}


def exporter_none(spelling: str, tmp_path) -> dict:
    """``otel.<signal>.exporter: none`` for the three signals, as dask reads one
    spelling of it from the environment, a YAML file or ``dask.config.set``"""
    where, text = spelling.split(":", 1)
    if where == "env":
        return dask.config.collect_env({f"DASK_OTEL__{s.upper()}__EXPORTER": text for s in SIGNALS})
    if where == "yaml":
        (tmp_path / "otel.yaml").write_text(
            "otel:\n" + "".join(f"  {s}:\n    exporter: {text}\n" for s in SIGNALS))
        return dask.config.merge(*dask.config.collect_yaml([tmp_path]))
    return {f"otel.{s}.exporter": None if text == "None" else text for s in SIGNALS}


@pytest.mark.parametrize("spelling", [
    "env:none", "env:None", "env:null", "yaml:null", "yaml:~", "yaml:none", "set:None", "set:none",
])
def test_every_spelling_of_none_means_no_exporter(spelling, tmp_path, monkeypatch):
    """Whatever the spelling, none (the outage WARNING's advice) exports nothing,
    though OTEL_*_EXPORTER names one; the shipped default follows OTEL_*_EXPORTER"""
    for signal in SIGNALS:
        monkeypatch.setenv(f"OTEL_{signal.upper()}_EXPORTER", "console")
    with dask.config.set(exporter_none(spelling, tmp_path)):
        config = read_config()
    assert [getattr(config, field) for field in SIGNALS.values()] == [(), (), ()]
    default = read_config()
    assert [getattr(default, field) for field in SIGNALS.values()] == [("console",)] * 3
