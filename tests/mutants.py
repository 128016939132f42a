"""Run the mutations of tests/RULES.md: each rule's named tests must fail on its one-line bug.

``python -m tests.mutants [SLUG ...] [-k TEXT] [--list] [--no-baseline] [-n N] [--timeout S]``

Each mutation is applied to a fresh scratch copy of the repository (its tracked and
untracked, not ignored files) and the rule's tests run there with pytest. A mutation is
``killed`` when they fail (pytest exit 1), ``survived`` when they pass, ``error`` when
pytest could not run them (exit 2-5: a collection error, no test collected) or they
outran ``--timeout``, ``does-not-apply`` when its ``-`` lines are not exactly once in the
file. The baseline first runs a row's tests unmutated: a row whose tests fail then is
``broken`` and its mutations are not run. The format is in tests/RULES.md; CONTRIBUTING.md
says when to run it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "tests" / "RULES.md"
HEADING = re.compile(r"^### ([a-z0-9][a-z0-9-]*): (.+)$")


@dataclass(slots=True)
class Mutation:
    path: str
    old: list[str]
    new: list[str]


@dataclass(slots=True)
class Row:
    slug: str
    rule: str
    where: str = ""
    tests: list[str] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)


def parse(text: str) -> list[Row]:
    """The sections of RULES.md; a section missing its tests or mutations is an error."""
    rows: list[Row] = []
    lines = iter(text.splitlines())
    for line in lines:
        if heading := HEADING.match(line):
            rows.append(Row(*heading.groups()))
        elif not rows or not line.strip() or line.startswith("#"):
            continue
        elif line.startswith("where:"):
            rows[-1].where = line[6:].strip()
        elif line.startswith("tests:"):
            rows[-1].tests += line[6:].split()
        elif line.startswith("mutation:"):
            if next(lines, "").strip() != "```diff":
                sys.exit(f"RULES.md {rows[-1].slug}: 'mutation:' must be followed by ```diff")
            old, new = [], []
            for diff in lines:
                if diff.strip() == "```":
                    break
                if not diff or diff[0] not in "-+" or (diff[0] == "-" and new):
                    sys.exit(f"RULES.md {rows[-1].slug}: {diff!r}: - lines, then + lines")
                (old if diff[0] == "-" else new).append(diff[1:])
            rows[-1].mutations.append(Mutation(line[9:].strip(), old, new))
    slugs = [row.slug for row in rows]
    for row in rows:
        if not row.tests or not row.mutations or not all(m.old for m in row.mutations):
            sys.exit(f"RULES.md {row.slug}: needs 'tests:' and a mutation with - lines")
        if slugs.count(row.slug) > 1:
            sys.exit(f"RULES.md {row.slug}: slug used twice")
    return rows


def apply(copy: Path, mutation: Mutation) -> bool:
    """Replace the - lines, whole and contiguous, by the + lines; False unless they occur once."""
    target = copy / mutation.path
    if not target.is_file():
        return False
    lines = target.read_text().split("\n")
    n = len(mutation.old)
    found = [i for i in range(len(lines) - n + 1) if lines[i:i + n] == mutation.old]
    if len(found) != 1:
        return False
    lines[found[0]:found[0] + n] = mutation.new
    target.write_text("\n".join(lines))
    return True


def scratch_copy() -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    copy = Path(tempfile.mkdtemp(prefix="mutants-"))
    for name in filter(None, files):
        source = ROOT / name
        if source.exists() or source.is_symlink():  # a tracked file deleted here is not copied
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name, follow_symlinks=False)
    return copy


def run(row: Row, mutation: Mutation | None, args) -> tuple[str, str]:
    """One pytest run of the row's tests in a fresh copy: (outcome, pytest's last line)."""
    copy = scratch_copy()
    try:
        if mutation and not apply(copy, mutation):
            return "does-not-apply", f"the - lines are not exactly once in {mutation.path}"
        # No bytecode: a same-size mutation must never be read back from a stale .pyc
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(copy), os.environ.get("PYTHONPATH")])), PYTHONDONTWRITEBYTECODE="1")
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q",
                   "-n", str(args.n), *row.tests]
        process = subprocess.Popen(command, cwd=copy, env=env, text=True, start_new_session=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            output, _ = process.communicate(timeout=args.timeout)
        except BaseException as e:  # a timeout, ^C or SIGTERM: pytest, its workers, clusters go too
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            return "error", f"timed out after {args.timeout:g} s"
        last = ([line for line in output.splitlines() if line.strip()] or [""])[-1]
        if args.verbose:
            print(output)
        # xdist ends a -x run that failed as interrupted (exit 2): a failure or a test's setup
        # error is a kill, a collection error (the copy does not import) is not
        failed = re.search(r"\d+ (failed|errors?)\b", last) and "ERROR collecting" not in output
        # survived only if tests ran and passed: exit 0 with "no tests ran" is no pass
        passed = process.returncode == 0 and re.search(r"\d+ passed", last) and not failed
        outcome = "survived" if passed else (
            "killed" if process.returncode in (1, 2) and failed else "error")
        return outcome, f"exit {process.returncode}: {last}"
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("slugs", nargs="*", help="rows to run (default: every row)")
    parser.add_argument("-k", dest="text", help="rows whose slug or rule contains TEXT")
    parser.add_argument("--list", action="store_true", help="list the selected rows and stop")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="first run each row's tests unmutated (default: on)")
    parser.add_argument("-n", type=int, default=2, help="pytest-xdist processes (default: 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the scratch copy is removed
    rows = parse(RULES.read_text())
    unknown = set(args.slugs) - {row.slug for row in rows}
    if unknown:
        parser.error(f"no such rows: {' '.join(sorted(unknown))}")
    rows = [row for row in rows if (not args.slugs or row.slug in args.slugs) and (
        not args.text or args.text.lower() in f"{row.slug} {row.rule}".lower())]
    if args.list:
        for row in rows:
            print(f"{row.slug}: {len(row.mutations)} mutation(s), {row.rule}")
        return 0
    tally = dict.fromkeys(["killed", "survived", "does-not-apply", "error", "broken"], 0)
    for row in rows:
        start = time.monotonic()
        # the unmutated tests must pass, or the row is broken and its mutations not run
        outcome, last = run(row, None, args) if args.baseline else ("survived", "")
        if outcome != "survived":
            print(f"{'broken':<15} {row.slug} (baseline {outcome}, "
                  f"{time.monotonic() - start:.0f} s) {last}", flush=True)
            tally["broken"] += len(row.mutations)
            continue
        for i, mutation in enumerate(row.mutations, 1):
            start = time.monotonic()
            outcome, last = run(row, mutation, args)
            tally[outcome] += 1
            print(f"{outcome:<15} {row.slug}#{i} {mutation.path} "
                  f"({time.monotonic() - start:.0f} s) {last}", flush=True)
    print("mutants: " + ", ".join(f"{count} {name}" for name, count in tally.items()))
    return 0 if tally["killed"] == sum(tally.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
