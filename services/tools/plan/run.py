"""`morphling plan`: SplitQuant's offline planner. Per-layer bits, layers placed across devices in pipeline order
and micro-batch sizes for a heterogeneous cluster, written as the plan `morphling up --plan` serves.

  morphling plan --devices A100-40GB,T4,T4 --model llama-2-13b --workload batch=32,prompt=512,output=128
  morphling plan --devices cpu:900MiB,cpu:700MiB --model default --profile docs/results/latency_profile.json

What is measured and what is modelled is said per device: a device named in a `--profile` (written by
`morphling profile --latency` on it) has measured layer times; any other is modelled from the devices table
(roofline.py). ω is computed from a checkpoint's weights (`--omega FILE`, else the shipped indicator when it
is of this model, else now); a named shape has no weights, so every layer is alike and only bits matter.

The plan file is the fabric's (`{"instances": [...]}`, executors exec0, exec1, ... in pipeline order) plus
"devices" (each executor's device and memory: `up --plan` gives each executor that memory as its arena
budget), "micro_batch", "workload" and "predicted". Bad input or no feasible plan: a message, exit 2.
"""

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

from shared.config import RESULTS_DIR
from shared.core.planner.devices import ClusterError, Device, describe, parse_devices, read_cluster
from shared.core.planner.latency import FittedLatency, LatencyError, load_profile
from shared.core.planner.memory import FULL_BITS, ArenaMemory, PaperMemory, Workload
from shared.core.planner.problem import Costs, LayerLatency
from shared.core.planner.roofline import RooflineLatency
from shared.core.planner.search import SOLVERS, Infeasible, Plan, Request, het, reference_latency, search, uniform
from shared.core.planner.shapes import SHAPES, ModelShape

DEFAULT_WORKLOAD = Workload(batch=32, prompt=512, output=128)
DEFAULT_THETA = 0.1
SHIPPED_OMEGA = RESULTS_DIR / "omega.json"


class PlanInputError(ValueError):
    """Input the planner cannot use; the message says which and why."""


def parse_workload(text: str) -> Workload:
    """`batch=32,prompt=512,output=128[,chunks=1]`, or a JSON file of the same keys."""
    if Path(text).is_file():
        try:
            fields = json.loads(Path(text).read_text())
        except ValueError as exc:
            raise PlanInputError(f"--workload {text}: not JSON: {exc}") from exc
    else:
        fields = {}
        for part in (p for p in text.split(",") if p.strip()):
            key, eq, value = part.partition("=")
            if not eq:
                raise PlanInputError(f"--workload: {part!r} is not key=value (batch, prompt, output, chunks)")
            fields[key.strip()] = value.strip()
    if not isinstance(fields, dict):
        raise PlanInputError("--workload: expected {\"batch\", \"prompt\", \"output\", \"chunks\"}")
    unknown = set(fields) - {"batch", "prompt", "output", "chunks"}
    if unknown:
        raise PlanInputError(f"--workload: unknown key {sorted(unknown)[0]!r} (batch, prompt, output, chunks)")
    values = asdict(DEFAULT_WORKLOAD)
    for key, value in fields.items():
        try:
            values[key] = int(value)
        except (TypeError, ValueError):
            raise PlanInputError(f"--workload: {key} must be a whole number, got {value!r}") from None
        if values[key] < 1:
            raise PlanInputError(f"--workload: {key} must be at least 1, got {value!r}")
    return Workload(**values)


def parse_bits(text: str) -> tuple[int, ...]:
    try:
        bits = tuple(sorted({int(b) for b in text.split(",") if b.strip()}, reverse=True))
    except ValueError:
        raise PlanInputError(f"--bits: expected widths such as 16,8,4, got {text!r}") from None
    if not bits or any(b not in (16, 8, 4) for b in bits):
        raise PlanInputError(f"--bits: the engine serves 16, 8 and 4 bits, got {text!r}")
    return bits


