"""One window played by several processes, each simulating some of the fleet's models (`--shards`).

The models of a fleet meet nowhere but in the monitor and the controller: a request asks for one model and the
router picks among that model's executors, a world (and so every instance, merge and replica) is one model's, the
controller's rungs read each executor or instance on its own, and the monitor publishes on its clock, the same
instants whatever the models (`deal` refuses a monitor whose pace would let one model's new pressure publish a
state of every model between two ticks). So a fleet's window splits by model with nothing changed: each shard is
a Simulation of its models (the monitor's pace and the instances' ids kept the whole fleet's), the shards run side
by side, one per core, and their runs are put together as the one process's run would have been
(tests/unit/test_shards.py holds the two equal on a fleet of two models under the ladder and under CoCoServe).

What a shard cannot see is when the whole window ends: at the last request's end, over every model. So a shard
that is done first waits for the others and then plays on to that end (Simulation.lengthen), so that its samples
and its controller's late actions (restores after the load) are the ones the whole window would have had.

The controller's decisions are the same states at the same instants in every shard: a window's count is one
shard's, and the wall seconds per decision the sum over the shards, each planning on its part of the fleet.
"""

import multiprocessing
import sys
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection

from services.tools.bench.trace import TraceRequest
from services.tools.simulator.cluster import SimRun, SimSettings, Simulation, in_time_order
from services.tools.simulator.fleet import Fleet, FleetError
from shared.core.monitor.pace import pace

Play = Callable[[Simulation, list[TraceRequest], str], SimRun]  # a window played on a simulation, with a label


def deal(fleet: Fleet, shards: int, settings: SimSettings) -> list[list[str]]:
    """The fleet's models dealt over `shards`, each to the shard with the fewest executors so far, the models
    with the most executors first: the executors' reports and steps are most of a shard's time. FleetError where
    the fleet cannot be split so: fewer models than shards, or a monitor whose pace lets a report of new pressure
    publish a state between two ticks (monitor/pace.py: cheap states, a small fleet), a state that would read
    every model's reports at an instant one shard alone chose."""
    if not 1 <= shards <= len(fleet.models):
        raise FleetError(f"--shards splits the fleet by model: between 1 and its {len(fleet.models)} model(s) "
                         f"({', '.join(fleet.models)}), got {shards}")
    cost_s = settings.monitor_state_s * len(fleet.executors)
    if shards > 1 and pace(settings.monitor.publish_interval_s, cost_s).urgent:
        raise FleetError(f"--shards needs a monitor that publishes on its clock alone: a state of {cost_s:g} s "
                         f"({len(fleet.executors)} executors at --monitor-state-s {settings.monitor_state_s:g}) "
                         f"lets new pressure publish one between two ticks, which reads every model at once")
    counts = {name: sum(s.shape.name == name for s in fleet.executors) for name in fleet.models}
    dealt: list[list[str]] = [[] for _ in range(shards)]
    for name in sorted(counts, key=lambda n: -counts[n]):
        min(dealt, key=lambda models: sum(counts[m] for m in models)).append(name)
    return dealt


def _shard(conn: Connection, fleet: Fleet, settings: SimSettings, models: list[str], arrivals: list[TraceRequest],
           play: Play) -> None:
    """A shard's process: its window played, told to the parent, played on to the end the parent sends back."""
    try:
        simulation = Simulation(fleet, settings, models)
        played = play(simulation, arrivals, "+".join(models))
        conn.send((played.origin + played.elapsed_s, played.drained))
        played = simulation.lengthen(played, *conn.recv())
        conn.send(played)
    except BaseException as exc:  # the parent must hear of it, not wait on a pipe forever
        conn.send(exc)
        raise
    finally:
        conn.close()


def _receive(conn: Connection, models: list[str]):
    message = conn.recv()
    if isinstance(message, BaseException):
        raise RuntimeError(f"the shard simulating {'+'.join(models)} failed: {message!r}") from message
    return message


def play_sharded(fleet: Fleet, settings: SimSettings, groups: list[list[str]], arrivals: list[TraceRequest],
                 play: Play) -> SimRun:
    """`arrivals` played as one window on a fresh cluster of `fleet`, its models simulated in `groups`, one
    process each (forked: they start with what this process has loaded)."""
    context = multiprocessing.get_context("fork")
    pipes, processes = [], []
    for models in groups:
        mine, theirs = context.Pipe()
        process = context.Process(target=_shard, args=(theirs, fleet, settings, models, arrivals, play),
                                  name=f"simulate-{'+'.join(models)}", daemon=True)
        process.start()
        theirs.close()
        pipes.append(mine)
        processes.append(process)
    try:
        ends = [_receive(conn, models) for conn, models in zip(pipes, groups)]
        end = (max(end for end, _ in ends), any(drained for _, drained in ends))
        for conn in pipes:
            conn.send(end)
        runs = [_receive(conn, models) for conn, models in zip(pipes, groups)]
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    print(f"  shards {' | '.join('+'.join(g) for g in groups)}: ended at "
          + ", ".join(f"{end - runs[0].origin:.1f}" for end, _ in ends) + " simulated s", file=sys.stderr)
    return merge(runs, fleet)


def merge(runs: list[SimRun], fleet: Fleet) -> SimRun:
    """The shards' runs of one window as one run: requests by index, each sample's executors in the fleet's
    order, events in time order."""
    first = runs[0]
    if any(len(r.samples) != len(first.samples) or r.decisions != first.decisions for r in runs):
        raise RuntimeError(f"the shards' windows differ in length: samples {[len(r.samples) for r in runs]}, "
                           f"decisions {[r.decisions for r in runs]}")
    rank = fleet.ranks
    samples = []
    for at in zip(*(r.samples for r in runs)):
        if any(t != at[0][0] for t, _ in at):
            raise RuntimeError(f"the shards sampled at different times: {[t for t, _ in at]}")
        samples.append((at[0][0], sorted((e for _, seen in at for e in seen), key=lambda e: rank[e["id"]])))
    return replace(first, requests=sorted((q for r in runs for q in r.requests), key=lambda q: q.index),
                   samples=samples, events=in_time_order([e for r in runs for e in r.events], fleet),
                   elapsed_s=max(r.elapsed_s for r in runs), plan_seconds=sum(r.plan_seconds for r in runs),
                   drained=any(r.drained for r in runs))
