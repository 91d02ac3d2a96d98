"""Container health check: healthy once a message arrives on a subject (an executor's telemetry, the
monitor's cluster state) within a few seconds.

Executors and the monitor serve no HTTP, and their heartbeat on the bus is the truest sign of life:
a process can be running yet stuck loading or disconnected. The probe user may only read (see
deploy/nats.conf), so a health check can never disturb the cluster.

    python deploy/nats_probe.py nats://probe:PASSWORD@nats:4222 morphling.telemetry.exec0
"""

import asyncio
import sys

from shared import subjects
from shared.bus import Bus
from shared.messages import ClusterState, ExecutorTelemetry


async def probe(url: str, subject: str, timeout_s: float) -> bool:
    model = ClusterState if subject == subjects.STATE else ExecutorTelemetry
    seen = asyncio.Event()

    async def on_message(incoming) -> None:
        seen.set()

    bus = await Bus.connect(url, "probe", first_attempt_timeout=timeout_s)
    try:
        await bus.subscribe(subject, model, on_message)
        await asyncio.wait_for(seen.wait(), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        await bus.close()


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    timeout_s = float(argv[2]) if len(argv) == 3 else 5.0
    try:
        return 0 if asyncio.run(probe(argv[0], argv[1], timeout_s)) else 1
    except Exception as exc:  # any failure is "unhealthy", reported in the health log
        print(f"probe failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
