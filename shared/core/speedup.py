"""CoCoServe's speed-up model (§4.1, Eqs. 1–4): what a layer-replication strategy is predicted to gain.

A strategy P gives each of the n decoder layers p_i copies; the batch of t tokens is split between a
layer's copies (bs_ij tokens on copy j, evenly unless given), which compute their rows in parallel.

    W(P) = Σ_i max_j layer(bs_ij)                              (Eq. 1: the compute, per layer the slowest copy)
    T(P) = δ(P) · Σ_i Σ_{j=1}^{p_i-1} hop(bs_ij)               (Eq. 2: the copies' transfers)
    S(P) = W(P0) / (W(P) + T(P))                               (Eq. 3; P0 = one copy of every layer)
    S_homo(P) = 1 / (γ + (1-γ)/n · Σ_i 1/p_i),  γ = δ·C/(d·B)  (Eq. 4: homogeneous devices, even splits)

Where the paper writes d²·bs·l/C and d·bs·l/B, the times come from a fitted profile (`morphling profile
--speedup`, SpeedupProfile): d²·t·l/C is one layer's compute time for t tokens, layer(t) = a + b·t, and
d·t·l/B the time to move that layer's input of t tokens (t·d·dtype_bytes bytes) between two executors,
hop(t) = h0 + h1·t·d·dtype_bytes. So C = d²·t·l/layer(t) and B = d·t·l/hop(t), and

    γ = δ·C/(d·B) = δ · hop(t) / layer(t)   for the same batch t.

Eq. 4 follows from Eq. 3 when times are proportional to tokens (a = h0 = 0): W(P) = Σ layer(t)/p_i,
T(P) = δ·Σ (p_i − 1)·hop(t)/p_i, and dividing by layer(t) gives n / (Σ 1/p_i + γ·Σ (1 − 1/p_i)), which is
Eq. 4. With intercepts the two differ: half a batch does not take half the time, which only Eq. 3 sees.

The choices the paper leaves open (δ, the skipped first copy in Eq. 2, the batch t it is evaluated at, the serial
part of a step, heterogeneity) are written out in docs/architecture.md ("CoCoServe's choices").

DEFAULT_PROFILE stands in when no profile is loaded: the profiler's first run on the development machine
(docs/results/speedup_profile.json of 2026-11-23T21:44Z: the default model in float32 on a 2-core CPU,
1 torch thread, 9 repeats). Replace its numbers when a newer recorded profile supersedes that run.
"""

import functools
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.messages import InstancePlan

KIND = "speedup-profile"
EQUATIONS = ("eq4", "eq3")  # the homogeneous closed form, or the full model


