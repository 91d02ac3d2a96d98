"""The pictures of a `morphling bench` run: a timeline per mode and window, and one TTFT CDF with every mode
(its windows pooled).

Both read only what results.json holds, so a run can be re-plotted from its JSON.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on a server
import matplotlib.pyplot as plt  # noqa: E402

from services.tools.bench.trace import arrival_rate  # noqa: E402


ACTION_COLORS = {"quantize": "tab:green", "restore": "tab:olive", "replicate": "tab:cyan", "migrate": "tab:pink",
                 "evict": "tab:gray", "batch": "tab:red", "tp_merge": "tab:blue", "tp_split": "tab:purple"}


def plot_timeline(mode: str, result: dict, slo_ttft_s: float, path: Path) -> Path:
    """Arrival rate, KV capacity and use, quantized layers with the controller's actions marked, and each
    request's TTFT, on one time axis."""
    line = result["timeline"]
    reqs = result["requests"]
    last_arrival = max((r["scheduled_s"] for r in reqs), default=0.0)
    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    rate_ax, kv_ax, layer_ax, ttft_ax = axes

    bin_s = max(1.0, last_arrival / 60)  # the same bins in every mode's plot
    rates = arrival_rate([r["scheduled_s"] for r in reqs], bin_s, last_arrival + bin_s)
    rate_ax.bar([i * bin_s for i in range(len(rates))], rates, width=bin_s, align="edge", color="tab:gray")
    rate_ax.set_ylabel("arrivals (req/s)")

    kv_ax.plot(line.get("t", []), line.get("kv_capacity_tokens", []), label="KV capacity", color="tab:blue")
    kv_ax.plot(line.get("t", []), line.get("kv_used_tokens", []), label="KV in use", color="tab:orange")
    kv_ax.set_ylabel("KV (tokens)")
    kv_ax.legend(loc="upper left", fontsize=8)

    layer_ax.stackplot(line.get("t", []), line.get("int8_layers", []), line.get("int4_layers", []),
                       labels=["INT8", "INT4"], colors=["tab:green", "tab:purple"], step="post")
    quantized = [a + b for a, b in zip(line.get("int8_layers", []), line.get("int4_layers", []))]
    layer_ax.set_ylim(0, max([1, *quantized]) * 1.1)
    layer_ax.set_ylabel("quantized layers")
    for kind in sorted({a["kind"] for a in result.get("actions", [])}):
        times = [a["t"] for a in result["actions"] if a["kind"] == kind]
        layer_ax.vlines(times, 0, 1, transform=layer_ax.get_xaxis_transform(), linewidth=1, linestyles=":",
                        color=ACTION_COLORS.get(kind, "tab:brown"), label=f"{kind} ({len(times)})")
    layer_ax.legend(loc="upper left", fontsize=8)

    served = [r for r in reqs if r["ttft_s"] is not None]
    ttft_ax.scatter([r["scheduled_s"] for r in served], [r["ttft_s"] for r in served], s=8,
                    c=["tab:red" if r["error"] else "tab:blue" for r in served])
    failed = [r for r in reqs if r["ttft_s"] is None]
    if failed:
        top = max([slo_ttft_s, *(r["ttft_s"] for r in served)]) * 1.1
        ttft_ax.scatter([r["scheduled_s"] for r in failed], [top] * len(failed), marker="x", color="tab:red",
                        label="failed before a first token")
        ttft_ax.legend(loc="upper left", fontsize=8)
    ttft_ax.axhline(slo_ttft_s, color="black", linestyle="--", linewidth=1)
    ttft_ax.set_ylabel("TTFT (s)")
    ttft_ax.set_xlabel("time since the replay started (s), by request arrival")

    fig.suptitle(f"{mode}: P95 TTFT {_fmt(result['ttft_p95'])} s, SLO violations "
                 f"{result['slo_violation_pct']:.1f}%, {result['preemptions']} preemptions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_cdf(results: dict[str, dict], slo_ttft_s: float, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, result in results.items():
        ttfts = sorted(r["ttft_s"] for r in result["requests"] if r["ttft_s"] is not None)
        n = len(result["requests"])  # failed requests never reach 1: the curve tops out below it
        ax.step(ttfts, [(i + 1) / n for i in range(len(ttfts))], where="post", label=mode)
    ax.axvline(slo_ttft_s, color="black", linestyle="--", linewidth=1, label=f"SLO {slo_ttft_s:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_goodput(modes: dict[str, dict], slo_ttft_s: float, path: Path) -> Path:
    """Each mode's sweep: goodput and P95 TTFT against the rate multiplier, its SLO capacity marked."""
    fig, (good_ax, p95_ax) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for mode, summary in modes.items():
        points = summary.get("sweep") or []
        rates = [p["rate_scale"] for p in points]
        line, = good_ax.plot(rates, [p["goodput_req_s"] for p in points], marker="o", label=mode)
        p95_ax.plot(rates, [p["ttft_p95"] if p["ttft_p95"] is not None else float("nan") for p in points],
                    marker="o", color=line.get_color())
        if summary.get("slo_capacity") is not None:
            for ax in (good_ax, p95_ax):
                ax.axvline(summary["slo_capacity"], color=line.get_color(), linestyle=":", linewidth=1)
    good_ax.set_ylabel("goodput (req/s within the SLOs)")
    good_ax.legend(fontsize=8)
    good_ax.grid(True, alpha=0.3)
    p95_ax.axhline(slo_ttft_s, color="black", linestyle="--", linewidth=1, label=f"SLO {slo_ttft_s:g} s")
    p95_ax.set_yscale("log")
    p95_ax.set_ylabel("P95 TTFT over the windows (s)")
    p95_ax.set_xlabel("rate multiplier of the trace's windows (dotted: each mode's SLO capacity)")
    p95_ax.legend(fontsize=8)
    p95_ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
