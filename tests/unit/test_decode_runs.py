"""Decode runs (services/tools/simulator/decode_run.py) against single steps: a simulation that advances decode-only
batches many steps at once must end exactly where one that schedules every step alone ends, every time, page
and float. The fleet's decode step grows with the batch and the context, so that every step of a run has its
own length; its KV is small, so that batches run out of pages and preempt; two executors pair as a CoCoServe
instance, or merge as TP2 for a request one of them cannot hold."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.tools.bench.trace import TraceRequest
from services.tools.simulator import costs, decode_run
from services.tools.simulator.cluster import SimSettings, Simulation
from services.tools.simulator.executor import SimExecutor, SimRequest
from services.tools.simulator.fleet import read_fleet
from services.tools.simulator.instance import _parts
from shared.config import ControllerConfig
from shared.core.planner.devices import DEVICES
from shared.core.planner.latency import FittedLatency
from shared.core.planner.roofline import RooflineLatency
from shared.core.planner.shapes import SHAPES
from shared.core.scheduling.growth import pages_growth
from shared.core.scheduling.scheduler import ScheduledChunk
from shared.core.scheduling.sequence import Sequence
from shared.messages import EvictArgs, ReplicateArgs
from shared.sampling import SamplingOptions

PAGE = 737_280  # the default model's page: one 16-token block of every layer's KV, float32
SLOT_PAGES = 30 * 20  # its 30 layers' slots at full precision
SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
         "dtype_bytes": 4, "num_layers": 30}


def write_fleet(tmp_path: Path, kv_pages: int, count: int, hop_s: float = 0.0) -> Path:
    """cpu executors with `kv_pages` pages for KV at full precision, a decode layer of 1 ms (at 16 bits; b/16 of
    it at b) + 0.1 ms a sequence + 2 µs a sequence's token of context + 1 µs a token of mean context, a step
    overhead of 5 ms + 0.3 ms a token, and `hop_s` a hop plus 1 ns a byte when it is not 0."""
    fitted = FittedLatency("cpu", SHAPE, {"prefill": {b: [0.002, 0.0001, 1e-5, 1e-6, 0.0] for b in (16, 8, 4)},
                                          "decode": {b: [0.001 * b / 16, 1e-4, 2e-6, 1e-6] for b in (16, 8, 4)}})
    (tmp_path / "latency.json").write_text(json.dumps(fitted.to_profile()))
    (tmp_path / "speedup.json").write_text(json.dumps({
        "kind": "speedup-profile", "model": "default", "device": "cpu", "threads": 1, "num_layers": 30,
        "hidden_size": 576, "dtype_bytes": 4, "layer": {"intercept_s": 0.002, "per_token_s": 0.0},
        "hop": {"intercept_s": hop_s, "per_byte_s": 1e-9 if hop_s else 0.0},
        "step_overhead": {"intercept_s": 0.005, "per_token_s": 3e-4}}))
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({
        "model": "default", "swap_s_per_layer": {"quantize": 0.004, "restore": 0.003},
        "executors": [{"device": "cpu", "count": count, "memory": (SLOT_PAGES + kv_pages) * PAGE,
                       "latency_profile": "latency.json", "speedup_profile": "speedup.json"}],
        "engine": {"max_model_len": 512, "max_num_seqs": 4}}))
    return path


LEVERS = {"none": ControllerConfig(levers=()),
          "morph": ControllerConfig(levers=("quantize",), morph_mode="default"),
          "cocoserve": ControllerConfig(levers=("replicate",), morph_mode="off", cocoserve_mode="default")}


class Recorded(Simulation):
    """Keeps every cluster state the monitor published: what the controller and the router read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.states: list[dict] = []

    def _publish(self) -> None:
        super()._publish()
        self.states.append(self.state.model_dump())


def replay(fleet, arrivals, decode_runs: bool, levers: str, drain_s: float) -> tuple[Simulation, list]:
    settings = SimSettings(controller=LEVERS[levers], drain_s=drain_s, decode_runs=decode_runs,
                           spare=levers == "cocoserve")
    sim = Recorded(fleet, settings)
    runs = [sim.run(arrivals)]
    sim.rest(1.0, 5.0)
    runs.append(sim.run(arrivals))  # a second window on what the first left
    return sim, runs


