"""`morphling bench-amoebas`: what a runtime TP merge and split cost (AMOEBAs' Figs. 9-10 in miniature).

Two executor processes in one gloo world each serve real ShareGPT requests alone, merge between two steps
into one TP2 instance (the FFN cut in place, the KV moved by head), step merged, split back (the KV first,
then the FFN refilled from the host variants) and step alone again; every repeat on live KV. Each member
reports its time per part of the transformation, the KV bytes it sent and received, the buffers that took
(the extra memory of a transformation) and the slot pages its FFN cut freed; the leader also times its
steps alone, merged and alone again.
"""

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from services.executor.engine.engine import LLMEngine
from services.executor.fabric import step as wire
from services.executor.fabric.transform import merge, split
from services.executor.fabric.world import World, WorldSettings
from services.tools.microbench.prompts import sharegpt_prompts
from shared.config import EngineConfig, data_dir, parse_size
from shared.net import free_port
from shared.sampling import SamplingOptions

MEMBERS = ["exec0", "exec1"]
MERGE_PARTS = ("ffn_s", "share_s", "plan_s", "kv_s", "total_s")
SPLIT_PARTS = ("share_s", "plan_s", "kv_s", "ffn_s", "total_s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling bench-amoebas", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--memory-budget", default="600MiB", help="each executor's arena (default %(default)s)")
    ap.add_argument("--requests", type=int, default=8, help="running on each executor (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="each prompt cut to this (default %(default)s)")
    ap.add_argument("--steps", type=int, default=8, help="steps timed in each phase (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="merge and split cycles; medians count")
    ap.add_argument("--data", type=Path, default=data_dir())
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    return ap.parse_args(argv)


def _config(args) -> EngineConfig:
    return EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget), max_model_len=1024,
                        prepare_variants=True)


def _join(config: EngineConfig, url: str, rank: int) -> World:
    return World.join(WorldSettings(url, rank, 2, 120.0), MEMBERS[rank], config.device)


def _fill(engine: LLMEngine, prompts: list[list[int]], tag: str) -> None:
    params = SamplingOptions(temperature=0.0, max_tokens=512, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)


def _warm(engine: LLMEngine) -> None:
    """Step until every request is decoding: the timed steps then compare like with like."""
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()


def _boundary(world: World) -> None:
    """Both members at the same step boundary before a transformation, so that neither times its wait."""
    torch.distributed.barrier(group=world.group(MEMBERS))


def _timed_steps(engine: LLMEngine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def _drain(engine: LLMEngine) -> None:
    for request_id in list(engine._requests):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()


def _follower(args, url: str, prompts: list[list[int]], reports) -> None:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))
    config = _config(args)
    world = _join(config, url, 1)
    engine = LLMEngine(config, progress=False)
    for repeat in range(args.repeats):
        _fill(engine, prompts, f"f{repeat}")
        _warm(engine)
        _boundary(world)
        _timed_steps(engine, args.steps)
        _boundary(world)
        member = merge(engine, world, MEMBERS, "exec1", "m0")
        while member.follow_one() != wire.SPLIT:
            pass
        reports.put({"merge": member.merged_state.report, "split": split(engine, member)})
        _timed_steps(engine, args.steps)
        _drain(engine)
    world.close()


def run(args) -> dict:
    config = _config(args)
    probe = LLMEngine(config, progress=True)
    prompts = sharegpt_prompts(probe, args.data / "prompts" / "ShareGPT_V3_filtered_1000.json", 2 * args.requests,
                               args.prompt_tokens, 0)
    unit_bytes = probe.arena.page_bytes // probe.arena.kv_cache.shape[1]
    del probe
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}"
    follower = ctx.Process(target=_follower, args=(args, url, prompts[args.requests:], reports), daemon=True)
    follower.start()
    world = _join(config, url, 0)
    rows = []
    try:
        engine = LLMEngine(config, progress=False)
        for repeat in range(args.repeats):
            _fill(engine, prompts[:args.requests], f"l{repeat}")
            _warm(engine)
            _boundary(world)
            alone = _timed_steps(engine, args.steps)
            _boundary(world)
            member = merge(engine, world, MEMBERS, "exec0", "m0")
            merged = _timed_steps(engine, args.steps)
            split_report = split(engine, member)
            after = _timed_steps(engine, args.steps)
            other = reports.get(timeout=600)
            rows.append(dict(repeat=repeat, step_alone_s=alone, step_merged_s=merged, step_after_s=after,
                             exec0=dict(merge=member.merged_state.report, split=split_report), exec1=other))
            print(f"repeat {repeat}: merge {member.merged_state.report['total_s'] * 1e3:.1f} ms, split "
                  f"{split_report['total_s'] * 1e3:.1f} ms; step {alone * 1e3:.0f} ms alone, {merged * 1e3:.0f} ms "
                  f"merged, {after * 1e3:.0f} ms alone again", flush=True)
            _drain(engine)
    finally:
        world.close()
        follower.join(timeout=120)
    result = dict(rows=rows, summary=summarise(rows), unit_bytes=unit_bytes,
                  config=dict(model=args.model, memory_budget=args.memory_budget, requests=args.requests,
                              prompt_tokens=args.prompt_tokens, steps=args.steps, repeats=args.repeats),
                  machine=dict(platform=platform.platform(), cpus=len(os.sched_getaffinity(0)),
                               torch=torch.__version__),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    print_table(result["summary"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "amoebas_transform.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'amoebas_transform.json'}")
    return result


def summarise(rows: list[dict]) -> dict:
    """Medians over the repeats, per member and transformation."""
    out: dict = {"step_ms": {k: 1e3 * statistics.median(r[f"step_{k}_s"] for r in rows)
                             for k in ("alone", "merged", "after")}}
    for who in MEMBERS:
        for kind in ("merge", "split"):
            reports = [r[who][kind] for r in rows]
            out[f"{who} {kind}"] = {k: statistics.median(rep[k] for rep in reports)
                                    for k in reports[0] if isinstance(reports[0][k], (int, float))}
    return out


def print_table(summary: dict) -> None:
    print(f"{'':>12} {'FFN ms':>8} {'share ms':>9} {'plan ms':>8} {'KV ms':>7} {'total ms':>9} {'KV MiB':>7} "
          f"{'buffers MiB':>11} {'FFN pages':>9}")
    for key in (f"{w} {k}" for k in ("merge", "split") for w in MEMBERS):
        r = summary[key]
        pages = r.get("ffn_pages_freed", r.get("ffn_bytes_refilled", 0))
        print(f"{key:>12} {r['ffn_s'] * 1e3:>8.1f} {r['share_s'] * 1e3:>9.1f} {r['plan_s'] * 1e3:>8.1f} "
              f"{r['kv_s'] * 1e3:>7.1f} {r['total_s'] * 1e3:>9.1f} "
              f"{(r['kv_bytes_sent'] + r['kv_bytes_received']) / 2**20:>7.2f} {r['buffer_bytes'] / 2**20:>11.2f} "
              f"{pages if 'ffn_pages_freed' in r else '-':>9}")
    s = summary["step_ms"]
    print(f"step time (exec0): {s['alone']:.1f} ms alone, {s['merged']:.1f} ms merged (TP2), "
          f"{s['after']:.1f} ms alone after the split")


def main(argv: list[str]) -> dict:
    return run(parse_args(argv))
