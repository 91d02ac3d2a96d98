"""`morphling scale --executors N`: have a running `morphling up` serve with N executors, added as peers of its
world or drained and removed (the newest first) without losing a request (services/scaling.py)."""

import argparse
import asyncio
import sys

from shared import subjects
from shared.bus import Bus, BusError
from shared.messages import ScaleReply, ScaleRequest

DEFAULT_NATS = "nats://127.0.0.1:4222"


async def scale(nats_url: str, executors: int, timeout_s: float) -> ScaleReply:
    bus = await Bus.connect(nats_url, "morphling-scale", first_attempt_timeout=3.0)
    try:
        return await bus.request(subjects.SCALE, ScaleRequest(executors=executors), ScaleReply, timeout_s)
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="morphling scale", description=__doc__.splitlines()[0])
    parser.add_argument("--executors", type=int, required=True, help="how many executors to serve with (1 or more)")
    parser.add_argument("--nats", default=DEFAULT_NATS, help="the bus `morphling up` runs (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds to wait for the change: a new executor loads the model, a removed one "
                             "finishes its requests (default %(default)g)")
    args = parser.parse_args(argv)
    if args.executors < 1:
        parser.error("--executors must be 1 or more")
    try:
        reply = asyncio.run(scale(args.nats, args.executors, args.timeout))
    except BusError as exc:
        print(f"morphling scale: no `morphling up` answered on {args.nats}: {exc}", file=sys.stderr)
        return 1
    if not reply.ok:
        print(f"morphling scale: {reply.error} (serving: {', '.join(reply.executors)})", file=sys.stderr)
        return 1
    changes = [f"added {', '.join(reply.added)}"] * bool(reply.added) + \
        [f"removed {', '.join(reply.removed)}"] * bool(reply.removed)
    print(f"{len(reply.executors)} executors serving ({', '.join(reply.executors)}); "
          f"{'; '.join(changes) or 'nothing to change'} in {reply.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
