"""A window played by shards, one process per model (services/tools/simulator/shards.py), against the same window in one
process: a host of eight H100s serving Llama-3-70B in two TP4 instances beside a host of eight serving Llama-3-8B,
their memory cut so that a burst of long prompts presses both and the controller acts on both."""

import json
from pathlib import Path

import pytest

from services.tools.bench.trace import TraceRequest
from services.tools.simulator import run as simulate_cli
from services.tools.simulator.cluster import SimSettings, Simulation
from services.tools.simulator.fleet import FleetError, read_fleet
from services.tools.simulator.shards import deal, play_sharded
from shared.config import ControllerConfig, MonitorConfig

FLEET = {"executors": [{"device": "H100-80GB", "count": 8, "model": "llama-3-70b", "tp": 4, "memory": "40GiB"},
                       {"device": "H100-80GB", "count": 8, "model": "llama-3-8b", "memory": "18GiB"}],
         "world_size": 8, "traffic": {"llama-3-70b": 1, "llama-3-8b": 3}}
ON_THE_CLOCK = 0.1 / 16  # a state costs the monitor 0.1 s: at its 0.2 s clock, none goes out between two ticks
BURST = [TraceRequest(0.5 + 0.004 * i, 1500 + 37 * (i % 50), 200 + 40 * (i % 7)) for i in range(600)]


def fleet_file(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(FLEET | changes))
    return path


def settings(levers: tuple[str, ...], spare: bool = False, monitor_state_s: float = ON_THE_CLOCK,
             drain_s: float = 60.0) -> SimSettings:
    controller = ControllerConfig(levers=levers, morph_mode="default" if "quantize" in levers else "off",
                                  cocoserve_mode="default" if "replicate" in levers else "off", amoebas="tp" in levers)
    return SimSettings(controller, MonitorConfig(slo_ttft_s=2.0, slo_tpot_s=0.2), monitor_state_s=monitor_state_s,
                       sample_interval_s=0.25, drain_s=drain_s, spare=spare)


def played(simulation: Simulation, arrivals: list[TraceRequest], label: str):
    return simulation.run(arrivals)


@pytest.mark.parametrize("levers, spare, drain_s, acted", [
    (("quantize", "replicate", "tp"), False, 60.0, {"quantize", "restore"}),
    (("quantize", "replicate", "tp"), False, 20.0, {"quantize"}),
    (("replicate",), True, 60.0, {"replicate", "migrate", "evict", "batch"})],
    ids=["ladder", "ladder cut at its drain", "cocoserve"])
def test_shards_play_a_window_exactly_as_one_process_does(tmp_path, levers, spare, drain_s, acted):
    """Every request's times, tokens and executor, every sample of the cluster, every command and pressure event
    and the controller's decisions: the same, though the 8B's shard is done long before the 70B's; also where the
    70B's requests are cut at the drain, 20 s after the last arrival, the 8B's all done before."""
    fleet = read_fleet(fleet_file(tmp_path))
    one = Simulation(fleet, settings(levers, spare, drain_s=drain_s)).run(BURST)
    sharded = play_sharded(fleet, settings(levers, spare, drain_s=drain_s), [["llama-3-70b"], ["llama-3-8b"]],
                           BURST, played)
    commands = {e.data["kind"] for e in one.events if e.kind == "command"}
    serves = {s.id: s.shape.name for s in fleet.executors}
    commanded = {serves[e.data["executor"]] for e in one.events if e.kind == "command"}
    assert acted <= commands and commanded == {r.model for r in one.requests} == {"llama-3-70b", "llama-3-8b"}
    unfinished = {r.model for r in one.requests if r.error == "unfinished at the end of the drain"}
    assert unfinished == ({"llama-3-70b"} if drain_s < 60 else set()) and sharded.drained == bool(unfinished)
    assert [vars(r) for r in sharded.requests] == [vars(r) for r in one.requests]
    assert sharded.samples == one.samples and len(one.samples) > 80
    assert sharded.events == one.events
    assert (sharded.decisions, sharded.elapsed_s) == (one.decisions, one.elapsed_s)
    assert sharded.plan_seconds > 0


