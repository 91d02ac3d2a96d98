"""SplitQuant's latency cost model (§IV-A): the seconds one decoder layer takes, per phase and precision.

The two phases differ in what bounds them, so each has its own linear model over features of its shape:

- prefill, v sequences of s prompt tokens each, is bound by compute. Its FLOPs are the projections'
  (∝ v·s) and attention's (∝ v·s²); the paper's terms are v, s, v·s and v·s², with an intercept for the
  fixed cost of launching a layer.
- decode, one token for each of v sequences with c = t + s tokens of context, is bound by the bytes it
  moves: the layer's weights once (the intercept), per-sequence activations (∝ v), the KV cache it reads
  (∝ v·c), and, as the paper has it, c alone (per-step work that grows with the context, not the batch).

One fit per (phase, bits) for bits in {16, 8, 4}, where 16 stands for the serving dtype's full precision
whatever it is (float32 on CPU). The coefficients come from `morphling profile --latency`
(services/tools/profile/latency.py), which times the real engine and writes a "latency-profile"
JSON; `load_profile` reads it back as a FittedLatency for the planner.

Fits minimise relative, not absolute, error: a batch of one short prompt and a batch of eight long ones
differ by two orders of magnitude in time, and an absolute fit would spend all its freedom on the latter
while the planner sums layer times of every size. Pure Python and numpy (no torch): the controller
plans without a model.
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

PREFILL_FEATURES = ("1", "v", "s", "v*s", "v*s^2")
DECODE_FEATURES = ("1", "v", "v*c", "c")
PHASES = ("prefill", "decode")
PROFILE_KIND = "latency-profile"
MIN_SECONDS = 1e-9  # the floor of a prediction: a cost model must never promise a free layer
BOX_STEPS = 17  # points along each axis where a fit is checked for negative predictions


class LatencyError(ValueError):
    """A latency model cannot be fitted, read or asked as requested."""


def prefill_features(v: float, s: float) -> list[float]:
    """The prefill model's features of v sequences of s prompt tokens each, in PREFILL_FEATURES' order."""
    return [1.0, float(v), float(s), float(v * s), float(v * s * s)]


def decode_features(v: float, c: float) -> list[float]:
    """The decode model's features of one step of v sequences at c tokens of context, in DECODE_FEATURES' order."""
    return [1.0, float(v), float(v * c), float(c)]


FEATURES: dict[str, tuple[tuple[str, ...], Callable[[float, float], list[float]]]] = {
    "prefill": (PREFILL_FEATURES, prefill_features), "decode": (DECODE_FEATURES, decode_features)}

Row = Sequence[float]  # (batch, prompt or context, seconds)


def fit(rows: Sequence[Row], features_fn: Callable[[float, float], list[float]]) -> list[float]:
    """Coefficients of features_fn's terms that best predict the seconds of `rows` [(v, s or c, seconds)],
    in the least-squares sense on relative residuals (each row divided by its own seconds).

    The free solution is kept unless a coefficient is negative and that makes a prediction non-positive
    somewhere on the box the samples span: noise can tilt a term below zero harmlessly, but a model that
    promises a free or negative layer inside the measured range would mislead the planner, so then the
    non-negative least squares solution is taken instead.
    """
    if not rows:
        raise LatencyError("no samples to fit")
    seconds = np.array([row[2] for row in rows], dtype=np.float64)
    if not (seconds > 0).all():
        raise LatencyError(f"every sample needs a positive time; the lowest are {sorted(seconds.tolist())[:3]}")
    weighted = np.array([features_fn(row[0], row[1]) for row in rows], dtype=np.float64) / seconds[:, None]
    # v·s² outgrows the intercept by six orders of magnitude: unit columns keep both solvers well conditioned.
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    design = weighted / scale
    if np.linalg.matrix_rank(design) < design.shape[1]:
        points = sorted({(row[0], row[1]) for row in rows})
        raise LatencyError(f"{len(points)} distinct sample points {points} do not determine "
                           f"{design.shape[1]} coefficients: sample more batch sizes and lengths")
    target = np.ones(len(rows))
    coefficients = np.linalg.lstsq(design, target, rcond=None)[0] / scale
    if (coefficients < 0).any() and _lowest_on_box(coefficients, rows, features_fn) <= 0:
        coefficients = nnls(design, target)[0] / scale
    return [float(c) for c in coefficients]


def _lowest_on_box(coefficients: np.ndarray, rows: Sequence[Row],
                   features_fn: Callable[[float, float], list[float]]) -> float:
    """The lowest prediction on a grid over the box [min v, max v] × [min length, max length] of `rows`."""
    vs = np.linspace(min(r[0] for r in rows), max(r[0] for r in rows), BOX_STEPS)
    lengths = np.linspace(min(r[1] for r in rows), max(r[1] for r in rows), BOX_STEPS)
    grid = np.array([features_fn(v, n) for v in vs for n in lengths])
    return float((grid @ coefficients).min())


def fit_error(rows: Sequence[Row], predict: Callable[[float, float], float]) -> dict:
    """Relative error |predicted − measured| / measured of `predict(v, s or c)` over `rows`, the paper's
    measure (§VI-B): its mean, its maximum and the number of points."""
    if not rows:
        raise LatencyError("no samples to measure a fit's error on")
    errors = [abs(predict(row[0], row[1]) - row[2]) / row[2] for row in rows]
    return {"mean_rel": float(np.mean(errors)), "max_rel": float(max(errors)), "points": len(errors)}


@dataclass(frozen=True)
class FittedLatency:
    """The latency of one decoder layer on one device, fitted from measurements.

    `model` is the layer shape it was measured for (hidden_size, intermediate_size, num_heads, num_kv_heads,
    head_dim, dtype_bytes, num_layers); `coefficients` maps phase -> bits -> coefficients in the order of
    PREFILL_FEATURES or DECODE_FEATURES.
    """
    device: str
    model: dict
    coefficients: dict[str, dict[int, list[float]]]
    source: str = "measured"

    def __post_init__(self) -> None:
        for phase, (names, _) in FEATURES.items():
            fits = self.coefficients.get(phase)
            if not fits:
                raise LatencyError(f"no {phase} coefficients for {self.device}")
            for bits, coefficients in fits.items():
                if len(coefficients) != len(names):
                    raise LatencyError(f"{phase} at {bits} bits has {len(coefficients)} coefficients, the model "
                                       f"has {len(names)} terms {list(names)}")

    def check_layers(self, layers: object, where: str) -> None:
        """LatencyError unless it was measured for layers of the shape of `layers` (a ModelShape, a model config)."""
        measured = {k: self.model.get(k) for k in ("hidden_size", "intermediate_size", "num_kv_heads")}
        serving = {k: getattr(layers, k) for k in measured}
        if measured != serving:
            raise LatencyError(f"{where} was measured for layers of {measured}, not {serving}")

    @property
    def bits(self) -> list[int]:
        """Precisions profiled in both phases, widest first."""
        return sorted(set(self.coefficients["prefill"]) & set(self.coefficients["decode"]), reverse=True)

    def prefill(self, bits: int, batch: int, prompt: int) -> float:
        """Seconds of ONE decoder layer at `bits` prefilling a micro-batch of `batch` sequences of `prompt`
        tokens each."""
        return self._predict("prefill", bits, prefill_features(batch, prompt))

    def decode(self, bits: int, batch: int, context: int) -> float:
        """Seconds of ONE decoder layer at `bits` for one decode step of `batch` sequences with `context`
        past tokens each."""
        return self._predict("decode", bits, decode_features(batch, context))

    def decode_line(self, bits: int, batch: int) -> Callable[[int], float]:
        """decode(bits, batch, context) by the context alone, to the float (the same sum in the same order): a
        simulated decode run asks step after step."""
        one, per_seq, per_token, per_context = self._coefficients("decode", bits)
        fixed = 0 + one * 1.0 + per_seq * float(batch)

        def seconds(context: int) -> float:
            return max(MIN_SECONDS, fixed + per_token * float(batch * context) + per_context * float(context))
        return seconds

    def _predict(self, phase: str, bits: int, features: list[float]) -> float:
        return max(MIN_SECONDS, sum(c * f for c, f in zip(self._coefficients(phase, bits), features)))

    def _coefficients(self, phase: str, bits: int) -> list[float]:
        coefficients = self.coefficients[phase].get(bits)
        if coefficients is None:
            raise LatencyError(f"{self.device} has no {phase} latency at {bits} bits: profiled "
                               f"{sorted(self.coefficients[phase], reverse=True)}")
        return coefficients

    def to_profile(self) -> dict:
        """The part of a latency-profile record that from_profile reads (JSON keys are strings)."""
        return {"kind": PROFILE_KIND, "device": self.device, "shape": dict(self.model),
                "coefficients": {phase: {str(bits): list(c) for bits, c in fits.items()}
                                 for phase, fits in self.coefficients.items()},
                "features": {phase: list(names) for phase, (names, _) in FEATURES.items()}}

    @classmethod
    def from_profile(cls, record: dict) -> "FittedLatency":
        """The model a `morphling profile --latency` record holds."""
        if not isinstance(record, dict) or record.get("kind") != PROFILE_KIND:
            kind = record.get("kind") if isinstance(record, dict) else type(record).__name__
            raise LatencyError(f"not a {PROFILE_KIND} record (kind {kind!r})")
        expected = {phase: list(names) for phase, (names, _) in FEATURES.items()}
        if record.get("features") != expected:
            raise LatencyError(f"fitted to features {record.get('features')}, this model has {expected}")
        try:
            coefficients = {phase: {int(bits): [float(c) for c in values]
                                    for bits, values in record["coefficients"][phase].items()}
                            for phase in PHASES}
            return cls(device=str(record["device"]), model=dict(record["shape"]), coefficients=coefficients)
        except LatencyError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LatencyError(f"malformed {PROFILE_KIND} record: {type(exc).__name__}: {exc}") from exc


def load_profile(path: str | Path) -> FittedLatency:
    """The FittedLatency of the latency-profile JSON at `path`."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise LatencyError(f"cannot read the latency profile {path}: {exc}") from exc
    try:
        return FittedLatency.from_profile(record)
    except LatencyError as exc:
        raise LatencyError(f"{path}: {exc}") from exc
