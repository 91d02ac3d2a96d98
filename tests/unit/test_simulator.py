"""The simulator (`morphling simulate`) on tiny fleets whose answers are computed by hand: step times from a
latency profile with only intercepts (a phase's batch costs the same whatever its size), pages from the default
model's layer sizes, and the real controller, monitor and router deciding. The default model's shape: 30
layers, KV heads 3 x 64, float32 on cpu, so a page (one 16-token block for every layer) is 2*30*192*4*16 =
737,280 bytes, and a layer's slot holds 20 pages at full precision (14,160,384 bytes), 5 at INT8 (3,564,288)
and 3 at INT4 (2,013,696)."""

import ast
import itertools
import json
from pathlib import Path

import pytest

from services.tools.bench.client import ClusterSample
from services.tools.bench.metrics import percentile, timeline
from services.tools.bench.trace import TraceRequest
from services.tools.simulator import executor as simulated_executor
from services.tools.simulator import run as simulate_cli
from services.tools.simulator import tp
from services.tools.simulator.cluster import SimSettings, Simulation, traffic_turns
from services.tools.simulator.executor import FollowerRefusal, SimExecutor, SimRequest, SimulatedRefusal
from services.tools.simulator.fidelity import compare
from services.tools.simulator.fleet import FleetError, read_fleet
from shared.config import PROJECT_ROOT, ControllerConfig, MonitorConfig
from shared.core.delivery import sendable
from shared.core.errors import QueueFullError
from shared.core.monitor.aggregate import ClusterView
from shared.core.planner.latency import DECODE_FEATURES, PREFILL_FEATURES, FittedLatency
from shared.core.policies import morph
from shared.core.policies.interface import PlannedCommand
from shared.messages import (BatchArgs, EvictArgs, ExecutorTelemetry, QuantizeArgs, ReplicateArgs, RestoreArgs,
                             TpMergeArgs)

PAGE = 737_280
SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
         "dtype_bytes": 4, "num_layers": 30}
PREFILL_S, DECODE_S, OVERHEAD_S = 0.002, 0.001, 0.010  # per layer, per layer, per step


def write_fleet(tmp_path: Path, pages: int = 800, count: int = 1, hop_s: float = 0.0, all_reduce_s: float | None = None,
                quantized_x: float = 1.0, reports_latency: bool = False, **engine) -> Path:
    """A fleet of `count` cpu executors whose layer takes PREFILL_S for a step's prefill chunks and DECODE_S for
    its decodes whatever their number and size (`quantized_x` times that at INT8 and INT4), and whose step costs
    OVERHEAD_S more; a hop takes `hop_s` and an all-reduce `all_reduce_s` (without it, the profile has no
    all-reduce line). `reports_latency`: the executors report their profile's layer seconds."""
    def seconds(bits: int, full: float) -> float:
        return full if bits == 16 else full * quantized_x

    fitted = FittedLatency("cpu", SHAPE, {
        "prefill": {b: [seconds(b, PREFILL_S)] + [0.0] * (len(PREFILL_FEATURES) - 1) for b in (16, 8, 4)},
        "decode": {b: [seconds(b, DECODE_S)] + [0.0] * (len(DECODE_FEATURES) - 1) for b in (16, 8, 4)}})
    (tmp_path / "latency.json").write_text(json.dumps(fitted.to_profile()))
    speedup = {"kind": "speedup-profile", "model": "default", "device": "cpu", "threads": 1, "num_layers": 30,
               "hidden_size": 576, "dtype_bytes": 4, "layer": {"intercept_s": 0.002, "per_token_s": 0.0},
               "hop": {"intercept_s": hop_s, "per_byte_s": 0.0},
               "step_overhead": {"intercept_s": OVERHEAD_S, "per_token_s": 0.0}}
    if all_reduce_s is not None:
        speedup["all_reduce"] = {"intercept_s": all_reduce_s, "per_byte_s": 0.0}
    (tmp_path / "speedup.json").write_text(json.dumps(speedup))
    fleet = {"model": "default",
             "executors": [{"device": "cpu", "count": count, "memory": pages * PAGE,
                            "latency_profile": "latency.json", "speedup_profile": "speedup.json",
                            "reports_latency": reports_latency}],
             "engine": {"max_model_len": 512, **engine},
             "swap_s_per_layer": {"quantize": 0.004, "restore": 0.003}}
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet))
    return path


def test_one_request_takes_a_prefill_step_then_a_decode_step_per_token(tmp_path):
    fleet = read_fleet(write_fleet(tmp_path))
    run = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=()))).run(
        [TraceRequest(0.5, prompt_tokens=100, output_tokens=5)])
    r = run.requests[0]
    prefill, decode = 30 * PREFILL_S + OVERHEAD_S, 30 * DECODE_S + OVERHEAD_S  # 0.07 s and 0.04 s
    assert r.error is None and r.tokens == 5 and r.executor == "exec0"
    assert r.first_token_s - r.arrival_s == pytest.approx(prefill)
    assert r.done_s - r.arrival_s == pytest.approx(prefill + 4 * decode)


def test_a_request_past_the_batch_cap_waits_for_the_running_one(tmp_path):
    fleet = read_fleet(write_fleet(tmp_path, max_num_seqs=1))
    run = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=()))).run(
        [TraceRequest(0.5, 100, 3), TraceRequest(0.5, 100, 3)])
    first, second = run.requests
    prefill, decode = 30 * PREFILL_S + OVERHEAD_S, 30 * DECODE_S + OVERHEAD_S
    assert first.done_s == pytest.approx(0.5 + prefill + 2 * decode)
    assert second.first_token_s == pytest.approx(first.done_s + prefill)


def test_the_router_spreads_arrivals_and_a_full_queue_sends_them_on(tmp_path):
    fleet = read_fleet(write_fleet(tmp_path, count=2, max_num_seqs=1, max_waiting=1))
    # Both executors take one running and one waiting; the fifth arrival finds every queue full.
    run = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=()))).run(
        [TraceRequest(0.5 + i * 1e-4, 100, 50) for i in range(5)])
    taken = [r.executor for r in run.requests]
    assert sorted(taken[:4]) == ["exec0", "exec0", "exec1", "exec1"]
    assert taken[4] is None and "queues full" in run.requests[4].error


def test_quantizing_a_layer_gives_its_slot_tail_to_the_kv_cache_and_restoring_takes_it_back(tmp_path):
    executor = SimExecutor(read_fleet(write_fleet(tmp_path)).executors[0], read_fleet(tmp_path / "fleet.json"))
    assert executor.slot_pages == {16: 20, 8: 5, 4: 3}
    kv = executor.ledger.snapshot().pages_kv
    assert kv == 800 - 30 * 20
    state, seconds = executor.apply(QuantizeArgs(layers=2, bits=8))
    assert state["changed"] == [0, 1] and seconds == pytest.approx(2 * 0.004)
    assert executor.ledger.snapshot().pages_kv == kv + 2 * 15
    executor.apply(QuantizeArgs(layers=[5], bits=4))
    assert executor.ledger.snapshot().pages_kv == kv + 2 * 15 + 17
    state, seconds = executor.apply(RestoreArgs(layers=3))
    assert sorted(state["changed"]) == [0, 1, 5] and executor.layer_bits == [16] * 30
    assert executor.ledger.snapshot().pages_kv == kv and seconds == pytest.approx(3 * 0.003)
    with pytest.raises(SimulatedRefusal, match="between 1 and 0"):
        executor.apply(RestoreArgs(layers=1))


@pytest.mark.parametrize("bits", [8, 4])
def test_executors_started_at_low_bits_hold_copies_of_the_arena_a_whole_quantize_leaves(tmp_path, bits):
    fleet = read_fleet(write_fleet(tmp_path, count=3))
    arenas: dict = {}
    started = [SimExecutor(spec, fleet, bits, arenas=arenas) for spec in fleet.executors]
    quantized = SimExecutor(fleet.executors[0], fleet)
    quantized.apply(QuantizeArgs(layers=30, bits=bits))
    for executor in started:
        assert executor.layer_bits == quantized.layer_bits
        assert executor.ledger.snapshot() == quantized.ledger.snapshot()
        assert executor.ledger.free_pages() == quantized.ledger.free_pages()
    started[0].ledger.allocate()  # each its own
    assert started[1].ledger.free_pages() == quantized.ledger.free_pages()


