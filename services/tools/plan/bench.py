"""`morphling bench-plan`: what SplitQuant's planner costs and predicts, and how its prediction holds up here.

1. Solve time by problem size: one ILP and one bit-width transfer heuristic on the same problem (one device
   order, one pair of micro-batches) for growing models and fleets, with the heuristic's gap to the ILP.
2. Fleets from the devices table (modelled latency): the plan's predicted output throughput against the
   paper's baselines, Uniform (one precision, even split) and Het (one precision, balanced split), as ratios.
3. On this CPU (measured latency): the plan `morphling plan` makes for two executors with unequal memory,
   run across two real processes, its measured prefill and decode step times against its predicted ones.

Prints a table per part and writes `splitquant.json` with a PNG of part 2 beside it.
"""

import argparse
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from services.tools.plan.run import analytic_omega
from services.tools.plan.run import main as plan_main
from shared.config import RESULTS_DIR
from shared.core.planner import heuristic, ilp
from shared.core.planner.devices import parse_devices
from shared.core.planner.latency import load_profile
from shared.core.planner.memory import PaperMemory, Workload
from shared.core.planner.problem import Costs, build, evaluate
from shared.core.planner.roofline import RooflineLatency
from shared.core.planner.search import Request, het, reference_latency, search, uniform
from shared.core.planner.shapes import SHAPES
from shared.provenance import provenance

THETA = 0.1
SIZES = [("llama-2-7b", "A100-40GB,T4"), ("llama-2-13b", "A100-40GB,T4,T4"), ("llama-2-13b", "V100-32GB,T4,T4,T4"),
         ("llama-2-70b", "A100-80GB,A100-40GB,V100-32GB,V100-32GB"),
         ("llama-2-70b", "A100-80GB,A100-40GB,V100-32GB,V100-32GB,T4,T4,T4,T4")]
FLEETS = [  # the paper's Table III where the table has the devices, and the A100 + 2 T4
    ("1xA100-40 + 2xT4", "A100-40GB,T4,T4", "llama-2-13b"),
    ("2xV100-32 + 1xA100-40 (cluster 2)", "V100-32GB,V100-32GB,A100-40GB", "llama-2-13b"),
    ("3xT4 + 1xV100-32 (cluster 5)", "T4,T4,T4,V100-32GB", "llama-2-13b"),
    ("3xP100-12 + 1xV100-32 (cluster 6)", "P100-12GB,P100-12GB,P100-12GB,V100-32GB", "llama-2-7b"),
    ("4xT4 (cluster 8)", "T4,T4,T4,T4", "llama-2-13b"),
    ("1xA100-80 + 2xL4", "A100-80GB,L4,L4", "llama-2-70b"),
]
WORKLOAD = Workload(batch=32, prompt=512, output=128)
CPU_DEVICES = "cpu:480MiB,cpu:650MiB"  # tests/integration/test_splitquant.py serves the same plan
CPU_WORKLOAD = "batch=16,prompt=448,output=64"


def fleet_request(devices: str, model: str, workload: Workload, group: int = 1) -> Request:
    shape = SHAPES[model]
    fleet = parse_devices(devices)
    memory = PaperMemory(shape, workload)
    raw = analytic_omega(shape, (16, 8, 4))
    omega = tuple(tuple(v / sum(r[2] for r in raw) for v in row) for row in raw)
    costs = Costs(shape.hidden_size, 2, (16, 8, 4), omega, memory.layer_bytes, memory.reserve, memory.floor,
                  memory.floor_why, 0.0)
    request = Request(tuple(fleet), tuple(RooflineLatency(d, shape) for d in fleet), costs, workload, group)
    return replace(request, costs=replace(costs, theta=THETA * reference_latency(request)))


