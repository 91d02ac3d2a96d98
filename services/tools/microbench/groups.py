"""`morphling bench-groups`: how long a process group of executors takes to form on demand (issue 54).

N processes each host a rendezvous of their own (`World.host`, as an executor does), learn one another's
`Peer` records (the service hears them on the bus; here they meet at one store, which is not what is timed), and
form the group of all of them the way an instance does: at its first member's store, under a key of every
member's incarnation (fabric/world.py). Timed, in each member, for each size and repeat: forming the group, its
first all-reduce, and forming it again after `drop` (a new group of the same members, as after a broken
instance). A group is formed when its slowest member has it, so each figure is the slowest member's; the
medians over repeats are reported, with a PNG beside the JSON.
"""

import argparse
import datetime
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from services.executor.fabric.world import Peer, World
from shared.net import free_port
from shared.provenance import provenance

TIMEOUT_S = 60.0
PARTS = ("form_s", "first_all_reduce_s", "reform_s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling bench-groups", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4", help="members per group, comma-separated (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="groups formed per size; medians count")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    return ap.parse_args(argv)


def _member(rank: int, size: int, meeting: int, repeats: int, results) -> None:
    """One executor's side: host a rendezvous, meet the others, then form, use, drop and re-form their group."""
    torch.set_num_threads(1)
    name = f"exec{rank}"
    world = World.host(name, rank, "127.0.0.1", "cpu", TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", meeting, is_master=rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    store.set(f"peer/{rank}", json.dumps([world.me.rendezvous, world.me.incarnation]))
    for other in range(size):
        rendezvous, incarnation = json.loads(store.get(f"peer/{other}"))
        world.admit(Peer(f"exec{other}", other, rendezvous, incarnation))
    members = [f"exec{r}" for r in range(size)]
    for repeat in range(repeats):
        store.add(f"start/{repeat}", 1)
        while int(store.add(f"start/{repeat}", 0)) < size:  # every member at the line before the clock starts
            time.sleep(0.001)
        start = time.perf_counter()
        group = world.group(members)
        formed = time.perf_counter()
        dist.all_reduce(torch.ones(1), group=group)
        reduced = time.perf_counter()
        del group
        world.drop(members)
        again = time.perf_counter()
        dist.all_reduce(torch.ones(1), group=world.group(members))
        reformed = time.perf_counter()
        world.drop(members)
        results.put((size, repeat, rank, formed - start, reduced - formed, reformed - again))
    store.add("done", 1)
    while rank == 0 and int(store.add("done", 0)) < size:  # the meeting store lives in rank 0
        time.sleep(0.01)
    world.close()


def measure(size: int, repeats: int) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    meeting = free_port()
    procs = [ctx.Process(target=_member, args=(r, size, meeting, repeats, results), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    got = [results.get(timeout=TIMEOUT_S * 2) for _ in range(size * repeats)]
    for p in procs:
        p.join(timeout=TIMEOUT_S)
    rows = []
    for repeat in range(repeats):
        mine = [g for g in got if g[1] == repeat]
        rows.append({"size": size, "repeat": repeat,
                     **{part: max(g[3 + i] for g in mine) for i, part in enumerate(PARTS)}})
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    sizes = sorted({r["size"] for r in rows})
    return [{"size": s, **{part: statistics.median(r[part] for r in rows if r["size"] == s) for part in PARTS}}
            for s in sizes]


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.25
    for i, part in enumerate(PARTS):
        ax.bar([j + i * width for j in range(len(summary))], [s[part] * 1e3 for s in summary], width, label=part)
    ax.set_xticks([j + width for j in range(len(summary))], [f"{s['size']} members" for s in summary])
    ax.set_ylabel("ms (slowest member, median)")
    ax.set_title("a process group formed on demand (gloo, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv if argv is not None else [])
    rows = [row for size in map(int, args.sizes.split(",")) for row in measure(size, args.repeats)]
    summary = summarise(rows)
    print(f"{'members':>8} {'form ms':>9} {'1st all-reduce ms':>18} {'re-form ms':>11}")
    for s in summary:
        print(f"{s['size']:>8} {s['form_s'] * 1e3:>9.1f} {s['first_all_reduce_s'] * 1e3:>18.1f} "
              f"{s['reform_s'] * 1e3:>11.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "fabric_groups.json"
    out.write_text(json.dumps({"summary": summary, "rows": rows, **provenance(args)}, indent=1, default=str))
    plot(summary, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0
