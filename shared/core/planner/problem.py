"""One instance of SplitQuant's ILP (Eq. 4): the device order and the micro-batch sizes fixed, every cost a
number. The ILP (ilp.py), the bit-width transfer heuristic (heuristic.py) and brute force (the tests) all
solve a Problem, and `evaluate` is the one definition of what an assignment costs, so they agree.

An assignment gives each decision unit (a group of consecutive layers; one layer unless `--group`) a device
index in pipeline order and a bits index. With T_{pre,j} and T_{dec,j} the stage times of Eqs. (5)-(6):

  latency = (μ_pre − 1)·T^pre_max + Σ_j T_{pre,j} + (n − 1)·[(μ_dec − 1)·T^dec_max + Σ_j T_{dec,j}]
  objective = latency + θ·Σ ω

The paper prints (n − 1) on the T^dec_max term only; its text ("the prefill time of the first token and
the decode time of the remaining n − 1 tokens") puts it on the whole decode pass, as here.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.core.planner.devices import Device
from shared.core.planner.memory import Workload

Assignment = tuple[tuple[int, int], ...]  # per unit: (device index in pipeline order, bits index)


class LayerLatency(Protocol):
    """What the ILP needs of a device's latency model: seconds of one decoder layer (latency.FittedLatency,
    measured; roofline.RooflineLatency, modelled)."""
    source: str

    def prefill(self, bits: int, batch: int, prompt: int) -> float: ...

    def decode(self, bits: int, batch: int, context: int) -> float: ...


@dataclass(frozen=True)
class Problem:
    devices: tuple[str, ...]  # in pipeline order, for messages
    bits: tuple[int, ...]  # BITS
    sizes: tuple[int, ...]  # layers in each unit, front to back
    capacity: tuple[float, ...]  # bytes device j has for layers: M_j less its reserve (embeddings on the first)
    layer_bytes: tuple[int, ...]  # M_{i,b}, by bits index
    prefill: tuple[tuple[float, ...], ...]  # [j][k]: one layer, one prefill micro-batch of κ chunks
    decode: tuple[tuple[float, ...], ...]  # [j][k]: one layer, one decode step of a micro-batch at s·κ + n/2
    omega: tuple[tuple[float, ...], ...]  # [u][k]: Σ ω of the unit's layers
    mu_prefill: int
    mu_decode: int
    output: int  # n
    comm_prefill: float  # Eq. (7): the slowest stage is at least the slowest hand-over
    comm_decode: float
    theta: float  # seconds of latency one unit of ω is worth
    omega_budget: float | None = None  # Σ ω may not exceed it
    # While an executor starts, a placed layer takes held_bytes whatever its bits (memory.ArenaMemory).
    held_bytes: int = 0
    start_capacity: tuple[float, ...] = ()

    @property
    def num_units(self) -> int:
        return len(self.sizes)

    @property
    def num_devices(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class Evaluation:
    latency: float
    quality: float  # Σ ω
    objective: float
    prefill_stages: tuple[float, ...]  # T_{pre,j}
    decode_stages: tuple[float, ...]  # T_{dec,j}
    memory: tuple[float, ...]  # bytes of layers on device j
    feasible: bool
    why: str = ""  # what is violated, when not feasible


def contiguous(problem: Problem, assignment: Assignment) -> bool:
    """Eqs. (15)-(16): the first unit on the first device, the last on the last, devices never going back."""
    devices = [j for j, _ in assignment]
    return (devices[0] == 0 and devices[-1] == problem.num_devices - 1
            and all(a <= b for a, b in zip(devices, devices[1:])))


def evaluate(problem: Problem, assignment: Assignment) -> Evaluation:
    n = problem.num_devices
    pre, dec, mem = [0.0] * n, [0.0] * n, [0.0] * n
    quality = 0.0
    for size, omega, (j, k) in zip(problem.sizes, problem.omega, assignment):
        pre[j] += size * problem.prefill[j][k]
        dec[j] += size * problem.decode[j][k]
        mem[j] += size * problem.layer_bytes[k]
        quality += omega[k]
    pre_max = max(max(pre), problem.comm_prefill)
    dec_max = max(max(dec), problem.comm_decode)
    latency = ((problem.mu_prefill - 1) * pre_max + sum(pre)
               + (problem.output - 1) * ((problem.mu_decode - 1) * dec_max + sum(dec)))
    why = ""
    if not contiguous(problem, assignment):
        why = "layers are not in pipeline order"
    elif over := [j for j in range(n) if mem[j] > problem.capacity[j] + 1e-6]:
        why = f"{problem.devices[over[0]]} (stage {over[0]}) holds more than its memory"
    elif over := [j for j in range(n) if problem.held_bytes and held(problem, assignment, j) > problem.start_capacity[j]
                  + 1e-6]:
        why = f"{problem.devices[over[0]]} (stage {over[0]}) cannot start with its layers at full precision"
    elif problem.omega_budget is not None and quality > problem.omega_budget + 1e-9:
        why = "the quality budget is exceeded"
    return Evaluation(latency, quality, latency + problem.theta * quality, tuple(pre), tuple(dec), tuple(mem),
                      not why, why)


def held(problem: Problem, assignment: Assignment, device: int) -> int:
    """Bytes the units on `device` take while it starts."""
    return sum(size for size, (j, _) in zip(problem.sizes, assignment) if j == device) * problem.held_bytes


def micro_batches(batch: int) -> list[int]:
    """The micro-batch sizes tried (the paper's set S, pruned): powers of two below B, and B."""
    sizes = {batch}
    size = 1
    while size < batch:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def units(num_layers: int, group: int) -> tuple[int, ...]:
    """Layer grouping (§VI-F): decide for `group` consecutive layers at once; the last group may be smaller."""
    return tuple(min(group, num_layers - start) for start in range(0, num_layers, group))


@dataclass(frozen=True)
class Costs:
    """Everything about one planning request that does not depend on the device order or the micro-batches."""
    hidden_size: int
    act_bytes: int  # bytes of one hidden-state element handed between stages
    bits: tuple[int, ...]
    omega: tuple[tuple[float, ...], ...]  # [layer][k], normalised (see search.normalised_omega)
    layer_bytes: Callable[[int], int]
    reserve: Callable[[bool, int], int]
    floor: int
    floor_why: str
    theta: float  # seconds per unit of normalised ω
    omega_budget: float | None = None
    held_bytes: int = 0
    start_reserve: int = 0


def build(costs: Costs, devices: Sequence[Device], latencies: Sequence[LayerLatency], workload: Workload,
          prefill_batch: int, decode_batch: int, group: int = 1) -> Problem:
    """The ILP for `devices` in this pipeline order with micro-batches η = prefill_batch, ξ = decode_batch."""
    sizes = units(len(costs.omega), group)
    starts = [sum(sizes[:u]) for u in range(len(sizes))]
    omega = tuple(tuple(sum(costs.omega[i][k] for i in range(s, s + size)) for k in range(len(costs.bits)))
                  for s, size in zip(starts, sizes))
    decode_context = workload.prompt * workload.chunks + workload.output // 2
    prefill = tuple(tuple(lat.prefill(b, prefill_batch, workload.prompt) * workload.chunks for b in costs.bits)
                    for lat in latencies)
    decode = tuple(tuple(lat.decode(b, decode_batch, decode_context) for b in costs.bits) for lat in latencies)
    hop_prefill = prefill_batch * workload.prompt * costs.hidden_size * costs.act_bytes
    hop_decode = decode_batch * costs.hidden_size * costs.act_bytes
    handovers = len(devices) > 1  # a lone device hands nothing over
    return Problem(
        devices=tuple(d.name for d in devices), bits=costs.bits, sizes=sizes,
        capacity=tuple(d.memory - costs.reserve(j == 0, prefill_batch) if d.memory >= costs.floor else -1.0
                       for j, d in enumerate(devices)),
        layer_bytes=tuple(costs.layer_bytes(b) for b in costs.bits), prefill=prefill, decode=decode, omega=omega,
        mu_prefill=math.ceil(workload.batch / prefill_batch), mu_decode=math.ceil(workload.batch / decode_batch),
        output=workload.output, comm_prefill=max(hop_prefill / d.link for d in devices) if handovers else 0.0,
        comm_decode=max(hop_decode / d.link for d in devices) if handovers else 0.0, theta=costs.theta,
        omega_budget=costs.omega_budget, held_bytes=costs.held_bytes,
        start_capacity=tuple(d.memory - costs.start_reserve for d in devices))
