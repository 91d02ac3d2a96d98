"""The controller process: follows the cluster state and sends the policies' commands.

No policy is configured yet (the first arrives with the morph lever), so the process only tracks
the state; it still runs so that deployments, `morphling up` and the audit trail have their final
shape before the policies do.
"""

import argparse
import asyncio
import logging
import signal
import sys

from shared.bus import Bus, BusError
from shared.config import ControllerConfig
from shared.telemetry import setup_tracing

from services.controller.loop import Controller

log = logging.getLogger(__name__)


async def _run_until_signalled(config: ControllerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Connecting can take long (the server may not be up yet): a signal must end that wait too.
    stopping = asyncio.create_task(stop.wait())
    connecting = asyncio.create_task(Bus.connect(config.nats_url, config.controller_id))
    await asyncio.wait({stopping, connecting}, return_when=asyncio.FIRST_COMPLETED)
    if not connecting.done():
        connecting.cancel()
        log.info("controller: stopped before the bus connected")
        return
    bus = connecting.result()
    controller = Controller(config, policies=[])
    await controller.start(bus)
    log.info("controller %s: following the cluster state on %s (no policies configured)",
             config.controller_id, config.nats_url)
    await stop.wait()
    log.info("controller %s: stopping", config.controller_id)
    await controller.stop()
    await bus.close()


def main(argv: list[str] | None = None) -> int:
    defaults = ControllerConfig()
    parser = argparse.ArgumentParser(prog="morphling controller", description=__doc__.splitlines()[0])
    parser.add_argument("--nats", default=defaults.nats_url, help="NATS server URL")
    parser.add_argument("--id", default=defaults.controller_id,
                        help="controller id: the issuer of its commands and the source of its events")
    parser.add_argument("--command-timeout", type=float, default=defaults.command_timeout_s,
                        help="seconds to wait for an executor's answer to one attempt")
    parser.add_argument("--command-retries", type=int, default=defaults.command_retries,
                        help="extra attempts (same seq) after an unanswered command")
    args = parser.parse_args(argv)
    if args.command_timeout <= 0 or args.command_retries < 0:
        parser.error("--command-timeout must be positive and --command-retries non-negative")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("controller")
    config = ControllerConfig(nats_url=args.nats, controller_id=args.id,
                              command_timeout_s=args.command_timeout, command_retries=args.command_retries)
    try:
        asyncio.run(_run_until_signalled(config))
    except BusError as exc:
        log.error("controller: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