def test_the_models_are_dealt_by_their_executors_and_a_split_the_monitor_would_notice_is_refused(tmp_path):
    fleet = read_fleet(fleet_file(tmp_path, executors=[
        {"device": "H100-80GB", "count": 16, "model": "llama-3-70b", "tp": 4},
        {"device": "H100-80GB", "count": 8, "model": "llama-3-8b"}]))
    assert deal(fleet, 2, settings(())) == [["llama-3-70b"], ["llama-3-8b"]]
    assert deal(fleet, 1, settings(())) == [["llama-3-70b", "llama-3-8b"]]
    with pytest.raises(FleetError, match="between 1 and its 2 model"):
        deal(fleet, 3, settings(()))
    # cheap states: new pressure on one model would publish a state of both between two ticks
    with pytest.raises(FleetError, match="publishes on its clock alone"):
        deal(fleet, 2, settings((), monitor_state_s=1e-4))
    assert deal(fleet, 1, settings((), monitor_state_s=1e-4)) == [["llama-3-70b", "llama-3-8b"]]


def test_a_shard_simulates_its_models_alone_and_its_instances_keep_the_fleets_ids(tmp_path):
    """The 8B's shard alone: its spare pairs numbered after the 70B's two TP4 instances, as in the whole fleet."""
    fleet = read_fleet(fleet_file(tmp_path))
    alone = Simulation(fleet, settings(("replicate",), spare=True), ["llama-3-8b"])
    assert sorted(alone.executors) == sorted(f"exec{i}" for i in range(8, 16))
    assert sorted({e.group.plan.id for e in alone.executors.values()}) == ["i2", "i3", "i4", "i5"]
    assert all(r.model == "llama-3-8b" for r in alone.run(BURST[:40]).requests)
    with pytest.raises(ValueError, match="serves no llama-3-13b"):
        Simulation(fleet, settings(()), ["llama-3-13b"])


def test_a_shard_that_fails_fails_the_window_with_its_error(tmp_path):
    def broken(simulation, arrivals, label):
        if "8b" in label:
            raise KeyError("a shard's own fault")
        return simulation.run(arrivals)

    fleet = read_fleet(fleet_file(tmp_path))
    with pytest.raises(RuntimeError, match="the shard simulating llama-3-8b failed: KeyError"):
        play_sharded(fleet, settings(()), [["llama-3-70b"], ["llama-3-8b"]], BURST[:40], broken)


def test_simulate_with_shards_writes_the_one_process_result_and_refuses_what_it_cannot_split(tmp_path, capsys):
    path = fleet_file(tmp_path)
    common = ["--fleet", str(path), "--modes", "fp16,morph", "--rate-scale", "2", "--window-s", "5",
              "--monitor-state-s", str(ON_THE_CLOCK), "--busy", "1", "--ordinary", "0", "--poll-s", "0.5"]
    reports = {}
    for shards in ("1", "2"):
        out = tmp_path / f"out{shards}"
        assert simulate_cli.main(common + ["--shards", shards, "--out", str(out)]) == 0
        reports[shards] = json.loads((out / "results.json").read_text())
    for mode in ("fp16", "morph"):
        (one,), (two,) = (reports[s]["modes"][mode]["windows"].values() for s in ("1", "2"))
        assert two["requests"] == one["requests"] and two["models"] == one["models"]
        assert two["simulation"]["decisions"] == one["simulation"]["decisions"]
    assert "in 2 shards" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_cli.parse_args(common[:-4] + ["--busy", "1", "--ordinary", "1", "--shards", "2"])
    assert "one window" in capsys.readouterr().err
    assert simulate_cli.main(common + ["--shards", "3", "--out", str(tmp_path / "out3")]) == 2
    assert "between 1 and its 2 model" in capsys.readouterr().err
    assert list((tmp_path / "out2").glob("timeline_morph_*.png"))