def test_the_fleet_file_is_checked(tmp_path):
    good = json.loads(write_fleet(tmp_path).read_text())
    for broken, message in (({"model": "gpt-5"}, "unknown model"),
                            ({"executors": [{"device": "TPU", "count": 1}]}, "unknown device"),
                            ({"executors": [{"device": "cpu", "count": 1}]}, "needs its memory"),
                            ({"executors": [{"device": "cpu", "count": 1, "memory": "1GiB",
                                             "speedup_profile": "speedup.json"}]}, "latency_profile"),
                            ({"executors": [{"device": "H100-80GB", "count": 0}]}, "positive integer"),
                            ({"engine": {"max_num_seqs": -1}}, "non-negative"),
                            ({"world_size": 0}, "world_size must be a positive integer"),
                            ({"tp": 0}, "tp must be a positive integer"),
                            ({"tp": 2}, "must divide the 1 executors"),
                            ({"executors": [{"device": "H100-80GB", "count": 3}], "tp": 3}, "divide the FFN's"),
                            ({"all_reduce_s": {"intercept_s": -1, "per_byte_s": 0}}, "all_reduce_s must be"),
                            ({"gpus": 8}, "unknown field"),
                            ({"executors": [{"device": "H100-80GB", "count": 1, "reports_latency": True}]},
                             "true only with a latency_profile"),
                            ({"executors": [{"device": "H100-80GB", "count": 1, "model": "gpt-5"}]}, "unknown model"),
                            ({"executors": [{"device": "H100-80GB", "count": 3, "tp": 3}]}, "divide the FFN's"),
                            ({"traffic": {"default": 0}}, "a positive weight per model"),
                            (MIXED, "serves llama-3-70b and llama-3-8b: give traffic"),
                            (MIXED | {"traffic": {"llama-3-70b": 1, "default": 1}}, "one weight each"),
                            (MIXED | {"traffic": {"llama-3-70b": 1, "llama-3-8b": 1}, "world_size": 16},
                             "exec0-exec15 holds executors of llama-3-70b at TP4 and llama-3-8b at TP1")):
        path = tmp_path / "broken.json"
        path.write_text(json.dumps(good | broken))
        with pytest.raises(FleetError, match=message):
            read_fleet(path)
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"model": "llama-3-8b", "executors": [{"device": "H100-80GB", "count": 8}]}))
    fleet = read_fleet(gpu)
    assert [s.id for s in fleet.executors] == [f"exec{i}" for i in range(8)]
    assert fleet.executors[0].latency.source == "modelled" and fleet.max_model_len(fleet.executors[0].shape) == 8192


def test_executors_join_worlds_of_world_size_in_order_and_merge_only_inside_theirs(tmp_path):
    path = write_fleet(tmp_path, count=5)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"world_size": 2}))
    sim = Simulation(read_fleet(path), SimSettings())
    seen = {name: e.telemetry(0.0) for name, e in sim.executors.items()}
    assert [seen[n].world for n in ("exec0", "exec3", "exec4")] == [["exec0", "exec1"], ["exec2", "exec3"], []]
    assert [u.tp for u in seen["exec0"].kv_units] == [1, 2] and seen["exec4"].plan is None  # alone: no world
    with pytest.raises(ValueError, match="two executors of one world"):  # exec4 has no pair in its world
        Simulation(read_fleet(path), SimSettings(spare=True))


def test_a_fleet_started_at_tp2_lays_out_each_members_shard_and_serves_at_its_leader(tmp_path):
    """`tp: 2`, as `up --tp 2`: SmolLM2's 9 query and 3 KV heads split 6+2 and 3+1, its FFN in halves of 768
    channels. exec0's page holds 2 heads' KV of a 16-token block over 30 layers (2*30*2*64*4*16 = 491,520 bytes),
    so 800 full pages' worth of memory is 1,200 of them, and its layer shard of (6*64 + 2*2*64)*576 + 576*6*64 +
    2*768*576 + 576*768 weights at 4 bytes, plus two norms, takes 16: 720 pages are left for KV. exec1 (1 head:
    2,400 pages of 245,760 bytes, 27 a layer) has 1,590 left; the instance holds the fewer, 720 blocks."""
    path = write_fleet(tmp_path, count=2, all_reduce_s=0.0007)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"tp": 2}))
    sim = Simulation(read_fleet(path), SimSettings(controller=ControllerConfig(levers=())))
    leader, follower = sim.executors["exec0"], sim.executors["exec1"]
    assert (leader.page_bytes, leader.ledger.num_pages, leader.slot_pages[16]) == (491_520, 1_200, 16)
    assert (follower.page_bytes, follower.ledger.num_pages, follower.slot_pages[16]) == (245_760, 2_400, 27)
    assert leader.group is follower.group and leader.group.num_blocks == 720
    seen = leader.telemetry(0.0)
    assert (seen.plan.tp, seen.plan.members, seen.kv.pages_free, seen.kv.pages_slot) == (2, ["exec0", "exec1"], 720,
                                                                                         480)
    with pytest.raises(FollowerRefusal):
        follower.admit(SimRequest(0, 0.0, 20, 5), 0.0)
    leader.admit(SimRequest(0, 0.0, 20, 5), 0.0)
    seconds, parts = leader.group.step_seconds(leader.scheduler.schedule().chunks)
    assert seconds == pytest.approx(30 * (PREFILL_S / 2 + 2 * 0.0007) + OVERHEAD_S)
    assert parts == {"exec0": seconds, "exec1": seconds}
    played = Simulation(read_fleet(path), SimSettings(controller=ControllerConfig(levers=()))).run(burst(12))
    assert all(r.error is None and r.tokens == r.output_tokens and r.executor == "exec0" for r in played.requests)


def test_members_laid_out_alike_back_their_instances_blocks_as_one_alone_would_each_in_an_arena_of_its_own(
        tmp_path):
    """Two TP2 instances of the fleet above (world_size 4): exec2 is laid out as exec0, exec3 as exec1, and each
    member's arena is what backing the instance's 720 blocks leaves on an arena laid out alone; taking a page in
    one leaves the others as they were."""
    path = write_fleet(tmp_path, count=4)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"tp": 2, "world_size": 4}))
    fleet = read_fleet(path)
    sim = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=())))
    assert sim.executors["exec0"].group is not sim.executors["exec2"].group
    for rank, names in enumerate((["exec0", "exec2"], ["exec1", "exec3"])):
        alone = SimExecutor(fleet.executors[rank], fleet, layout=tp.member_shape(fleet.executors[rank].shape, 2, rank))
        alone.map_blocks(720)
        for name in names:
            member = sim.executors[name]
            assert member.mapped == alone.mapped and member.ledger.free_pages() == alone.ledger.free_pages()
            assert member.ledger.snapshot() == alone.ledger.snapshot()
    ledgers = [e.ledger for e in sim.executors.values()] + [e.blocks.ledger for e in sim.executors.values()]
    assert len({id(ledger) for ledger in ledgers}) == 4 + 2  # each member's own; a leader's blocks its instance's
    free = {name: e.ledger.num_free for name, e in sim.executors.items()}
    sim.executors["exec3"].ledger.allocate()
    assert {name: e.ledger.num_free for name, e in sim.executors.items()} == free | {"exec3": free["exec3"] - 1}


def test_a_model_too_big_for_one_device_serves_at_tp4_and_is_refused_alone(tmp_path):
    """Llama-3-70B's 80 layers (1.7 GB each at bf16) outgrow an H100's 80 GB; four shards of them fit and leave
    each member 25,565 blocks of its 2 KV heads: 409,040 tokens of KV an instance."""
    path = tmp_path / "fleet.json"
    fleet = {"model": "llama-3-70b", "executors": [{"device": "H100-80GB", "count": 8}], "world_size": 8}
    path.write_text(json.dumps(fleet | {"tp": 4}))
    sim = Simulation(read_fleet(path), SimSettings())
    groups = {e.group for e in sim.executors.values()}
    assert sorted(g.plan.members[0] for g in groups) == ["exec0", "exec4"]
    assert {(g.plan.tp, g.num_blocks) for g in groups} == {(4, 25_565)}
    path.write_text(json.dumps(fleet))
    with pytest.raises(ValueError, match="the layers and one block need"):
        Simulation(read_fleet(path), SimSettings())


MIXED = {"executors": [{"device": "H100-80GB", "count": 8, "model": "llama-3-70b", "tp": 4},
                       {"device": "H100-80GB", "count": 8, "model": "llama-3-8b"}], "world_size": 8}


def test_the_models_take_the_requests_in_turns_in_proportion_to_their_traffic():
    """Smooth weighted round robin at 1:3: credits (1, 3) give b, (2, 2) a (the first of a tie), (-1, 5) b,
    (0, 4) b, and back to (0, 0)."""
    assert list(itertools.islice(traffic_turns({"a": 1, "b": 3}), 8)) == ["b", "a", "b", "b"] * 2
    assert set(itertools.islice(traffic_turns({"only": 2.5}), 3)) == {"only"}


