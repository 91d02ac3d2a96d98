"""What one replay measured: latency percentiles, SLO violations, throughput, and the precision the
tokens were generated at. Pure functions over the client's records and the cluster timeline.

Definitions (seconds throughout):
- TTFT: from the moment the client sent the request to its first streamed token; percentiles over
  every request that got one. TPOT: (last token - first token) / (tokens - 1), over finished
  requests of two tokens or more. End-to-end: sent to the last token, over finished requests.
- SLO violation: a request that failed, or whose TTFT exceeded the SLO (a failure counts whether or
  not it got a first token: a user who got an error was not served).
- Throughput: tokens of finished requests per second of the run (first arrival to last completion);
  goodput: requests that finished within the TTFT SLO and, where one is given, the TPOT SLO (a one-token
  request has no TPOT and meets it), per second of the same span.
- Precision share: each streamed token is attributed to the layer bits its executor reported in the
  cluster sample at or just before it arrived (samples every 0.25 s, through the monitor's view,
  which lags the executor by a few hundred milliseconds); with several executors, a token counts
  for each executor's state with equal weight, as the router spreads load evenly.
"""

import bisect
import math
from collections import defaultdict

from services.tools.bench.client import ClusterSample, RequestRecord


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def tpot_s(r: RequestRecord) -> float | None:
    if not r.ok or r.completion_tokens < 2 or len(r.chunk_s) < 2:
        return None
    return (r.chunk_s[-1] - r.chunk_s[0]) / (r.completion_tokens - 1)


def quantized_mix(layers: list[int]) -> tuple[int, int]:
    """(layers at INT8, layers at INT4) of one executor's bits per layer."""
    return sum(1 for b in layers if b == 8), sum(1 for b in layers if b == 4)


def timeline(samples: list[ClusterSample]) -> dict[str, list]:
    """The cluster samples as columns, summed over live executors (KV in tokens: over the instances' leaders, since
    the other members of an instance back the same blocks with pages of their own)."""
    cols = defaultdict(list)
    for s in samples:
        leaders = [e for e in s.executors if e.get("role", "leader") == "leader"]
        cols["t"].append(round(s.time_s, 3))
        cols["kv_capacity_tokens"].append(sum((e["kv"]["pages_base"] + e["kv"]["pages_extension"]) * e["block_size"]
                                              for e in leaders))
        cols["kv_used_tokens"].append(sum(e["kv"]["pages_used"] * e["block_size"] for e in leaders))
        mixes = [quantized_mix(e["layers"]) for e in s.executors]
        cols["int8_layers"].append(sum(m[0] for m in mixes))
        cols["int4_layers"].append(sum(m[1] for m in mixes))
        cols["running"].append(sum(e["running"] for e in s.executors))
        cols["waiting"].append(sum(e["waiting"] for e in s.executors))
    return dict(cols)


def preemptions(samples: list[ClusterSample]) -> int:
    """Preemptions during the run: each executor's counter, last sample minus first."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for s in samples:
        for e in s.executors:
            first.setdefault(e["id"], e["preemptions"])
            last[e["id"]] = e["preemptions"]
    return sum(last[k] - first[k] for k in last)


def precision_share(records: list[RequestRecord], samples: list[ClusterSample]) -> dict[tuple[int, int], float]:
    """Share of streamed tokens generated at each (INT8 layers, INT4 layers) mix of an executor."""
    if not samples:
        return {}
    times = [s.time_s for s in samples]
    # Each sample's mixes, as shares of its executors: counted once, not once per chunk that falls in it.
    mixes: dict[int, dict[tuple[int, int], float]] = {}
    weights: dict[tuple[int, int], float] = defaultdict(float)
    for r in records:
        if not r.chunk_s:
            continue
        per_chunk = (r.completion_tokens or len(r.chunk_s)) / len(r.chunk_s)
        for t in r.chunk_s:
            index = max(0, bisect.bisect_right(times, t) - 1)
            if index not in mixes:
                executors = samples[index].executors
                mixes[index] = defaultdict(float)
                for e in executors:
                    mixes[index][quantized_mix(e["layers"])] += 1 / len(executors)
            for mix, share in mixes[index].items():
                weights[mix] += per_chunk * share
    total = sum(weights.values())
    return {mix: w / total for mix, w in sorted(weights.items())} if total else {}


def summarize(records: list[RequestRecord], samples: list[ClusterSample], slo_ttft_s: float,
              slo_tpot_s: float | None = None) -> dict:
    finished = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    tpots = [t for t in (tpot_s(r) for r in finished) if t is not None]
    e2e = [r.e2e_s for r in finished]
    good = [r for r in finished if r.ttft_s is not None and r.ttft_s <= slo_ttft_s]
    goodput = [r for r in good if slo_tpot_s is None or (tpot_s(r) or 0.0) <= slo_tpot_s]
    starts = [r.scheduled_s for r in records]
    span = max((r.done_s for r in finished), default=0.0) - min(starts, default=0.0)
    tokens = sum(r.completion_tokens for r in finished)
    lines = timeline(samples)
    capacity = lines.get("kv_capacity_tokens", [])
    lag = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    return {
        "request_count": len(records),
        "finished": len(finished),
        "failed": len(records) - len(finished),
        "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95), "ttft_p99": percentile(ttfts, 99),
        "tpot_p50": percentile(tpots, 50), "tpot_p99": percentile(tpots, 99),
        "e2e_p95": percentile(e2e, 95),
        "slo_violation_pct": 100.0 * (len(records) - len(good)) / len(records) if records else 0.0,
        "throughput_tok_s": tokens / span if span > 0 else 0.0,
        "goodput_req_s": len(goodput) / span if span > 0 else 0.0,
        "preemptions": preemptions(samples),
        "kv_capacity_start_tokens": capacity[0] if capacity else None,
        "kv_capacity_peak_tokens": max(capacity, default=None),
        "kv_used_peak_tokens": max(lines.get("kv_used_tokens", []), default=None),
        "client_lag_max_s": max(lag, default=0.0),  # how late the client sent anything: its own distortion
        "timeline": lines,
    }
