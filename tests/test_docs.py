"""The README's tables say what the code does: they are compared with otel.yaml and
with what a real cluster emits, so that they cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from distributed import span, wait

import dask_otel.config
from conftest import otel_cluster, wait_until

README = Path(__file__).parents[1] / "README.md"


def markdown_table(text: str, marker: str) -> list[list[str]]:
    """Rows of the first table after ``<!-- marker``, cells stripped, header dropped"""
    after = text.split(f"<!-- {marker}", 1)[1].splitlines()[1:]
    rows = []
    for line in after:
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[2:]


def code(cell: str) -> str:
    return re.fullmatch(r"`([^`]*)`", cell).group(1)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_config_table_matches_otel_yaml():
    rows = markdown_table(README.read_text(), "config-table")
    documented = {code(key): code(default) for key, default, _ in rows}
    defaults = flatten(dask_otel.config.DEFAULTS)
    assert set(documented) == set(defaults)
    for key, value in defaults.items():
        assert documented[key] == yaml.safe_dump(value).splitlines()[0].removesuffix(" ..."), key


def attribute_patterns() -> list[tuple[str, re.Pattern]]:
    rows = markdown_table(README.read_text(), "span-attributes-table")
    patterns = []
    for name, *_ in rows:
        name = code(name)
        regex = re.sub(r"<[a-z]+>", "[^.]+", re.escape(name).replace(r"\<", "<").replace(r"\>", ">"))
        patterns.append((name, re.compile(regex + "$")))
    return patterns


def inc(x):
    return x + 1


def fail(x):
    raise ValueError(x)


def test_span_attribute_table_matches_what_is_emitted():
    """Every attribute emitted is in the table, and every row of the table is emitted"""
    config = {"otel.spans.code": True, "distributed.diagnostics.computations.nframes": 1}
    with otel_cluster(config) as (client, mirrored):
        with span("documented") as sid:
            client.gather(client.map(inc, range(3)))
            wait(client.map(fail, range(2)))
        mirrored.by_dask_id(sid)
        # an unfinished span, exported when the scheduler closes
        with span("cut short"):
            running = client.submit(__import__("time").sleep, 3)
            tasks = mirrored.cluster.scheduler.tasks
            wait_until(lambda: getattr(tasks.get(running.key), "state", "") == "processing")
            # what the scheduler does on close, run on its event loop
            client.run_on_scheduler(
                lambda dask_scheduler: dask_scheduler.plugins["dask-otel"].mirror.flush()
            )
            del running
        emitted = {k for s in mirrored.spans() for k in s.attributes}

    patterns = attribute_patterns()
    undocumented = {a for a in emitted if not any(p.match(a) for _, p in patterns)}
    assert not undocumented, f"emitted but not in the README table: {sorted(undocumented)}"
    never = [name for name, p in patterns if not any(p.match(a) for a in emitted)]
    assert not never, f"in the README table but never emitted: {never}"
