"""tests/RULES.md stays a list of rules somebody checks: every mutation applies to
today's code (its ``-`` lines exactly once in the file it names) and every test it
names exists. ``python -m tests.mutants`` runs them; this only keeps the pins fresh,
so that a fold that moves a pinned line fails here, not silently in a mutation run
nobody does."""

from __future__ import annotations

import ast
import shutil
import tempfile
from pathlib import Path

from tests.mutants import ROOT, RULES, apply, parse

ROWS = parse(RULES.read_text())


def test_every_mutation_applies_to_exactly_one_place():
    stale = []
    with tempfile.TemporaryDirectory() as scratch:
        for row in ROWS:
            for mutation in row.mutations:
                copy = Path(scratch) / mutation.path
                copy.parent.mkdir(parents=True, exist_ok=True)
                if (ROOT / mutation.path).is_file():
                    shutil.copy(ROOT / mutation.path, copy)
                if not apply(Path(scratch), mutation):
                    stale.append(f"{row.slug}: {mutation.path}")
    assert not stale, "re-pin these rows (their - lines are not exactly once):\n" + "\n".join(stale)


def test_every_named_test_exists():
    missing = []
    for row in ROWS:
        for test in row.tests:
            path, _, name = test.partition("::")
            function = name.split("[")[0].split("::")[-1]
            source = ROOT / path
            defined = {
                node.name for node in ast.walk(ast.parse(source.read_text()))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            } if source.is_file() else set()
            if function not in defined:
                missing.append(f"{row.slug}: {test}")
    assert not missing, "these rows name tests that are gone:\n" + "\n".join(missing)