# --- the model: a named shape, or a checkpoint (ω from its weights, memory from its arena) ----------------

def analytic_omega(shape: ModelShape, bits: tuple[int, ...]) -> list[list[float]]:
    """Eq. (3) with every layer's weights alike (no checkpoint to read): Σ_o D_W·S(b)², S(b) = 1/(2^b − 1)."""
    return [[0.0 if b == FULL_BITS else shape.layer_params / (2**b - 1) ** 2 for b in bits]
            for _ in range(shape.num_layers)]


class Checkpoint:
    """What the planner reads of a checkpoint: its shape, its arena's geometry and ω (torch is imported here
    only, so that planning for a named shape needs no model)."""

    def __init__(self, model: str, block_size: int = 16):
        from shared.core.errors import ModelLoadError
        from services.executor.engine.model.loader import load_checkpoint

        self.model, self.block_size = model, block_size
        try:
            self.config = load_checkpoint(model).config
        except (OSError, ValueError, ModelLoadError) as exc:
            raise PlanInputError(f"--model {model}: not a checkpoint or a known shape ({', '.join(SHAPES)}): "
                                 f"{exc}") from exc
        self.shape = dataclasses.replace(self.config, name=model)  # a ModelConfig is its shape, named as asked

    def arena(self, dtype_name: str, workload: Workload, device: str) -> ArenaMemory:
        import torch

        from services.executor.engine.memory.arena import ArenaGeometry
        from services.executor.engine.model.decoder import int4_packing, layer_layout, variant_layout

        dtype = getattr(torch, dtype_name)
        cfg = self.config
        geometry = ArenaGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.block_size, dtype)
        page = geometry.page_bytes
        slot = {FULL_BITS: geometry.pages_for_bytes(layer_layout(cfg, dtype)[1]) * page}
        for bits in (8, 4):
            slot[bits] = geometry.pages_for_bytes(variant_layout(cfg, dtype, bits, int4_packing(device))[1]) * page
        return ArenaMemory(cfg.num_layers, page, self.block_size, slot, workload)

    def omega(self, bits: tuple[int, ...], path: Path | None) -> tuple[list[list[float]], str]:
        from services.tools.profile.indicator import IndicatorError, load_omega

        try:
            if path is not None:
                table = load_omega(path, self.config.num_layers)
                source = str(path)
            else:
                table, source = self._shipped_or_computed()
        except IndicatorError as exc:
            raise PlanInputError(str(exc)) from exc
        missing = [b for b in bits if b != FULL_BITS and b not in table]
        if missing:
            raise PlanInputError(f"ω of {source} has no {missing[0]}-bit values: write it with "
                                 f"`morphling profile --indicator --bits {','.join(str(b) for b in bits if b != 16)}`")
        return [[0.0 if b == FULL_BITS else table[b][i] for b in bits] for i in range(self.config.num_layers)], source

    def _shipped_or_computed(self) -> tuple[dict[int, list[float]], str]:
        from services.executor.engine.engine import LLMEngine
        from services.executor.engine.morphing.importance import fingerprint, load_tokens
        from services.executor.engine.morphing.variants import DEFAULT_CORPUS
        from services.tools.profile.indicator import CALIB_TOKENS, load_omega, omega
        from shared.config import EngineConfig, parse_size

        window = 512
        print(f"loading {self.model} for its variance indicator ω ...", file=sys.stderr, flush=True)
        engine = LLMEngine(EngineConfig(model=self.model, memory_budget=parse_size("1GiB"), max_model_len=window),
                           progress=False)
        key = fingerprint(engine)
        if SHIPPED_OMEGA.exists() and json.loads(SHIPPED_OMEGA.read_text()).get("model_fingerprint") == key:
            return load_omega(SHIPPED_OMEGA, self.config.num_layers), str(SHIPPED_OMEGA)
        tokens = load_tokens(engine, DEFAULT_CORPUS, CALIB_TOKENS)
        windows = [tokens[s:s + window] for s in range(0, len(tokens), window)]
        return omega(engine, windows), f"computed now from {len(tokens)} tokens of {DEFAULT_CORPUS.name}"


