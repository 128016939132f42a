"""A workload that fills the dashboards: nested Dask spans, and enough data to spill.

Each round, under one root span, it creates ``--chunks`` arrays of ``--chunk-mb``
MB of random floats (incompressible), sums each one back (reading spilled chunks
from disk) and adds the sums up, then releases everything::

    spill demo                 root span: one OTel trace
    ├── load                   span; TaskGroup make_chunk
    └── reduce                 span; TaskGroup chunk_sum
        └── total              span; TaskGroup add_up

Every stage has its own task prefix (Dask attaches a TaskGroup to the span of its
first task). With workers whose ``distributed.worker.memory.target`` is below
their share of the chunks, ``load`` spills and ``reduce`` unspills.

In the compose stack it runs forever against the stack's scheduler::

    python workload.py tcp://scheduler:8786 --every 15

and prints each round's trace id, to paste into Tempo or Jaeger. The tests import
:func:`run_round` and run it against their own cluster.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from distributed import Client, span, wait

#: Names of the spans of one round: root, then children as (name, parent)
SPAN_TREE = {"spill demo": None, "load": "spill demo", "reduce": "spill demo",
             "total": "reduce"}
#: TaskGroup (task prefix) -> the span it belongs to
TASK_GROUPS = {"make_chunk": "load", "chunk_sum": "reduce", "add_up": "total"}


def make_chunk(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).random(nbytes // 8)


def chunk_sum(chunk: np.ndarray) -> float:
    return float(chunk.sum())


def add_up(sums: list[float]) -> float:
    return float(sum(sums))


def run_round(client: Client, chunks: int = 16, chunk_bytes: int = 4_000_000,
              seed: int = 0, hold: float = 0.0) -> str:
    """One round of the workload; returns the root Dask span's id (the OTel trace
    id is that UUID without dashes).

    ``hold``: seconds to keep the chunks (some of them on disk) after the round
    before releasing them. Spill levels are gauges, sampled once per metric export
    or scrape; a round lasts about a second, so without holding a dashboard may
    never see a key on disk.
    """
    with span("spill demo") as root_id:
        with span("load"):
            data = client.map(make_chunk, range(seed, seed + chunks), nbytes=chunk_bytes)
            wait(data)
        with span("reduce"):
            sums = client.map(chunk_sum, data)
            wait(sums)
            with span("total"):
                client.submit(add_up, sums).result()
    time.sleep(hold)
    del data, sums
    return root_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scheduler", help="scheduler address, e.g. tcp://scheduler:8786")
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--every", type=float, default=15.0,
                        help="seconds between the starts of two rounds")
    parser.add_argument("--rounds", type=int, default=0, help="0: run forever")
    parser.add_argument("--hold", type=float, default=10.0,
                        help="seconds to keep each round's chunks before releasing them")
    args = parser.parse_args()

    with Client(args.scheduler, timeout=120) as client:
        done = 0
        while args.rounds == 0 or done < args.rounds:
            started = time.monotonic()
            root_id = run_round(client, args.chunks, int(args.chunk_mb * 1e6),
                                seed=done * args.chunks, hold=args.hold)
            done += 1
            print(f"round {done}: trace id {root_id.replace('-', '')} "
                  f"(Dask span {root_id})", flush=True)
            time.sleep(max(0.0, args.every - (time.monotonic() - started)))


if __name__ == "__main__":
    main()