def test_a_fleet_of_two_models_routes_each_request_to_the_executors_serving_the_one_it_asks_for(tmp_path):
    """A host of eight H100s serving Llama-3-70B in two TP4 instances beside a host of eight serving Llama-3-8B
    alone, the 8B taking three requests of four: each request is served by an executor of its model, the
    instances numbered over the fleet, and each report names its executor's model."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(MIXED | {"traffic": {"llama-3-70b": 1, "llama-3-8b": 3}}))
    fleet = read_fleet(path)
    assert list(fleet.models) == ["llama-3-70b", "llama-3-8b"] and fleet.traffic == {"llama-3-70b": 1.0,
                                                                                       "llama-3-8b": 3.0}
    sim = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=())))
    assert {e.group.plan.id for e in sim.executors.values() if e.group} == {"i0", "i1"}
    assert sim.executors["exec0"].max_model_len == 8192 and sim.executors["exec8"].group is None
    played = sim.run(burst(12))
    asked = [r.model for r in played.requests]
    assert asked == ["llama-3-8b", "llama-3-70b", "llama-3-8b", "llama-3-8b"] * 3
    serves = {s.id: s.shape.name for s in fleet.executors}
    assert all(r.error is None and r.tokens == r.output_tokens and serves[r.executor] == r.model
               for r in played.requests)
    assert {r.executor for r in played.requests if r.model == "llama-3-70b"} <= {"exec0", "exec4"}
    assert {e.telemetry.model for e in sim.state.executors} == {"llama-3-70b", "llama-3-8b"}
    # CoCoServe's spare plan pairs the executors serving alone, and leaves the TP instances as they started
    groups = {e.group for e in Simulation(fleet, SimSettings(spare=True)).executors.values()}
    assert sorted((g.plan.id, g.plan.tp, *g.plan.members[:2]) for g in groups) == [
        ("i0", 4, "exec0", "exec1"), ("i1", 4, "exec4", "exec5"), ("i2", 1, "exec8", "exec9"),
        ("i3", 1, "exec10", "exec11"), ("i4", 1, "exec12", "exec13"), ("i5", 1, "exec14", "exec15")]


def test_simulate_reports_each_model_of_a_fleet_of_several_on_its_own(tmp_path, capsys):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(MIXED | {"traffic": {"llama-3-70b": 1, "llama-3-8b": 3}}))
    out = tmp_path / "out"
    assert simulate_cli.main(["--fleet", str(path), "--modes", "fp16,int8", "--rate-scale", "2", "--busy", "1",
                              "--ordinary", "0", "--window-s", "5", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["fleet"]["models"] == ["llama-3-70b", "llama-3-8b"]
    for mode in ("fp16", "int8"):
        (window,) = report["modes"][mode]["windows"].values()
        by_model = window["models"]
        assert by_model["llama-3-70b"]["request_count"] + by_model["llama-3-8b"]["request_count"] == (
            window["request_count"])
        assert 2.5 < by_model["llama-3-8b"]["request_count"] / by_model["llama-3-70b"]["request_count"] < 3.5
        # a member of a 70B TP4 instance reads a quarter of 141 GB of layers a step, twice the 8B's 15 GB
        assert by_model["llama-3-70b"]["tpot_p50"] > by_model["llama-3-8b"]["tpot_p50"]
        assert report["modes"][mode]["models"]["llama-3-8b"]["ttft_p95"] == by_model["llama-3-8b"]["ttft_p95"]
    int8 = report["modes"]["int8"]["windows"]
    assert next(iter(int8.values()))["models"]["llama-3-8b"]["precision"]["mixes"][0]["int8_layers"] == 32
    assert {r["model"] for w in int8.values() for r in w["requests"]} == {"llama-3-70b", "llama-3-8b"}
    assert (out / "ttft_cdf_llama-3-70b.png").is_file() and (out / "ttft_cdf_llama-3-8b.png").is_file()
    assert "by model:" in capsys.readouterr().out


def test_cocoserve_is_refused_on_a_fleet_started_at_tp(tmp_path, capsys):
    """CoCoServe starts from pairs of executors serving alone: a fleet started in TP instances has none."""
    path = write_fleet(tmp_path, count=2)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"tp": 2}))
    assert simulate_cli.main(["--fleet", str(path), "--modes", "fp16,cocoserve", "--rate-scale", "1", "--out",
                              str(tmp_path / "out")]) == 2
    assert "cocoserve cannot run on a fleet started in TP2 instances" in capsys.readouterr().err


def test_an_instance_started_at_tp_swaps_as_a_whole_its_blocks_following_the_fewest_pages(tmp_path):
    """The TP2 fleet above, two layers quantized to INT8 by its leader: exec0's shard of a layer goes from 16
    pages to 4 (1,916,928 weights at a byte, 3,328 scales at 4 and two norms: 1,934,848 bytes), 24 pages freed;
    exec1's from 27 to 7, 40 freed. The instance follows exec0, 720 -> 744 blocks, and exec1's 886 pages over
    them are spare. The restore takes them back: refused while 730 live blocks could not fit in 720, then, with
    one request's two blocks at the top ids, moving them below."""
    path = write_fleet(tmp_path, count=2)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"tp": 2}))
    sim = Simulation(read_fleet(path), SimSettings(controller=ControllerConfig(levers=())))
    leader, follower = sim.executors["exec0"], sim.executors["exec1"]
    state, seconds = leader.apply(QuantizeArgs(layers=2, bits=8))
    assert (state["changed"], state["blocks_before"], state["blocks_after"]) == ([0, 1], 720, 744)
    assert seconds == pytest.approx(2 * 0.004)  # the fleet's measured quantize, a layer
    assert leader.layer_bits[:3] == follower.layer_bits[:3] == [8, 8, 16] and leader.group.plan.layers[1].bits == 8
    seen = {name: e.telemetry(0.0) for name, e in sim.executors.items()}
    assert seen["exec0"].kv.pages_free == 744 and seen["exec0"].layers[:3] == [8, 8, 16]
    assert (seen["exec0"].spare_pages, seen["exec1"].spare_pages) == (0, 886)
    with pytest.raises(SimulatedRefusal, match="is a member of instance"):
        follower.apply(RestoreArgs(layers=2))
    taken = leader.group.ledger.allocate_many(730)
    with pytest.raises(SimulatedRefusal, match="would keep 720 of its 744 KV blocks, but 24 live blocks"):
        leader.apply(RestoreArgs(layers=2))
    assert leader.group.num_blocks == 744 and leader.layer_bits[:2] == follower.layer_bits[:2] == [8, 8]
    assert follower.ledger.num_free == 886
    for page in taken:
        leader.group.ledger.decref(page)
    leader.admit(SimRequest(0, 0.0, 20, 5), 0.0)
    leader.finish_step(leader.start_step(0.0))
    assert leader.requests["0"].tokens == 1
    seq = leader.scheduler.running[0]
    assert seq.block_table == [743, 742]
    state, _ = leader.apply(RestoreArgs(layers=2))
    assert state["blocks_after"] == 720 and max(seq.block_table) < 720 and leader.layer_bits[:2] == [16, 16]
    assert follower.ledger.num_free == 1590 - 720


def test_a_tp_merge_refuses_swaps_as_the_executor_does(tmp_path):
    fleet = read_fleet(write_fleet(tmp_path, pages=620, count=2))
    sim = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=())))
    group, _, _ = tp.merge(sim.executors, TpMergeArgs(executors=["exec0", "exec1"], instance="tp-0"), 0.0)
    with pytest.raises(SimulatedRefusal, match="is a TP merge, which serves at the bits its layers had"):
        sim.executors["exec0"].apply(QuantizeArgs(layers=1, bits=8))


def test_dispatch_sends_nothing_to_a_busy_executor_or_on_a_state_older_than_its_last_answer():
    planned = [PlannedCommand("a", RestoreArgs(layers=1)), PlannedCommand("b", RestoreArgs(layers=1)),
               PlannedCommand("a", QuantizeArgs(layers=1, bits=8)), PlannedCommand("c", RestoreArgs(layers=1))]
    out = sendable(planned, busy={"b"}, reported={"a": 10.0, "b": 10.0, "c": 10.0}, settled={"c": 10.0})
    assert list(out) == ["a"] and [p.args.kind for p in out["a"]] == ["restore", "quantize"]


def burst(n: int = 60) -> list[TraceRequest]:
    return [TraceRequest(1.0 + 0.01 * i, 200, 60) for i in range(n)]


