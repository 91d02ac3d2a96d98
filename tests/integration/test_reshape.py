"""CoCoServe's operations on a running instance (real processes in a gloo world, `fabric/offline.py`):
replicate, migrate and evict layer ranges between steps while requests run, and greedy output stays what
one executor alone generates, every request gets all its tokens, and every ledger adds up afterwards; and
MorphServe's quantize and restore, taken by the instance as a whole, generate what one executor does with
the same layers swapped.

The instance starts as the issue's: two executors, every layer on exec0, exec1 spare. Its KV is what the
member with the fewest pages outside slots can back: it grows when layers leave exec0 and exec1 holds few,
and shrinks when they come back (live blocks then move below the ids the instance gives up).
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.executor.engine.engine import LLMEngine
from services.executor.fabric.offline import Shape, instance_engine
from shared.config import EngineConfig
from shared.core.errors import ReshapeRefused
from shared.messages import EvictArgs, MigrateArgs, QuantizeArgs, ReplicateArgs, RestoreArgs
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama_8kv

PROMPTS = ["The quick brown fox", "In 1990 the city", "Hello there, how are", "A B C D E F G", "One two three",
           "Rain fell on the roof", "She opened the door and", "Numbers: 1 2 3 4"]
NEW_TOKENS = 16
LAYERS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshape")
    model = write_tiny_llama_8kv(tmp / "tiny")
    plan = tmp / "spare.json"
    plan.write_text(json.dumps({"instances": [{"members": ["exec0", "exec1"],
                                               "layers": [{"placement": ["exec0"]}] * LAYERS}]}))
    # Pages of 32 KiB; a layer slot takes 25 (its FFN padded from 200 to 4 x 64 channels): 124 pages leave 24
    # blocks beside every layer, 74 beside two.
    config = EngineConfig(model=str(model), memory_budget=124 * 32768, block_size=8, max_model_len=96)
    params = SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [c.outputs[0].token_ids for c in LLMEngine(config, progress=False).generate(PROMPTS, params)]
    return config, str(plan), params, expected


def run(engine, params, arrivals: dict[int, list[int]], ops: dict[int, object]) -> tuple[dict, list]:
    """Step `engine`: prompts `arrivals[k]` join before step k, `ops[k]` applies before step k."""
    out: dict[str, list[int]] = {}
    reports, step = [], 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], params)
        if step in ops:
            try:
                reports.append((ops[step], engine.reshape(ops[step])))
            except ReshapeRefused as exc:
                reports.append((ops[step], exc))
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
        step += 1
    return out, reports


def test_replicate_migrate_evict_mid_stream_keep_every_token_and_the_ledgers_exact(setup):
    config, plan, params, expected = setup
    with instance_engine(config, Shape(2, plan_file=plan), timeout_s=60) as engine:
        blocks = engine.member.num_blocks
        ops = {3: ReplicateArgs(instance="i0", layers=[0, 3], to="exec1"),  # requests 4.. go to exec1's replica
               9: MigrateArgs(instance="i0", layers=[2, 3], source="exec0", to="exec1"),
               13: EvictArgs(instance="i0", layers=[0, 1], source="exec1"),  # exec1's requests move to exec0
               17: MigrateArgs(instance="i0", layers=[2, 3], source="exec1", to="exec0")}
        out, reports = run(engine, params, {0: [0, 1, 2, 3], 5: [4, 5, 6, 7]}, ops)
        assert [out[f"r{i}"] for i in range(len(PROMPTS))] == expected
        replicate, migrate, evict, back = (report for _, report in reports)
        assert replicate["layers_copied"] == 4 and replicate["blocks_after"] == blocks == 24
        assert migrate["kv_rows_moved"] > 0 and evict["kv_rows_moved"] > 0
        assert evict["blocks_after"] == 74  # each member now holds two layers
        assert back["blocks_after"] == blocks and back["layers_copied"] == 2
        assert back["blocks_relocated"] > 0  # live KV moved below the ids the instance gave up
        assert [layer.placement for layer in engine.member.plan.layers] == [["exec0"]] * LAYERS
        stats = engine.stats().ledger
        assert stats.pages_kv_used == 0 and stats.pages_kv_free == blocks
        engine.member.blocks.check_consistency()
        engine.member.arena.ledger.check_consistency()


def test_a_refused_operation_changes_nothing(setup):
    config, plan, _, _ = setup
    long = SamplingOptions(temperature=0.0, max_tokens=48, ignore_eos=True)
    with instance_engine(config, Shape(2, plan_file=plan), timeout_s=60) as engine:
        engine.reshape(MigrateArgs(instance="i0", layers=[2, 3], source="exec0", to="exec1"))
        assert engine.member.num_blocks == 74
        for i in range(len(PROMPTS)):
            engine.add_request(f"r{i}", PROMPTS[i], long)
        for _ in range(30):
            engine.step()
        before, used = engine.member.plan, engine.stats().ledger.pages_kv_used
        assert used > 24
        with pytest.raises(ReshapeRefused, match="layer 1 is not on exec1"):
            engine.reshape(MigrateArgs(instance="i0", layers=[1, 2], source="exec1", to="exec0"))
        # Back on exec0, layers 2 and 3 would leave it 24 blocks, fewer than the requests hold now.
        with pytest.raises(ReshapeRefused, match="no memory"):
            engine.reshape(MigrateArgs(instance="i0", layers=[2, 3], source="exec1", to="exec0"))
        assert engine.member.plan == before and engine.stats().ledger.pages_kv_used == used
        assert engine.member.num_blocks == 74
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for d in engine.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        assert all(len(out[f"r{i}"]) == 48 - 30 for i in range(len(PROMPTS)))


OPERATIONS = st.one_of(
    st.builds(lambda a, n: ("replicate", a, min(a + n, LAYERS - 1)), st.integers(0, LAYERS - 1), st.integers(0, 3)),
    st.builds(lambda a, n, to: ("migrate", a, min(a + n, LAYERS - 1), to), st.integers(0, LAYERS - 1),
              st.integers(0, 3), st.sampled_from(["exec0", "exec1"])),
    st.builds(lambda a, n, src: ("evict", a, min(a + n, LAYERS - 1), src), st.integers(0, LAYERS - 1),
              st.integers(0, 3), st.sampled_from(["exec0", "exec1"])))


def _operation(spec) -> object:
    kind, a, b, *who = spec
    if kind == "replicate":
        return ReplicateArgs(instance="i0", layers=[a, b], to="exec1")
    if kind == "migrate":
        return MigrateArgs(instance="i0", layers=[a, b], source="exec1" if who[0] == "exec0" else "exec0", to=who[0])
    return EvictArgs(instance="i0", layers=[a, b], source=who[0])


def placed_after(placements: list[set[str]], op) -> list[set[str]] | None:
    """Where each layer is after `op`, worked out here from what the operations mean (not by shared.core.plans), or
    None where the layers' placement refuses it: a replica already there, a source without the layer, a last copy."""
    after = [set(p) for p in placements]
    for i in range(op.layers[0], op.layers[1] + 1):
        if isinstance(op, ReplicateArgs):
            if op.to in after[i]:
                return None
            after[i].add(op.to)
        elif isinstance(op, MigrateArgs):
            if op.source not in after[i]:
                return None
            after[i] = after[i] - {op.source} | {op.to}
        else:
            if op.source not in after[i] or after[i] == {op.source}:
                return None
            after[i].discard(op.source)
    return after


