"""The MorphServe policy and its hysteresis, driven with hand-made cluster states (no bus).

A fake executor applies the planned commands to its layers and KV capacity the way the real one
does (a quantized layer's slot tail becomes KV pages), so that the policy sees its own effects.
"""

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from services.controller.loop import Controller
from shared.config import ControllerConfig
from shared.core.hysteresis import Hysteresis
from shared.core.plans import alone
from shared.core.policies.morph import (ExecutorMemory, MorphMemory, MorphSettings, learn_freed_pages,
                                                make_policy, next_quantize, next_restore, pages_taken_back, plan,
                                                settings_for_mode, will_quantize)
from shared.messages import ClusterState, ExecutorState, ExecutorTelemetry, InstancePlan, KvPages

SLOT, FREED, BASE = 10, {8: 5, 4: 7}, 40  # pages per FP16 slot, pages freed per layer, base KV pages


@dataclass
class FakeExecutor:
    name: str = "e0"
    layers: list[int] = field(default_factory=lambda: [16] * 8)
    alive: bool = True
    draining: bool = False
    plan: InstancePlan | None = None

    def capacity(self) -> int:
        return BASE + sum(FREED[b] for b in self.layers if b <= 8)

    def apply(self, commands):
        for c in commands:
            assert c.executor == self.name
            if c.args.kind == "quantize":
                for i in c.args.layers:
                    assert self.layers[i] > c.args.bits, f"layer {i} is already at {self.layers[i]}"
                    self.layers[i] = c.args.bits
            else:
                for i in c.args.layers:
                    assert self.layers[i] <= 8, f"layer {i} is not quantized"
                    self.layers[i] = 16

    def state(self, usage: float, waiting: int = 0, delay: float = 0.0, growth: int = 0, preemptions: int = 0,
              admission_blocked: int = 0, rejected: int = 0, instance: str = "i0",
              layer_seconds: dict[int, float] | None = None, predicted: float | None = None) -> ExecutorState:
        cap = self.capacity()
        used = min(cap, round(usage * cap))
        ext = cap - BASE
        kv = KvPages(pages_total=BASE + SLOT * len(self.layers), pages_slot=SLOT * len(self.layers) - ext,
                     pages_free=cap - used, pages_used=used, pages_base=BASE, pages_extension=ext)
        t = ExecutorTelemetry(executor=self.name, instance=instance, time=0.0, model="m", max_model_len=64,
                              block_size=16, page_bytes=4096, kv=kv, layers=list(self.layers), swap_order=[],
                              running=1, waiting=waiting, max_waiting=8, preemptions=preemptions, prompt_tokens=0,
                              generated_tokens=0, queue_delay_s=delay, ttft_s=0.0, tpot_s=0.0, draining=self.draining,
                              plan=self.plan, pages_growth=growth, admission_blocked=admission_blocked,
                              rejected=rejected, layer_seconds=layer_seconds or {}, predicted_wait_s=predicted)
        return ExecutorState(executor=self.name, alive=self.alive, last_seen=0.0, kv_usage=used / cap,
                             queue_delay_s=delay, waiting=waiting, telemetry=t)


BASE_SETTINGS = MorphSettings(enter_windows=3, leave_windows=4, min_dwell_s=2.0, step=2, max_layers=4,
                              bits_order=(8, 4), swap_order=[5, 2, 7, 0, 1, 3, 4, 6], release_margin=0.1)
PRESSURE, CALM, BETWEEN = 1.0, 0.0, 0.85  # KV usage


class Driver:
    def __init__(self, settings=BASE_SETTINGS, executor=None, dt=0.2):
        self.settings, self.ex, self.dt = settings, executor or FakeExecutor(), dt
        self.memory, self.now, self.log = MorphMemory(), 0.0, []

    def window(self, usage: float, **kw):
        self.now += self.dt
        state = ClusterState(time=self.now, executors=[self.ex.state(usage, **kw)])
        commands, self.memory = plan(state, self.memory, self.settings)
        self.ex.apply(commands)
        self.log.extend((self.now, c) for c in commands)
        return commands