def seen(sim: Simulation, runs: list) -> dict:
    """Everything a user of the simulator or the next window could tell apart."""
    return {"requests": [[asdict(r) for r in run.requests] for run in runs],
            "samples": [run.samples for run in runs], "events": [[e.model_dump() for e in run.events] for run in runs],
            "decisions": [run.decisions for run in runs], "now": sim.now, "states": sim.states,
            "executors": {name: (e.ledger.snapshot(), e.layer_bits, e.counts, e.scheduler.num_preemptions,
                                 e.telemetry(sim.now).model_dump(exclude={"instance"}))
                          for name, e in sim.executors.items()}}


def runs_and_single_steps(fleet, arrivals, levers: str, drain_s: float) -> tuple[dict, dict]:
    return tuple(seen(*replay(fleet, arrivals, flag, levers, drain_s)) for flag in (True, False))


requests = st.lists(st.builds(TraceRequest, st.floats(0.0, 2.0), st.integers(1, 200), st.integers(1, 80)),
                    min_size=1, max_size=14).map(lambda rs: sorted(rs, key=lambda r: r.arrival_s))


@st.composite
def fleets(draw):
    """(executors, KV pages each, levers): two executors in a world need hold only a block each, so that a long
    request makes them merge (AMOEBAs' TP2); CoCoServe pairs them as one instance, which holds a sequence."""
    levers = draw(st.sampled_from(sorted(LEVERS)))
    count = 2 if levers == "cocoserve" else draw(st.integers(1, 2))
    low = 8 if count == 2 and levers != "cocoserve" else 32
    return count, draw(st.integers(low, 90)), levers


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrivals=requests, fleet=fleets(), drain_s=st.sampled_from([0.5, 90.0]))
def test_decode_runs_end_exactly_where_single_steps_end(tmp_path, arrivals, fleet, drain_s):
    """Arrivals cut runs, reports and the bench's poll settle them, the levers' commands (quantize and restore,
    replicate, migrate, evict and batch, a merge and its split) cut them, the drain's cancels cut them, short
    pages stop them before a preemption; an instance's run marks its members busy as its steps would; a CoCoServe
    pair's decode batches, replicated or not, step its replicas' shares as its chunks would."""
    count, kv_pages, levers = fleet
    fleet = read_fleet(write_fleet(tmp_path, kv_pages, count, hop_s=2e-4))
    runs, single = runs_and_single_steps(fleet, arrivals, levers, drain_s)
    assert runs == single


class Checked(Recorded):
    """Holds every report's longest_blocks and pages_growth to what the executor's scheduler holds, counted there."""

    def _build_report(self, name: str):
        executor = self.executors[name]
        scheduler = executor.scheduler
        longest = max((len(s.prompt_ids) + s.params.max_tokens for s in (*scheduler.running, *scheduler.waiting)),
                      default=0) if executor.leads else 0
        built = super()._build_report(name)
        assert executor.longest is not None and (executor.longest if executor.leads else 0) == longest
        assert executor._pages_growth() == pages_growth(scheduler.running, executor.blocks, executor.max_model_len)
        return built


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrivals=requests, fleet=fleets())
def test_what_a_report_counts_as_it_goes_is_what_the_scheduler_holds(tmp_path, arrivals, fleet):
    """The executor counts its longest sequence again only when the longest leaves, and a decode batch its
    members' pages to come as they open blocks and end: through finishes, the drain's cancels, a merge and its
    split, a CoCoServe instance's leader, a report's are those of the sequences its scheduler holds."""
    count, kv_pages, levers = fleet
    settings = SimSettings(controller=LEVERS[levers], drain_s=0.5, spare=levers == "cocoserve")
    sim = Checked(read_fleet(write_fleet(tmp_path, kv_pages, count, hop_s=2e-4)), settings)
    sim.run(arrivals)
    assert sim.states


def test_a_lone_decode_batch_is_one_event_until_its_first_sequence_finishes(tmp_path):
    fleet = read_fleet(write_fleet(tmp_path, kv_pages=64, count=1))
    steps = {}
    for flag in (True, False):
        sim = Simulation(fleet, SimSettings(controller=ControllerConfig(levers=()), decode_runs=flag))
        run = sim.run([TraceRequest(0.0, 20, 40), TraceRequest(0.0, 20, 10)])
        steps[flag] = (sim.executors["exec0"].step_serial, [(r.first_token_s, r.done_s) for r in run.requests])
    # single steps: the first prompt, the second's beside the first's decode, then 38 decodes; runs: the same two
    # steps, a run to the shorter one's end (9 steps) and one of the longer one's last 29 (the reports and the
    # bench's poll read it, none cuts it)
    assert steps[False][0] == 40 and steps[True][0] == 4
    assert steps[True][1] == steps[False][1]


