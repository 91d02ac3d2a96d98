"""SplitQuant's optimizer (§IV-C): every distinct device order × every (prefill, decode) micro-batch pair, one
ILP each (or the bit-width transfer heuristic where the ILP is too large), the best objective kept; and the
paper's two baselines, Uniform and Het (§VI-A), on the same costs so that their predictions compare.

Pure: devices, latency models and costs in, a Plan out. The CLI (plan.py) reads files and writes the plan.
"""

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shared.core.planner import heuristic, ilp
from shared.core.planner.devices import Device
from shared.core.planner.memory import FULL_BITS, Workload
from shared.core.planner.problem import Assignment, Costs, Evaluation, LayerLatency, Problem, build, evaluate, micro_batches

# Above this many ILP variables, `auto` goes straight to the heuristic (about 80 layers on 8 devices at 3 bits).
MAX_ILP_VARIABLES = 6000
SOLVERS = ("auto", "ilp", "heuristic")


class Infeasible(ValueError):
    """No plan fits; the message says what does not fit where."""


@dataclass(frozen=True)
class Request:
    devices: tuple[Device, ...]  # as the user listed them
    latencies: tuple[LayerLatency, ...]  # one per device, same order
    costs: Costs
    workload: Workload
    group: int = 1  # layers decided together (§VI-F)
    solver: str = "auto"
    time_limit: float | None = 60.0  # seconds per ILP run, as the paper's §VI-F


@dataclass(frozen=True)
class Plan:
    order: tuple[int, ...]  # indices into Request.devices, in pipeline order
    prefill_batch: int  # η
    decode_batch: int  # ξ
    layers: tuple[tuple[int, int], ...]  # per decoder layer: (stage in pipeline order, bits)
    evaluation: Evaluation
    solver: str  # "ilp optimal", "ilp time limit", "heuristic", ...
    solves: int  # problems solved to find it
    seconds: float

    def throughput(self, workload: Workload) -> float:
        """Output tokens per second of the batch."""
        return workload.batch * workload.output / self.evaluation.latency


def orders(devices: Sequence[Device], latencies: Sequence[LayerLatency]) -> list[tuple[int, ...]]:
    """Every pipeline order of the devices, once per distinct sequence of devices (two T4s are interchangeable)."""
    kinds = [(d, id(lat)) if lat.source == "measured" else (d, lat.source) for d, lat in zip(devices, latencies)]
    seen, out = set(), []
    for perm in itertools.permutations(range(len(devices))):
        key = tuple(kinds[i] for i in perm)
        if key not in seen:
            seen.add(key)
            out.append(perm)
    return out