def test_step_load_quantizes_every_k_windows_in_swap_order_int8_first_up_to_max_layers():
    d = Driver()
    fired = [i for i in range(40) if d.window(PRESSURE)]
    assert fired == [2, 5, 8, 11]  # the k-th window of each run of k
    args = [c.args.model_dump() for _, c in d.log]
    assert args == [{"layers": [5, 2], "bits": 8}, {"layers": [7, 0], "bits": 8},
                    {"layers": [5, 2], "bits": 4}, {"layers": [7, 0], "bits": 4}]
    assert sum(b <= 8 for b in d.ex.layers) == 4


def test_int4_only_and_single_layer_steps():
    d = Driver(MorphSettings(enter_windows=1, step=1, max_layers=3, bits_order=(4,)))
    for _ in range(10):
        d.window(PRESSURE)
    assert [c.args.model_dump() for _, c in d.log] == [{"layers": [i], "bits": 4} for i in range(3)]


def test_pressure_events_quantize_at_once_and_only_new_ones_count():
    d = Driver()  # enter_windows=3: a level alone needs three windows
    assert not d.window(0.5)
    assert d.window(0.5, preemptions=1) and d.log[-1][1].args.layers == [5, 2]  # the first preemption: at once
    assert "1 preemptions" in d.log[-1][1].reason and d.log[-1][1].inputs["pressure_events"] == 1
    assert not any(d.window(0.5, preemptions=1) for _ in range(5))  # the same count is no new event
    assert d.window(0.5, preemptions=1, admission_blocked=2)  # a head of the queue held for pages
    assert d.window(0.5, preemptions=1, admission_blocked=2, rejected=1)  # a refusal for a full queue
    # A restarted process counts from zero: its first events are new, a count no higher than before is too.
    assert d.window(0.5, preemptions=1, instance="i1")
    assert not d.window(0.5, preemptions=1, instance="i1")


def test_pressure_events_wait_for_a_layer_to_quantize_and_never_skip_the_dwell_down():
    d = Driver(MorphSettings(enter_windows=3, leave_windows=1, min_dwell_s=2.0, step=1, max_layers=1,
                             bits_order=(8,)))
    assert d.window(0.5, preemptions=1)
    assert not d.window(0.5, preemptions=2)  # the top of the ladder: nothing left to quantize
    assert not any(d.window(CALM, preemptions=2) for _ in range(int(1.8 / d.dt)))  # the dwell holds the restore
    assert any(d.window(CALM, preemptions=2) for _ in range(3))


def test_calm_restores_in_reverse_only_after_m_windows_and_the_dwell():
    d = Driver(replace(BASE_SETTINGS, min_dwell_s=5.0))
    for _ in range(12):
        d.window(PRESSURE)
    last_quantize = d.log[-1][0]
    restores = []
    for _ in range(200):
        for c in d.window(CALM):
            restores.append((d.now, c.args.layers))
    assert [r[1] for r in restores] == [[0, 7], [2, 5]]  # a restore goes all the way to FP16
    assert restores[0][0] >= last_quantize + 5.0 - 1e-9  # the dwell, not the 4 windows, held it
    assert restores[1][0] - restores[0][0] == pytest.approx(4 * d.dt)  # then every m windows
    assert d.ex.layers == [16] * 8


def test_a_window_between_the_marks_breaks_the_run():
    d = Driver()
    for usage in [PRESSURE, PRESSURE, BETWEEN, PRESSURE, PRESSURE]:
        assert not d.window(usage)
    assert d.window(PRESSURE)


def test_queue_delay_and_blocked_admission_are_pressure_too():
    slow = Driver()
    assert [bool(slow.window(0.1, delay=5.0, waiting=1)) for _ in range(3)] == [False, False, True]
    # a burst's delay lingers once its queue has drained: nothing waiting, nothing to quantize for
    assert not any(Driver().window(0.1, delay=5.0) for _ in range(10))
    lax = MorphSettings(kv_high=0.99, kv_low=0.5)
    full_queue, short_of_pages = Driver(lax), Driver(lax)
    assert [bool(full_queue.window(0.1, waiting=8)) for _ in range(3)] == [False, False, True]
    assert [bool(short_of_pages.window(0.95, waiting=1)) for _ in range(3)] == [False, False, True]
    assert not any(Driver(lax).window(0.8, waiting=1) for _ in range(10))  # room for one: not the KV


