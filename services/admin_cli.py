"""`morphling morph` and `morphling status`: the admin endpoints of a gateway, from a terminal.

They speak HTTP to the gateway rather than NATS to the executors, so an operator needs nothing but
the gateway's URL and an admin key; the gateway's CommandSender keeps the commands idempotent and
audited exactly like the controller's.

Layer bits are printed run-length encoded in layer order, `BITSxCOUNT` per run: `8x4 32x26` means
layers 0-3 hold 8-bit weights and layers 4-29 full precision (32 on CPU, 16 on GPUs).

Instances of several executors (DESIGN.md, "Instances across executors") add the executors' INSTANCE and ROLE
columns and a table of the instances below theirs, its LAYERS column as runs of layers per placement,
`0-9 exec0 | 10-29 exec0+exec1` (a `+` joins the TP shards or replicas of a layer). A cluster of standalone
executors prints as it did before instances existed, so that what reads the output keeps reading it.
"""

import argparse
import os
import sys

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
URL_VARIABLE = "MORPHLING_URL"  # `morphling up` prints the line that exports it
TIMEOUT_S = 120.0  # a morph waits for the executors to apply it, which a busy CPU executor makes slow


def layer_runs(layers: list[int]) -> str:
    """Bits per layer as runs in layer order, e.g. [8, 8, 32] -> "8x2 32x1"."""
    runs: list[list[int]] = []
    for bits in layers:
        if runs and runs[-1][0] == bits:
            runs[-1][1] += 1
        else:
            runs.append([bits, 1])
    return " ".join(f"{bits}x{count}" for bits, count in runs) or "-"


def index_ranges(indices: list[int]) -> str:
    """Layer indices as ranges, e.g. [0, 1, 2, 7] -> "0-2,7"."""
    parts: list[list[int]] = []
    for i in sorted(indices):
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) or "-"


def table(header: list[str], rows: list[list]) -> str:
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def liveness(executor: dict) -> str:
    """yes, suspect (silent a while: no new requests), or NO (dead: its requests moved elsewhere)."""
    if not executor["alive"]:
        return "NO"
    return "suspect" if executor.get("suspect") else "yes"


def cluster_table(executors: list[dict]) -> str:
    # The instance columns go just before LAYER_BITS, so that the other columns keep their places and it stays last.
    grouped = any(e.get("role") == "follower" for e in executors)
    rows = [[e["id"], liveness(e), e.get("restarts", 0), e["running"], e["waiting"], e["kv"]["pages_total"],
             e["kv"]["pages_free"], e["kv"]["pages_base"], e["kv"]["pages_extension"],
             *([e.get("instance") or "-", e.get("role", "leader")] if grouped else []), layer_runs(e["layers"])]
            for e in executors]
    if not rows:
        return "no executors"
    return table(["EXECUTOR", "ALIVE", "RESTARTS", "RUNNING", "WAITING", "KV_TOTAL", "KV_FREE", "KV_BASE", "KV_EXT",
                  *(["INSTANCE", "ROLE"] if grouped else []), "LAYER_BITS"], rows)


def placement_runs(layers: list[dict]) -> str:
    """Runs of consecutive layers computed by the same executors, e.g. "0-9 exec0 | 10-29 exec0+exec1"."""
    runs: list[list] = []
    for index, layer in enumerate(layers):
        where = "+".join(layer["placement"])
        if runs and runs[-1][2] == where:
            runs[-1][1] = index
        else:
            runs.append([index, index, where])
    return " | ".join(f"{a if a == b else f'{a}-{b}'} {where}" for a, b, where in runs) or "-"


def instances_table(instances: list[dict]) -> str | None:
    """The instances of several executors; None when every executor serves alone (nothing to add to the
    executors' table)."""
    if not any(len(i["members"]) > 1 for i in instances):
        return None
    rows = [[i["id"], i["leader"], ",".join(i["members"]), i.get("tp", 1),
             layer_runs([layer.get("bits", 16) for layer in i["layers"]]), placement_runs(i["layers"])]
            for i in instances]
    return table(["INSTANCE", "LEADER", "MEMBERS", "TP", "PLAN_BITS", "LAYERS"], rows)


