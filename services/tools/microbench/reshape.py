"""`morphling bench-reshape`: what CoCoServe's operations cost by number of layers (the paper's Table 2),
and (`--speedup`) how the speed-up model's predictions compare with measured speed-ups.

One instance of the issue's shape (two executors, every layer on exec0, exec1 spare; real processes in a
gloo world, fabric/offline.py) serves `--prompts` requests that hold KV; between two of their steps it
replicates layers [0, n) onto exec1 and evicts them again, then migrates layers [L-n, L) to exec1 and back,
for each n in `--layers`. The table gives each operation's time, the bytes it moved (weights and KV
rows) and the pages the destination took for the layers; the JSON and a chart go to `--out`.
"""

import argparse
import json
import os
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from services.executor.engine.engine import LLMEngine
from services.executor.fabric.offline import Shape, instance_engine
from services.tools.microbench.prompts import sharegpt_prompts
from shared.config import EngineConfig, data_dir, parse_size
from shared.core.speedup import SpeedupProfile, Strategy, speedup, speedup_eq4, speedup_with_overhead
from shared.messages import EvictArgs, MigrateArgs, ReplicateArgs
from shared.sampling import SamplingOptions

OPERATIONS = ("replicate", "evict", "migrate", "migrate back")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling bench-reshape", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--memory-budget", default="1GiB", help="each executor's arena (default %(default)s)")
    ap.add_argument("--layers", default="1,5,10,20,30", help="layer counts n (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=8, help="requests holding KV meanwhile (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each operation; the median counts")
    ap.add_argument("--speedup", action="store_true",
                    help="measure speed-ups against the model's predictions instead")
    ap.add_argument("--strategies", default="0-14,0-29,10-19,0-4+20-24",
                    help="layer ranges replicated on exec1, one strategy per comma (default %(default)s)")
    ap.add_argument("--batch", type=int, default=16, help="prompts generated at each strategy (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--profile", type=Path, default=Path("docs/results/speedup_profile.json"),
                    help="`morphling profile --speedup` output (default %(default)s)")
    ap.add_argument("--data", type=Path, default=data_dir())
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args(argv)
    args.layers = [int(n) for n in args.layers.split(",")]
    return args


def spare_plan(num_layers: int, directory: Path) -> Path:
    path = directory / "spare.json"
    path.write_text(json.dumps({"instances": [{"members": ["exec0", "exec1"],
                                               "layers": [{"placement": ["exec0"]}] * num_layers}]}))
    return path


def operations(n: int, num_layers: int) -> list:
    last = [num_layers - n, num_layers - 1]
    return [ReplicateArgs(instance="i0", layers=[0, n - 1], to="exec1"),
            EvictArgs(instance="i0", layers=[0, n - 1], source="exec1"),
            MigrateArgs(instance="i0", layers=last, source="exec0", to="exec1"),
            MigrateArgs(instance="i0", layers=last, source="exec1", to="exec0")]


def recompute_seconds(leader: LLMEngine, prompts: list[list[int]]) -> float:
    """What evicting by recomputation would cost instead: prefilling the sequences again (their KV of the
    evicted layers cannot be rebuilt without the layers before them)."""
    start = time.perf_counter()
    leader.generate(prompts, SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - start


def run(args) -> dict:
    config = EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget), max_model_len=512)
    probe = LLMEngine(config, progress=True)
    num_layers = probe.model_config.num_layers
    prompts = sharegpt_prompts(probe, args.data / "prompts" / "ShareGPT_V3_filtered_1000.json", args.prompts, 128, 0)
    layer_pages = probe.arena.slot_pages
    del probe
    counts = [n for n in args.layers if 1 <= n <= num_layers]
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            instance_engine(config, Shape(2, plan_file=str(spare_plan(num_layers, Path(tmp)))),
                            threads=threads) as leader:
        recompute_s = recompute_seconds(leader, prompts)
        params = SamplingOptions(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
        for i, prompt in enumerate(prompts):  # they run for the whole benchmark: KV that has to move
            leader.add_request(f"hold{i}", prompt, params.model_copy(update={"max_tokens": 512 - len(prompt)}))
        for _ in range(4):
            leader.step()
        print(f"recomputing the {len(prompts)} running sequences instead of moving their KV: {recompute_s:.3f} s")
        print(f"{'layers':>6} {'operation':>13} {'seconds':>8} {'MiB moved':>10} {'KV rows':>8} {'pages':>6}")
        for n in counts:
            samples: dict[str, list[dict]] = {name: [] for name in OPERATIONS}
            for _ in range(args.repeats):
                for name, op in zip(OPERATIONS, operations(n, num_layers)):
                    samples[name].append(leader.reshape(op))
                    leader.step()
            for name in OPERATIONS:
                reports = sorted(samples[name], key=lambda r: r["seconds"])
                mid = reports[len(reports) // 2]
                row = dict(layers=n, operation=name, seconds=mid["seconds"], bytes_moved=mid["bytes_moved"],
                           kv_rows_moved=mid["kv_rows_moved"],
                           pages_taken=n * layer_pages if name in ("replicate", "migrate") else 0)
                rows.append(row)
                print(f"{n:>6} {name:>13} {row['seconds']:>8.3f} {row['bytes_moved'] / 2**20:>10.1f} "
                      f"{row['kv_rows_moved']:>8} {row['pages_taken']:>6}", flush=True)
    result = dict(rows=rows, recompute_s=recompute_s,
                  config=dict(model=args.model, memory_budget=args.memory_budget, prompts=args.prompts,
                              repeats=args.repeats, threads_each=threads, layer_pages=layer_pages),
                  machine=dict(platform=platform.platform(), processor=platform.processor(),
                               cpus=len(os.sched_getaffinity(0)), torch=torch.__version__),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reshape_cost.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out / "reshape_cost.png")
    print(f"wrote {args.out / 'reshape_cost.json'} and {args.out / 'reshape_cost.png'}")
    return result


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (t_ax, b_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for name in OPERATIONS:
        mine = [r for r in rows if r["operation"] == name]
        t_ax.plot([r["layers"] for r in mine], [r["seconds"] for r in mine], marker="o", label=name)
        b_ax.plot([r["layers"] for r in mine], [r["bytes_moved"] / 2**20 for r in mine], marker="o", label=name)
    t_ax.set(xlabel="layers", ylabel="seconds", title="time of one operation")
    b_ax.set(xlabel="layers", ylabel="MiB", title="weights and KV moved")
    t_ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def strategy_ranges(text: str) -> list[list[int]]:
    """'0-4+20-24' -> [[0, 4], [20, 24]]"""
    return [[int(x) for x in part.split("-")] for part in text.split("+")]


def run_speedup(args) -> dict:

    profile = SpeedupProfile.load(args.profile)
    config = EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget), max_model_len=512)
    probe = LLMEngine(config, progress=True)
    num_layers = probe.model_config.num_layers
    prompts = sharegpt_prompts(probe, args.data / "prompts" / "ShareGPT_V3_filtered_1000.json", args.batch, 64, 1)
    del probe
    params = SamplingOptions(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            instance_engine(config, Shape(2, plan_file=str(spare_plan(num_layers, Path(tmp)))),
                            threads=threads) as leader:
        leader.generate(prompts[:2], params.model_copy(update={"max_tokens": 4}))  # warm-up

        def measure() -> float:
            start = time.perf_counter()
            leader.generate(prompts, params)
            return time.perf_counter() - start

        base = measure()
        print(f"{'strategy (on exec1)':>20} {'seconds':>8} {'measured':>9} {'Eq. 3':>6} {'Eq. 3+o':>8} {'Eq. 4':>6}")
        print(f"{'P0 (none)':>20} {base:>8.2f} {1:>8.2f}x")
        for text in args.strategies.split(","):
            ranges = strategy_ranges(text)
            for a, b in ranges:
                leader.reshape(ReplicateArgs(instance="i0", layers=[a, b], to="exec1"))
            strategy = Strategy.of_plan(leader.member.plan)
            seconds = measure()
            for a, b in ranges:
                leader.reshape(EvictArgs(instance="i0", layers=[a, b], source="exec1"))
            tokens = args.batch  # decode steps dominate: one token per sequence
            row = dict(strategy=text, seconds=seconds, measured=base / seconds,
                       eq3=speedup(strategy, profile, tokens),
                       eq3_overhead=speedup_with_overhead(strategy, profile, tokens),
                       eq4=speedup_eq4(strategy, profile, tokens))
            rows.append(row)
            print(f"{text:>20} {seconds:>8.2f} {row['measured']:>8.2f}x {row['eq3']:>5.2f}x "
                  f"{row['eq3_overhead']:>7.2f}x {row['eq4']:>5.2f}x", flush=True)
    result = dict(rows=rows, baseline_s=base,
                  config=dict(model=args.model, batch=args.batch, new_tokens=args.new_tokens, threads_each=threads,
                              profile=str(args.profile)),
                  machine=dict(platform=platform.platform(), processor=platform.processor(),
                               cpus=len(os.sched_getaffinity(0)), torch=torch.__version__),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speedup_measured.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'speedup_measured.json'}")
    return result


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    return run_speedup(args) if args.speedup else run(args)