SLOWER, FASTER = {16: 1.0, 8: 1.5, 4: 1.3}, {16: 1.0, 8: 0.7, 4: 0.5}  # a layer's seconds by width


@pytest.mark.parametrize("seconds, answers", [(FASTER, True), ({}, True), (SLOWER, False)])
def test_a_queue_predicted_to_wait_is_pressure_before_its_mean_wait_rises(seconds, answers):
    """A burst's first reports: requests wait, none has waited long yet (the mean delay is low), but at the rate
    requests leave the queue a new one would wait past the mark. Where fewer bits are faster, that is pressure."""
    lax = MorphSettings(kv_high=0.99, kv_low=0.5)
    early = Driver(lax)
    assert [bool(early.window(0.1, waiting=3, delay=0.0, predicted=2.0, layer_seconds=seconds))
            for _ in range(3)] == [False, False, answers]
    # below the mark, unknown, or with nothing waiting: no pressure from it
    for kw in (dict(waiting=3, predicted=0.5), dict(waiting=3, predicted=None), dict(waiting=0, predicted=9.0)):
        assert not any(Driver(lax).window(0.1, delay=0.0, **kw) for _ in range(10)), kw


@hsettings(max_examples=200, deadline=None)
@given(st.floats(0.0, 0.99), st.integers(0, 8), st.floats(0.0, 5.0), st.one_of(st.none(), st.floats(0.0, 30.0)),
       st.floats(0.0, 30.0), st.sampled_from([FASTER, {}, SLOWER]))
def test_a_longer_predicted_wait_never_takes_pressure_away(usage, waiting, delay, predicted, more, seconds):
    """Pressure is monotone in the predicted wait, counts it only while requests wait, and a queue whose next
    step is slower at fewer bits is never quantized for, however long its predicted wait."""
    from shared.core.policies.morph import under_pressure

    ex = FakeExecutor()
    step = next_quantize(ex.layers, BASE_SETTINGS)
    before = under_pressure(ex.state(usage, waiting=waiting, delay=delay, predicted=predicted, layer_seconds=seconds),
                            BASE_SETTINGS, step)
    longer = (predicted or 0.0) + more
    after = under_pressure(ex.state(usage, waiting=waiting, delay=delay, predicted=longer, layer_seconds=seconds),
                           BASE_SETTINGS, step)
    assert after or not before
    without = under_pressure(ex.state(usage, waiting=waiting, delay=delay, predicted=None, layer_seconds=seconds),
                             BASE_SETTINGS, step)
    if waiting == 0 or seconds is SLOWER:
        assert after == without


@pytest.mark.parametrize("seconds, answers", [(FASTER, True), ({}, True), (SLOWER, False)])
def test_a_queue_with_kv_to_spare_is_quantized_for_only_where_fewer_bits_are_faster(seconds, answers):
    lax = MorphSettings(kv_high=0.99, kv_low=0.5)
    delayed, full, refused = Driver(lax), Driver(lax), Driver(lax)
    assert any(delayed.window(0.1, delay=5.0, waiting=1, layer_seconds=seconds) for _ in range(5)) is answers
    assert any(full.window(0.1, waiting=8, layer_seconds=seconds) for _ in range(5)) is answers
    assert bool(refused.window(0.1, rejected=1, layer_seconds=seconds)) is answers  # at once, or not at all
    state = full.ex.state(0.1, waiting=8, layer_seconds=seconds)
    assert will_quantize(state, lax, ExecutorMemory()) is answers  # what the ladder tells CoCoServe