# --- latency per device: measured where a profile names it, else modelled ---------------------------------

def latencies(devices: list[Device], shape: ModelShape, profiles: list[FittedLatency], bits: tuple[int, ...],
              full_bytes: int) -> list[LayerLatency]:
    by_device = {p.device: p for p in profiles}
    out: list[LayerLatency] = []
    for d in devices:
        profile = by_device.get(d.name)
        if profile is not None:
            _check_profile(profile, shape, bits)
            out.append(profile)
        elif d.modelled:
            out.append(RooflineLatency(d, shape, full_bytes))
        else:
            raise PlanInputError(f"{d.name} has no datasheet figures to model its latency: measure it there with "
                                 f"`morphling profile --latency --device-name {d.name}` and pass --profile FILE")
    return out


def _check_profile(profile: FittedLatency, shape: ModelShape, bits: tuple[int, ...]) -> None:
    keys = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
    theirs = {k: profile.model.get(k) for k in keys}
    ours = {k: getattr(shape, k) for k in keys}
    if theirs != ours:
        raise PlanInputError(f"the profile of {profile.device} was measured on layers of {theirs}, the plan is for "
                             f"{shape.name} with {ours}: profile this model there, or leave the profile out")
    missing = [b for b in bits if b not in profile.bits]
    if missing:
        raise PlanInputError(f"the profile of {profile.device} has no {missing[0]}-bit times (it has {profile.bits})")


# --- the plan file and the table ---------------------------------------------------------------------------

