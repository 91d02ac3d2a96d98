"""The controller process: follows the cluster state and sends the policies' commands.

One policy, the ladder (policies/ladder.py), over every lever `--levers` allows: MorphServe's layer swapping
(policies/morph.py, `--mode`) on every instance's leader; CoCoServe's scale-down, and its scale-up on idle
capacity (policies/cocoserve.py, `--cocoserve`), on instances of several executors and onto idle executors serving
alone; AMOEBAs' split of TP merges
nothing needs any more (policies/amoebas.py, `--amoebas`). All off runs the process with no policy at all
rather than not running it, so that deployments, `morphling up` and the audit trail keep one shape whether or
not anything morphs: the static baselines (executors started with --static-bits) are measured with exactly that.

It plans on every cluster state the monitor publishes: at its clock, and at once when an executor reports
pressure events (a preemption, an admission held for KV pages, a refusal), which the quantize rung acts on
without waiting out its hysteresis windows.

The morph settings are not fixed here: a mode's preset is scaled to each executor's depth, read
from its telemetry on every window, so one controller serves executors of different models, each in
the swap order it reports (its LIS profile). The command line adds only what a preset cannot know:
a swap order that overrides the executors' (`--swap-order`, a `morphling profile` JSON) and
overrides of single settings by name (`--morph-set kv_high=0.85`), checked before the bus is touched.
CoCoServe's thresholds have flags of their own (`--t-up`, `--t-down`, `--delta-bs`, the hysteresis windows)
and `--cocoserve-set` for the rest; its speed-up model predicts with the profile `--speedup` names
(`morphling profile --speedup`), read and checked at start, else with speedup.DEFAULT_PROFILE.
"""

import argparse
import asyncio
import json
import logging
import sys

from services.controller.loop import Controller
from shared.bus import Bus, BusError, stop_on_signals
from shared.config import LEVERS, ControllerConfig, parse_levers, read_swap_order, seconds
from shared.core.policies import cocoserve_algorithms, ladder
from shared.core.policies.capacity import capacity_settings
from shared.core.policies.morph import MODES, settings_for_mode
from shared.core.speedup import SpeedupProfile
from shared.telemetry import setup_tracing

log = logging.getLogger(__name__)


async def _run_until_signalled(config: ControllerConfig, profile: SpeedupProfile | None) -> None:
    stop = stop_on_signals()
    bus = await Bus.connect_unless(stop, config.nats_url, config.controller_id)
    if bus is None:
        log.info("controller: stopped before the bus connected")
        return
    # The ladder reads the rungs' modes, levers and overrides from the config at each window.
    controller = Controller(config, policies=ladder.policies_for(config, profile))
    await controller.start(bus)
    log.info("controller %s: following the cluster state on %s (levers %s; morph mode %s%s; CoCoServe mode %s%s; "
             "speed-up profile %s)", config.controller_id, config.nats_url, ",".join(config.levers) or "none",
             config.morph_mode,
             "".join(f", {k}={v}" for k, v in config.morph_overrides), config.cocoserve_mode,
             "".join(f", {k}={v}" for k, v in config.cocoserve_overrides), config.speedup_profile or "default")
    await stop.wait()
    log.info("controller %s: stopping", config.controller_id)
    await controller.stop()
    await bus.close()


