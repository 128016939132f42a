"""Workflows no one wrote by hand (tests/support/workflows.py): seeded programs of
span blocks, repeats while their TaskGroups live, P2P shuffles and rechunks,
erring tasks, a worker killed mid-run, cancellations, a client leaving inside its
block, a second cluster, each run on worker processes. Dask's own record is the
oracle (tests/support/oracle.py): every span, task, fine metric and exemplar
accounted for when the cluster closes.

The seeds below cover every kind of step together (``python -m
tests.support.workflows --coverage SEED...``). A failure prints its seed and its
program; replay it with ``python -m tests.support.workflows SEED`` or
``pytest tests/test_generated.py -k seed17``. A soak over more seeds:
``DASK_OTEL_SOAK_SEEDS=200 python -m pytest tests/test_generated.py`` (seeds 0 to 199;
``DASK_OTEL_SOAK_SEEDS=200-399``: seeds 200 to 399).
"""

from __future__ import annotations

import os

import pytest

from tests.support.workflows import generate, kinds, replay

#: Together, every kind of step of tests.support.workflows.KINDS (the coverage
#: table: ``python -m tests.support.workflows --coverage`` with these seeds)
SEEDS = [2, 4, 7, 12, 14, 17, 19, 24, 33, 38, 41, 44, 45, 48, 53, 57, 59, 95, 3691, 7075]


def seeds() -> list:
    """The seeds to run; a program that starts a second cluster of worker
    processes is ``slow``. Measured on 2 cores at -n 4: 2 to 14 s a seed, the 20
    in 46 s, at load 5; 9 to 31 s, in 95 s, at load 11 (up to 90 s at load 13)"""
    soak = os.environ.get("DASK_OTEL_SOAK_SEEDS", "")
    first, _, last = soak.partition("-")
    chosen = (range(int(first), int(last) + 1) if last else range(int(first))) if soak else SEEDS
    return [pytest.param(seed, id=f"seed{seed}", marks=[pytest.mark.slow]
                         if kinds(generate(seed))["other"] else [])
            for seed in chosen]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", seeds())
def test_a_generated_workflow_is_accounted_for_by_dask(seed):
    replay(seed)
