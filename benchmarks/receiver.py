"""An OTLP/gRPC receiver in its own process, so that decoding what the bridge
sends does not count as scheduler CPU.

Run by :class:`harness.ReceiverProcess`. Prints one JSON line (the ``OTEL_*``
variables that point an exporter at it), then answers commands read from stdin,
one per line: ``count`` (prints the number of spans received so far), ``clear``,
``quit``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from otlp_receiver import OTLPReceiver  # noqa: E402


def main() -> None:
    with OTLPReceiver("grpc") as receiver:
        print(json.dumps(receiver.env()), flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "count":
                print(len(receiver.spans()), flush=True)
            elif command == "clear":
                receiver.clear()
                print("ok", flush=True)
            elif command == "quit":
                break


if __name__ == "__main__":
    main()