@pytest.mark.parametrize("tp", [1, 2], ids=["an executor alone", "a TP2 instance"])
def test_under_kv_pressure_the_real_controller_quantizes_within_a_second_of_the_first_pressure(tmp_path, tp):
    # 30 slots of 20 pages and 120 KV pages: 60 requests of 260 tokens (17 blocks each at their end) need 1020.
    # At TP2, 400 full pages' worth of memory: exec0's 600 pages of its 2 KV heads less 30 slots of 16 leave the
    # instance the same 120 blocks (test_a_fleet_started_at_tp2_...), and its leader quantizes as a whole.
    path = write_fleet(tmp_path, pages=720 if tp == 1 else 400, count=tp)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"tp": tp}))
    fleet = read_fleet(path)
    settings = SimSettings(controller=ControllerConfig(levers=("quantize",), morph_mode="default"),
                           monitor=MonitorConfig(slo_ttft_s=2.0, slo_tpot_s=0.5))
    run = Simulation(fleet, settings).run(burst())
    quantizes = [e for e in run.events if e.kind == "command" and e.data["kind"] == "quantize" and e.data["ok"]]
    pressure = [e.time for e in run.events if e.kind == "pressure"]
    assert quantizes and pressure
    decided = quantizes[0].time - quantizes[0].data["latency_s"]
    assert decided < pressure[0] + 1.0  # on the KV in use, or at the latest a second after the first pressure
    assert run.decisions > 0 and any(mix != (0, 0) for r in run.requests for mix in r.token_bits)

    static = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=()))).run(burst())
    assert not [e for e in static.events if e.kind == "command"]
    served = [r for r in run.requests if r.error is None]
    assert len(served) >= sum(r.error is None for r in static.requests)
    ttft = percentile([r.first_token_s - r.arrival_s for r in served], 95)
    assert ttft < percentile([r.first_token_s - r.arrival_s for r in static.requests if r.error is None], 95)


@pytest.mark.parametrize("reports", [False, True], ids=["no profile reported", "its profile reported"])
def test_a_queue_on_layers_slower_quantized_is_quantized_for_only_where_the_executor_does_not_say_so(tmp_path,
                                                                                                   reports):
    # One sequence at a time and KV to spare: the queue waits on compute, and INT8 and INT4 layers take twice as long.
    fleet = read_fleet(write_fleet(tmp_path, quantized_x=2.0, reports_latency=reports, max_num_seqs=1))
    simulation = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=("quantize",),
                                                                           morph_mode="default")))
    run = simulation.run([TraceRequest(0.5 + 0.01 * i, 100, 30) for i in range(30)])
    quantizes = [e for e in run.events if e.kind == "command" and e.data["kind"] == "quantize"]
    assert bool(quantizes) is not reports
    assert all(r.error is None for r in run.requests) and not [e for e in run.events if e.kind == "pressure"]
    # What its steps since a report took a layer, at each width: twice as long quantized, prefill or decode.
    reported = simulation.executors["exec0"].telemetry(simulation.now).layer_seconds
    if reports:
        assert reported[16] > 0 and reported == {16: reported[16], 8: pytest.approx(2 * reported[16]),
                                                 4: pytest.approx(2 * reported[16])}
    else:
        assert reported == {}


def test_where_states_are_dear_the_monitor_slows_its_clock_and_sends_none_between_ticks(tmp_path):
    """The real monitor's pace (monitor/pace.py): a state costing 0.3 s (two executors at 0.15 s each) goes out
    every 0.6 s, pressure or not, where cheap ones go out every 0.2 s and also between ticks."""
    fleet = read_fleet(write_fleet(tmp_path, pages=720, count=2))
    planned = {}
    for cost in (0.0, 0.15):
        settings = SimSettings(controller=ControllerConfig(levers=("quantize",), morph_mode="default"),
                               monitor=MonitorConfig(slo_ttft_s=2.0, slo_tpot_s=0.5), monitor_state_s=cost)
        run = Simulation(fleet, settings).run(burst(120))
        assert [e for e in run.events if e.kind == "pressure"]  # new pressure to publish for
        planned[cost] = (run.decisions, run.elapsed_s)
    decisions, elapsed = planned[0.15]
    assert decisions <= elapsed / 0.6 + 1
    cheap, cheap_elapsed = planned[0.0]
    assert cheap > cheap_elapsed / 0.2  # its ticks, and states of new pressure between them


def test_windows_replay_on_one_cluster_and_a_rest_waits_until_the_pressure_actions_are_undone(tmp_path):
    fleet = read_fleet(write_fleet(tmp_path, pages=720))
    settings = SimSettings(controller=ControllerConfig(levers=("quantize",), morph_mode="default"),
                           monitor=MonitorConfig(slo_ttft_s=2.0, slo_tpot_s=0.5))
    sim = Simulation(fleet, settings)
    first = sim.run(burst())
    assert first.origin == 0.0 and min(sim.executors["exec0"].layer_bits) < 16  # quantized under the burst
    waited, settled = sim.rest(rest_s=10.0, timeout_s=180.0)
    assert settled and waited >= 10.0 and sim.executors["exec0"].layer_bits == [16] * 30  # all restored
    second = sim.run(burst())
    assert second.origin == pytest.approx(first.origin + first.elapsed_s + waited)
    assert {r.index for r in second.requests}.isdisjoint(r.index for r in first.requests)
    offsets = [r.arrival_s - second.origin for r in second.requests]
    assert offsets == pytest.approx([r.arrival_s for r in first.requests])
    assert all(r.error is None and r.tokens == 60 for r in first.requests)
    # An executor with a history predicts waits from a full window of departures, so under this burst it refuses
    # some (executor/admission.py); none is left unfinished.
    assert all(r.done_s is not None for r in second.requests)
    assert all(t >= 0.0 for t, _ in second.samples) and second.events[0].time >= second.origin
    quantized = [e for e in second.events if e.kind == "command" and e.data["kind"] == "quantize"]
    assert quantized  # a rested cluster meets the second burst as it met the first


def test_a_request_unfinished_at_the_drain_is_cancelled_and_frees_its_pages(tmp_path):
    fleet = read_fleet(write_fleet(tmp_path, pages=720))
    sim = Simulation(fleet, SimSettings(drain_s=0.05))
    played = sim.run([TraceRequest(0.0, 200, 400)])
    (request,) = played.requests
    assert request.error == "unfinished at the end of the drain"
    assert sim.rest(rest_s=1.0, timeout_s=10.0)[1]  # the step it was in ends first
    executor = sim.executors["exec0"]
    assert not executor.requests and not executor.scheduler.has_work() and executor.ledger.snapshot().pages_kv_used == 0
    assert request.error == "unfinished at the end of the drain" and request.tokens <= 1


def test_the_simulator_runs_the_controllers_own_policy_not_a_copy(tmp_path, monkeypatch):
    calls = []
    real = morph.plan
    monkeypatch.setattr(morph, "plan", lambda *a, **k: calls.append(a[0].time) or real(*a, **k))
    fleet = read_fleet(write_fleet(tmp_path, pages=720))
    Simulation(fleet, SimSettings(controller=ControllerConfig(levers=("quantize",)))).run(burst(10))
    assert calls  # the ladder reached shared/core/policies/morph.py itself
    # ...and no file of the simulator defines a function of the pieces it must import.
    owned = {"plan", "make_policy", "choose_executor", "serving", "observe", "state", "schedule", "sendable",
             "pages_growth", "advance", "splits", "at_rest", "shape", "cluster_body"}
    for path in (PROJECT_ROOT / "services" / "tools" / "simulator").glob("*.py"):
        defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        assert not defined & owned, f"{path.name} defines {defined & owned}: import it instead"


