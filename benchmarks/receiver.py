"""An OTLP/gRPC receiver in its own process, so that decoding what the bridge
sends does not count as scheduler CPU.

Run by :class:`benchmarks.harness.ReceiverProcess` (``python -m benchmarks.receiver``). Prints one JSON line (the ``OTEL_*``
variables that point an exporter at it), then answers commands read from stdin,
one per line: ``count`` (prints the number of spans received so far), ``clear``,
``mode <ok|unavailable|reject>`` (the receiver's fault mode), ``quit``.
"""

from __future__ import annotations

import json
import sys

from tests.support.otlp_receiver import OTLPReceiver


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
            elif command.startswith("mode "):
                receiver.mode = command.split()[1]
                print("ok", flush=True)
            elif command == "quit":
                break


if __name__ == "__main__":
    main()
