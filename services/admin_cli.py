"""`morphling morph` and `morphling status`: the admin endpoints of a gateway, from a terminal.

They speak HTTP to the gateway rather than NATS to the executors, so an operator needs nothing but
the gateway's URL and an admin key; the gateway's CommandSender keeps the commands idempotent and
audited exactly like the controller's.

Layer bits are printed run-length encoded in layer order, `BITSxCOUNT` per run: `8x4 32x26` means
layers 0-3 hold 8-bit weights and layers 4-29 full precision (32 on CPU, 16 on GPUs).

Instances of several executors (DESIGN.md, "Instances across executors") add the executors' INSTANCE and ROLE
columns and a table of the instances below theirs, its LAYERS column as runs of layers per placement,
`0-9 exec0 | 10-29 exec0+exec1` (a `+` joins the TP shards or replicas of a layer), REPLICAS as runs of the
copies each layer has, `0-14×2 15-29×1`, and its leader's batch cap and SLO window (share of requests over
an SLO, p95 TTFT and TPOT). Standalone executors are listed there too, as the one-member instances
`i-<executor>` the morph API names them. A cluster of standalone executors prints as it did before instances
existed, so that what reads the output keeps reading it; `--instances` adds the table there too.

`morphling morph` posts its flags under the API's names (`--from` as "from", `--max-num-seqs` as
"max_num_seqs"), so the gateway alone judges a body, and its 400 names the field; quantize and restore keep
the checks they always had here.
"""

import argparse
import os
import sys

import httpx

from shared.core.plans import alone

BITS_ACTIONS = ("quantize", "restore")
INSTANCE_ACTIONS = ("replicate", "migrate", "evict", "batch", "tp_merge", "tp_split")
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


def replica_runs(replicas: list[int]) -> str:
    """Copies per layer as runs in layer order, e.g. [2, 2, 1] -> "0-1×2 2×1"."""
    runs: list[list[int]] = []
    for index, count in enumerate(replicas):
        if runs and runs[-1][2] == count:
            runs[-1][1] = index
        else:
            runs.append([index, index, count])
    return " ".join(f"{a if a == b else f'{a}-{b}'}×{count}" for a, b, count in runs) or "-"


def standalone_instance(executor: dict) -> dict:
    """A standalone executor as the one-member instance the morph API takes (shared/core/plans.alone), in the shape
    of GET /v1/cluster's instances; its bits are the executor's own."""
    plan = alone(executor["id"], len(executor["layers"])).model_dump()
    for layer, bits in zip(plan["layers"], executor["layers"]):
        layer["bits"] = bits
    return {**plan, "replicas": [1] * len(plan["layers"])}


def slo_cells(leader: dict | None) -> list[str]:
    """Share of requests over an SLO, p95 TTFT and p95 TPOT over the monitor's window; '-' without requests."""
    slo = (leader or {}).get("slo") or {}
    if not slo.get("requests"):
        return ["-", "-", "-"]
    return [f"{100 * slo['violation_rate']:.1f}%", f"{slo['ttft_p95_s']:.3f}s", f"{slo['tpot_p95_s']:.3f}s"]


def instances_table(instances: list[dict], executors: list[dict], everyone: bool = False) -> str | None:
    """The instances, standalone executors' included; None when every executor serves alone (nothing to add
    to the executors' table) unless `everyone`."""
    if not everyone and not any(len(i["members"]) > 1 for i in instances):
        return None
    by_id = {e["id"]: e for e in executors}
    solo = [standalone_instance(e) for e in executors
            if e["alive"] and e.get("instance") is None and e.get("role", "leader") == "leader"]
    rows = [[i["id"], i["leader"], ",".join(i["members"]), i.get("tp", 1),
             by_id.get(i["leader"], {}).get("max_num_seqs") or "-", *slo_cells(by_id.get(i["leader"])),
             layer_runs([layer.get("bits", 16) for layer in i["layers"]]),
             replica_runs(i["replicas"]) if "replicas" in i else "-", placement_runs(i["layers"])]
            for i in [*instances, *solo]]
    if not rows:
        return "no instances"
    return table(["INSTANCE", "LEADER", "MEMBERS", "TP", "BATCH", "SLO_VIOL", "TTFT_P95", "TPOT_P95", "PLAN_BITS",
                  "REPLICAS", "LAYERS"], rows)


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


