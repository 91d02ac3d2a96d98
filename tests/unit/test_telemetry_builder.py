"""The one builder of ExecutorTelemetry (shared/core/telemetry.py): what a report says of an executor alone, of a
member of an instance and of a follower, whichever of the service, the follower or the simulator builds it (the
simulator's unvalidated build is held equal to validation in test_simulator.py)."""

from hypothesis import given
from hypothesis import strategies as st

from shared.core.memory.ledger import LedgerSnapshot
from shared.core.telemetry import NO_QUEUE, Queue, Served, executor_telemetry
from shared.core.plans import alone
from shared.messages import LayerPlan

SERVED = Served(executor="exec0", instance="p1", model="m", max_model_len=256, block_size=16, page_bytes=4096,
                layer_pages=8, kv_heads=3, max_waiting=64)
PAGES = LedgerSnapshot(pages_total=100, pages_slot=32, pages_kv_free=50, pages_kv_used=18, pages_base=60,
                       pages_extension=8)


def queue(running: int, waiting: int, max_num_seqs: int, departures: tuple[int, float]) -> Queue:
    return Queue(running=running, waiting=waiting, max_num_seqs=max_num_seqs, preemptions=1, admission_blocked=2,
                 rejected=3, prompt_tokens=40, generated_tokens=20, queue_delay_s=0.5, ttft_s=0.7, tpot_s=0.05,
                 departures=departures, pages_growth=6, longest_blocks=4)


def test_alone_it_reports_its_own_layers_and_order_and_no_spare_pages():
    t = executor_telemetry(SERVED, 10.0, PAGES, queue(2, 0, 8, (0, 0.0)), layers=[16, 8, 4], swap_order=[2, 0, 1],
                           member_of=None, plan=alone("exec0", 3), free_pages=11, busy=0.5, draining=False)
    assert (t.layers, t.swap_order, t.spare_pages) == ([16, 8, 4], [2, 0, 1], 0)
    assert (t.kv.pages_free, t.kv.pages_used, t.kv.pages_extension) == (50, 18, 8)
    assert (t.running, t.max_num_seqs, t.rejected, t.pressure_events) == (2, 8, 3, 6)


def test_a_member_reports_its_instances_layers_front_to_back_and_its_free_pages_as_spare():
    plan = alone("exec0", 3).model_copy(update={"members": ["exec0", "exec1"], "layers": [
        LayerPlan(placement=["exec0"], bits=16), LayerPlan(placement=["exec1"], bits=4),
        LayerPlan(placement=["exec0"], bits=8)]})
    t = executor_telemetry(SERVED, 10.0, PAGES, NO_QUEUE, layers=[16, 16, 16], swap_order=[2, 1, 0], member_of=plan,
                           plan=plan, free_pages=11, busy=0.1, draining=True, hold_s=3.0)
    assert (t.layers, t.swap_order, t.spare_pages, t.merge_hold_s) == ([16, 4, 8], [0, 1, 2], 11, 3.0)
    assert (t.running, t.waiting, t.max_num_seqs, t.requests, t.predicted_wait_s) == (0, 0, 0, [], 0.0)


@given(st.integers(0, 50), st.integers(0, 50), st.integers(1, 32), st.integers(0, 100), st.floats(0.0, 30.0))
def test_the_predicted_wait_is_the_queue_beyond_the_free_batch_slots_at_the_recent_departure_rate(
        running, waiting, max_num_seqs, departures, span_s):
    t = executor_telemetry(SERVED, 0.0, PAGES, queue(running, waiting, max_num_seqs, (departures, span_s)),
                           layers=[16], swap_order=[0], member_of=None, plan=None, free_pages=0, busy=0.0,
                           draining=False)
    ahead = max(0, waiting - max(0, max_num_seqs - running))
    if ahead == 0:
        assert t.predicted_wait_s == 0.0
    elif departures == 0 or span_s == 0:
        assert t.predicted_wait_s is None
    else:
        assert t.predicted_wait_s == ahead * span_s / departures