def test_simulate_writes_the_bench_shape_of_results(tmp_path, capsys):
    out = tmp_path / "out"
    rc = simulate_cli.main(["--fleet", str(write_fleet(tmp_path, pages=720)), "--modes", "fp16,morph",
                            "--rate-scale", "0.5", "--busy", "1", "--ordinary", "1", "--window-s", "5",
                            "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "results.json").read_text())
    assert set(report["modes"]) == {"fp16", "morph"} and report["simulated"] is True
    fp16 = report["modes"]["fp16"]
    for key in ("ttft_p95", "slo_violation_pct", "tpot_p50", "throughput_tok_s", "quality", "spread", "windows"):
        assert key in fp16
    first, second = fp16["windows"].values()
    assert first["simulation"]["simulated_s_per_wall_s"] > 0 and first["request_count"] > 0
    # The first window's wall time counts building the cluster; its loop alone runs faster. Later windows build none.
    assert first["simulation"]["setup_s"] > 0 and second["simulation"]["setup_s"] == 0
    assert first["simulation"]["loop_simulated_s_per_wall_s"] > first["simulation"]["simulated_s_per_wall_s"]
    assert second["simulation"]["loop_simulated_s_per_wall_s"] == second["simulation"]["simulated_s_per_wall_s"]
    for window in (first, second):  # every token the client received, and the loop's wall time spread over them
        simulation = window["simulation"]
        assert simulation["generated_tokens"] == sum(r["completion_tokens"] for r in window["requests"]) > 0
        assert simulation["loop_wall_us_per_token"] == pytest.approx(
            1e6 * (simulation["wall_s"] - simulation["setup_s"]) / simulation["generated_tokens"])
    assert first["rest"] == {"waited_s": 0.0, "started_at_rest": True}  # the bench's windows: rested between
    assert second["rest"]["started_at_rest"] and second["rest"]["waited_s"] >= 10.0
    assert fp16["quality"]["full_precision_token_share"] == 1.0
    assert "morph" in report["comparison"] and (out / "ttft_cdf.png").is_file()
    assert "TTFT p50" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [(["--modes", "fp16,fp16"], "at most once"),
                                           (["--modes", "morph"], "add fp16"),
                                           (["--window-s", "0"], "--window-s must be positive"),
                                           (["--poll-s", "0"], "--poll-s must be positive"),
                                           (["--rest-s", "-1"], "must not be negative")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        simulate_cli.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_compare_replays_a_run_at_its_rate_and_reports_signed_errors(tmp_path):
    fleet, first = write_fleet(tmp_path, pages=720), tmp_path / "first"
    common = ["--fleet", str(fleet), "--modes", "fp16,morph", "--busy", "1", "--ordinary", "0", "--window-s", "5"]
    assert simulate_cli.main(common + ["--rate-scale", "0.4", "--out", str(first)]) == 0
    measured = json.loads((first / "results.json").read_text())
    # The simulation is deterministic: replayed against itself, at the rate scale read from the run, it is exact.
    again = tmp_path / "again"
    assert simulate_cli.main(common + ["--compare", str(first / "results.json"), "--out", str(again)]) == 0
    fidelity = json.loads((again / "results.json").read_text())["fidelity"]["modes"]
    assert set(fidelity) == {"fp16", "morph"}
    assert all(e in (0.0, None) for mode in fidelity.values() for e in mode["mean_abs_error"].values())
    # A measured run half as slow at P95 reads as a prediction 50% low, and its actions are counted by kind.
    window = next(iter(measured["modes"]["fp16"]["windows"].values()))
    window["ttft_p95"] *= 2
    window["actions"] = [{"kind": "quantize", "ok": True}, {"kind": "quantize", "ok": False}]
    row = next(iter(compare(json.loads((first / "results.json").read_text()), measured)["fp16"]["windows"].values()))
    assert row["ttft_p95"]["error"] == pytest.approx(-0.5)
    assert row["actions"] == {"measured": {"quantize": 1}, "predicted": {}}


def test_compare_with_repeated_runs_reports_the_machines_own_repeat_beside_the_prediction(tmp_path, capsys):
    fleet, first = write_fleet(tmp_path, pages=720), tmp_path / "first"
    common = ["--fleet", str(fleet), "--modes", "fp16", "--busy", "1", "--ordinary", "0", "--window-s", "5"]
    assert simulate_cli.main(common + ["--rate-scale", "0.4", "--out", str(first)]) == 0
    # A second "measured" run of the same command, twice as slow at P95 TTFT: the first and it are 100% apart.
    second = json.loads((first / "results.json").read_text())
    for window in second["modes"]["fp16"]["windows"].values():
        window["ttft_p95"] *= 2
    (tmp_path / "second.json").write_text(json.dumps(second))
    out = tmp_path / "out"
    argv = common + ["--compare", str(first / "results.json"), "--compare", str(tmp_path / "second.json"),
                     "--out", str(out)]
    assert simulate_cli.main(argv) == 0
    fidelity = json.loads((out / "results.json").read_text())["fidelity"]
    assert fidelity["modes"]["fp16"]["mean_abs_error"]["ttft_p95"] == 0.0  # against the first, exact
    assert fidelity["against_each"]["fp16"]["ttft_p95"] == pytest.approx(0.25)  # 0 and 50% low
    assert fidelity["repeatability"]["fp16"]["ttft_p95"] == pytest.approx(1.0)
    assert fidelity["repeatability"]["fp16"]["ttft_p50"] == 0.0
    assert "the machine's own repeat" in capsys.readouterr().out
    # A run of other windows or another rate is no repeat of the first: refused before anything runs.
    second["capacity"]["rate_scale"] = 0.5
    (tmp_path / "other.json").write_text(json.dumps(second))
    with pytest.raises(SystemExit) as exc:
        simulate_cli.parse_args(common + ["--compare", str(first / "results.json"),
                                          "--compare", str(tmp_path / "other.json")])
    assert exc.value.code == 2 and "not a run of the same bench command" in capsys.readouterr().err


def test_compare_steps_sets_the_fleets_decode_step_against_a_measured_engine_bench(tmp_path, capsys):
    """Every layer takes DECODE_S and a step OVERHEAD_S more, whatever the batch: 30 layers make 40 ms."""
    measured = tmp_path / "engine_gpu_bench.json"
    measured.write_text(json.dumps({"machine": {"gpu": "NVIDIA H100 80GB HBM3"}, "decode": {"rows": [
        {"batch": 1, "kv_tokens_mean": 100.0, "ours_step_ms": 50.0},
        {"batch": 4, "kv_tokens_mean": 400.0, "ours_step_ms": 20.0}]}}))
    out = tmp_path / "steps"
    argv = ["--fleet", str(write_fleet(tmp_path)), "--compare-steps", str(measured), "--out", str(out)]
    assert simulate_cli.main(argv) == 0
    steps = json.loads((out / "steps.json").read_text())["steps"]
    assert [(s["batch"], s["context"]) for s in steps] == [(1, 100), (4, 100)]  # the bench counts all the KV
    assert [s["predicted_ms"] for s in steps] == pytest.approx([40.0, 40.0])
    assert [s["error"] for s in steps] == pytest.approx([-0.2, 1.0])
    assert "NVIDIA H100 80GB HBM3 measured" in capsys.readouterr().out
    measured.write_text(json.dumps({"decode": {"rows": []}}))
    with pytest.raises(SystemExit) as exc:
        simulate_cli.parse_args(argv)
    assert exc.value.code == 2 and "not a `morphling bench-engine --device cuda` result" in capsys.readouterr().err


def test_compare_tp_sets_steps_alone_and_merged_against_a_measured_amoebas_bench(tmp_path, capsys):
    """Alone, 30 layers of DECODE_S and OVERHEAD_S make 40 ms; merged TP2, each layer's half and two all-reduces
    of 0.5 ms: 30 * (0.5 + 1) + 10 = 55 ms."""
    measured = tmp_path / "amoebas_transform.json"
    measured.write_text(json.dumps({"config": {"requests": 4, "prompt_tokens": 100, "steps": 6},
                                    "summary": {"step_ms": {"alone": 50.0, "merged": 55.0, "after": 40.0}}}))
    out = tmp_path / "tp"
    fleet = write_fleet(tmp_path, pages=620, count=2, all_reduce_s=0.0005)
    argv = ["--fleet", str(fleet), "--compare-tp", str(measured), "--out", str(out)]
    assert simulate_cli.main(argv) == 0
    steps = json.loads((out / "tp_steps.json").read_text())["steps"]
    assert [(s["phase"], s["batch"], s["context"]) for s in steps] == [("alone", 4, 103), ("merged", 8, 109),
                                                                      ("after", 4, 115)]
    assert [s["predicted_ms"] for s in steps] == pytest.approx([40.0, 55.0, 40.0])
    assert [s["error"] for s in steps] == pytest.approx([-0.2, 0.0, 0.0])
    assert "merged" in capsys.readouterr().out
    argv[1] = str(write_fleet(tmp_path, pages=620, count=1))
    assert simulate_cli.main(argv) == 2 and "takes two executors" in capsys.readouterr().err
    measured.write_text(json.dumps({"config": {"requests": 4}, "summary": {}}))
    with pytest.raises(SystemExit) as exc:
        simulate_cli.parse_args(argv)
    assert exc.value.code == 2 and "not a `morphling bench-amoebas` result" in capsys.readouterr().err


def test_copies_multiply_the_volume_and_keep_every_burst_in_place():
    window = [TraceRequest(0.0, 10, 2), TraceRequest(0.1, 11, 3), TraceRequest(4.0, 12, 4)]
    played = simulate_cli.superposed(window, 4)
    assert len(played) == 12 and played == sorted(played, key=lambda r: r.arrival_s)
    gap = 4.0 / 2  # the window's mean gap between arrivals
    assert [r.arrival_s for r in played if r.prompt_tokens == 12] == [4.0 + i * gap / 4 for i in range(4)]
    # copies are spread over less than one gap: the burst at 0-0.1 s stays a burst at 0-1.6 s, before 4 s
    assert max(r.arrival_s for r in played if r.prompt_tokens < 12) < 4.0
    assert simulate_cli.superposed(window, 1) is window


# --- instances of several executors ---------------------------------------------------------------------------
def spare_cluster(tmp_path, pages=800, hop_s=0.0, levers=()) -> Simulation:
    fleet = read_fleet(write_fleet(tmp_path, pages=pages, count=2, hop_s=hop_s))
    return Simulation(fleet, SimSettings(controller=ControllerConfig(levers=levers), spare=True))


def a_step_of_two_prompts(leader):
    for i in range(2):
        leader.admit(SimRequest(i, 0.0, 100, 5), 0.0)
    return leader.start_step(0.0)


def test_a_replicate_takes_the_replicas_slots_and_splits_the_batch(tmp_path):
    sim = spare_cluster(tmp_path, hop_s=0.005)
    leader, spare = sim.executors["exec0"], sim.executors["exec1"]
    # exec0 holds 30 slots of 20 pages: 200 of its 800 pages are outside, and the instance has 200 blocks; exec1
    # holds none, backs those 200 blocks and has 600 pages spare.
    before = spare.telemetry(0.0)
    assert (before.plan.id, before.spare_pages, leader.telemetry(0.0).kv.pages_free) == ("i0", 600, 200)
    state, seconds = leader.apply(ReplicateArgs(instance="i0", layers=[0, 9], to="exec1"))
    after = spare.telemetry(0.0)
    assert after.spare_pages == 400 and after.kv.pages_slot == 200 and state["blocks_after"] == 200
    assert [layer.placement for layer in after.plan.layers[9:11]] == [["exec0", "exec1"], ["exec0"]]
    assert seconds == pytest.approx(0.005)  # no measured line: the weights over the hop line, all intercept
    # Two prompts: layers 0-9 computed side by side, one prompt each (exec1's with a hop there and back), then
    # layers 10-29 on exec0 with both: 10*0.002 + 2*0.005 + 20*0.002 + 0.010 = 0.08 s, against 0.07 s alone (a
    # batch costs what one prompt does here, so splitting it buys nothing and the hops cost).
    assert a_step_of_two_prompts(leader) == pytest.approx(0.08)
    assert spare.busy.share(0.5) == pytest.approx(0.02 / 1.0)


def test_a_step_of_the_spare_plan_is_the_leaders_alone(tmp_path):
    leader = spare_cluster(tmp_path).executors["exec0"]
    assert a_step_of_two_prompts(leader) == pytest.approx(30 * PREFILL_S + OVERHEAD_S)


def test_the_clusters_samples_show_each_member_the_kv_its_report_shows(tmp_path):
    sim = spare_cluster(tmp_path)
    run = sim.run([TraceRequest(0.5, 100, 40), TraceRequest(0.6, 300, 40)])
    both = next(seen for t, seen in run.samples if t == pytest.approx(0.75))
    # Every member of an instance counts the instance's blocks (fabric/member.py's snapshot): 200 blocks, of
    # which the two prompts hold 7 + 19 once prefilled; none once they are done.
    assert [(e["kv"]["pages_base"] + e["kv"]["pages_extension"], e["kv"]["pages_used"]) for e in both] == [
        (200, 26), (200, 26)]
    # ... which the bench's timeline counts once, at the leader, as GET /v1/cluster's roles say
    assert [e["role"] for e in both] == ["leader", "follower"]
    line = timeline([ClusterSample(0.75, both)])
    assert (line["kv_capacity_tokens"], line["kv_used_tokens"]) == ([200 * 16], [26 * 16])
    sim.rest(1.0, timeout_s=5.0)  # samples go on while the cluster rests, as the bench's poll does
    _, last = sim.samples[-1]
    reports = {n: e.telemetry(sim.now).kv.model_dump() for n, e in sim.executors.items()}
    assert {e["id"]: e["kv"] for e in last} == reports and reports["exec1"]["pages_used"] == 0


def test_the_poll_shares_what_is_unchanged_and_each_sample_reads_the_cluster_at_its_time(tmp_path, monkeypatch):
    fleet = read_fleet(write_fleet(tmp_path, pages=720))
    sim = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=("quantize",), morph_mode="default")))
    fresh = []  # every sample as the poll read it at its time, copied out of reach of later polls
    polled = Simulation._sample

    def sample(self):
        polled(self)
        e = self.executors["exec0"]
        fresh.append((self.now, [{"id": e.id, "role": "leader", "kv": e.kv_pages(e.ledger.snapshot()),
                                  "block_size": e.limits.block_size, "layers": list(e.layer_bits),
                                  "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                                  "preemptions": e.scheduler.num_preemptions}]))
    monkeypatch.setattr(Simulation, "_sample", sample)
    sim.run(burst())
    sim.rest(rest_s=10.0, timeout_s=180.0)
    assert sim.samples == fresh  # no later poll changed an earlier sample through what they share
    layers = [seen[0]["layers"] for _, seen in sim.samples]
    assert min(min(bits) for bits in layers) < 16 and layers[-1] == [16] * 30  # quantized under the burst, restored
    changes = sum(a != b for a, b in itertools.pairwise(layers))
    assert len({id(bits) for bits in layers}) == changes + 1  # a new list only where the layers changed
    idle = [seen[0] for _, seen in sim.samples[-5:]]
    assert all(s is idle[0] for s in idle)  # a rested executor's samples are one


def test_a_long_window_says_how_far_it_has_got(tmp_path, capsys):
    sim = Simulation(read_fleet(write_fleet(tmp_path, pages=720)), SimSettings(sample_interval_s=1.0))
    played, _ = simulate_cli.timed(sim, burst(), "fp16 busy@0s", every_s=0.0)
    lines = capsys.readouterr().err.splitlines()
    said = [float(line.split()[2]) for line in lines]
    assert all(line.startswith("  fp16 busy@0s: ") and "x real time" in line for line in lines)
    # told at each poll: the fresh cluster's first, then the window's
    assert said == pytest.approx([0.0] + [round(t) for t, _ in played.samples], abs=0.5)


def test_the_poll_is_as_often_as_asked(tmp_path):
    fleet = write_fleet(tmp_path, pages=720)
    args = simulate_cli.parse_args(["--fleet", str(fleet), "--poll-s", "2"])
    played = Simulation(read_fleet(fleet), simulate_cli.settings_for("fp16", args)).run(burst())
    assert len(played.samples) > 3
    assert [t for t, _ in played.samples] == pytest.approx([2.0 * (i + 1) for i in range(len(played.samples))])


@pytest.mark.parametrize("args, why", [
    (EvictArgs(instance="i0", layers=[0, 3], source="exec1"), "no replica on exec1"),
    (ReplicateArgs(instance="i9", layers=[0, 3], to="exec1"), "not 'i9'"),
    (BatchArgs(instance="i0", max_num_seqs=10_000), "max_num_seqs must be between"),
    (QuantizeArgs(layers=31, bits=8), "layers must be between 1 and 30")])
def test_a_refused_command_changes_nothing(tmp_path, args, why):
    sim = spare_cluster(tmp_path)
    before = {n: e.telemetry(0.0) for n, e in sim.executors.items()}
    with pytest.raises(SimulatedRefusal, match=why):
        sim.executors["exec0"].apply(args)
    assert {n: e.telemetry(0.0) for n, e in sim.executors.items()} == before


def test_a_tp1_instance_swaps_the_layers_its_members_hold(tmp_path):
    """The spare plan's pair, every layer on exec0 (20 pages a layer of 737,280 bytes at full precision, 5 at
    INT8): two layers quantized free 30 of its pages, and the instance's 200 blocks grow to 230; their restore
    gives them back."""
    sim = spare_cluster(tmp_path)
    leader, follower = sim.executors["exec0"], sim.executors["exec1"]
    state, _ = leader.apply(QuantizeArgs(layers=2, bits=8))
    assert (state["blocks_before"], state["blocks_after"], leader.layer_bits[:3]) == (200, 230, [8, 8, 16])
    assert follower.ledger.num_free == 800 - 230 and leader.group.parts[0][1] == ((8, 2), (16, 28))
    state, _ = leader.apply(RestoreArgs(layers=2))
    assert (state["blocks_after"], leader.layer_bits[:2], follower.ledger.num_free) == (200, [16, 16], 600)


def test_a_follower_refuses_commands_for_its_leader(tmp_path):
    with pytest.raises(SimulatedRefusal, match="send it to its leader exec0"):
        spare_cluster(tmp_path).executors["exec1"].apply(BatchArgs(instance="i0", max_num_seqs=4))


def test_a_request_routed_to_a_follower_on_an_older_state_is_refused_and_goes_on_to_the_leader(tmp_path):
    sim = spare_cluster(tmp_path)
    sim.run([])  # the first reports and state: exec1 follows exec0
    for i in range(2):
        sim.arrive(SimRequest(i, sim.now, 100, 5))
    # A state from before the instance formed: exec1 alone with an empty queue, exec0 two requests behind.
    sim.state = sim.state.model_copy(update={"executors": [
        e if e.executor == "exec0" else e.model_copy(update={"telemetry": e.telemetry.model_copy(
            update={"plan": None})}) for e in sim.state.executors]})
    late = SimRequest(2, sim.now, 100, 5)
    sim.arrive(late)
    follower = sim.executors["exec1"]
    assert late.executor == "exec0" and late.error is None
    assert not follower.scheduler.has_work() and follower.rejected == 0  # as follower.py: no queue-full count
    with pytest.raises(FollowerRefusal, match="requests go to the leader"):
        follower.admit(SimRequest(3, sim.now, 100, 5), sim.now)


def test_a_request_no_executor_holds_waits_for_a_merge_whose_leader_alone_then_takes_requests(tmp_path):
    # 620 pages: 20 KV blocks outside the slots each (320 tokens). Merged TP2, each member's FFN cut frees
    # 7 - 1 = 6 pages a layer (180): 3 heads x 200 pages = 600 units, 2 heads a block on exec0: 300 blocks.
    fleet = read_fleet(write_fleet(tmp_path, pages=620, count=2, max_model_len=1024))
    sim = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=("tp",), amoebas=True)))
    run = sim.run([TraceRequest(0.5, 900, 100), TraceRequest(2.0, 20, 5), TraceRequest(40.0, 20, 5)])
    long_, during, later = run.requests
    assert long_.error is None and long_.tokens == 100 and long_.executor == "exec0"
    merges = [e.data for e in run.events if e.kind == "command" and e.data["kind"] == "tp_merge"]
    assert [(m["executor"], m["ok"], m["state"]["blocks"]) for m in merges] == [("exec0", True, 300),
                                                                                 ("exec1", True, 300)]
    # Alone, exec1 (no KV in use) would have taken it before exec0 (63 of 300 blocks): only the leader serves.
    assert during.error is None and during.executor == "exec0"
    splits = [e.data for e in run.events if e.kind == "command" and e.data["kind"] == "tp_split"]
    assert [s["ok"] for s in splits] == [True] and later.error is None
    assert sim.executors["exec1"].group is None and sim.executors["exec0"].kv_capacity() == 20


@pytest.mark.parametrize("all_reduce_s, in_fleet, reduce_s", [(0.0007, None, 0.0007), (0.0007, 0.0009, 0.0009),
                                                              (None, None, 0.0003)],
                         ids=["the profile's", "the fleet's over the profile's", "a hop"])
def test_a_tp_step_is_each_layer_split_k_ways_and_two_all_reduces_a_layer(tmp_path, all_reduce_s, in_fleet,
                                                                           reduce_s):
    path = write_fleet(tmp_path, pages=620, count=2, hop_s=0.0003, all_reduce_s=all_reduce_s)
    if in_fleet is not None:
        path.write_text(json.dumps(json.loads(path.read_text()) | {"all_reduce_s": {"intercept_s": in_fleet,
                                                                                    "per_byte_s": 0.0}}))
    fleet = read_fleet(path)
    sim = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=())))
    group, _, _ = tp.merge(sim.executors, TpMergeArgs(executors=["exec0", "exec1"], instance="tp-0"), 0.0)
    sim.executors["exec0"].admit(SimRequest(0, 0.0, 20, 5), 0.0)
    seconds, parts = group.step_seconds(sim.executors["exec0"].scheduler.schedule().chunks)
    assert seconds == pytest.approx(30 * (PREFILL_S / 2 + 2 * reduce_s) + OVERHEAD_S)
    assert parts == {"exec0": seconds, "exec1": seconds}