def results_table(results: list[dict]) -> str:
    rows = []
    for r in results:
        s = r.get("state") or {}
        rows.append([r["executor"], "ok" if r["ok"] else "REFUSED", index_ranges(s.get("changed", [])),
                     s.get("bits", "-"), s.get("pages_released", "-"), s.get("pages_reclaimed", "-"),
                     s.get("blocks_relocated", "-"), f"{s['seconds']:.3f}" if "seconds" in s else "-",
                     r.get("error") or ""])
    return table(["EXECUTOR", "RESULT", "LAYERS", "BITS", "RELEASED", "RECLAIMED", "RELOCATED", "SECONDS",
                  "ERROR"], rows)


def _default_admin_key() -> str | None:
    keys = [k.strip() for k in os.environ.get("MORPHLING_ADMIN_KEYS", "").split(",") if k.strip()]
    return keys[0] if keys else None


def default_url() -> str:
    return os.environ.get(URL_VARIABLE, "").strip() or DEFAULT_URL


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=default_url(),
                        help=f"the gateway's base URL (default: ${URL_VARIABLE}, else {DEFAULT_URL})")
    parser.add_argument("--admin-key", default=_default_admin_key(),
                        help="admin key (default: the first of $MORPHLING_ADMIN_KEYS; none when unset)")


def _call(prog: str, method: str, url: str, key: str | None, body: dict | None = None) -> dict | None:
    """The JSON body of a 200 answer, or None after printing why there is none."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, url, json=body, headers=headers, timeout=TIMEOUT_S)
        reply = r.json()
    except httpx.HTTPError as exc:
        print(f"{prog}: cannot reach {url}: {exc}", file=sys.stderr)
        return None
    except ValueError:
        print(f"{prog}: {url} answered {r.status_code} without JSON: {r.text[:200]!r}", file=sys.stderr)
        return None
    if r.status_code != 200:
        _report_error(prog, r.status_code, reply)
        return None
    return reply


def _report_error(prog: str, status: int, body: dict) -> None:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        print(f"{prog}: {status} {err.get('code') or err.get('type')}: {err.get('message')}", file=sys.stderr)
    else:
        print(f"{prog}: {status}: {body}", file=sys.stderr)


def status_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="morphling status", description="print the cluster as a gateway sees it",
                                     epilog="LAYER_BITS: runs in layer order, BITSxCOUNT (8x4 32x26: layers "
                                            "0-3 at 8 bits, 4-29 at full precision); LAYERS of an instance: "
                                            "runs of layers per placement (0-9 exec0 | 10-29 exec0+exec1)")
    _common(parser)
    args = parser.parse_args(argv)
    body = _call(parser.prog, "GET", f"{args.url.rstrip('/')}/v1/cluster", args.admin_key)
    if body is None:
        return 1
    print(cluster_table(body["executors"]))
    instances = instances_table(body.get("instances", []))
    if instances is not None:
        print()
        print(instances)
    return 0


def morph_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="morphling morph", description="quantize or restore decoder layers "
                                     "through a gateway, answered once the executors applied it")
    _common(parser)
    parser.add_argument("--executor", required=True, help="an executor id, or '*' for every live executor")
    parser.add_argument("--action", required=True, choices=("quantize", "restore"))
    parser.add_argument("--layers", required=True, type=int,
                        help="how many layers (quantize: next full-precision ones front to back; restore: the "
                             "last quantized first)")
    parser.add_argument("--bits", type=int, choices=(4, 8), help="target bits, required for quantize")
    args = parser.parse_args(argv)
    if args.action == "quantize" and args.bits is None:
        parser.error("--bits is required for quantize")
    if args.action == "restore" and args.bits is not None:
        parser.error("restore returns layers to full precision and takes no --bits")
    body = {"executor": args.executor, "action": args.action, "layers": args.layers}
    if args.bits is not None:
        body["bits"] = args.bits
    reply = _call(parser.prog, "POST", f"{args.url.rstrip('/')}/v1/cluster/morph", args.admin_key, body)
    if reply is None:
        return 1
    print(results_table(reply["results"]))
    print()
    print(cluster_table(reply["executors"]))
    return 0 if all(r["ok"] for r in reply["results"]) else 1