def decodes(seqs):
    return [ScheduledChunk(s, s.num_computed, 1) for s in seqs]


def test_a_decode_steps_seconds_are_the_cost_models_to_the_float(tmp_path):
    spec = read_fleet(write_fleet(tmp_path, kv_pages=64, count=1)).executors[0]
    seqs = []
    for prompt in (17, 100, 301):
        seq = Sequence(str(prompt), 0, [0] * prompt, SamplingOptions(max_tokens=50), 0.0)
        seq.output_ids, seq.num_computed = [0, 0], prompt + 1
        seqs.append(seq)
    bits = [16] * 10 + [8] * 12 + [4] * 8
    context = sum(s.num_computed + 1 for s in seqs) / 3
    assert costs.decode_step_seconds(spec, bits, 3)(int(context)) == costs.step_seconds(spec, bits, decodes(seqs))


@settings(max_examples=200, deadline=None)
@given(device=st.sampled_from(["H100-80GB", "L4", "T4"]), model=st.sampled_from(["llama-3-8b", "smollm2-135m"]),
       bits=st.sampled_from([16, 8, 4]), batch=st.integers(1, 512), context=st.integers(0, 131072),
       coefficients=st.lists(st.floats(-1e-3, 1e-2, allow_subnormal=False), min_size=4, max_size=4))
def test_a_decode_line_is_the_latency_models_decode_to_the_float(device, model, bits, batch, context, coefficients):
    """A decode run times its steps by the context alone (decode_line): the roofline's and a fitted profile's,
    each the model's own decode, bit for bit (a fit's negative terms included, which its floor catches)."""
    fitted = FittedLatency("cpu", SHAPE, {"prefill": {b: [0.0] * 5 for b in (16, 8, 4)},
                                          "decode": {b: coefficients for b in (16, 8, 4)}})
    for latency in (RooflineLatency(DEVICES[device], SHAPES[model]), fitted):
        assert latency.decode_line(bits, batch)(context) == latency.decode(bits, batch, context)


def test_an_instances_decode_run_steps_are_its_step_seconds_to_the_float(tmp_path):
    """Layers 0-9 on the leader, 10-19 replicated on both, 20-29 on the other member, two of them at 8 bits: a
    run's step, each replica's rows and every member's busy time, as step_seconds gives them from the chunks."""
    fleet = read_fleet(write_fleet(tmp_path, kv_pages=64, count=2, hop_s=2e-4))
    instance = Simulation(fleet, SimSettings(spare=True)).executors["exec0"].group
    instance.reshape(ReplicateArgs(instance="i0", layers=[10, 29], to="exec1"))
    instance.reshape(EvictArgs(instance="i0", layers=[20, 29], **{"from": "exec0"}))
    instance.plan.layers[3].bits = instance.plan.layers[25].bits = 8
    instance.parts = _parts(instance.plan)
    seqs = []
    for index, prompt in enumerate((17, 100, 301, 5, 64)):
        seq = Sequence(str(index), 0, [0] * prompt, SamplingOptions(max_tokens=50), 0.0)
        seq.output_ids, seq.num_computed = [0], prompt
        seqs.append(seq)
    instance.sticky.setdefault(1, {})["3"] = "exec1"  # one already has its replica: the others fill around it
    base = [s.num_computed for s in seqs]
    timing = instance.decode_timing(seqs, base)
    for step in range(6):
        seconds, busy = timing(step)
        assert (seconds, busy) == instance.step_seconds([ScheduledChunk(s, b + step, 1) for s, b in zip(seqs, base)])
        assert 0 < busy["exec1"] < seconds
    assert instance.parts[1][0].placement == ("exec0", "exec1")
    assert set(instance.sticky[1].values()) == {"exec0", "exec1"}  # both replicas computed rows