def solve_times() -> list[dict]:
    rows = []
    for model, devices in SIZES:
        request = fleet_request(devices, model, WORKLOAD)
        problem = build(request.costs, request.devices, request.latencies, WORKLOAD, 4, WORKLOAD.batch)
        exact = ilp.solve(problem, time_limit=120)
        quick = heuristic.solve(problem, time_limit=120)
        best = evaluate(problem, exact.assignment).objective if exact.assignment else None
        found = evaluate(problem, quick.assignment).objective if quick.assignment else None
        rows.append(dict(model=model, devices=devices, layers=SHAPES[model].num_layers,
                         num_devices=problem.num_devices, variables=exact.variables, ilp_s=exact.seconds,
                         ilp_status=exact.status, heuristic_s=quick.seconds,
                         heuristic_gap=(found / best - 1) if best and found else None))
        r = rows[-1]
        gap = "-" if r["heuristic_gap"] is None else f"{r['heuristic_gap'] * 100:.1f}%"
        print(f"{model:<12} {r['num_devices']:>2} dev {r['layers']:>3} layers {r['variables']:>6} vars   "
              f"ILP {r['ilp_s']:8.3f} s ({r['ilp_status']})   heuristic {r['heuristic_s']:7.3f} s, gap {gap}",
              flush=True)
    return rows


def fleets(count: int | None = None) -> list[dict]:
    rows = []
    for name, devices, model in FLEETS[:count]:
        request = fleet_request(devices, model, WORKLOAD, group=2)
        started = time.perf_counter()
        plan = search(request)
        seconds = time.perf_counter() - started
        base, balanced = uniform(request), het(request)
        at_quality = search(replace(request, costs=replace(request.costs, omega_budget=base.evaluation.quality))) \
            if base is not None else None

        def rate(p):
            return None if p is None else p.throughput(WORKLOAD)

        bits = sorted({b for _, b in plan.layers}, reverse=True)
        rows.append(dict(fleet=name, devices=devices, model=model, plan_tokens_s=rate(plan), plan_bits=bits,
                         plan_omega=plan.evaluation.quality, search_s=seconds, problems=plan.solves,
                         at_uniform_quality_tokens_s=rate(at_quality),
                         uniform_tokens_s=rate(base), uniform_bits=base.layers[0][1] if base else None,
                         het_tokens_s=rate(balanced), het_bits=balanced.layers[0][1] if balanced else None))
        r = rows[-1]

        def ratio(x):
            return f"{r['plan_tokens_s'] / x:5.2f}x" if x else "  OOM"

        same = f"{r['at_uniform_quality_tokens_s'] / r['uniform_tokens_s']:5.2f}x" if base else "    -"
        print(f"{name:<36} {model:<12} plan {r['plan_tokens_s']:8.1f} tok/s bits {bits}   vs Uniform "
              f"{ratio(r['uniform_tokens_s'])} ({r['uniform_bits']}-bit)   vs Het {ratio(r['het_tokens_s'])} "
              f"({r['het_bits']}-bit)   at Uniform's quality {same}   ({seconds:.1f} s)", flush=True)
    return rows


