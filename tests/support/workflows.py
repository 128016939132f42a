"""Workflows no one wrote by hand: a seeded generator of small Dask programs, and
their runner on worker processes, with Dask's own record as the oracle.

A program is a list of steps, each a plain tuple (:data:`KINDS` says what each
kind is); :func:`render` prints it as the Python a user would have written, so
that a failure names its seed and shows its program. The runner executes it on
``otel_cluster(processes=True, n_workers=2)`` with metrics in memory: when the
cluster closes, :mod:`tests.support.oracle` holds everything the bridge exported
against what Dask recorded (spans, TaskGroups, fine metrics, exemplars).

Replay one or more seeds (prints each program, runs it, prints the oracle's
verdict)::

    python -m tests.support.workflows 17 42
    python -m tests.support.workflows --print 17      # the program only
    python -m tests.support.workflows --coverage 0-199  # step kinds per seed

Steps (``body`` is a list of steps; ``hold``: the futures stay referenced to the
end of the program, so Dask keeps their TaskGroups):

- ``("span", "distributed" | "dask_otel", name, body)``: a span block;
- ``("map", func, start, n, pure, hold)``: ``client.map(func, range(start, start + n))``
  without ``key=`` (``pure=False``: keys Dask makes unique), results waited for;
- ``("submit", func, x, pure, hold)``: ``client.submit(func, x)``;
- ``("shuffle", partitions, agg, hold)``: a P2P shuffle of a small dataframe
  (``hold``: persisted, and the aggregate computed from it);
- ``("rechunk", chunks, hold)``: a P2P rechunk of a small array, summed;
- ``("err", n, pure)``: ``client.map(fail, ...)``, every ``ValueError`` caught;
- ``("repeat", stage)``: step number ``stage`` (an earlier map, submit, shuffle,
  rechunk or err) run again as it was, its first run's futures still held;
- ``("kill", n)``: slow tasks; SIGKILL of the worker process running one (its
  nanny starts it again, Dask reruns the task);
- ``("cancel", n)``: slow tasks, ``client.cancel`` once they run;
- ``("leave", name, n)``: a second client, a ``dask_otel.span`` block in which it
  runs tasks and closes;
- ``("other", as_current, body)``: ``body`` run against a second cluster of this
  process (its own client; ``as_current``: inside ``client2.as_current()``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

#: Every kind of step, and the kinds a seed set must cover
KINDS = ("span:distributed", "span:dask_otel", "nested:3", "map", "submit", "shuffle",
         "rechunk", "err", "repeat", "kill", "cancel", "leave", "other")
#: Step kinds that make tasks of their own and can be run again (``repeat``)
STAGES = ("map", "submit", "shuffle", "rechunk", "err")
#: Task functions of tests.support.tasks a map or submit stage draws from
FUNCS = ("inc", "double", "square", "slow_inc")
#: The cluster a program runs on, and the config on top of otel_cluster's (the
#: transition log the oracle reads kept long enough, as tests/conftest.py does, so
#: that ``python -m tests.support.workflows`` replays as pytest runs)
CONFIG = {"otel.metrics.exporter": "memory", "distributed.admin.low-level-log-length": 1_000_000}
N_WORKERS = 2

Step = tuple
Program = list


# --- the generator -----------------------------------------------------------------


def generate(seed: int) -> Program:
    """The program of ``seed``: 2 to 4 top-level steps, span blocks nested up to 3
    levels, at most one worker kill, one leaving client and one second cluster"""
    rng = random.Random(seed)
    state = {"kill": 0, "leave": 0, "other": 0, "names": 0}
    program: Program = []
    for _ in range(rng.randint(2, 4)):
        program.append(_step(rng, state, depth=0, program_so_far=program))
    return program


def _name(state: dict) -> str:
    state["names"] += 1
    return "abcdefghijklmnopqrstuvwxyz"[(state["names"] - 1) % 26] + (
        str((state["names"] - 1) // 26) if state["names"] > 26 else "")


def _stage_ids(program: Program) -> list[int]:
    """Numbers of the stages of ``program`` that ran on its first cluster"""
    second = {n for n, step in walk(program) if step[0] == "other"
              for n in range(n + 1, n + 1 + sum(1 for _ in walk(step[2])))}
    return [n for n, step in walk(program) if step[0] in STAGES and n not in second]


def _step(rng: random.Random, state: dict, depth: int, program_so_far: Program,
          other: bool = False) -> Step:
    # weights; a second cluster runs no P2P, no repeat and no fault
    choices = {"span": (8 if depth == 0 else 4) if depth < 3 else 0, "map": 4, "submit": 2,
               "err": 2, "shuffle": 0 if other else 2, "rechunk": 0 if other else 2,
               "repeat": 0 if other else 3, "kill": 0 if other or state["kill"] else 1,
               "cancel": 0 if other else 1, "leave": 0 if other or state["leave"] else 1,
               "other": 0 if other or state["other"] else 1}
    # stages that ran before this step (a block being built is not in the program
    # yet: its steps come after every step of it, so the numbers hold)
    earlier = _stage_ids(program_so_far)
    if not earlier:
        choices["repeat"] = 0
    kind = rng.choices(list(choices), weights=list(choices.values()))[0]
    if kind == "span":
        api = rng.choice(("distributed", "dask_otel"))
        name = _name(state)
        body: Program = []
        for _ in range(rng.randint(1, 3)):
            body.append(_step(rng, state, depth + 1, program_so_far, other))
        return ("span", api, name, body)
    if kind == "map":
        return ("map", rng.choice(FUNCS), rng.randrange(0, 20), rng.randint(2, 6),
                rng.random() < 0.6, rng.random() < 0.5)
    if kind == "submit":
        return ("submit", rng.choice(FUNCS), rng.randrange(0, 20), rng.random() < 0.6,
                rng.random() < 0.5)
    if kind == "err":
        return ("err", rng.randint(1, 3), rng.random() < 0.5)
    if kind == "shuffle":
        return ("shuffle", rng.randint(2, 4), rng.choice(("sum", "max", "count")),
                rng.random() < 0.5)
    if kind == "rechunk":
        return ("rechunk", rng.randint(2, 4), rng.random() < 0.5)
    if kind == "repeat":
        return ("repeat", rng.choice(earlier))
    if kind == "kill":
        state["kill"] += 1
        return ("kill", rng.randint(2, 4))
    if kind == "cancel":
        return ("cancel", rng.randint(1, 3))
    if kind == "leave":
        state["leave"] += 1
        return ("leave", _name(state), rng.randint(1, 3))
    state["other"] += 1
    body = [_step(rng, state, depth, program_so_far, other=True)
            for _ in range(rng.randint(1, 2))]
    return ("other", rng.random() < 0.5, body)


def walk(program: Program, start: int = 0) -> Iterator[tuple[int, Step]]:
    """(number, step) of every step, nested ones included, in the order they run;
    numbers count from 1"""
    number = start

    def go(steps: Program) -> Iterator[tuple[int, Step]]:
        nonlocal number
        for step in steps:
            number += 1
            yield number, step
            if step[0] == "span":
                yield from go(step[3])
            elif step[0] == "other":
                yield from go(step[2])

    yield from go(program)


def kinds(program: Program) -> Counter:
    """How many steps of each of :data:`KINDS` the program has"""
    found: Counter = Counter()

    def go(steps: Program, depth: int) -> None:
        for step in steps:
            if step[0] == "span":
                found[f"span:{step[1]}"] += 1
                if depth + 1 >= 3:
                    found["nested:3"] += 1
                go(step[3], depth + 1)
            else:
                found[step[0]] += 1
                if step[0] == "other":
                    go(step[2], depth)

    go(program, 0)
    return found


# --- the program as Python -----------------------------------------------------------


def render(program: Program) -> str:
    """The program as the Python a user writes (``# [n]``: the step's number)"""
    lines: list[str] = []
    steps = dict(walk(program))
    numbers = {id(step): n for n, step in walk(program)}

    def go(body: Program, indent: str, client: str) -> None:
        for step in body:
            n = numbers[id(step)]
            lines.extend(indent + line for line in _lines(step, n, client, steps))
            if step[0] == "span":
                go(step[3], indent + "    ", client)
            elif step[0] == "other":
                go(step[2], indent + "    ", "client2")

    go(program, "", "client")
    legend = ("# 'held': its futures stay referenced to the end; the others are released, "
              "and forgotten by the scheduler, before the next step")
    return "\n".join([legend, *lines])


def _call(func: str, args: str, pure: bool) -> str:
    return f"{func}, {args}" + ("" if pure else ", pure=False")


def _lines(step: Step, n: int, client: str, steps: dict[int, Step], again: str = "") -> list[str]:
    kind = step[0]
    tag = f"  # [{n}]{again}"
    if kind == "span":
        return [f"with {step[1]}.span({step[2]!r}):{tag}"]
    if kind == "map":
        _, func, start, count, pure, hold = step
        return [f"s{n} = {client}.map({_call(func, f'range({start}, {start + count})', pure)}); "
                f"{client}.gather(s{n}){tag}{' held' if hold else ''}"]
    if kind == "submit":
        _, func, x, pure, hold = step
        return [f"s{n} = {client}.submit({_call(func, str(x), pure)}).result(){tag}"
                f"{' held' if hold else ''}"]
    if kind == "err":
        _, count, pure = step
        return [f"s{n} = {client}.map({_call('fail', f'range({count})', pure)}); "
                f"ValueError caught from each{tag} held"]
    if kind == "shuffle":
        _, parts, agg, hold = step
        frame = f"dd.from_pandas(frame({parts}), npartitions={parts})"
        if hold:
            return [f"p{n} = {client}.persist({frame}.shuffle('k', shuffle_method='p2p'))"
                    f"{tag} held",
                    f"s{n} = {client}.compute(p{n}.v.{agg}()).result()"]
        return [f"s{n} = {client}.compute({frame}.shuffle('k', shuffle_method='p2p')"
                f".v.{agg}()).result(){tag}"]
    if kind == "rechunk":
        _, chunks, hold = step
        return [f"s{n} = {client}.compute(da.ones(({chunks * 10}, 40), chunks=(10, 40))"
                f".rechunk(({chunks * 10}, 4), method='p2p').sum()).result(){tag}"
                f"{' held' if hold else ''}"]
    if kind == "repeat":
        return _lines(steps[step[1]], n, client, steps, f" again: [{step[1]}] as it ran")
    if kind == "kill":
        return [f"s{n} = {client}.map(slow_inc, range({step[1]}), delay=1.0, pure=False); "
                f"SIGKILL the worker running one; {client}.gather(s{n}){tag}"]
    if kind == "cancel":
        return [f"s{n} = {client}.map(slow, range({step[1]}), delay=1.0, pure=False); "
                f"{client}.cancel(s{n}) once running{tag}"]
    if kind == "leave":
        return [f"c{n} = Client(cluster){tag}",
                f"with dask_otel.span({step[1]!r}):",
                f"    c{n}.gather(c{n}.map(double, range({step[2]}), pure=False)); c{n}.close()"]
    if kind == "other":
        current = " (client2.as_current())" if step[1] else ""
        return [f"# against a second cluster, client2{current}:{tag}"]
    raise ValueError(f"unknown step kind {kind!r} in {step!r}")


# --- the runner ----------------------------------------------------------------------


def frame(partitions: int) -> Any:
    """The small dataframe of a shuffle stage: 100 rows a partition"""
    import pandas as pd

    rows = 100 * partitions
    return pd.DataFrame({"k": [i % 7 for i in range(rows)], "v": range(rows)})


class Runner:
    """Runs one program's steps on a cluster: what a stage holds stays referenced to
    the end of the program; what it does not hold is released, and the runner waits
    until the scheduler forgot it (so whether a TaskGroup still lives at a later
    step does not depend on the garbage collector's timing)"""

    def __init__(self, program: Program, client: Any, stack: contextlib.ExitStack,
                 failures: list[str]):
        self.program = program
        self.steps = dict(walk(program))
        self.numbers = {id(step): n for n, step in walk(program)}
        self.client = client
        self.stack = stack
        #: Futures and persisted collections the program keeps to its end
        self.held: list[Any] = []
        #: The second cluster's client, once a step needed it
        self.second: Any = None
        #: The oracle's verdicts on the second cluster (it closes first)
        self.failures = failures

    def run(self) -> None:
        self.body(self.program, self.client)

    def body(self, steps: Program, client: Any) -> None:
        for step in steps:
            self.step(step, self.numbers[id(step)], client)

    def step(self, step: Step, n: int, client: Any) -> None:
        import dask_otel
        import distributed

        kind = step[0]
        if kind == "span":
            block = distributed.span if step[1] == "distributed" else dask_otel.span
            with block(step[2]):
                self.body(step[3], client)
        elif kind == "repeat":
            self.step(self.steps[step[1]], n, client)
        elif kind == "other":
            second = self.second_client()
            with second.as_current() if step[1] else contextlib.nullcontext():
                self.body(step[2], second)
        else:
            made, hold = getattr(self, f"run_{kind}")(client, *step[1:])
            if hold:
                self.held.append(made)
            else:
                self.release(client, made)

    # the stages: each returns what it made (futures, a persisted collection) and
    # whether the program holds it
    def run_map(self, client: Any, func: str, start: int, n: int, pure: bool, hold: bool):
        from tests.support import tasks

        futures = client.map(getattr(tasks, func), range(start, start + n), pure=pure)
        client.gather(futures)
        return futures, hold

    def run_submit(self, client: Any, func: str, x: int, pure: bool, hold: bool):
        from tests.support import tasks

        future = client.submit(getattr(tasks, func), x, pure=pure)
        future.result()
        return [future], hold

    def run_err(self, client: Any, n: int, pure: bool):
        from tests.support.tasks import fail

        futures = client.map(fail, range(n), pure=pure)
        for future in futures:
            try:
                future.result()
            except ValueError:
                pass
            else:
                raise AssertionError(f"{future} did not raise")
        return futures, True

    def run_shuffle(self, client: Any, parts: int, agg: str, hold: bool):
        import dask.dataframe as dd

        shuffled = dd.from_pandas(frame(parts), npartitions=parts).shuffle(
            "k", shuffle_method="p2p")
        made = []
        if hold:
            shuffled = client.persist(shuffled)
            made.append(shuffled)
        made.append(client.compute(getattr(shuffled.v, agg)()))
        made[-1].result()
        return made, hold

    def run_rechunk(self, client: Any, chunks: int, hold: bool):
        import dask.array as da

        x = da.ones((chunks * 10, 40), chunks=(10, 40)).rechunk((chunks * 10, 4), method="p2p")
        future = client.compute(x.sum())
        future.result()
        return [future], hold

    # the faults
    def run_kill(self, client: Any, n: int):
        from tests.support.tasks import slow_inc

        futures = client.map(slow_inc, range(n), delay=1.0, pure=False)
        address = self.running(client, futures)
        pid = client.run(os.getpid, workers=[address])[address]
        os.kill(pid, signal.SIGKILL)
        assert client.gather(futures) == list(range(1, n + 1))
        client.wait_for_workers(N_WORKERS, timeout=120)
        return futures, True

    def run_cancel(self, client: Any, n: int):
        from tests.support.cluster import wait_until
        from tests.support.tasks import slow

        futures = client.map(slow, range(n), delay=1.0, pure=False)
        self.running(client, futures)
        client.cancel(futures)
        wait_until(lambda: all(f.cancelled() for f in futures), 60, "the futures cancelled")
        return futures, False

    def run_leave(self, client: Any, name: str, n: int):
        import dask_otel
        from distributed import Client

        from tests.support.tasks import double

        leaving = Client(client.scheduler.address, timeout=60)
        with dask_otel.span(name):
            leaving.gather(leaving.map(double, range(n), pure=False))
            leaving.close()
        return [], False

    def running(self, client: Any, futures: list, timeout: float = 60) -> str:
        """The address of a worker that runs one of ``futures`` now"""
        from tests.support.cluster import wait_until

        keys = {f.key for f in futures}

        def executing() -> str | None:
            on = client.run(_executing, keys=keys)
            return next((address for address, n in on.items() if n), None)

        return wait_until(executing, timeout, "a slow task running on a worker")

    def release(self, client: Any, made: list) -> None:
        """Drop ``made`` and wait until the scheduler forgot the keys no other
        future of ``client`` holds (and so their TaskGroups, if nothing else is
        left in them)"""
        from tests.support.cluster import wait_until

        keys = {key for m in made for key in _keys(m)}
        made.clear()
        gc.collect()  # futures sit in reference cycles: freed by the collector's timing
        scheduler = client.cluster.scheduler  # in-process (otel_cluster)

        def forgotten() -> bool:
            return not any(k in scheduler.tasks for k in keys if not client.refcount.get(k))

        wait_until(forgotten, 60, f"the scheduler to forget {sorted(map(str, keys))[:3]}...")

    def second_client(self) -> Any:
        """The client of this program's second cluster, started at its first use"""
        if self.second is None:
            from tests.support.cluster import otel_cluster

            self.second, _ = self.stack.enter_context(
                _checked(otel_cluster(CONFIG, processes=True, n_workers=1), self.failures))
        return self.second


def _keys(made: Any) -> list:
    """The keys of a future or a persisted collection"""
    key = getattr(made, "key", None)
    if key is not None:
        return [key]
    import dask

    return list(dask.core.flatten(made.__dask_keys__()))


def _executing(dask_worker: Any, keys: set) -> int:
    """How many of ``keys`` ``dask_worker`` is executing (for ``Client.run``)"""
    return sum(ts.key in keys for ts in dask_worker.state.executing)


@contextlib.contextmanager
def _checked(cluster: Any, failures: list[str]) -> Iterator[Any]:
    """``cluster`` (an ``otel_cluster``), whose oracle's verdict at its close is
    kept in ``failures`` instead of raised, so that the other cluster is checked too"""
    done = False
    try:
        with cluster as value:
            yield value
            done = True
    except AssertionError as e:
        if not done:
            raise  # the program's own, not the oracle's
        failures.append(str(e))


def run(program: Program) -> None:
    """Run ``program`` on worker processes; the oracle compares each cluster at its
    close (AssertionError: Dask's record and the export differ)"""
    from tests.support.cluster import otel_cluster

    failures: list[str] = []  # both clusters' verdicts, the second's first
    with _checked(otel_cluster(CONFIG, processes=True, n_workers=N_WORKERS), failures) as (
            client, mirrored):
        with contextlib.ExitStack() as stack:
            runner = Runner(program, client, stack, failures)
            runner.run()
            held = runner.held  # to the end: the program's futures stay alive
        del held
    if failures:
        raise AssertionError("\n".join(failures))


def replay(seed: int) -> None:
    """Run the program of ``seed``, with the seed and the program on any failure"""
    program = generate(seed)
    started = time.monotonic()
    try:
        run(program)
    except Exception as e:
        failure = AssertionError(
            f"seed {seed} failed after {time.monotonic() - started:.1f}s "
            f"(replay: python -m tests.support.workflows {seed}):\n{render(program)}\n"
            f"{type(e).__name__}: {e}")
        # the oracle's verdict is whole in the message; anything else keeps its traceback
        raise failure from (None if isinstance(e, AssertionError) else e)


def _seeds(args: list[str]) -> list[int]:
    seeds = []
    for arg in args:
        first, _, last = arg.partition("-")
        seeds += list(range(int(first), int(last) + 1)) if last else [int(first)]
    return seeds


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--print":
        for seed in _seeds(argv[1:]):
            print(f"# seed {seed}\n{render(generate(seed))}\n")
        return 0
    if argv and argv[0] == "--coverage":
        print("seed " + " ".join(KINDS))
        for seed in _seeds(argv[1:]):
            found = kinds(generate(seed))
            print(f"{seed} " + " ".join(str(found.get(k, 0)) for k in KINDS))
        return 0
    failed = 0
    for seed in _seeds(argv):
        print(f"# seed {seed}\n{render(generate(seed))}", flush=True)
        started = time.monotonic()
        try:
            run(generate(seed))
        except AssertionError as e:
            failed += 1
            print(f"FAILED in {time.monotonic() - started:.1f}s:\n{e}\n", flush=True)
        else:
            print(f"ok in {time.monotonic() - started:.1f}s\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
