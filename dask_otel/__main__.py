"""``dask-otel`` command line: ``dask-otel demo [--endpoint URL [--metrics]]
[--protocol grpc|http/protobuf]`` (:mod:`dask_otel.demo`)"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dask-otel demo [--endpoint URL [--metrics]] [--protocol grpc|http/protobuf]")
        return 0 if argv else 2
    if argv[0] != "demo":
        print(f"dask-otel: unknown command {argv[0]!r}; try: dask-otel demo")
        return 2
    from dask_otel.demo import main as demo

    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
