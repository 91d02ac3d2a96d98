"""`morphling profile`: rank decoder layers by MorphServe's Layer Importance Score into a swap order
(services/executor/engine/morphing/importance.py computes it; serving reads the result at start).

`--speedup`, `--latency` and `--indicator` hand the command line to the profile of that name, each with flags of its
own.
"""

import argparse
import sys
from pathlib import Path

from services.executor.engine.engine import LLMEngine
from services.executor.engine.morphing.importance import DEFAULT_PROFILE, WINDOW, run_profile, write_json
from services.executor.engine.morphing.variants import DEFAULT_CORPUS
from shared.config import EngineConfig, parse_size


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--speedup" in argv:  # another profile, with flags of its own
        from services.tools.profile import speedup

        return speedup.main([a for a in argv if a != "--speedup"])
    if "--latency" in argv:  # SplitQuant's latency cost model, with flags of its own
        from services.tools.profile import latency

        return latency.main([a for a in argv if a != "--latency"])
    if "--indicator" in argv:  # SplitQuant's variance indicator, with flags of its own
        from services.tools.profile import indicator

        return indicator.main([a for a in argv if a != "--indicator"])
    ap = argparse.ArgumentParser(prog="morphling profile", description=__doc__.splitlines()[0])
    ap.add_argument("--speedup", action="store_true",
                    help="instead, fit the speed-up model's coefficients (morphling profile --speedup --help)")
    ap.add_argument("--latency", action="store_true",
                    help="instead, fit the latency cost model per phase and bits (morphling profile --latency --help)")
    ap.add_argument("--indicator", action="store_true",
                    help="instead, rate each layer's quantization sensitivity by SplitQuant's variance indicator ω "
                         "(morphling profile --indicator --help)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--max-tokens", type=int, default=1024, help="calibration tokens (cut into windows)")
    ap.add_argument("--window", type=int, default=WINDOW)
    ap.add_argument("--memory-budget", default="600MiB")
    ap.add_argument("--out", type=Path, default=DEFAULT_PROFILE, help="the profile JSON to write")
    args = ap.parse_args(argv)

    engine = LLMEngine(EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget),
                                    max_model_len=args.window), progress=False)
    record = run_profile(engine, args.corpus, args.max_tokens, args.window, progress=True)
    print(f"{'step':>4} {'layer':>5} {'LTS':>7} {'LRS':>7} {'MDS':>7} {'LIS':>7}")
    for step, s in enumerate(record["steps"]):
        i = s["layer"]
        print(f"{step:>4} {i:>5} {record['lts'][i]:7.4f} {record['lrs'][i]:7.4f} {s['mds'][i]:7.4f} {s['lis']:7.4f}")
    write_json(args.out, record)
    print(f"swap order: {record['order']}\nwrote {args.out} ({record['tokens']} tokens, {record['seconds']:.0f} s)")
    return record
