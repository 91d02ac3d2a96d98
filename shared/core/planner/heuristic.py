"""SplitQuant's bit-width transfer heuristic (§IV-C), for problems too large for the ILP in the time allowed.

1. adabits: the start point ignores latency. Layers are split into contiguous stages in proportion to the
   memory each device has for them, and each stage's units are raised from the lowest bits, the best ω
   saved per byte first, while they fit. (The paper solves this step as a smaller ILP; a greedy keeps the
   heuristic polynomial, which is what it is for.)
2. Transfer: rules C = (b_st, b_pi, nums) move `nums` boundary units from one stage to its neighbour at
   bits b_st, lowering the receiver's units (its cheapest ω per freed byte first) until the moved units
   fit; a rule that only changes one unit's bits is the nums = 0 case. The best improving rule is applied
   until none improves the objective or the time is up. Every stage's rules are tried, not only the
   straggler's: at these sizes that costs milliseconds, and it can only do better.
3. Where no rule improves, two units' bits changed at once (`_pairs`), the best improving pair taken, then the
   rules again. Not in the paper: under a quality budget (Σω) or a full device, lowering a slow unit's bits
   may only fit with another unit's raised, which no single rule does, and the rules stopped up to 75% above
   the optimum on random small problems (docs/splitquant.md, "Heuristic").
"""

import itertools
import time

from shared.core.planner.ilp import Solution
from shared.core.planner.problem import Assignment, Problem, evaluate, held

MOVES = (1, 2)  # units a transfer rule moves at once


