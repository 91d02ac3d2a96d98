"""choose_executor: live, not draining, right model, not excluded; not suspect, most free KV pages, then
shortest queue."""

from services.gateway.router import choose_executor
from shared.messages import ClusterState, ExecutorState, ExecutorTelemetry, KvPages


def executor(name, free=10, waiting=0, alive=True, draining=False, model="m", suspect=False):
    kv = KvPages(pages_total=100, pages_slot=50, pages_free=free, pages_used=50 - free, pages_base=40,
                 pages_extension=10)
    t = ExecutorTelemetry(executor=name, instance="i0", time=0.0, model=model, max_model_len=2048, block_size=16,
                          page_bytes=1, kv=kv, layers=[16] * 4, swap_order=[], running=0, waiting=waiting,
                          max_waiting=8, preemptions=0, prompt_tokens=0, generated_tokens=0, queue_delay_s=0.0,
                          ttft_s=0.0, tpot_s=0.0, draining=draining)
    return ExecutorState(executor=name, alive=alive, suspect=suspect, last_seen=0.0, kv_usage=0.5, queue_delay_s=0.0,
                         waiting=float(waiting), telemetry=t)


def state(*executors):
    return ClusterState(time=0.0, executors=list(executors))


def test_no_state_or_no_executor_gives_none():
    assert choose_executor(None, set(), "m") is None
    assert choose_executor(state(), set(), "m") is None


def test_most_free_pages_wins_then_shortest_queue_then_id():
    s = state(executor("a", free=5), executor("b", free=20, waiting=3), executor("c", free=20, waiting=1))
    assert choose_executor(s, set(), "m") == "c"
    s = state(executor("b", free=20, waiting=1), executor("a", free=20, waiting=1))
    assert choose_executor(s, set(), "m") == "a"


def test_dead_draining_other_model_and_excluded_are_skipped():
    s = state(executor("dead", free=99, alive=False), executor("drain", free=98, draining=True),
              executor("other", free=97, model="x"), executor("tried", free=96), executor("ok", free=1))
    assert choose_executor(s, {"tried"}, "m") == "ok"
    assert choose_executor(s, {"tried", "ok"}, "m") is None
    assert choose_executor(s, set(), "x") == "other"


def test_a_suspect_executor_is_asked_only_when_no_other_can_be():
    s = state(executor("stalled", free=99, suspect=True), executor("ok", free=1))
    assert choose_executor(s, set(), "m") == "ok"
    assert choose_executor(s, {"ok"}, "m") == "stalled"
