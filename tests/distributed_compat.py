"""distributed's own tests with the bridge switched on by the preload variable alone.

    python -m tests.distributed_compat /path/to/distributed-checkout [up|down|off]   # from the repository root

The checkout must be of the installed distributed version: its tests are in
neither the wheel nor the sdist, so CI (which reaches only package registries)
cannot run this; it is a documented check (README, "When telemetry fails").
``test_spans.py``, ``test_worker_metrics.py`` and ``test_scheduler_plugin.py`` and
the repository's ``conftest.py`` are copied to a temporary directory and run
unchanged against the installed distributed, with
``DASK_DISTRIBUTED__SCHEDULER__PRELOAD=dask_otel`` and the bridge exporting spans
and metrics over OTLP/gRPC to a real receiver on 127.0.0.1 (``up``) or to a closed
port on 127.0.0.1 (``down``); ``off`` runs the same files without the preload, the
baseline for the time they take. Exits with pytest's code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.otlp_receiver import OTLPReceiver, closed_port

FILES = [
    "conftest.py",
    "distributed/tests/test_spans.py",
    "distributed/tests/test_worker_metrics.py",
    "distributed/diagnostics/tests/test_scheduler_plugin.py",
]


def closed_port_env() -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true"}


def run(src: Path, env: dict[str, str], preload: str = "dask_otel") -> int:
    with tempfile.TemporaryDirectory() as work:
        for name in FILES:
            shutil.copy(src / name, Path(work) / Path(name).name)
        env = {
            **os.environ,
            **env,
            "DASK_DISTRIBUTED__SCHEDULER__PRELOAD": preload,
            "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        }
        return subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-o", "addopts=", "--timeout=300", *(Path(n).name for n in FILES[1:])],
            cwd=work, env=env,
        )


def main() -> int:
    src = Path(sys.argv[1])
    collector = sys.argv[2] if len(sys.argv) > 2 else "up"
    if collector == "down":
        return run(src, closed_port_env())
    if collector == "off":
        return run(src, closed_port_env(), preload="[]")
    with OTLPReceiver("grpc") as receiver:
        code = run(src, receiver.env())
        print(f"the receiver got {len(receiver.spans())} spans", flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