def _split(problem: Problem) -> list[int] | None:
    """Units per device: in proportion to how many each can hold at the lowest bits, the first and the last at
    least one (Eq. 15); None if the model does not fit even at the lowest bits."""
    n, widest = problem.num_devices, min(problem.layer_bytes) * max(problem.sizes)
    room = [max(int(c // widest), 0) for c in problem.capacity]
    if problem.held_bytes:
        room = [min(r, max(int(c // (problem.held_bytes * max(problem.sizes))), 0))
                for r, c in zip(room, problem.start_capacity)]
    if sum(room) < problem.num_units or room[0] == 0 or room[-1] == 0 or (n > 1 and problem.num_units < 2):
        return None
    # Largest remainder on each stage's share, then single units moved from stages over their room (or from
    # the largest stage to an empty end) to the stage with the most room to spare.
    share = [problem.num_units * r / sum(room) for r in room]
    counts = [int(s) for s in share]
    for j in sorted(range(n), key=lambda j: share[j] - counts[j], reverse=True)[:problem.num_units - sum(counts)]:
        counts[j] += 1
    for _ in range(problem.num_units * n):  # each move settles a unit: more means no split exists
        over = next((j for j in range(n) if counts[j] > room[j]), None)
        empty_end = next((j for j in (0, n - 1) if counts[j] == 0), None)
        if over is None and empty_end is None:
            return counts
        donor = over if over is not None else max(range(n), key=lambda d: counts[d])
        taker = empty_end if empty_end is not None else max(range(n), key=lambda d: room[d] - counts[d])
        counts[donor] -= 1
        counts[taker] += 1
    return None


def _fits(problem: Problem, assignment: list[tuple[int, int]], device: int) -> bool:
    used = sum(size * problem.layer_bytes[k] for size, (j, k) in zip(problem.sizes, assignment) if j == device)
    starting = held(problem, tuple(assignment), device) <= problem.start_capacity[device] + 1e-6 \
        if problem.held_bytes else True
    return used <= problem.capacity[device] + 1e-6 and starting


def adabits(problem: Problem) -> Assignment | None:
    counts = _split(problem)
    if counts is None:
        return None
    lowest = min(range(len(problem.bits)), key=lambda k: problem.layer_bytes[k])
    assignment = [(j, lowest) for j, count in enumerate(counts) for _ in range(count)]
    for device in range(problem.num_devices):
        if not _fits(problem, assignment, device):
            return None
        while True:
            upgrades = []
            for u, (j, k) in enumerate(assignment):
                for better in range(len(problem.bits)):
                    extra = problem.sizes[u] * (problem.layer_bytes[better] - problem.layer_bytes[k])
                    saved = problem.omega[u][k] - problem.omega[u][better]
                    if j == device and extra > 0 and saved > 0:
                        upgrades.append((saved / extra, -u, u, better))
            for _, _, u, better in sorted(upgrades, reverse=True):
                trial = assignment.copy()
                trial[u] = (device, better)
                if _fits(problem, trial, device):
                    assignment = trial
                    break
            else:
                break
    return tuple(assignment)


def _make_room(problem: Problem, assignment: list[tuple[int, int]], device: int, keep: set[int]) -> bool:
    """Lower the bits of `device`'s units outside `keep`, cheapest ω per freed byte first, until it fits."""
    while not _fits(problem, assignment, device):
        options = []
        for u, (j, k) in enumerate(assignment):
            if j != device or u in keep:
                continue
            for lower in range(len(problem.bits)):
                freed = problem.sizes[u] * (problem.layer_bytes[k] - problem.layer_bytes[lower])
                if freed > 0:
                    options.append(((problem.omega[u][lower] - problem.omega[u][k]) / freed, u, lower))
        if not options:
            return False
        _, u, lower = min(options)
        assignment[u] = (device, lower)
    return True


def _neighbours(problem: Problem, current: Assignment):
    n_k = len(problem.bits)
    for u, (j, k) in enumerate(current):  # nums = 0: one unit's bits
        for other in range(n_k):
            if other != k:
                trial = list(current)
                trial[u] = (j, other)
                yield tuple(trial)
    devices = [j for j, _ in current]
    for j in range(problem.num_devices):
        mine = [u for u, d in enumerate(devices) if d == j]
        if not mine:
            continue
        for nums in MOVES:
            for to, moved in ((j + 1, mine[-nums:]), (j - 1, mine[:nums])):
                if not 0 <= to < problem.num_devices or len(moved) < nums:
                    continue
                for bits in range(n_k):
                    trial = list(current)
                    for u in moved:
                        trial[u] = (to, bits)
                    if _make_room(problem, trial, to, set(moved)):
                        yield tuple(trial)


def _pairs(problem: Problem, current: Assignment):
    """Two units' bits changed at once, each where it lies."""
    n_k = len(problem.bits)
    for u, v in itertools.combinations(range(len(current)), 2):
        (ju, ku), (jv, kv) = current[u], current[v]
        for bu, bv in itertools.product(range(n_k), repeat=2):
            if bu != ku and bv != kv:
                trial = list(current)
                trial[u], trial[v] = (ju, bu), (jv, bv)
                yield tuple(trial)


def _best(problem: Problem, trials, score: float, deadline: float) -> tuple[Assignment | None, float]:
    """The feasible trial of the lowest objective below `score`, if any, looked for until `deadline`."""
    best, best_score = None, score
    for trial in trials:
        if time.perf_counter() >= deadline:
            break
        e = evaluate(problem, trial)
        if e.feasible and e.objective < best_score - 1e-12:
            best, best_score = trial, e.objective
    return best, best_score


def transfer(problem: Problem, start: Assignment, deadline: float) -> Assignment:
    current, score = start, evaluate(problem, start).objective
    while time.perf_counter() < deadline:
        best, best_score = _best(problem, _neighbours(problem, current), score, deadline)
        if best is None:
            best, best_score = _best(problem, _pairs(problem, current), score, deadline)
        if best is None:
            break
        current, score = best, best_score
    return current


def solve(problem: Problem, time_limit: float | None = None) -> Solution:
    started = time.perf_counter()
    start = adabits(problem)
    if start is None or not evaluate(problem, start).feasible:
        return Solution(None, "infeasible", time.perf_counter() - started, 0)
    deadline = started + (time_limit if time_limit else float("inf"))
    assignment = transfer(problem, start, deadline)
    status = "heuristic" if time.perf_counter() < deadline else "time limit"
    return Solution(assignment, status, time.perf_counter() - started, 0)