class SpeedupProfileError(ValueError):
    """A speed-up profile that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Line:
    intercept: float
    slope: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass(frozen=True)
class SpeedupProfile:
    """The fitted costs `morphling profile --speedup` writes (services/tools/profile/speedup.py)."""
    model: str
    device: str
    threads: int
    num_layers: int
    hidden_size: int
    dtype_bytes: int
    layer: Line  # seconds of one decoder layer on one executor over a batch of t tokens
    hop: Line  # seconds to move B bytes of hidden states between two executors
    step_overhead: Line  # seconds of the rest of a step (embedding, logits, sampling, scheduling) over t tokens
    all_reduce: Line | None = None  # seconds to sum B bytes across a pair; None in profiles written before it

    def layer_s(self, tokens: float) -> float:
        return self.layer.at(tokens)

    def hop_s(self, tokens: float) -> float:
        """Moving the hidden states of `tokens` tokens: d·t·l/B."""
        return self.hop.at(tokens * self.hidden_size * self.dtype_bytes)

    def overhead_s(self, tokens: float) -> float:
        return self.step_overhead.at(tokens)

    @classmethod
    def from_dict(cls, data: object, source: str = "speed-up profile") -> "SpeedupProfile":
        """Refuses a bad profile with SpeedupProfileError naming `source` and the field."""
        def fail(field: str, problem: str) -> SpeedupProfileError:
            return SpeedupProfileError(f"{source}: {field}: {problem}")

        if not isinstance(data, Mapping):
            raise fail("(top level)", f"expected a JSON object, got {type(data).__name__}")
        if data.get("kind") != KIND:
            raise fail("kind", f"expected {KIND!r} (written by `morphling profile --speedup`), "
                               f"got {data.get('kind')!r}")

        def text(field: str) -> str:
            value = data.get(field)
            if not isinstance(value, str) or not value:
                raise fail(field, f"expected a non-empty string, got {value!r}")
            return value

        def count(field: str) -> int:
            value = data.get(field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise fail(field, f"expected a whole number of at least 1, got {value!r}")
            return value

        def line(field: str, slope: str) -> Line:
            value = data.get(field)
            if not isinstance(value, Mapping):
                raise fail(field, f'expected {{"intercept_s": ..., "{slope}": ...}}, got {value!r}')
            numbers = []
            for key in ("intercept_s", slope):
                number = value.get(key)
                if (not isinstance(number, (int, float)) or isinstance(number, bool) or not math.isfinite(number)
                        or number < 0):
                    raise fail(f"{field}.{key}", f"expected a finite number of seconds >= 0, got {number!r}")
                numbers.append(float(number))
            return Line(*numbers)

        profile = cls(model=text("model"), device=text("device"), threads=count("threads"),
                      num_layers=count("num_layers"), hidden_size=count("hidden_size"),
                      dtype_bytes=count("dtype_bytes"), layer=line("layer", "per_token_s"),
                      hop=line("hop", "per_byte_s"), step_overhead=line("step_overhead", "per_token_s"),
                      all_reduce=line("all_reduce", "per_byte_s") if "all_reduce" in data else None)
        if profile.layer.intercept == 0 and profile.layer.slope == 0:
            # γ divides by the layer time: a layer that costs nothing cannot be sped up.
            raise fail("layer", "a layer that takes no time at any batch size cannot be sped up")
        return profile

    @classmethod
    def load(cls, path: str | Path) -> "SpeedupProfile":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise SpeedupProfileError(f"cannot read the speed-up profile {path}: {exc}") from exc
        return cls.from_dict(data, source=str(path))


DEFAULT_PROFILE = SpeedupProfile(
    model="default", device="cpu", threads=1, num_layers=30, hidden_size=576, dtype_bytes=4,
    layer=Line(0.0023736627833119616, 9.236722329452841e-05),
    hop=Line(0.00017489480839057536, 3.6618341027105666e-10),
    step_overhead=Line(0.014279566654476182, 0.0005735364785829465))


# --- strategies ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Strategy:
    """P: for each decoder layer, the executors that compute it. The first holds the layer's original; the
    others are replicas that split the batch rows with it (p_i = len(placements[i]))."""
    placements: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        for i, placement in enumerate(self.placements):
            if not placement or len(set(placement)) != len(placement):
                raise ValueError(f"layer {i}: a placement names one or more different executors, got {placement}")

    @classmethod
    def of_plan(cls, plan: InstancePlan) -> "Strategy":
        return cls(tuple(tuple(layer.placement) for layer in plan.layers))

    @classmethod
    def sequential(cls, num_layers: int) -> "Strategy":
        """P0 = [1, …, 1]."""
        return cls(tuple(("0",) for _ in range(num_layers)))

    @classmethod
    def of_replicas(cls, replicas: Sequence[int]) -> "Strategy":
        """The paper's vector P; consecutive layers with the same p_i share their copies (one run)."""
        if any(p < 1 for p in replicas):
            raise ValueError(f"every layer needs at least one copy, got {list(replicas)}")
        return cls(tuple(tuple(str(j) for j in range(p)) for p in replicas))

    # Cached: CoCoServe's scale-up weighs a few strategies per instance at every cluster state.
    @functools.cached_property
    def replicas(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self.placements)

    @functools.cached_property
    def copies(self) -> tuple[tuple[int, int], ...]:
        """(p, the number of layers with p copies), for each p."""
        return tuple(Counter(self.replicas).items())

    @functools.cached_property
    def replicated_layers(self) -> int:
        return sum(1 for p in self.placements if len(p) > 1)

    @functools.cached_property
    def runs(self) -> int:
        """Runs of consecutive layers with the same copies, more than one: the fabric's replicated segments."""
        return sum(1 for i, p in enumerate(self.placements)
                   if len(p) > 1 and (i == 0 or self.placements[i - 1] != p))

    def with_replicas(self, layers: Sequence[int], executor: str) -> "Strategy":
        chosen = set(layers)
        return Strategy(tuple((*p, executor) if i in chosen else p for i, p in enumerate(self.placements)))

    def without_replicas(self, layers: Sequence[int], executor: str) -> "Strategy":
        chosen = set(layers)
        return Strategy(tuple(tuple(e for e in p if e != executor) if i in chosen else p
                              for i, p in enumerate(self.placements)))