def instance_results_table(body: dict, results: list[dict]) -> str:
    """What each leader answered to a replicate, migrate, evict or batch `body`."""
    layers = body.get("layers")
    span = f"{layers[0]}-{layers[1]}" if isinstance(layers, list) and len(layers) == 2 else "-"
    rows = [[r["executor"], "ok" if r["ok"] else "REFUSED", body.get("instance", "-"), body["action"], span,
             body.get("from", "-"), body.get("to", "-"), body.get("max_num_seqs", "-"),
             f"{r['state']['seconds']:.3f}" if "seconds" in (r.get("state") or {}) else "-", r.get("error") or ""]
            for r in results]
    return table(["LEADER", "RESULT", "INSTANCE", "ACTION", "LAYERS", "FROM", "TO", "MAX_NUM_SEQS", "SECONDS",
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
                                            "runs of layers per placement (0-9 exec0 | 10-29 exec0+exec1); "
                                            "REPLICAS: runs of copies per layer (0-14×2 15-29×1)")
    _common(parser)
    parser.add_argument("--instances", action="store_true",
                        help="list the instances even when every executor serves alone (each is then the "
                             "instance i-<executor>, with its batch cap and SLO window)")
    args = parser.parse_args(argv)
    body = _call(parser.prog, "GET", f"{args.url.rstrip('/')}/v1/cluster", args.admin_key)
    if body is None:
        return 1
    print(cluster_table(body["executors"]))
    instances = instances_table(body.get("instances", []), body["executors"], args.instances)
    if instances is not None:
        print()
        print(instances)
    return 0


def morph_body(args: argparse.Namespace) -> dict:
    """The POST /v1/cluster/morph body: every flag given, under the API's name for it."""
    layers = args.layers
    if args.action in BITS_ACTIONS and layers is not None and len(layers) == 1:
        layers = layers[0]  # quantize and restore take a count
    given = {"executor": args.executor, "action": args.action, "instance": args.instance, "layers": layers,
             "bits": args.bits, "from": args.source, "to": args.to, "max_num_seqs": args.max_num_seqs,
             "executors": args.executors}
    return {name: value for name, value in given.items() if value is not None}


def morph_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="morphling morph", description="morph the cluster through a gateway, "
                                     "answered once the executors applied it: quantize or restore an executor's "
                                     "layers, or replicate, migrate or evict an instance's layers, or cap its batch, "
                                     "or merge executors into a TP instance and split it back",
                                     epilog="e.g. --action replicate --instance i0 --layers 0 14 --to exec1; "
                                            "--action batch --instance i-exec0 --max-num-seqs 8; "
                                            "--action tp_merge --executors exec0 exec1; "
                                            "--action tp_split --instance tp-exec0-exec1")
    _common(parser)
    parser.add_argument("--action", required=True, choices=(*BITS_ACTIONS, *INSTANCE_ACTIONS))
    parser.add_argument("--executor", help="quantize, restore: an executor id, or '*' for every live executor")
    parser.add_argument("--instance", help="replicate, migrate, evict, batch, tp_split: an instance id "
                                           "(i-<executor> for a standalone executor; see `morphling status "
                                           "--instances`)")
    parser.add_argument("--layers", nargs="+", type=int, metavar="N",
                        help="quantize, restore: how many layers (quantize: next full-precision ones in the swap "
                             "order; restore: the last quantized first); replicate, migrate, evict: the range "
                             "A B of decoder layers, both included")
    parser.add_argument("--bits", type=int, choices=(4, 8), help="quantize: target bits (required)")
    parser.add_argument("--to", metavar="EXECUTOR", help="replicate, migrate: the member that gets the layers, or an "
                        "executor serving alone, which joins the instance for them")
    parser.add_argument("--from", dest="source", metavar="EXECUTOR",
                        help="migrate, evict: the member that gives the layers up")
    parser.add_argument("--max-num-seqs", type=int, help="batch: the sequences the instance runs at once")
    parser.add_argument("--executors", nargs="+", metavar="EXECUTOR",
                        help="tp_merge: the executors serving alone that merge (2, or 4), the first leading")
    args = parser.parse_args(argv)
    if args.action in BITS_ACTIONS:
        if args.executor is None:
            parser.error(f"--executor is required for {args.action}")
        if args.layers is None:
            parser.error(f"--layers is required for {args.action}")
        if args.action == "quantize" and args.bits is None:
            parser.error("--bits is required for quantize")
        if args.action == "restore" and args.bits is not None:
            parser.error("restore returns layers to full precision and takes no --bits")
    body = morph_body(args)
    reply = _call(parser.prog, "POST", f"{args.url.rstrip('/')}/v1/cluster/morph", args.admin_key, body)
    if reply is None:
        return 1
    bits = args.action in BITS_ACTIONS
    print(results_table(reply["results"]) if bits else instance_results_table(body, reply["results"]))
    print()
    print(cluster_table(reply["executors"]))
    if not bits:  # the instance it changed, whatever the cluster's shape
        print()
        print(instances_table(reply.get("instances", []), reply["executors"], everyone=True))
    return 0 if all(r["ok"] for r in reply["results"]) else 1