def test_ledgers_stay_exact_across_random_interleavings_of_operations_and_requests(setup):
    config, plan, params, expected = setup

    with instance_engine(config, Shape(2, plan_file=plan), timeout_s=60) as engine:
        blocks_at_start = engine.member.num_blocks

        @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(st.lists(st.tuples(st.integers(0, 12), OPERATIONS), max_size=5),
               st.lists(st.integers(0, 8), min_size=len(PROMPTS), max_size=len(PROMPTS)))
        def interleaving(ops, arrival_steps):
            arrivals: dict[int, list[int]] = {}
            for i, k in enumerate(arrival_steps):
                arrivals.setdefault(k, []).append(i)
            scheduled = {}
            for k, spec in ops:
                scheduled.setdefault(k, _operation(spec))
            placements = [set(layer.placement) for layer in engine.member.plan.layers]
            out, reports = run(engine, params, arrivals, scheduled)
            assert [out[f"r{i}"] for i in range(len(PROMPTS))] == expected
            for op, report in reports:  # in the order they applied
                after = placed_after(placements, op)
                if after is None:
                    assert isinstance(report, ReshapeRefused), (op, report)
                elif isinstance(report, ReshapeRefused):  # what the placement allows only memory may refuse
                    assert str(report).startswith("no memory"), (op, report)
                else:
                    placements = after
            assert [set(layer.placement) for layer in engine.member.plan.layers] == placements
            stats = engine.stats().ledger
            assert stats.pages_kv_used == 0 and stats.pages_kv_free == engine.member.num_blocks
            engine.member.blocks.check_consistency()
            engine.member.arena.ledger.check_consistency()
            # Back to every layer on exec0 alone, the instance has all its blocks again.
            for i, layer in enumerate(engine.member.plan.layers):
                if "exec0" not in layer.placement:
                    engine.reshape(MigrateArgs(instance="i0", layers=[i, i], source="exec1", to="exec0"))
                elif "exec1" in layer.placement:
                    engine.reshape(EvictArgs(instance="i0", layers=[i, i], source="exec1"))
            assert engine.member.num_blocks == blocks_at_start

        interleaving()


def test_an_instance_quantizes_and_restores_as_a_whole(setup):
    config, plan, params, expected = setup
    alone = LLMEngine(config, progress=False)
    alone.swapper.set_bits([1, 2], 8)
    expected_int8 = [c.outputs[0].token_ids for c in alone.generate(PROMPTS, params)]
    with instance_engine(config, Shape(2, plan_file=plan), timeout_s=60) as engine:
        engine.reshape(ReplicateArgs(instance="i0", layers=[0, 3], to="exec1"))  # both members hold 1 and 2
        blocks = engine.member.num_blocks
        report = engine.reshape(QuantizeArgs(layers=[1, 2], bits=8))
        assert report["layers"] == [16, 8, 8, 16] and report["blocks_after"] > blocks  # both freed slot tails
        assert [c.outputs[0].token_ids for c in engine.generate(PROMPTS, params)] == expected_int8
        with pytest.raises(ReshapeRefused, match="between 1 and 2"):
            engine.reshape(RestoreArgs(layers=3))
        assert engine.reshape(RestoreArgs(layers=2))["blocks_after"] == blocks
        assert [c.outputs[0].token_ids for c in engine.generate(PROMPTS, params)] == expected
        engine.member.arena.ledger.check_consistency()