@pytest.mark.parametrize("fleet_file", ["fitted, tp 2", "roofline, tp 4"])
def test_a_tp_instances_decode_run_steps_are_its_step_seconds_to_the_float(tmp_path, fleet_file):
    """A TP instance started at TP 2 on cpu executors of a fitted profile, and at TP 4 on H100s serving
    Llama-3-70B by the roofline, two layers at 8 bits: a run's steps and every member's busy time, as
    step_seconds gives them from the chunks."""
    if fleet_file == "fitted, tp 2":
        path = write_fleet(tmp_path, kv_pages=64, count=2, hop_s=2e-4)
        path.write_text(json.dumps(json.loads(path.read_text()) | {"tp": 2}))
    else:
        path = tmp_path / "fleet.json"
        path.write_text(json.dumps({"model": "llama-3-70b", "executors": [{"device": "H100-80GB", "count": 4}],
                                    "tp": 4}))
    instance = Simulation(read_fleet(path), SimSettings()).executors["exec0"].group
    instance.plan.layers[3].bits = instance.plan.layers[25].bits = 8
    seqs = []
    for index, prompt in enumerate((17, 100, 301, 5, 64)):
        seq = Sequence(str(index), 0, [0] * prompt, SamplingOptions(max_tokens=50), 0.0)
        seq.output_ids, seq.num_computed = [0], prompt
        seqs.append(seq)
    base = [s.num_computed for s in seqs]
    timing = instance.decode_timing(seqs, base)
    for step in range(6):
        assert timing(step) == instance.step_seconds([ScheduledChunk(s, b + step, 1) for s, b in zip(seqs, base)])


def ten_ms_steps(seqs, base):
    return lambda step: (0.01, {})


def test_a_run_stops_before_the_step_whose_page_is_not_free(tmp_path):
    """Two sequences 3 and 5 tokens short of a new block, and one free page: the scheduler would preempt in the
    step where the second needs a page, so the run holds the steps before it; with two free pages it runs until
    the shorter one's last token."""
    fleet = read_fleet(write_fleet(tmp_path, kv_pages=64, count=1))
    for free, steps in ((1, 5), (2, 8)):
        executor = SimExecutor(fleet.executors[0], fleet)
        for index, (prompt, output) in enumerate(((29, 20), (27, 9))):  # blocks of 16: 32 positions held
            executor.admit(SimRequest(index, 0.0, prompt, output), 0.0)
        ends = executor.start_step(0.0)
        executor.finish_step(ends)
        while executor.ledger.num_free > free:
            executor.ledger.allocate()
        run = decode_run.plan_run(executor.scheduler, executor.blocks, 512, ends, ten_ms_steps)
        assert len(run.ends) == steps and [step for step, _ in run.pages] == [3, 5][:free]


def test_a_command_that_reaches_a_member_waiting_at_a_merges_collective_waits_its_turn(tmp_path):
    """A long request makes the gateway merge exec0 and exec1; exec0 reaches the collective first and waits
    there for exec1's step, and the controller's quantize for exec0's pressure comes meanwhile. It is taken
    after the merge (refused: a member morphs with its instance), as the real executor's engine thread takes
    its commands one by one. Applied at once, it had let exec0 step at the collective, and that step ended
    holding a sequence the merge had given the leader."""
    fleet = read_fleet(write_fleet(tmp_path, kv_pages=10, count=2, hop_s=2e-4))
    arrivals = [TraceRequest(0.5, 68, 14), TraceRequest(0.5, 65, 1), TraceRequest(0.5, 61, 13),
                TraceRequest(1.375, 1, 1), TraceRequest(1.375, 82, 80)]
    runs, single = runs_and_single_steps(fleet, arrivals, "morph", 0.5)
    assert runs == single
    commands = [(e["data"]["executor"], e["data"]["kind"], e["data"]["ok"]) for e in runs["events"][0]
                if e["kind"] == "command"]
    # the merge and the refusal after it are answered at one instant: events then go in the fleet's order
    assert sorted(commands[:3]) == [("exec0", "quantize", False), ("exec0", "tp_merge", True),
                                    ("exec1", "tp_merge", True)]
    assert [kind for name, kind, _ in commands if name == "exec0"][:2] == ["tp_merge", "quantize"]
    assert [r["error"] for r in runs["requests"][0]][:4] == [None] * 4


def test_a_step_that_ends_with_a_report_at_the_same_instant_has_ended_for_it(tmp_path):
    """Found by the property above: here a run's last step ends at 3.700000000000002 s, the very float of a
    periodic report. A run's steps have ended by their end (`DecodeRun.begun_by`); single steps had ended or
    not by the order their events were queued in, and the report saw 13 pages still in use or none."""
    fleet = read_fleet(write_fleet(tmp_path, kv_pages=32, count=1, hop_s=2e-4))
    arrivals = [TraceRequest(0.0, 87, 44), TraceRequest(0.0, 87, 44), TraceRequest(1.90625, 1, 25),
                TraceRequest(1.90625, 139, 25)]
    runs, single = runs_and_single_steps(fleet, arrivals, "morph", 90.0)
    assert runs == single