def test_kv_short_is_quantized_for_however_slow_the_fewer_bits():
    lax = MorphSettings(kv_high=0.99, kv_low=0.5)
    d = Driver(lax)
    assert d.window(0.1, preemptions=1, layer_seconds=SLOWER)
    assert d.window(0.1, preemptions=1, admission_blocked=1, rejected=1, layer_seconds=SLOWER)
    assert not d.window(0.1, preemptions=1, admission_blocked=1, rejected=2, layer_seconds=SLOWER)  # a refusal
    short_of_pages = Driver(lax)
    assert [bool(short_of_pages.window(0.95, waiting=1, layer_seconds=SLOWER)) for _ in range(3)] == [
        False, False, True]


def test_a_queue_climbs_the_ladder_only_as_far_as_each_step_is_faster():
    int8_only = {16: 1.0, 8: 0.8, 4: 0.9}  # INT4 slower than INT8, faster than full precision
    d = Driver()
    for _ in range(40):
        d.window(0.1, delay=5.0, waiting=1, layer_seconds=int8_only)
    assert sorted(d.ex.layers) == [8] * 4 + [16] * 4


def test_a_queue_skips_a_rung_slower_than_full_precision_for_a_deeper_one_that_is_faster():
    cpu_like = {16: 1.0, 8: 1.1, 4: 0.6}  # this CPU at a queue's batch: INT8 slower than float32, INT4 faster
    queue = Driver()
    for _ in range(40):
        queue.window(0.1, delay=5.0, waiting=1, layer_seconds=cpu_like)
    assert sorted(queue.ex.layers) == [4] * 4 + [16] * 4
    assert {c.args.bits for _, c in queue.log if c.args.kind == "quantize"} == {4}
    short = Driver()  # KV short climbs rung by rung: the least precision given up for the pages
    assert [c.args.bits for c in short.window(PRESSURE, preemptions=1, layer_seconds=cpu_like)] == [8]
    neither = Driver()
    for _ in range(40):
        assert not neither.window(0.1, delay=5.0, waiting=1, layer_seconds={16: 1.0, 8: 1.1, 4: 1.2})


@hsettings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({16: st.floats(0.5, 2.0), 8: st.floats(0.5, 2.0), 4: st.floats(0.5, 2.0)}))
def test_a_queue_with_kv_to_spare_quantizes_only_to_bits_faster_than_the_layers_hold(seconds):
    d = Driver()
    for _ in range(30):
        before = list(d.ex.layers)
        for c in d.window(0.1, delay=5.0, waiting=1, layer_seconds=seconds):
            if c.args.kind == "quantize":
                assert all(seconds[c.args.bits] < seconds[before[i]] for i in c.args.layers)
                if before[c.args.layers[0]] == 16 and seconds[8] >= seconds[16]:
                    assert c.args.bits == 4  # the only faster rung, taken straight from full precision
    if min(seconds[8], seconds[4]) < seconds[16]:
        assert any(b <= 8 for b in d.ex.layers)  # some faster rung was taken


def test_release_test_blocks_a_restore_while_the_kv_in_use_would_not_fit():
    d = Driver(MorphSettings(enter_windows=1, leave_windows=2, min_dwell_s=0.0, step=2, max_layers=2,
                             bits_order=(8,), kv_high=0.99, kv_low=0.98, release_margin=0.1))
    d.window(PRESSURE)  # layers 0 and 1 to INT8: capacity 40 -> 50 pages
    assert d.ex.capacity() == 50
    for _ in range(50):  # 38 used: under kv_low even of the 40 pages left, but 38 * 1.1 > 40
        assert not d.window(0.76)
    for _ in range(50):  # nothing restores while a request waits, however empty the KV
        assert not d.window(0.1, waiting=1)
    assert not d.window(0.7)  # 35 used: 38.5 <= 40
    assert d.window(0.7)[0].args.model_dump() == {"layers": [1, 0]}