@pytest.mark.parametrize("path", sorted((PROJECT_ROOT / "services" / "tools" / "simulator" / "fleets").glob("*.json")),
                         ids=lambda p: p.name)
def test_every_shipped_fleet_reads_with_its_profiles(path):
    fleet = read_fleet(path)
    assert fleet.executors and all(s.shape.num_layers > 0 for s in fleet.executors)


def test_cocoserve_and_amoebas_run_end_to_end_on_the_cpu_bench_fleet(tmp_path, capsys):
    fleet = PROJECT_ROOT / "services" / "tools" / "simulator" / "fleets" / "cpu-bench.json"
    argv = ["--fleet", str(fleet), "--modes", "cocoserve,amoebas", "--rate-scale", "0.25", "--busy", "1",
            "--ordinary", "0", "--window-s", "5", "--out", str(tmp_path)]
    assert simulate_cli.main(argv) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["modes"]) == {"cocoserve", "amoebas"}
    for mode in report["modes"].values():
        window = next(iter(mode["windows"].values()))
        assert window["request_count"] > 0 and window["failed"] == 0


def test_the_monitor_takes_each_executors_newest_report_into_a_state_with_every_finished_request(tmp_path,
                                                                                                monkeypatch):
    """As monitor/service.py holds reports: at 20 reports a second and 2 states a second, a state takes in one
    report per executor, the newest, carrying the finished requests of those it replaced. The nine periodic
    reports a tick would replace unread are never built."""
    built, observed, published = [], [], []
    telemetry, observe, publish = SimExecutor.telemetry, ClusterView.observe, Simulation._publish
    monkeypatch.setattr(SimExecutor, "telemetry", lambda self, now: built.append(telemetry(self, now)) or built[-1])
    monkeypatch.setattr(ClusterView, "observe", lambda self, t, now: observed.append(t) or observe(self, t, now))
    monkeypatch.setattr(Simulation, "_publish", lambda self: published.append(self.now) or publish(self))
    sim = Simulation(read_fleet(write_fleet(tmp_path)), SimSettings(
        controller=ControllerConfig(levers=()), monitor=MonitorConfig(publish_interval_s=0.5),
        telemetry_interval_s=0.05))
    run = sim.run([TraceRequest(0.1 * i, 20, 2) for i in range(12)])
    assert all(r.error is None for r in run.requests) and run.elapsed_s > 1.0
    before_last = [t for t in built if t.time <= published[-1]]
    assert len(before_last) == len(published) == len(observed)  # no pressure here: no report between ticks
    for tick, report in zip(published[1:], before_last[1:]):
        assert tick - 0.05 <= report.time < tick  # the last periodic report before the tick
    newest = before_last[-1].time
    assert sum(len(t.requests) for t in observed) == sum(r.done_s <= newest for r in run.requests) > 0


