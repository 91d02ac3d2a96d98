"""The `morphling` command: one entry point, a subcommand per process or tool.

Each subcommand hands the rest of the command line to its module's `main(argv)`, imported only when
that subcommand runs: starting one process must not import the others (the gateway has no torch,
the executor has no web server), and `morphling --help` works before every module exists.
"""

import argparse
import importlib
import logging
import sys

# name -> ("module" or "module:function", help); the function defaults to main. The deployment files
# (docker-compose.yml) are checked against these names.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.up", "start nats-server, monitor, controller, executors and a gateway on one machine"),
    "gateway": ("services.gateway.app", "the OpenAI-compatible HTTP front end"),
    "executor": ("services.executor.process", "one engine on one device, serving requests from the bus"),
    "monitor": ("services.monitor.service", "turns executor telemetry into the cluster state"),
    "controller": ("services.controller.service",
                   "morphs under load and back after: quantizes layers (MorphServe); replicates, migrates, "
                   "evicts and caps the batch (CoCoServe); splits TP merges nothing needs (AMOEBAs)"),
    "bench-engine": ("services.tools.microbench.engine",
                     "offline generation throughput: our engine vs transformers.generate; --against URL: our "
                     "served system beside another OpenAI-compatible server (vLLM)"),
    "bench": ("services.tools.bench.run", "replay a bursty trace against the system in each precision mode"),
    "simulate": ("services.tools.simulator.run",
                 "the bench's experiment on a simulated fleet, run by the real monitor, controller and router"),
    "bench-cpu-kernels": ("services.tools.microbench.cpu_kernels",
                          "which low-bit linear beats float32 on this CPU at which batch rows (the model's linears)"),
    "bench-cocoserve": ("services.tools.bench.cocoserve",
                        "one instance without operations vs CoCoServe scaling over a request-rate sweep"),
    "bench-reshape": ("services.tools.microbench.reshape",
                      "what replicate, evict and migrate cost by number of layers (CoCoServe's Table 2)"),
    "bench-amoebas": ("services.tools.microbench.amoebas",
                      "what a runtime TP merge and split cost, part by part (AMOEBAs' Figs. 9-10)"),
    "bench-groups": ("services.tools.microbench.groups",
                     "how long a process group of executors takes to form on demand, with its first all-reduce"),
    "bench-bus": ("services.tools.bench.bus_scale",
                  "what the real monitor and controller sustain as synthetic executors' telemetry grows to 1,000"),
    "bench-hybrid": ("services.tools.bench.hybrid",
                     "AMOEBAs' scheduler vs round-robin vs least-load-first on short and long requests (Fig. 12)"),
    "bench-plan": ("services.tools.plan.bench",
                   "SplitQuant's planner: solve time by size, fleets against Uniform and Het, predicted vs measured here"),
    "profile": ("services.tools.profile.lis",
                "rank decoder layers by importance (LIS) into a swap order; --speedup: fit the speed-up model; "
                "--latency: time layers by phase and bits (SplitQuant); --indicator: the variance indicator ω"),
    "plan": ("services.tools.plan.run",
             "SplitQuant: per-layer bits, layers across a mixed GPU fleet and micro-batch sizes (an ILP)"),
    "eval": ("services.tools.evaluate", "perplexity with K layers quantized (`morphling eval ppl`)"),
    "morph": ("services.admin_cli:morph_main",
              "by hand through a gateway: quantize or restore layers, replicate, migrate or evict them, cap the batch, "
              "merge executors into a TP instance and split it"),
    "status": ("services.admin_cli:status_main", "the cluster as a gateway sees it: load, KV pages, layer bits"),
    "scale": ("services.scale_cli", "add executors to a running `morphling up`, or drain and remove them"),
    "events": ("services.events_cli", "what the controller and the monitor decided, and why, from the event stream"),
}

# A flag that makes a subcommand another module's: `bench-engine --against URL` compares two served systems over
# HTTP, which is the bench's work (services/tools/bench/peer.py), not the executor's.
FLAG_ROUTES: dict[tuple[str, str], str] = {("bench-engine", "--against"): "services.tools.bench.peer"}


def _usage_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="morphling", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        # add_help=False: `morphling gateway --help` must reach the gateway's own parser.
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        # Prints usage; exits 0 for --help and 2 for a missing or unknown command.
        _usage_parser().parse_args(argv[:1])
        return 2
    command, rest = argv[0], argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: it would bury progress lines and bars under polls and streams.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    module_name, _, function = COMMANDS[command][0].partition(":")
    for (name, flag), routed in FLAG_ROUTES.items():
        if name == command and any(a == flag or a.startswith(f"{flag}=") for a in rest):
            module_name, function = routed, ""
    result = getattr(importlib.import_module(module_name), function or "main")(rest)
    # Tools return a report (bench-engine returns its rows), services an exit status or None.
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