def test_a_restore_counts_the_pages_running_sequences_will_still_take():
    d = Driver(MorphSettings(enter_windows=1, leave_windows=2, min_dwell_s=0.0, step=2, max_layers=2,
                             bits_order=(8,), kv_high=0.99, kv_low=0.9, release_margin=0.1))
    d.window(PRESSURE)  # capacity 40 -> 50 pages
    # 10 pages in use fit the 40 left after a restore many times over, but the burst's sequences will take
    # 30 more: (10 + 30) * 1.1 > 40 keeps the extension.
    assert not any(d.window(0.2, growth=30) for _ in range(50))
    assert not d.window(0.2, growth=20)  # 33 <= 40, and 10 + 20 <= 0.9 * 40: the calm run starts
    assert d.window(0.2, growth=20)[0].args.model_dump() == {"layers": [1, 0]}
    assert d.log[-1][1].inputs["pages_growth"] == 20 and d.log[-1][1].inputs["pages_taken_back"] == 10


def test_leaders_morph_their_instances_and_followers_leave_it_to_them():
    pair = InstancePlan(id="i0", leader="e0", members=["e0", "e1"], layers=alone("e0", 8).layers)
    follower = FakeExecutor(plan=pair.model_copy(update={"leader": "e1"}))
    for ex in (FakeExecutor(plan=alone("e0", 8)), FakeExecutor(plan=pair)):
        d = Driver(executor=ex)
        assert any(d.window(PRESSURE) for _ in range(20))
    d = Driver(executor=follower)
    assert not any(d.window(PRESSURE) for _ in range(20))


def test_a_held_restore_waits_for_the_costlier_rung_to_step_back_first():
    d = Driver()
    while not any(b <= 8 for b in d.ex.layers):
        d.window(PRESSURE)
    state = lambda: ClusterState(time=d.now, executors=[d.ex.state(0.1)])  # noqa: E731 calm
    for _ in range(100):
        d.now += d.dt
        commands, d.memory = plan(state(), d.memory, d.settings, hold_restore={"e0"})
        assert commands == []
    assert any(d.window(0.1) for _ in range(100))  # released: the restore comes


def test_freed_pages_are_learned_and_unknown_widths_bounded_from_above():
    known = learn_freed_pages({}, [8, 8, 16], 10)
    assert known == {8: 5}
    known = learn_freed_pages(known, [4, 8, 16], 12)
    assert known == {8: 5, 4: 7}
    assert pages_taken_back(known, [4, 8, 16], 12, [0]) == 7
    assert pages_taken_back({}, [4, 8, 8], 17, [0]) == 17  # only the total is known: assume it all


def test_a_splitquant_plans_bits_are_left_as_planned():
    planned = alone("e0", 8, bits=8).model_copy(update={"slots": "placed"})
    d = Driver(executor=FakeExecutor(layers=[8] * 8, plan=planned))
    assert not any(d.window(CALM) for _ in range(100))  # no restore above the planned bits
    assert not any(d.window(PRESSURE, preemptions=i) for i in range(1, 20))


def test_dead_and_draining_executors_get_nothing():
    for flag in ("alive", "draining"):
        ex = FakeExecutor()
        setattr(ex, flag, flag == "draining")
        d = Driver(executor=ex)
        assert not any(d.window(PRESSURE) for _ in range(20))


def test_modes_scale_with_depth_and_off_sends_nothing():
    assert (settings_for_mode("default", 32).step, settings_for_mode("default", 32).max_layers) == (2, 8)
    assert (settings_for_mode("accuracy", 32).step, settings_for_mode("accuracy", 32).max_layers) == (1, 4)
    perf = settings_for_mode("performance", 32)
    assert (perf.step, perf.max_layers) == (4, 16)
    assert (settings_for_mode("default", 30).max_layers, settings_for_mode("performance", 30).max_layers) == (8, 15)
    assert settings_for_mode("performance", 4).step == 1 and settings_for_mode("accuracy", 2).max_layers == 1
    assert settings_for_mode("default", 8, kv_high=0.8).kv_high == 0.8
    d = Driver(settings_for_mode("off", 8))
    assert not any(d.window(PRESSURE, waiting=8, delay=9.0) for _ in range(50))


