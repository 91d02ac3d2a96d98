"""`--sweep`: each mode's SLO capacity, the highest rate multiplier of the trace's windows it serves within the SLO.

A sweep point plays every picked window at one rate multiplier (the `rate_scale` the windows are replayed at) and
pools their requests. It meets the SLO when the pooled P95 TTFT is within it and no request failed: the
capacity probe's rule (capacity.Probe.meets), applied to the windows instead of to steady load. The multiplier
is then found by the capacity probe's search and interpolation (capacity.search, capacity.crossing) with the
multiplier as the rate: up by 1.5x from the start while points meet the SLO, down while they miss, one more
point at the bracket's geometric mean, and the crossing interpolated. `slo_capacity` is None when no point
meets the SLO.

Quality at capacity is read from the highest point that met the SLO, the one the capacity interpolates from:
agreement of its tokens with fp16's for the same requests (the bench's agreement.py rule), against fp16's
point nearest that multiplier, since greedy tokens do not depend on the rate but for batching noise; and the
share of tokens each width served, pooled over the windows.

Pure: a caller gives `play(rate_scale) -> {window name: window result}` (report.window_result's dicts), so
`morphling bench` and `morphling simulate` sweep by one rule.
"""

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from services.tools.bench.capacity import Probe, search
from services.tools.bench.metrics import percentile

SWEEP_FACTOR = 1.5


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """`--sweep`, `--sweep-points` and `--burstiness`, as `morphling bench` and `morphling simulate` both take them."""
    ap.add_argument("--burstiness", type=float,
                    help="Gamma-distributed arrivals of this shape at each window's rate instead of the trace's "
                         "times (1: Poisson; below 1 burstier), as `vllm bench serve --burstiness`")
    ap.add_argument("--sweep", action="store_true",
                    help="find each mode's SLO capacity: the highest rate multiplier of the windows within the SLO")
    ap.add_argument("--sweep-points", type=int, default=6,
                    help="rate multipliers a sweep plays at most, per mode (default %(default)s)")


def check_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.burstiness is not None and args.burstiness <= 0:
        ap.error("--burstiness must be positive")
    if args.sweep_points < 2:
        ap.error("--sweep-points must be at least 2: a bracket needs a point that meets the SLO and one that misses")


@dataclass
class Sweep:
    slo_capacity: float | None  # the rate multiplier found; None if no point met the SLO
    points: list[dict]  # one a multiplier played, in rate order
    played: dict[float, dict[str, dict]] = field(repr=False)  # rate multiplier -> window name -> window result

    @property
    def best(self) -> float | None:
        """The highest multiplier that met the SLO: where quality at capacity is read."""
        meeting = [p["rate_scale"] for p in self.points if p["meets_slo"]]
        return max(meeting) if meeting else None


def pooled_probe(rate_scale: float, windows: dict[str, dict]) -> Probe:
    """The point's verdict inputs: P95 TTFT over every window's requests, and their failures."""
    requests = [r for w in windows.values() for r in w["requests"]]
    ttfts = [r["ttft_s"] for r in requests if r["ttft_s"] is not None]
    return Probe(rate_scale, percentile(ttfts, 95), sum(r["error"] is not None for r in requests), len(requests))


def point(probe: Probe, windows: dict[str, dict], slo_ttft_s: float) -> dict:
    """One row of `sweep` in results.json: the verdict, and the goodput and violations the plot shows."""
    n = len(windows)
    return {"rate_scale": probe.rate_rps, "ttft_p95": probe.ttft_p95_s, "failed": probe.failed,
            "requests": probe.requests, "meets_slo": probe.meets(slo_ttft_s),
            "goodput_req_s": sum(w["goodput_req_s"] for w in windows.values()) / n,
            "slo_violation_pct": sum(w["slo_violation_pct"] for w in windows.values()) / n,
            "throughput_tok_s": sum(w["throughput_tok_s"] for w in windows.values()) / n}


def sweep(play: Callable[[float], dict[str, dict]], start: float, slo_ttft_s: float, max_points: int = 6,
          label: str = "", progress: Callable[[str], None] | None = None) -> Sweep:
    """The SLO capacity of the system `play` replays the windows on, starting at multiplier `start`; `label` (the
    mode) names its points in the progress lines."""
    played: dict[float, dict[str, dict]] = {}

    def measure(rate_scale: float) -> Probe:
        played[rate_scale] = play(rate_scale)
        return pooled_probe(rate_scale, played[rate_scale])

    kwargs = {"progress": progress} if progress else {}
    capacity, probes = search(measure, start, slo_ttft_s, SWEEP_FACTOR, max_points, what=f"{label} sweep point".strip(),
                              rate_text=lambda r: f"x{r:.3g}", **kwargs)
    found = capacity if any(p.meets(slo_ttft_s) for p in probes) else None
    return Sweep(found, [point(p, played[p.rate_rps], slo_ttft_s) for p in probes], played)


def nearest(rates, rate_scale: float) -> float:
    return min(rates, key=lambda r: (abs(r - rate_scale), r))


def token_shares(windows: dict[str, dict]) -> list[dict]:
    """Share of the point's tokens served at each (INT8 layers, INT4 layers) mix, pooled over its windows by tokens."""
    weights: dict[tuple[int, int], float] = {}
    for w in windows.values():
        tokens = sum(r["completion_tokens"] for r in w["requests"])
        for mix in w["precision"]["mixes"]:
            key = (mix["int8_layers"], mix["int4_layers"])
            weights[key] = weights.get(key, 0.0) + mix["token_share"] * tokens
    total = sum(weights.values())
    return [{"int8_layers": k[0], "int4_layers": k[1], "token_share": v / total}
            for k, v in sorted(weights.items())] if total else []


def quality_at_capacity(mine: Sweep, agreement_with_fp16: Callable[[float, float], dict | None],
                        reference: Sweep | None) -> dict | None:
    """`quality_at_capacity`: at the mode's best point, agreement with fp16's nearest point (None where fp16 was not
    swept or served no text to compare) and the token share of each width. None when no point met the SLO."""
    best = mine.best
    if best is None:
        return None
    shares = token_shares(mine.played[best])
    agreed = None
    if reference is not None:
        agreed = agreement_with_fp16(best, nearest(reference.played, best))
    return {"rate_scale": best,
            "token_agreement": agreed.get("token_agreement") if agreed else None,
            "prefix_agreement": agreed.get("prefix_agreement") if agreed else None,
            "full_precision_token_share": next((s["token_share"] for s in shares
                                                if s["int8_layers"] == s["int4_layers"] == 0), 0.0 if shares else None),
            "token_shares": shares}


def sweep_keys(mine: Sweep, agreement_with_fp16: Callable[[float, float], dict | None] | None,
               reference: Sweep | None) -> dict:
    """What a swept mode adds to its results.json entry: `slo_capacity`, `sweep` (its points) and
    `quality_at_capacity`. No `agreement_with_fp16` (a simulation's tokens carry no text): no token agreement."""
    return {"slo_capacity": mine.slo_capacity, "sweep": mine.points,
            "quality_at_capacity": quality_at_capacity(mine, agreement_with_fp16 or (lambda *_: None), reference)}