@pytest.mark.parametrize("tp_degree", [1, 2])
def test_reports_built_without_validation_are_the_messages_validation_makes(tmp_path, monkeypatch, tp_degree):
    """The simulator builds its reports without ExecutorTelemetry's validation, for speed: every report of a run,
    alone or in a TP2 instance, leader or follower, with finished requests and under pressure, must be the
    message validation makes of the same fields, field by field, type by type and in the same order."""
    unvalidated, checked = simulated_executor.unvalidated, []

    def built_and_checked(message, **fields):
        built, validated = unvalidated(message, **fields), message(**fields)
        assert built == validated and list(built.__dict__) == list(validated.__dict__)
        assert [type(v) for v in built.__dict__.values()] == [type(v) for v in validated.__dict__.values()]
        if message is ExecutorTelemetry:
            checked.append(built)
        return built

    monkeypatch.setattr(simulated_executor, "unvalidated", built_and_checked)
    path = write_fleet(tmp_path, pages=720 if tp_degree == 1 else 400, count=2, all_reduce_s=0.0007)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"tp": tp_degree}))
    played = Simulation(read_fleet(path), SimSettings()).run(burst())
    assert all(r.error is None for r in played.requests)
    assert {r.executor for r in checked} == {"exec0", "exec1"}
    assert any(r.requests for r in checked) and any(r.pressure_events for r in checked)


# Two executors of two sequences and two waiting, and 400 arrivals in 1.2 s: every queue full, most refused.
OVERLOAD = [TraceRequest(0.5 + i * 0.003, 100, 40) for i in range(400)]


def overloaded_fleet(tmp_path):
    return read_fleet(write_fleet(tmp_path, count=2, max_num_seqs=2, max_waiting=2))


def test_reports_of_pressure_no_state_would_read_are_not_built_and_change_nothing(tmp_path, monkeypatch):
    """Overloaded, every refusal is new pressure. Once the one state between two ticks that pressure may bring has
    gone out, a report that a periodic one replaces before the tick is left unbuilt: the requests, the states and
    the events come out as when every such report is built, from fewer reports."""
    fleet, arrivals = overloaded_fleet(tmp_path), OVERLOAD
    settings = SimSettings(monitor=MonitorConfig(publish_interval_s=0.5))

    def played(build_all: bool):
        built, states = [], []
        telemetry, publish = SimExecutor.telemetry, Simulation._publish
        with monkeypatch.context() as m:
            m.setattr(SimExecutor, "telemetry", lambda self, now: built.append(now) or telemetry(self, now))
            m.setattr(Simulation, "_publish", lambda self: publish(self) or states.append(self.state))
            if build_all:
                m.setattr(Simulation, "_unheard", lambda self, name: False)
            run = Simulation(fleet, settings).run(arrivals)
        return run, built, states

    lean, lean_built, lean_states = played(build_all=False)
    full, full_built, full_states = played(build_all=True)
    assert sum(r.error is not None for r in full.requests) > 100  # refused: every queue full
    assert [(r.executor, r.done_s, r.error) for r in lean.requests] == [(r.executor, r.done_s, r.error)
                                                                        for r in full.requests]
    assert lean_states == full_states and lean.events == full.events
    assert len(lean_built) < len(full_built) * 0.8


