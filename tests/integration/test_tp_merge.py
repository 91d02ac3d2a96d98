"""AMOEBAs' runtime merge and split across real processes (a gloo world, no bus): two executors serving alone,
each with requests mid-generation, merge between two steps into one TP2 instance (FFN cut in place, KV
moved by head); the instance takes a new request, runs, and splits back (KV first, the FFN refilled), and
each executor finishes its requests alone: every request gets exactly the tokens one engine alone
generates, nothing recomputed, nothing lost. Four executors likewise merge into one TP4 instance."""

import multiprocessing

from services.executor.engine.engine import LLMEngine
from services.executor.fabric import step as wire
from services.executor.fabric.transform import merge, split
from services.executor.fabric.world import FabricError, World, WorldSettings
from shared.config import EngineConfig
from shared.net import free_port
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3, write_tiny_llama_8kv

# exec0's two prompts are the longer: more blocks there, so the split gives the request that arrived merged
# (r4) to exec1.
PROMPTS = ["A B C D E F G H I J K L M N O P Q R S T U V W", "Hello there, how are you today, my old friend and",
           "The quick brown fox", "In 1990 the city of", "Rain fell on the roof all night"]
NEW_TOKENS = 30
STEPS_ALONE = 3
STEPS_MERGED = 9  # past a block boundary: new blocks by head unit
TIMEOUT_S = 60.0


def _join(config: EngineConfig, url: str, rank: int) -> World:
    return World.join(WorldSettings(url, rank, 2, TIMEOUT_S), f"exec{rank}", "cpu")


def _step(engine: LLMEngine, out: dict[str, list[int]]) -> None:
    for d in engine.step():
        out.setdefault(d.request_id, []).extend(d.token_ids)


def _config(model: str, tmp_path) -> EngineConfig:
    # Four sequences at once, in arenas of a few hundred pages of 8 tokens.
    return EngineConfig(model=model, memory_budget=4 << 20, block_size=8, max_model_len=128, max_num_seqs=4,
                        prepare_variants=True, variant_cache_dir=str(tmp_path / "variants"))


def _finish(engine: LLMEngine) -> dict[str, list[int]]:
    """Step `engine` until its requests end; the tokens they got meanwhile."""
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        _step(engine, out)
    return out


def _alone_first(config: EngineConfig, params: SamplingOptions, requests: tuple[int, ...]
                 ) -> tuple[LLMEngine, dict[str, list[int]]]:
    """An engine serving alone, `STEPS_ALONE` steps into `requests`, and the tokens they have so far."""
    engine = LLMEngine(config, progress=False)
    for i in requests:
        engine.add_request(f"r{i}", PROMPTS[i], params)
    out: dict[str, list[int]] = {}
    for _ in range(STEPS_ALONE):
        _step(engine, out)
    return engine, out


def _exec1(config: EngineConfig, url: str, params: SamplingOptions, before, after) -> None:
    world = _join(config, url, 1)
    engine, out = _alone_first(config, params, (2, 3))
    before.put(out)
    member = merge(engine, world, ["exec0", "exec1"], "exec1", "m0")
    try:
        while member.follow_one() != wire.SPLIT:
            pass
        split(engine, member)
        after.put(_finish(engine))
    except FabricError as exc:
        after.put(repr(exc))
    world.close()


def test_two_executors_merge_mid_stream_into_tp2_and_split_back_and_every_request_keeps_its_tokens(tmp_path):
    # Four sequences at once: the request added to the merged instance waits there, with no blocks, until the
    # split hands it to a member.
    config = _config(str(write_tiny_llama3(tmp_path / "tiny")), tmp_path)
    params = SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [c.outputs[0].token_ids for c in LLMEngine(config, progress=False).generate(PROMPTS, params)]

    ctx = multiprocessing.get_context("spawn")
    before, after = ctx.Queue(), ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}"
    follower = ctx.Process(target=_exec1, args=(config, url, params, before, after), daemon=True)
    follower.start()
    world = _join(config, url, 0)
    try:
        engine, out = _alone_first(config, params, (0, 1))
        member = merge(engine, world, ["exec0", "exec1"], "exec0", "m0")
        assert member.is_leader and member.plan.tp == 2 and engine.member is member
        for rid, tokens in before.get(timeout=TIMEOUT_S).items():
            out.setdefault(rid, []).extend(tokens)
        engine.add_request("r4", PROMPTS[4], params)  # arrives merged: the split gives it a member
        for _ in range(STEPS_MERGED):
            _step(engine, out)
        blocks = member.num_blocks
        assert [s.request_id for s in engine.scheduler.waiting] == ["r4"]
        split(engine, member)
        assert engine.member is None and set(engine._requests) == {"r0", "r1"}  # r4 went to exec1, the less loaded
        while engine.has_unfinished():
            _step(engine, out)
        alone = after.get(timeout=TIMEOUT_S)
        assert isinstance(alone, dict), alone
        for rid, tokens in alone.items():
            out.setdefault(rid, []).extend(tokens)
    finally:
        world.close()
        follower.join(timeout=TIMEOUT_S)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert blocks > 0 and engine.stats().running == 0
    engine.arena.ledger.check_consistency()
    assert engine.arena.ledger.num_free == engine.arena.ledger.snapshot().pages_kv  # every page back


def _member_of_four(config: EngineConfig, url: str, rank: int, params: SamplingOptions, out_queue) -> None:
    """One of four executors: alone for a few steps, merged into TP4 (exec3 leading: not in rank order), and
    alone again after the split; puts the tokens it generated (or what went wrong)."""
    names = [f"exec{r}" for r in range(4)]
    world = World.join(WorldSettings(url, rank, 4, TIMEOUT_S), names[rank], "cpu")
    try:
        engine, alone = _alone_first(config, params, (rank,))
        members = ["exec3", "exec0", "exec1", "exec2"]
        member = merge(engine, world, members, names[rank], "m4")
        merged: dict[str, list[int]] = {}
        if member.is_leader:
            for _ in range(STEPS_MERGED):
                _step(engine, merged)
        else:
            while member.follow_one() != wire.SPLIT:
                pass
        split(engine, member)
        out_queue.put((rank, [alone, merged, _finish(engine)], member.plan.tp))
    except Exception as exc:  # reported, so that the test fails with it instead of timing out
        out_queue.put((rank, repr(exc), 0))
    finally:
        world.close()


def test_four_executors_merge_into_tp4_out_of_rank_order_and_split_back_with_every_request_intact(tmp_path):
    config = _config(str(write_tiny_llama_8kv(tmp_path / "tiny8kv")), tmp_path)
    params = SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [c.outputs[0].token_ids for c in LLMEngine(config, progress=False).generate(PROMPTS[:4], params)]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_member_of_four, args=(config, url, r, params, results), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    phases: list[dict[str, list[int]]] = [{}, {}, {}]  # alone, merged (the leader's), alone again
    try:
        for _ in procs:
            rank, out, tp = results.get(timeout=2 * TIMEOUT_S)
            assert isinstance(out, list), f"exec{rank}: {out}"
            assert tp == 4
            for phase, tokens in zip(phases, out):
                phase.update(tokens)
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
    assert all(phases[1].get(f"r{i}") for i in range(4))  # every request took merged steps
    assert [[t for phase in phases for t in phase.get(f"r{i}", [])] for i in range(4)] == expected