def _layers(assignment: Assignment, sizes: Sequence[int], bits: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((j, bits[k]) for (j, k), size in zip(assignment, sizes) for _ in range(size))


def check_fits(request: Request) -> None:
    """Infeasible with the reason when no order could fit, before any ILP runs."""
    costs, w = request.costs, request.workload
    below = [d for d in request.devices if d.memory < costs.floor]
    if below:
        d = below[0]
        raise Infeasible(f"{d.name} has {_gib(d.memory)} but every device needs {_gib(costs.floor)}: "
                         f"{costs.floor_why} ({w.batch} sequences of {w.context} tokens)")
    cheapest = min(costs.layer_bytes(b) for b in costs.bits)
    lowest = min(costs.bits, key=costs.layer_bytes)
    num_layers = len(costs.omega)
    room = [d.memory - costs.reserve(False, 1) for d in request.devices]
    first = max(d.memory - costs.reserve(True, 1) for d in request.devices)
    best_room = sum(room) - max(room) + max(first, 0)
    if best_room < num_layers * cheapest:
        raise Infeasible(
            f"the model does not fit: at {lowest} bits its {num_layers} decoder layers need "
            f"{_gib(num_layers * cheapest)} "
            f"(with their KV for {w.batch} sequences of {w.context} tokens), and the devices have {_gib(best_room)} "
            f"for layers after the embeddings ({_gib(costs.reserve(True, 1) - costs.reserve(False, 1))} on the first) "
            f"and the activations: add devices, lower the batch or the context, or allow fewer bits")


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _solve(problem: Problem, request: Request) -> ilp.Solution:
    units, bits = problem.num_units, len(problem.bits)
    variables = units * problem.num_devices * (bits + 1) + units * bits
    use_ilp = request.solver == "ilp" or (request.solver == "auto" and variables <= MAX_ILP_VARIABLES)
    if use_ilp:
        solution = ilp.solve(problem, request.time_limit)
        if solution.assignment is not None or request.solver == "ilp" or solution.status == "infeasible":
            return replace(solution, status=f"ilp {solution.status}")
    solution = heuristic.solve(problem, request.time_limit)
    return replace(solution, status=f"heuristic{' (time limit)' if solution.status == 'time limit' else ''}")


def search(request: Request, order_list: Sequence[tuple[int, ...]] | None = None,
           batches: Sequence[tuple[int, int]] | None = None) -> Plan:
    """The best plan over `order_list` (every distinct order) and `batches` ((η, ξ) pairs; every pair of S)."""
    check_fits(request)
    started = time.perf_counter()
    order_list = order_list or orders(request.devices, request.latencies)
    batches = batches or _pairs(request.workload.batch)
    best, solves = None, 0
    for order in order_list:
        devices = [request.devices[i] for i in order]
        latencies = [request.latencies[i] for i in order]
        for prefill_batch, decode_batch in batches:
            problem = build(request.costs, devices, latencies, request.workload, prefill_batch, decode_batch,
                            request.group)
            solution = _solve(problem, request)
            solves += 1
            if solution.assignment is None:
                continue
            e = evaluate(problem, solution.assignment)
            if e.feasible and (best is None or e.objective < best.evaluation.objective):
                layers = _layers(solution.assignment, problem.sizes, problem.bits)
                best = Plan(tuple(order), prefill_batch, decode_batch, layers, e, solution.status, 0, 0.0)
    if best is None:
        budget = request.costs.omega_budget
        raise Infeasible("no placement fits the devices' memory" + (
            f" within the quality budget (Σω ≤ {budget:.3g})" if budget is not None else "") +
            ": allow fewer bits, lower the batch or the context, or add devices")
    return replace(best, solves=solves, seconds=time.perf_counter() - started)


def even_split(num_layers: int, stages: int) -> list[int]:
    """Layers per stage as even as they go, the extra ones to the front (vLLM's pipeline split)."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if j < extra else 0) for j in range(stages)]


def uniform(request: Request) -> Plan | None:
    """The Uniform baseline: every layer at the same bits, lowered from full precision until the even split
    of the layers over the devices, in the order given, fits; the best micro-batches for it. None: nothing fits."""
    order = tuple(range(len(request.devices)))
    counts = even_split(len(request.costs.omega), len(order))
    stages = tuple(j for j, count in enumerate(counts) for _ in range(count))
    for bits in sorted(request.costs.bits, reverse=True):
        single = _single_bits(request, bits)
        best = None
        for p, d in _pairs(request.workload.batch):
            problem = build(single.costs, list(request.devices), list(request.latencies), request.workload, p, d)
            e = evaluate(problem, tuple((j, 0) for j in stages))
            if e.feasible and (best is None or e.objective < best.evaluation.objective):
                best = Plan(order, p, d, tuple((j, bits) for j in stages), e, "uniform", 0, 0.0)
        if best is not None:
            return best
    return None


def het(request: Request) -> Plan | None:
    """The Het baseline: every layer at the same bits (lowered from full precision until one fits), the
    partition and the order balanced for the workload by the same ILP with the bits fixed."""
    for bits in sorted(request.costs.bits, reverse=True):
        try:
            plan = search(_single_bits(request, bits))
        except Infeasible:
            continue
        return replace(plan, solver="het")
    return None


def _single_bits(request: Request, bits: int) -> Request:
    costs = request.costs
    k = costs.bits.index(bits)
    single = replace(costs, bits=(bits,), omega=tuple((row[k],) for row in costs.omega), theta=0.0, omega_budget=None)
    return replace(request, costs=single)


def _pairs(batch: int) -> list[tuple[int, int]]:
    sizes = micro_batches(batch)
    return [(p, d) for p in sizes for d in sizes]


def reference_latency(request: Request) -> float:
    """The unit θ is measured in: the whole batch through every layer at full precision without pipelining
    (one micro-batch), on the mean device. It depends on nothing the search chooses."""
    w = request.workload
    context = w.prompt * w.chunks + w.output // 2
    per_layer = sum(lat.prefill(FULL_BITS, w.batch, w.prompt) * w.chunks + (w.output - 1) * lat.decode(
        FULL_BITS, w.batch, context) for lat in request.latencies) / len(request.latencies)
    return len(request.costs.omega) * per_layer