def test_a_wait_refused_again_on_the_same_queue_is_refused_without_predicting_it_and_changes_nothing(tmp_path,
                                                                                                    monkeypatch):
    """Overloaded with a short bound on the predicted wait, every arrival is offered to each executor whose wait
    is too long: refused again on the same queue and departures, it is refused without predicting the wait
    again, and the requests, the states, the events and the refusals counted come out as when each is
    predicted afresh."""
    fleet = read_fleet(write_fleet(tmp_path, count=3, max_num_seqs=2, max_waiting=64))
    arrivals = [TraceRequest(0.5 + i * 0.005, 100, 10) for i in range(600)]
    settings = SimSettings(monitor=MonitorConfig(publish_interval_s=0.5))

    def played(again: bool):
        states, refused_again = [], []
        publish, refused_before = Simulation._publish, SimExecutor._refused_before

        def counted(self, queue, now):
            if not refused_before(self, queue, now):
                return False
            refused_again.append(now)
            return again  # else predicted afresh

        with monkeypatch.context() as m:
            m.setattr(Simulation, "_publish", lambda self: publish(self) or states.append(self.state))
            m.setattr(SimExecutor, "_refused_before", counted)
            simulation = Simulation(fleet, settings)
            for executor in simulation.executors.values():
                executor.max_queue_wait_s = 0.3
            run = simulation.run(arrivals)
        rejected = {name: executor.rejected for name, executor in simulation.executors.items()}
        return run, states, rejected, refused_again

    lean, lean_states, lean_rejected, refused_again = played(again=True)
    full, full_states, full_rejected, _ = played(again=False)
    assert sum(r.error is not None for r in full.requests) > 100
    assert len(refused_again) > 100
    assert [(r.executor, r.done_s, r.error) for r in lean.requests] == [(r.executor, r.done_s, r.error)
                                                                        for r in full.requests]
    assert lean_states == full_states and lean.events == full.events and lean_rejected == full_rejected


def test_a_wait_refused_is_admitted_once_the_last_departure_leaves_the_window(tmp_path):
    """The rate requests leave the queue at is unknown once none has left over the latency window: a request is
    then admitted whatever the queue's length predicted before (admission.py), however long it was refused."""
    fleet = read_fleet(write_fleet(tmp_path, max_num_seqs=1))
    executor = SimExecutor(fleet.executors[0], fleet)
    executor.max_queue_wait_s = 0.5
    for index in range(10):
        executor.admit(SimRequest(index, 0.0, 100, 400), 0.0)  # none has left yet: no rate, admitted
    ends = executor.start_step(0.0)
    executor.finish_step(ends)  # the first left the queue: nine wait behind one slot, ~0.07 s a departure
    window = simulated_executor.LATENCY_WINDOW_S
    for now in (ends + 0.01, ends + window / 2, ends + window - 0.01):
        with pytest.raises(QueueFullError):
            executor.admit(SimRequest(10, now, 100, 400), now)
    executor.admit(SimRequest(10, ends + window + 0.01, 100, 400), ends + window + 0.01)
    assert executor.rejected == 3 and len(executor.scheduler.waiting) == 10


def test_an_overloaded_executor_reports_out_of_cycle_once_between_two_beats_as_its_heartbeat_does(tmp_path,
                                                                                                  monkeypatch):
    """Every refusal is new pressure: a report for each would flood the monitor with reports it reads only the
    newest of. The real heartbeat sends one out of cycle between two beats, the rest with the beat."""
    fleet, arrivals = overloaded_fleet(tmp_path), OVERLOAD
    settings = SimSettings()
    built: dict[str, list[float]] = {"exec0": [], "exec1": []}
    telemetry = SimExecutor.telemetry
    monkeypatch.setattr(SimExecutor, "telemetry", lambda self, now: built[self.id].append(now) or telemetry(self, now))
    monkeypatch.setattr(Simulation, "_unheard", lambda self, name: False)  # every report the executors send, built
    monkeypatch.setattr(Simulation, "_superseded", lambda self, name: False)
    run = Simulation(fleet, settings).run(arrivals)
    assert sum(r.error is not None for r in run.requests) > 100
    beats = (1.7 - 0.5) / settings.telemetry_interval_s
    for times in built.values():
        assert beats <= sum(0.5 <= t < 1.7 for t in times) <= 2 * (beats + 1)


class OneEventEach(Simulation):
    """The loop as it was: every arrival on the heap from the start, every executor's periodic report its own
    event."""

    def _feed(self, requests):
        for request in requests:
            self.at(request.arrival_s, self.arrive, request)

    def _beat(self):  # the first beat, at the start: then each executor's own
        for name in self.executors:
            self._beat_of(name)

    def _beat_of(self, name):
        self._woken.discard(name)
        self._next_beat = self.now + self.settings.telemetry_interval_s
        self.at(self._next_beat, self._beat_of, name)
        if self._superseded(name):
            self._unbuilt[name] = self.now
        else:
            self._report(name)


def test_arrivals_fed_one_at_a_time_and_reports_beating_as_one_event_change_nothing(tmp_path, monkeypatch):
    """A whole trace's arrivals on the heap at once made every event dearer, and a thousand executors' reports a
    beat were a thousand events: fed one at a time, beating as one, a fleet under pressure, with arrivals at the
    same instant and the quantize lever at work, plays out as it did, request by request, state by state."""
    fleet = read_fleet(write_fleet(tmp_path, pages=720, count=3, max_num_seqs=4))
    settings = SimSettings(controller=ControllerConfig(levers=("quantize",), morph_mode="default"),
                           monitor=MonitorConfig(slo_ttft_s=2.0, slo_tpot_s=0.5))
    arrivals = [TraceRequest(0.5 + (i // 3) * 0.02, 60 + 7 * (i % 5), 20 + i % 11) for i in range(240)]
    played = {}
    for simulation in (Simulation, OneEventEach):
        states = []
        publish = simulation._publish
        with monkeypatch.context() as m:
            m.setattr(simulation, "_publish", lambda self: publish(self) or states.append(self.state))
            run = simulation(fleet, settings).run(arrivals)
        played[simulation] = ([(r.executor, r.first_token_s, r.done_s, r.error) for r in run.requests], states,
                              run.events)
    assert [e for e in run.events if e.kind == "command" and e.data["kind"] == "quantize"]
    assert len({executor for executor, *_ in played[Simulation][0]}) == 3
    assert played[Simulation] == played[OneEventEach]


def test_simulate_sweeps_each_modes_slo_capacity_by_the_benchs_rule(tmp_path, capsys):
    out = tmp_path / "out"
    rc = simulate_cli.main(["--fleet", str(write_fleet(tmp_path, pages=720)), "--modes", "fp16,int4", "--sweep",
                            "--sweep-points", "4", "--rate-scale", "0.5", "--busy", "1", "--ordinary", "0",
                            "--window-s", "5", "--burstiness", "0.5", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "results.json").read_text())
    for mode in ("fp16", "int4"):
        summary = report["modes"][mode]
        points = summary["sweep"]
        assert 2 <= len(points) <= 4 and 0.5 in [p["rate_scale"] for p in points]
        # today's keys are the start's: the sweep's point at --rate-scale
        (window,) = summary["windows"].values()
        start = next(p for p in points if p["rate_scale"] == 0.5)
        assert start["requests"] == window["request_count"] and start["ttft_p95"] == window["ttft_p95"]
        meeting = [p["rate_scale"] for p in points if p["meets_slo"]]
        if meeting:
            assert summary["slo_capacity"] >= max(meeting)
            at = summary["quality_at_capacity"]
            assert at["rate_scale"] == max(meeting) and at["token_agreement"] is None  # simulated tokens have no text
            assert at["full_precision_token_share"] == (1.0 if mode == "fp16" else 0.0)
        else:
            assert summary["slo_capacity"] is None and summary["quality_at_capacity"] is None
    assert (out / "goodput_sweep.png").stat().st_size > 10_000
    assert "SLO capacity" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        simulate_cli.main(["--sweep", "--sweep-points", "1", "--out", str(out)])