Split = Sequence[Sequence[float]]  # bs_ij: tokens on copy j of layer i


def even_split(strategy: Strategy, tokens: float) -> list[list[float]]:
    return [[tokens / p] * p for p in strategy.replicas]


def _split(strategy: Strategy, tokens: float, bs: Split | None) -> Split:
    if bs is None:
        return even_split(strategy, tokens)
    if [len(row) for row in bs] != list(strategy.replicas):
        raise ValueError(f"bs must give one batch share per copy of each layer: copies {list(strategy.replicas)}, "
                         f"shares {[len(row) for row in bs]}")
    return bs


def delta(strategy: Strategy) -> float:
    """δ(P): 2 transfers (scatter and gather) per replicated run, spread over the replicated layers."""
    replicated = strategy.replicated_layers
    return 2 * strategy.runs / replicated if replicated else 0.0


def compute_time(strategy: Strategy, profile: SpeedupProfile, tokens: float, bs: Split | None = None) -> float:
    """W(P), Eq. 1."""
    if bs is None:  # even splits: each of a layer's p copies computes t/p tokens, so layers count by p
        return sum(layers * profile.layer_s(tokens / p) for p, layers in strategy.copies)
    return sum(max(profile.layer_s(share) for share in row) for row in _split(strategy, tokens, bs))


def transfer_time(strategy: Strategy, profile: SpeedupProfile, tokens: float, bs: Split | None = None) -> float:
    """T(P), Eq. 2."""
    if bs is None:
        return delta(strategy) * sum(layers * (p - 1) * profile.hop_s(tokens / p) for p, layers in strategy.copies)
    rows = _split(strategy, tokens, bs)
    return delta(strategy) * sum(profile.hop_s(share) for row in rows for share in row[1:])


def sequential_time(strategy: Strategy, profile: SpeedupProfile, tokens: float) -> float:
    """W(P0): every layer computed once over the whole batch."""
    return len(strategy.placements) * profile.layer_s(tokens)


def speedup(strategy: Strategy, profile: SpeedupProfile, tokens: float, bs: Split | None = None) -> float:
    """S(P), Eq. 3."""
    baseline = sequential_time(strategy, profile, tokens)
    return baseline / (compute_time(strategy, profile, tokens, bs) + transfer_time(strategy, profile, tokens, bs))


def speedup_with_overhead(strategy: Strategy, profile: SpeedupProfile, tokens: float,
                          bs: Split | None = None) -> float:
    """Eq. 3 with the measured rest of a step as a sequential term on both sides (not in the paper)."""
    rest = profile.overhead_s(tokens)
    baseline = sequential_time(strategy, profile, tokens) + rest
    return baseline / (compute_time(strategy, profile, tokens, bs) + transfer_time(strategy, profile, tokens, bs)
                       + rest)


def gamma(strategy: Strategy, profile: SpeedupProfile, tokens: float) -> float:
    """γ = δ·C/(d·B) = δ·hop(t)/layer(t)."""
    return delta(strategy) * profile.hop_s(tokens) / profile.layer_s(tokens)


def speedup_homogeneous(replicas: Sequence[int], gamma_value: float) -> float:
    """S_homo(P), Eq. 4 (Algorithm 1 writes Σ 1/p_i as ‖1 ⊘ P‖₁)."""
    n = len(replicas)
    return 1.0 / (gamma_value + (1.0 - gamma_value) / n * sum(1.0 / p for p in replicas))


def speedup_eq4(strategy: Strategy, profile: SpeedupProfile, tokens: float) -> float:
    return speedup_homogeneous(strategy.replicas, gamma(strategy, profile, tokens))


def predict(strategy: Strategy, profile: SpeedupProfile, tokens: float, equation: str) -> float:
    """The speed-up a policy compares strategies by: Eq. 4 ("eq4") or Eq. 3 with even splits ("eq3")."""
    if equation == "eq4":
        return speedup_eq4(strategy, profile, tokens)
    if equation == "eq3":
        return speedup(strategy, profile, tokens)
    raise ValueError(f"equation must be one of {', '.join(EQUATIONS)}, got {equation!r}")
