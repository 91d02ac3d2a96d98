"""CoCoServe onto an executor serving alone, across real processes (a gloo world, no bus): two executors serve
alone, each with requests mid-generation; exec1 joins exec0's instance between two steps (its requests go to
exec0, their KV computed again), takes a replica of every layer and a share of the batch, and once its replicas
are evicted leaves the instance and serves alone again with its whole model. Every request gets exactly the
tokens one engine alone generates, and every ledger adds up. A join that does not fit is refused alike by both,
nothing changed."""

import multiprocessing

import pytest

from services.executor.engine.engine import LLMEngine
from services.executor.fabric import enlist
from services.executor.fabric import step as wire
from services.executor.fabric.world import FabricError, World, WorldSettings
from shared.config import EngineConfig
from shared.core.errors import ReshapeRefused
from shared.core.plans import alone
from shared.messages import EvictArgs, ReplicateArgs
from shared.net import free_port
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3
from tests.integration.test_tp_merge import PROMPTS as MERGE_PROMPTS
from tests.integration.test_tp_merge import _alone_first, _step

PROMPTS = [*MERGE_PROMPTS, "One two three four"]
NEW_TOKENS = 24
STEPS_REPLICATED = 8
TIMEOUT_S = 60.0


def _config(model: str, budget: int = 4 << 20) -> EngineConfig:
    return EngineConfig(model=model, memory_budget=budget, block_size=8, max_model_len=128, max_num_seqs=4)


def _exec1(config: EngineConfig, url: str, params: SamplingOptions, results) -> None:
    world = World.join(WorldSettings(url, 1, 2, TIMEOUT_S), "exec1", "cpu")
    engine, out = _alone_first(config, params, (2, 3))
    results.put(out)
    try:
        member = enlist.join(engine, world, "exec1", "exec0", "i-exec0")
        results.put({"held": [i for i, views in enumerate(engine.model.layers) if views is not None],
                     "blocks": member.num_blocks})
        replicated = False
        while True:
            kind = member.follow_one()
            replicated |= kind == wire.RESHAPE and bool(engine.model.layers[0] is not None)
            if kind == wire.PART and "exec1" not in member.plan.members:
                break
        enlist.leave(engine, member)
        engine.add_request("r5", PROMPTS[5], params)  # alone again: it serves a request of its own
        alone_out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            _step(engine, alone_out)
        ledger = engine.arena.ledger
        ledger.check_consistency()
        results.put({"replicated": replicated, "out": alone_out, "bits": list(engine.model.layer_bits),
                     "all_free": ledger.num_free == ledger.snapshot().pages_kv})
    except (FabricError, ReshapeRefused) as exc:
        results.put(repr(exc))
    world.close()


def test_an_executor_serving_alone_joins_for_replicas_and_leaves_and_every_request_keeps_its_tokens(tmp_path):
    config = _config(str(write_tiny_llama3(tmp_path / "tiny")))
    params = SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [c.outputs[0].token_ids for c in LLMEngine(config, progress=False).generate(PROMPTS, params)]

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}"
    newcomer = ctx.Process(target=_exec1, args=(config, url, params, results), daemon=True)
    newcomer.start()
    world = World.join(WorldSettings(url, 0, 2, TIMEOUT_S), "exec0", "cpu")
    try:
        engine, out = _alone_first(config, params, (0, 1))
        layers = engine.model_config.num_layers
        plan = alone("exec0", layers)
        carried, report = enlist.lead_join(engine, world, plan, "exec1")
        member = engine.member
        assert member.plan.members == ["exec0", "exec1"] and member.joined == {"exec1"}
        assert report["sequences_recomputed"] == 2 and carried is None
        for rid, tokens in results.get(timeout=TIMEOUT_S).items():
            out.setdefault(rid, []).extend(tokens)
        joined = results.get(timeout=TIMEOUT_S)
        assert joined == {"held": [], "blocks": member.num_blocks}, joined
        assert {s.request_id for s in engine.scheduler.waiting} >= {"r2", "r3"}  # exec1's, to be computed again

        replicate = engine.reshape(ReplicateArgs(instance=plan.id, layers=[0, layers - 1], to="exec1"))
        assert replicate["layers_copied"] == layers
        engine.add_request("r4", PROMPTS[4], params)  # a newcomer request: it may go to exec1's replica
        for _ in range(STEPS_REPLICATED):
            _step(engine, out)
        assert "exec1" in engine.runner.sticky[0].values()  # exec1's replica computed some requests' rows
        engine.reshape(EvictArgs(instance=plan.id, layers=[0, layers - 1], source="exec1"))
        left, after = enlist.lead_part(engine, engine.member)
        assert left == ["exec1"] and after.members == ["exec0"] and engine.member is None
        while engine.has_unfinished():
            _step(engine, out)
        alone_again = results.get(timeout=TIMEOUT_S)
        assert isinstance(alone_again, dict), alone_again
    finally:
        world.close()
        newcomer.join(timeout=TIMEOUT_S)
    out |= alone_again["out"]
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert alone_again["replicated"] and alone_again["all_free"]
    assert alone_again["bits"] == [engine.model.full_bits] * layers
    ledger = engine.arena.ledger
    ledger.check_consistency()
    assert ledger.num_free == ledger.snapshot().pages_kv  # every page back


def _small_newcomer(config: EngineConfig, url: str, results) -> None:
    world = World.join(WorldSettings(url, 1, 2, TIMEOUT_S), "exec1", "cpu")
    engine = LLMEngine(config, progress=False)
    try:
        enlist.join(engine, world, "exec1", "exec0", "i-exec0")
        results.put("joined")
    except ReshapeRefused as exc:
        results.put((str(exc), all(views is not None for views in engine.model.layers), engine.member is None))
    world.close()


def test_a_join_the_newcomer_cannot_back_is_refused_by_both_and_changes_nothing(tmp_path):
    model = str(write_tiny_llama3(tmp_path / "tiny"))
    config = _config(model)
    params = SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}"
    # exec1's whole arena holds fewer pages than exec0 has outside its slots.
    newcomer = ctx.Process(target=_small_newcomer, args=(_config(model, 3 << 20), url, results), daemon=True)
    newcomer.start()
    world = World.join(WorldSettings(url, 0, 2, TIMEOUT_S), "exec0", "cpu")
    try:
        engine, out = _alone_first(config, params, (0, 1))
        before = engine.stats().ledger
        with pytest.raises(ReshapeRefused, match="no memory: exec1 can back"):
            enlist.lead_join(engine, world, alone("exec0", engine.model_config.num_layers), "exec1")
        message, whole, alone_still = results.get(timeout=TIMEOUT_S)
        assert "no memory" in message and whole and alone_still
        assert engine.member is None and engine.stats().ledger == before
        while engine.has_unfinished():
            _step(engine, out)
    finally:
        world.close()
        newcomer.join(timeout=TIMEOUT_S)
    assert all(len(out[f"r{i}"]) == NEW_TOKENS for i in (0, 1))