@pytest.mark.parametrize("bad", [dict(mode="fast"), dict(kv_low=0.95), dict(step=0), dict(bits_order=(4, 8)),
                                 dict(bits_order=(2,)), dict(enter_windows=0), dict(release_margin=-1)])
def test_nonsense_settings_are_refused(bad):
    with pytest.raises(ValueError):
        MorphSettings(**bad)
    with pytest.raises(ValueError):
        settings_for_mode("default", 8, nonsense=1)


def test_adapter_reads_the_controller_config_and_keeps_its_memory():
    config = ControllerConfig(morph_mode="performance", morph_overrides=(("enter_windows", 2),))
    controller = Controller(config, [make_policy()])
    ex = FakeExecutor()
    planned = [controller.plan(ClusterState(time=i * 0.2, executors=[ex.state(PRESSURE)])) for i in range(2)]
    assert planned[0] == [] and planned[1][0].args.model_dump() == {"layers": [0], "bits": 8}  # 4 * 8 / 32 = 1 layer


def test_hysteresis_counts_windows_and_waits_out_the_dwell():
    h = Hysteresis(enter_after=2, leave_after=3, min_dwell_s=10.0)
    assert [h.update(True, False, t) for t in (0, 1)] == [None, "enter"]
    assert [h.update(False, True, t) for t in (2, 3, 4, 5)] == [None, None, None, None]
    assert h.update(False, True, 11) == "leave"  # the run was complete; the dwell held it
    assert h.update(True, True, 12) is None  # pressure wins a contradictory window but needs its run
    assert h.update(True, False, 13) == "enter"  # a burst right after a restore waits for no dwell
    assert [h.update(False, True, t) for t in (14, 15, 16)] == [None, None, None]  # but the way down does
    assert h.update(True, False, 17, urgent=True) == "enter"  # urgent pressure is a whole run at once
    assert h.update(False, True, 18, urgent=True) is None  # urgency without pressure is nothing


def test_restore_rank_is_reverse_of_the_ladder():
    assert next_restore([4, 8, 8, 4, 16], MorphSettings(step=5)) == [3, 0, 2, 1]


def test_the_executors_reported_order_is_followed_unless_the_settings_override_it():
    reported = [3, 1, 0, 2]
    assert next_quantize([16] * 4, MorphSettings(step=2), reported) == ([3, 1], 8)
    assert next_quantize([16] * 4, MorphSettings(step=2, swap_order=(2, 0, 1, 3)), reported) == ([2, 0], 8)
    assert next_quantize([16] * 4, MorphSettings(step=2)) == ([0, 1], 8)  # nothing reported: front to back
    assert next_restore([8, 8, 16, 8], MorphSettings(step=2), reported) == [0, 1]  # most recent first


@hsettings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([PRESSURE, CALM, BETWEEN, "delay", "waiting"]),
                          st.floats(min_value=0.01, max_value=3.0)), min_size=1, max_size=300),
       st.integers(1, 3), st.integers(1, 4), st.floats(0.0, 5.0), st.integers(1, 3), st.integers(0, 8),
       st.sampled_from([(8, 4), (8,), (4,)]), st.permutations(list(range(8))))
def test_oscillating_load_never_flaps_overshoots_or_restores_fp16(load, k, m, dwell, step, max_layers,
                                                                   bits_order, order):
    s = MorphSettings(enter_windows=k, leave_windows=m, min_dwell_s=dwell, step=step, max_layers=max_layers,
                      bits_order=bits_order, swap_order=order)
    d = Driver(s)
    for level, dt in load:
        d.dt = dt
        kw = {"delay": 9.0} if level == "delay" else {"waiting": 3} if level == "waiting" else {}
        d.window(0.1 if level == "delay" else 0.97 if level == "waiting" else level, **kw)  # FakeExecutor.apply checks the layers
        assert sum(b <= 8 for b in d.ex.layers) <= max_layers
    last = None
    for now, c in d.log:
        if last is not None and (last[1], c.args.kind) == ("quantize", "restore"):
            assert now - last[0] >= dwell - 1e-9, (last, now, c)
        last = (now, c.args.kind)
