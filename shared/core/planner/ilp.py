"""SplitQuant's ILP (§IV-C, Eqs. 4-16) over one Problem, solved with HiGHS through SciPy's `milp`.

Variables, in this order: z_{u,j,b} (unit u on device j at bits b), y_{u,b}, u_{u,j}, and the two
continuous stage maxima T^pre_max, T^dec_max. The objective is problem.evaluate's, linear in them: Σ_j T_{pre,j}
and Σ_j T_{dec,j} are sums over z, and the maxima are variables bounded below by every stage (5)-(6) and by
the hand-overs (7). Constraint (16) is written as the paper means it: a unit on device j puts the unit before
it on j or an earlier device (the printed k = j..N−1 would forbid two units on one device).

Memory rows are in units of the largest unit's largest footprint rather than bytes: HiGHS's tolerances are
absolute, and a 10^10-byte row would make them meaningless.
"""

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from shared.core.planner.problem import Assignment, Problem


@dataclass(frozen=True)
class Solution:
    assignment: Assignment | None  # None: no feasible assignment was found
    status: str  # "optimal", "time limit" (the best found, not proven), "infeasible"
    seconds: float
    variables: int


class _Rows:
    """A sparse constraint matrix built row by row."""

    def __init__(self):
        self.rows, self.cols, self.vals, self.lb, self.ub = [], [], [], [], []

    def add(self, entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        row = len(self.lb)
        for col, val in entries:
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(val)
        self.lb.append(lb)
        self.ub.append(ub)

    def constraint(self, width: int) -> LinearConstraint:
        a = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lb), width)).tocsr()
        return LinearConstraint(a, np.array(self.lb), np.array(self.ub))


@contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS 1.12 (SciPy 1.17's) prints a stray debug line from C++ on stdout whatever its options say
    (ERGO-Code/HiGHS#2783); it would land in the middle of `morphling plan`'s table."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep clean
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve(problem: Problem, time_limit: float | None = None) -> Solution:
    n_u, n_j, n_k = problem.num_units, problem.num_devices, len(problem.bits)

    def z(u, j, k):
        return (u * n_j + j) * n_k + k

    y0 = n_u * n_j * n_k
    u0 = y0 + n_u * n_k
    t_pre, t_dec = u0 + n_u * n_j, u0 + n_u * n_j + 1
    width = t_dec + 1

    def y(u, k):
        return y0 + u * n_k + k

    def used(u, j):
        return u0 + u * n_j + j

    n = problem.output
    c = np.zeros(width)
    for u, size in enumerate(problem.sizes):
        for j in range(n_j):
            for k in range(n_k):
                c[z(u, j, k)] = (size * (problem.prefill[j][k] + (n - 1) * problem.decode[j][k])
                                 + problem.theta * problem.omega[u][k])
    c[t_pre] = problem.mu_prefill - 1
    c[t_dec] = (n - 1) * (problem.mu_decode - 1)

    rows = _Rows()
    for j in range(n_j):  # (5), (6)
        rows.add([(z(u, j, k), size * problem.prefill[j][k]) for u, size in enumerate(problem.sizes)
                  for k in range(n_k)] + [(t_pre, -1.0)], -np.inf, 0.0)
        rows.add([(z(u, j, k), size * problem.decode[j][k]) for u, size in enumerate(problem.sizes)
                  for k in range(n_k)] + [(t_dec, -1.0)], -np.inf, 0.0)
    for u in range(n_u):  # (9), (10), (11)
        rows.add([(z(u, j, k), 1.0) for j in range(n_j) for k in range(n_k)], 1.0, 1.0)
        for k in range(n_k):
            rows.add([(z(u, j, k), 1.0) for j in range(n_j)] + [(y(u, k), -1.0)], 0.0, 0.0)
        for j in range(n_j):
            rows.add([(z(u, j, k), 1.0) for k in range(n_k)] + [(used(u, j), -1.0)], 0.0, 0.0)
    scale = max(problem.layer_bytes) * max(problem.sizes)
    for j in range(n_j):  # (12), (13): the reserve, embeddings included, is already out of capacity
        rows.add([(z(u, j, k), size * problem.layer_bytes[k] / scale) for u, size in enumerate(problem.sizes)
                  for k in range(n_k)], -np.inf, max(problem.capacity[j], 0.0) / scale)
    if problem.held_bytes:  # starting: every placed layer at full precision (memory.ArenaMemory)
        for j in range(n_j):
            rows.add([(used(u, j), size * problem.held_bytes / scale) for u, size in enumerate(problem.sizes)],
                     -np.inf, max(problem.start_capacity[j], 0.0) / scale)
    for u in range(1, n_u):  # (16)
        for j in range(n_j):
            for k in range(j + 1, n_j):
                rows.add([(used(u, j), 1.0), (used(u - 1, k), 1.0)], -np.inf, 1.0)
    if problem.omega_budget is not None:
        rows.add([(z(u, j, k), problem.omega[u][k]) for u in range(n_u) for j in range(n_j) for k in range(n_k)],
                 -np.inf, problem.omega_budget)

    lower, upper = np.zeros(width), np.ones(width)
    lower[used(0, 0)] = 1.0  # (15)
    lower[used(n_u - 1, n_j - 1)] = 1.0
    for j in range(n_j):
        if problem.capacity[j] < 0:  # below the floor: the device can hold nothing
            for u in range(n_u):
                upper[[z(u, j, k) for k in range(n_k)]] = 0.0
    lower[t_pre], upper[t_pre] = problem.comm_prefill, np.inf  # (7)
    lower[t_dec], upper[t_dec] = problem.comm_decode, np.inf
    integrality = np.ones(width)
    integrality[[t_pre, t_dec]] = 0

    options = {"time_limit": time_limit} if time_limit else {}
    started = time.perf_counter()
    with _quiet_stdout():
        result = milp(c, constraints=rows.constraint(width), integrality=integrality,
                      bounds=Bounds(lower, upper), options=options)
    seconds = time.perf_counter() - started
    if result.x is None:
        return Solution(None, "infeasible" if result.status == 2 else "time limit", seconds, width)
    x = result.x
    assignment = tuple(max(((j, k) for j in range(n_j) for k in range(n_k)), key=lambda jk: x[z(u, *jk)])
                       for u in range(n_u))
    return Solution(assignment, "optimal" if result.status == 0 else "time limit", seconds, width)