def plan_record(plan: Plan, request: Request, workload: Workload, context: dict) -> dict:
    devices = [request.devices[i] for i in plan.order]
    executors = [f"exec{j}" for j in range(len(devices))]
    e = plan.evaluation
    reserve = [request.costs.reserve(j == 0, plan.prefill_batch) for j in range(len(devices))]
    return {
        "instances": [{"id": "i0", "leader": executors[0], "members": executors, "tp": 1, "slots": "placed",
                       "layers": [{"placement": [executors[j]], "bits": bits} for j, bits in plan.layers]}],
        "devices": [{"executor": x, "name": d.name, "memory": d.memory,
                     "latency": request.latencies[i].source}
                    for x, d, i in zip(executors, devices, plan.order)],
        "micro_batch": {"prefill": plan.prefill_batch, "decode": plan.decode_batch},
        "workload": asdict(workload) | {"context": workload.context},
        "predicted": predicted(plan, workload) | {
            "memory_bytes": [round(m + r) for m, r in zip(e.memory, reserve)]},
        **context,
        "solver": {"method": plan.solver, "problems": plan.solves, "seconds": round(plan.seconds, 3)},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def predicted(plan: Plan, workload: Workload) -> dict:
    e = plan.evaluation
    return {"throughput_tokens_s": plan.throughput(workload), "latency_s": e.latency,
            "stage_times_s": {"prefill": list(e.prefill_stages), "decode": list(e.decode_stages)},
            "omega": e.quality, "objective": e.objective}


def print_plan(plan: Plan, request: Request, workload: Workload) -> None:
    e = plan.evaluation
    print(f"{'stage':>5} {'executor':>8} {'device':<22} {'layers':>9} {'bits':<18} {'memory GiB':>16} "
          f"{'prefill ms':>10} {'decode ms':>9} latency")
    for j, i in enumerate(plan.order):
        d = request.devices[i]
        held = [n for n, (stage, _) in enumerate(plan.layers) if stage == j]
        bits = [b for stage, b in plan.layers if stage == j]
        mix = ", ".join(f"{b}×{bits.count(b)}" for b in sorted(set(bits), reverse=True)) or "-"
        span = f"{held[0]}-{held[-1]}" if held else "-"
        used = e.memory[j] + request.costs.reserve(j == 0, plan.prefill_batch)
        print(f"{j:>5} {'exec' + str(j):>8} {describe(d):<22} {span:>9} {mix:<18} "
              f"{used / (1 << 30):>7.2f} / {d.memory / (1 << 30):<6.2f} {e.prefill_stages[j] * 1e3:>10.2f} "
              f"{e.decode_stages[j] * 1e3:>9.3f} {request.latencies[i].source}")
    print(f"micro-batches: prefill {plan.prefill_batch}, decode {plan.decode_batch} of {workload.batch}; "
          f"predicted {plan.throughput(workload):.1f} output tokens/s ({e.latency:.2f} s for the batch), "
          f"Σω {e.quality:.3f}; {plan.solver}, {plan.solves} problems in {plan.seconds:.1f} s")


def compare(plan: Plan, baselines: dict[str, Plan | None], request: Request) -> dict:
    workload = request.workload
    out = {}
    for name, base in baselines.items():
        if base is None:
            print(f"{name:>8}: no uniform precision fits")
            out[name] = None
            continue
        ratio = plan.throughput(workload) / base.throughput(workload)
        print(f"{name:>8}: {base.layers[0][1]}-bit, {base.throughput(workload):.1f} tokens/s; the plan is "
              f"{ratio:.2f}x (Σω {base.evaluation.quality:.3f})")
        out[name] = predicted(base, workload) | {"bits": base.layers[0][1], "plan_speedup": ratio,
                                                 "layers_per_stage": [sum(1 for s, _ in base.layers if s == j)
                                                                      for j in range(len(base.order))],
                                                 "order": [request.devices[i].name for i in base.order]}
    return out


def build_request(args: argparse.Namespace) -> tuple[Request, dict]:
    devices = read_cluster(args.cluster) if args.cluster else parse_devices(args.devices)
    workload = parse_workload(args.workload)
    bits = parse_bits(args.bits)
    checkpoint = None if args.model in SHAPES else Checkpoint(args.model)
    shape = SHAPES[args.model] if checkpoint is None else checkpoint.shape
    on_cpu = all(d.name == "cpu" for d in devices)
    dtype_name = "float32" if on_cpu else "bfloat16"  # what the engine serves in there (EngineConfig.dtype auto)
    full_bytes = 4 if on_cpu else 2
    memory_model = args.memory_model or ("paper" if checkpoint is None else "arena")
    if memory_model == "arena":
        if checkpoint is None:
            raise PlanInputError("--memory-model arena needs a checkpoint (--model default or a path): the arena's "
                                 "pages are laid out from the model's own tensors")
        memory = checkpoint.arena(dtype_name, workload, "cpu" if on_cpu else "cuda")
    else:
        memory = PaperMemory(shape, workload, full_bytes)
    if checkpoint is None:
        omega, omega_source = analytic_omega(shape, bits), "modelled: every layer alike (a named shape has no weights)"
    else:
        omega, omega_source = checkpoint.omega(bits, args.omega)
    lowest = min(range(len(bits)), key=lambda k: bits[k])
    total = sum(row[lowest] for row in omega) or 1.0
    omega = tuple(tuple(v / total for v in row) for row in omega)  # Σω = 1 with every layer at the lowest bits
    try:
        profiles = [load_profile(p) for p in args.profile]
    except LatencyError as exc:
        raise PlanInputError(str(exc)) from exc
    lats = latencies(devices, shape, profiles, bits, full_bytes)
    costs = Costs(shape.hidden_size, full_bytes, bits, omega, memory.layer_bytes, memory.reserve, memory.floor,
                  memory.floor_why, theta=0.0, held_bytes=memory.held_bytes, start_reserve=memory.start_reserve)
    request = Request(tuple(devices), tuple(lats), costs, workload, args.group, args.solver, args.time_limit)
    theta = args.theta * reference_latency(request)
    request = replace(request, costs=replace(costs, theta=theta))
    context = {"model": {"name": shape.name, **{k: v for k, v in asdict(shape).items() if k != "name"}},
               "memory_model": memory_model, "omega_source": omega_source, "theta": args.theta,
               "bits": list(bits)}
    return request, context


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="morphling plan", description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--devices", help="devices-table rows in any order, each NAME or NAME:MEMORY, comma-separated")
    where.add_argument("--cluster", type=Path, help='the same as JSON: {"devices": [...], "link_GBps": 12.5}')
    ap.add_argument("--model", default="default",
                    help=f"a checkpoint (default, or a path) or a named shape: {', '.join(SHAPES)}")
    ap.add_argument("--workload", default="batch=32,prompt=512,output=128",
                    help="batch=B,prompt=s,output=n[,chunks=κ], or a JSON file of those keys")
    ap.add_argument("--bits", default="16,8,4", help="the bit widths a layer may take")
    ap.add_argument("--theta", type=float, default=DEFAULT_THETA,
                    help="θ: what quantizing every layer to the lowest bits is worth, as a fraction of the batch's "
                         "unpipelined full-precision latency (0: speed only)")
    ap.add_argument("--quality-budget",
                    help="Σω may not exceed this (1.0 = every layer at the lowest bits); `uniform`: the Uniform "
                         "baseline's Σω (the paper's §VI-C); `none`: no budget. Default: uniform's where a uniform "
                         "precision fits, so that a plan trades no quality for speed unasked")
    ap.add_argument("--profile", type=Path, action="append", default=[],
                    help="a latency profile (`morphling profile --latency`); it applies to devices of its name")
    ap.add_argument("--omega", type=Path,
                    help="the variance indicator of a checkpoint (`morphling profile --indicator`)")
    ap.add_argument("--memory-model", choices=("paper", "arena"),
                    help="default: arena (this runtime's) for a checkpoint, paper for a named shape")
    ap.add_argument("--group", type=int, default=1, help="layers decided together (the paper's layer grouping)")
    ap.add_argument("--solver", choices=SOLVERS, default="auto",
                    help="auto: the ILP, the bit-width transfer heuristic where the ILP is too large")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per ILP (or heuristic) run")
    ap.add_argument("--no-baselines", action="store_true", help="skip the Uniform and Het baselines")
    ap.add_argument("--out", type=Path, default=Path("plan.json"))
    args = ap.parse_args(argv)
    if args.group < 1 or args.time_limit <= 0 or args.theta < 0:
        print("morphling plan: --group and --time-limit must be positive, --theta not negative", file=sys.stderr)
        return 2
    try:
        request, context = build_request(args)
        request = default_budget(request) if args.quality_budget is None else with_budget(request, args.quality_budget)
        plan = search(request)
    except (ClusterError, PlanInputError, Infeasible, LatencyError) as exc:
        print(f"morphling plan: {exc}", file=sys.stderr)
        return 2
    record = plan_record(plan, request, request.workload, context)
    print_plan(plan, request, request.workload)
    if not args.no_baselines:
        record["baselines"] = compare(plan, {"uniform": uniform(request), "het": het(request)}, request)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def default_budget(request: Request) -> Request:
    """Uniform's quality, as the paper's evaluation plans (§VI-C); where no uniform precision fits, none, and says so:
    only a mixed plan can fit then."""
    try:
        return with_budget(request, "uniform")
    except Infeasible:
        print("morphling plan: no uniform precision fits, so the plan has no quality budget (the default is the "
              "Uniform baseline's)", file=sys.stderr)
        return request


def with_budget(request: Request, budget: str) -> Request:
    if budget == "none":
        return request
    if budget == "uniform":
        base = uniform(request)
        if base is None:
            raise Infeasible("--quality-budget uniform: no uniform precision fits, so there is no budget to match")
        value = base.evaluation.quality
    else:
        try:
            value = float(budget)
        except ValueError:
            raise PlanInputError(f"--quality-budget: a number, `uniform` or `none`, got {budget!r}") from None
    return replace(request, costs=replace(request.costs, omega_budget=value))