def parse_setting(text: str, flag: str = "--morph-set") -> tuple[str, object]:
    """'kv_high=0.85' -> ('kv_high', 0.85); values are JSON (numbers, lists), else taken as text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{flag} takes key=value, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    # JSON lists would make the frozen config unhashable; MorphSettings takes tuples alike.
    return key.strip(), tuple(value) if isinstance(value, list) else value


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
    parser.add_argument("--levers", default=",".join(defaults.levers), metavar="LEVER[,LEVER...]",
                        help=f"the rungs of the ladder it may use, of {', '.join(LEVERS)}, or none "
                             f"(default %(default)s)")
    parser.add_argument("--mode", default=defaults.morph_mode, choices=MODES,
                        help="how eagerly layers are quantized under load; off: no morphing (default %(default)s)")
    parser.add_argument("--swap-order", metavar="PATH",
                        help="JSON written by `morphling profile` ({\"order\": [layers]}); default: the order "
                             "each executor reports")
    parser.add_argument("--morph-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one morph setting of the mode's preset, e.g. kv_high=0.85 (repeatable)")
    coco = parser.add_argument_group("CoCoServe (instances of several executors)")
    coco.add_argument("--cocoserve", default=defaults.cocoserve_mode, choices=cocoserve_algorithms.MODES,
                      help="scale-down: migrate, evict, cut the batch under SLO violations and step back after; "
                           "default: also replicate layers onto idle members; off: neither (default %(default)s)")
    coco.add_argument("--speedup", metavar="PATH", default=defaults.speedup_profile,
                      help="the speed-up model's costs, as `morphling profile --speedup` writes them; default: "
                           "the built-in profile of the default model on a CPU")
    coco_defaults = cocoserve_algorithms.CocoSettings()
    for flag, key, kind, what in (
            ("--t-up", "t_up", float, "vacancy (min of memory and compute) above which a member takes replicas"),
            ("--t-down", "t_down", float, "SLO violation rate above which the instance scales down"),
            ("--delta-bs", "delta_bs", int, "sequences the batch cap moves by per step (phase 3)"),
            ("--cocoserve-enter-windows", "enter_windows", int, "consecutive violating states per scale-down step"),
            ("--cocoserve-leave-windows", "leave_windows", int, "consecutive calm states per step back"),
            ("--cocoserve-up-windows", "up_windows", int, "consecutive states with idle capacity before replicating"),
            ("--cocoserve-dwell", "min_dwell_s", float, "seconds after a scale-down step before any step back")):
        coco.add_argument(flag, dest=key, type=kind, default=None,
                          help=f"{what} (default {getattr(coco_defaults, key)})")
    coco.add_argument("--cocoserve-set", action="append", default=[], metavar="KEY=VALUE",
                      help="override any other CoCoServe setting by name, e.g. settle_s=3 (repeatable)")
    parser.add_argument("--amoebas", choices=("on", "off"), default="on" if defaults.amoebas else "off",
                        help="split TP instances the gateway merged for long requests back once those are done "
                             "(AMOEBAs; default %(default)s)")
    parser.add_argument("--capacity-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting of when it asks for more executors or fewer, e.g. sustain_s=10 "
                             "(shared/core/policies/capacity.py; repeatable)")
    parser.add_argument("--stats-interval", type=seconds(allow_zero=True), default=defaults.stats_interval_s,
                        metavar="SECONDS", help="seconds between its stats events (states received and planned, "
                                                "the time planning took); 0: none (default %(default)g)")
    args = parser.parse_args(argv)
    if args.command_timeout <= 0 or args.command_retries < 0:
        parser.error("--command-timeout must be positive and --command-retries non-negative")
    try:
        levers = parse_levers(args.levers)
        overrides = dict(parse_setting(text) for text in args.morph_set)
        if args.swap_order:
            overrides["swap_order"] = read_swap_order(args.swap_order)
        # Checked once at a typical depth, so that a typo fails here and not silently per window.
        settings_for_mode(args.mode, 32, **overrides)
        coco_overrides = dict(parse_setting(text, "--cocoserve-set") for text in args.cocoserve_set)
        coco_overrides |= {key: getattr(args, key) for key in ("t_up", "t_down", "delta_bs", "enter_windows",
                                                               "leave_windows", "up_windows", "min_dwell_s")
                           if getattr(args, key) is not None}
        cocoserve_algorithms.settings_for_mode(args.cocoserve, **coco_overrides)
        capacity = dict(parse_setting(text, "--capacity-set") for text in args.capacity_set)
        capacity_settings(**capacity)
        profile = SpeedupProfile.load(args.speedup) if args.speedup else None
    except (ValueError, TypeError) as exc:  # SpeedupProfileError among them
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("controller")
    config = ControllerConfig(nats_url=args.nats, controller_id=args.id,
                              command_timeout_s=args.command_timeout, command_retries=args.command_retries,
                              morph_mode=args.mode, morph_overrides=tuple(overrides.items()),
                              cocoserve_mode=args.cocoserve, cocoserve_overrides=tuple(coco_overrides.items()),
                              speedup_profile=args.speedup, amoebas=args.amoebas == "on", levers=levers,
                              stats_interval_s=args.stats_interval, capacity_overrides=tuple(capacity.items()))
    try:
        asyncio.run(_run_until_signalled(config, profile))
    except BusError as exc:
        log.error("controller: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