def served_on_cpu(profile: Path, workdir: Path, threads: int, steps: int) -> dict:
    """The CPU plan's measured step times in two processes against its per-layer predictions."""
    import torch

    from services.executor.fabric.offline import Shape, instance_engine
    from shared.config import EngineConfig, parse_size
    from shared.sampling import SamplingOptions

    plan_file = workdir / "cpu_plan.json"
    if plan_main(["--devices", CPU_DEVICES, "--model", "default", "--workload", CPU_WORKLOAD,
                  "--profile", str(profile), "--out", str(plan_file), "--no-baselines"]) != 0:
        raise SystemExit("morphling plan failed for the CPU plan")
    record = json.loads(plan_file.read_text())
    bits = [layer["bits"] for layer in record["instances"][0]["layers"]]
    latency = load_profile(profile)
    prompt, batch = record["workload"]["prompt"], record["micro_batch"]["decode"]
    torch.set_num_threads(threads)
    # One budget for both: step times do not depend on it, and the larger device's fits either member.
    config = EngineConfig(model="default", memory_budget=parse_size("700MiB"),
                          max_model_len=record["workload"]["context"], max_num_batched_tokens=prompt)
    params = SamplingOptions(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    with instance_engine(config, Shape(2, plan_file=str(plan_file)), threads=threads) as engine:
        prefills = []
        for k in range(batch):
            engine.add_request(f"r{k}", [(7 * k + j) % 1000 + 10 for j in range(prompt)], params)
            started = time.perf_counter()
            engine.step()  # one sequence's prompt: one step (max_num_batched_tokens)
            prefills.append(time.perf_counter() - started)
        engine.step()
        decodes = []
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            decodes.append(time.perf_counter() - started)
        context = prompt + 2 + steps // 2
    predicted_prefill = sum(latency.prefill(b, 1, prompt) for b in bits)
    predicted_decode = sum(latency.decode(b, batch, context) for b in bits)
    out = dict(plan=record["instances"][0], devices=record["devices"], micro_batch=record["micro_batch"],
               prefill_measured_s=statistics.median(prefills[1:] or prefills), prefill_predicted_s=predicted_prefill,
               decode_measured_s=statistics.median(decodes), decode_predicted_s=predicted_decode,
               decode_batch=batch, decode_context=context, steps=steps, threads=threads)
    print(f"CPU plan {CPU_DEVICES}: bits {[bits.count(b) for b in (16, 8, 4)]} (16/8/4), "
          f"layers on exec0 {sum(1 for lay in record['instances'][0]['layers'] if lay['placement'] == ['exec0'])}\n"
          f"  prefill of one {prompt}-token prompt: measured {out['prefill_measured_s'] * 1e3:.1f} ms, "
          f"predicted (layers) {predicted_prefill * 1e3:.1f} ms, "
          f"ratio {out['prefill_measured_s'] / predicted_prefill:.2f}\n"
          f"  decode step of {batch} at ~{context} tokens: measured {out['decode_measured_s'] * 1e3:.1f} ms, "
          f"predicted (layers) {predicted_decode * 1e3:.1f} ms, "
          f"ratio {out['decode_measured_s'] / predicted_decode:.2f}",
          flush=True)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = [r["fleet"] for r in rows]
    width = 0.2
    for k, (key, label) in enumerate((("uniform_tokens_s", "Uniform"), ("het_tokens_s", "Het"),
                                      ("at_uniform_quality_tokens_s", "SplitQuant at Uniform's Σω"),
                                      ("plan_tokens_s", f"SplitQuant (θ={THETA})"))):
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))], [r[key] or 0 for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), names, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("predicted output tokens/s (modelled)")
    ax.set_title(f"batch {WORKLOAD.batch}, prompt {WORKLOAD.prompt}, output {WORKLOAD.output}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="morphling bench-plan", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "splitquant")
    ap.add_argument("--profile", type=Path, default=RESULTS_DIR / "latency_profile.json",
                    help="this CPU's latency profile, for part 3")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process in part 3 (the profile's)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed in part 3")
    ap.add_argument("--skip-served", action="store_true", help="parts 1 and 2 only (no model)")
    ap.add_argument("--fleets", type=int, default=None,
                    help=f"part 2's first N fleets only (default all {len(FLEETS)})")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print("1. solve time by problem size (one order, micro-batches 4 / 32)", flush=True)
    sizes = solve_times()
    print(f"\n2. fleets, predicted (modelled latency), batch {WORKLOAD.batch} × {WORKLOAD.prompt} + {WORKLOAD.output}",
          flush=True)
    fleet_rows = fleets(args.fleets)
    served = None if args.skip_served else served_on_cpu(args.profile, args.out, args.threads, args.steps)
    record = dict(solve_times=sizes, fleets=fleet_rows, served_on_cpu=served, workload=asdict(WORKLOAD),
                  theta=THETA, **provenance(args))
    (args.out / "splitquant.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(fleet_rows, args.out / "splitquant_fleets.png")
    print(f"wrote {args.out / 'splitquant.json'} and {args.out / 'splitquant_fleets.png'}")
    return record
