"""choose_executor: live, an instance's leader, not draining, right model, not excluded; not suspect, the least
shortest queue, then the least share of its KV in use; AMOEBAs' baselines by turn or by requests."""

import pytest
from hypothesis import given, strategies as st

from shared.core.plans import leads
from shared.core.plans import tp_plans
from shared.core.router import Unreported, choose_executor, prompt_pages, serving
from shared.messages import ClusterState, ExecutorState, ExecutorTelemetry, KvPages


def executor(name, free=10, waiting=0, running=0, alive=True, draining=False, model="m", suspect=False, plan=None,
             time=0.0):
    kv = KvPages(pages_total=100, pages_slot=50, pages_free=free, pages_used=50 - free, pages_base=40,
                 pages_extension=10)
    t = ExecutorTelemetry(executor=name, instance="i0", time=time, model=model, max_model_len=2048, block_size=16,
                          page_bytes=1, kv=kv, layers=[16] * 4, swap_order=[], running=running, waiting=waiting,
                          max_waiting=8, preemptions=0, prompt_tokens=0, generated_tokens=0, queue_delay_s=0.0,
                          ttft_s=0.0, tpot_s=0.0, draining=draining, plan=plan)
    return ExecutorState(executor=name, alive=alive, suspect=suspect, last_seen=0.0, kv_usage=0.5, queue_delay_s=0.0,
                         waiting=float(waiting), telemetry=t)


def state(*executors):
    return ClusterState(time=0.0, executors=list(executors))


def test_no_state_or_no_executor_gives_none():
    assert choose_executor(None, set(), "m") is None
    assert choose_executor(state(), set(), "m") is None


def test_shortest_queue_wins_then_most_free_pages_then_id():
    s = state(executor("a", free=90, waiting=2), executor("b", free=5, waiting=1), executor("c", free=20, waiting=1))
    assert choose_executor(s, set(), "m") == "c"
    s = state(executor("b", free=20, waiting=1), executor("a", free=20, waiting=1))
    assert choose_executor(s, set(), "m") == "a"


def test_a_queue_counts_though_its_prompts_hold_no_kv_yet():
    """Waiting requests are not prefilled: a report shows their executor's KV as free as an idle one's."""
    s = state(executor("queued", free=40, waiting=6), executor("busy", free=10, running=30))
    assert choose_executor(s, set(), "m") == "busy"


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


def test_only_an_instances_leader_is_asked_never_its_followers():
    (tp2,) = tp_plans(["lead", "follow"], 2, 4)
    s = state(executor("follow", free=99, plan=tp2), executor("lead", free=1, plan=tp2), executor("solo", free=5))
    assert [e.executor for e in serving(s)] == ["lead", "solo"]
    assert choose_executor(s, set(), "m") == "solo"
    assert choose_executor(s, {"solo"}, "m") == "lead"
    assert choose_executor(s, {"solo", "lead"}, "m") is None


def test_followers_stay_out_when_their_leader_is_dead_or_draining():
    (tp2,) = tp_plans(["lead", "follow"], 2, 4)
    for lead in (executor("lead", alive=False, plan=tp2), executor("lead", draining=True, plan=tp2)):
        assert choose_executor(state(lead, executor("follow", free=99, plan=tp2)), set(), "m") is None


def test_an_executor_without_a_plan_leads_itself_and_a_solo_plan_changes_nothing():
    solo = tp_plans(["a", "b"], 1, 4)
    assert leads(executor("a")) and leads(executor("a", plan=solo[0]))
    assert not leads(executor("b", plan=solo[0]))  # a plan that names another leader makes it a follower
    s = state(executor("a", free=5, plan=solo[0]), executor("b", free=9, plan=solo[1]))
    assert choose_executor(s, set(), "m") == "b"


def test_the_baselines_order_by_turn_or_by_requests():
    s = state(executor("b", free=1), executor("a", free=50), executor("c", free=20))
    assert [choose_executor(s, set(), "m", "rr", turn) for turn in range(4)] == ["a", "b", "c", "a"]
    assert choose_executor(s, {"b"}, "m", "rr", 1) == "c"
    busy = state(executor("a", free=50, running=5), executor("b", free=1, waiting=1))
    assert choose_executor(busy, set(), "m", "llf") == "b"
    assert choose_executor(busy, set(), "m", "amoebas") == "a"


def test_what_was_sent_since_the_state_counts_as_used_so_arrivals_between_states_spread():
    s = state(executor("a", free=20), executor("b", free=19))
    sent = Unreported()
    assert choose_executor(s, set(), "m", unreported=sent.view()) == "a"
    sent.add("a", 1.0, prompt_pages(30, 16))  # two pages: a now looks fuller than b
    assert choose_executor(s, set(), "m", unreported=sent.view()) == "b"


def test_a_report_taken_after_a_send_counts_it_and_a_gone_executor_is_forgotten():
    sent = Unreported()
    sent.add("a", 1.0, 2)
    sent.add("a", 3.0, 5)
    sent.add("gone", 1.0, 7)
    sent.forget_reported(state(executor("a", time=2.0)))
    assert {name: (v.requests, v.pages) for name, v in sent.view().items()} == {"a": (1, 5)}
    sent.forget_reported(state(executor("a", time=3.5)))
    assert sent.view() == {}


def test_a_refuser_is_asked_last_until_it_reports_after_its_refusal():
    s = state(executor("a", waiting=0, time=1.0), executor("b", waiting=3, time=1.0))
    sent = Unreported()
    sent.refused("a", 2.0)
    assert choose_executor(s, set(), "m", unreported=sent.view()) == "b"
    assert choose_executor(s, {"b"}, "m", unreported=sent.view()) == "a"  # the last resort, still asked
    sent.forget_reported(state(executor("a", time=1.5), executor("b", time=1.5)))
    assert choose_executor(s, set(), "m", unreported=sent.view()) == "b"  # no report of a's since it refused
    sent.add("a", 2.5, 1)
    sent.forget_reported(state(executor("a", time=2.2), executor("b", time=2.2)))
    assert {name: (v.requests, v.full) for name, v in sent.view().items()} == {"a": (1, False)}
    assert choose_executor(s, set(), "m", unreported=sent.view()) == "a"


def test_an_admission_on_its_way_outlives_a_report_and_a_refused_one_leaves_nothing():
    s = state(executor("a", free=20, time=1.0), executor("b", free=20, time=1.0))
    sent = Unreported()
    sent.asking("a")
    sent.forget_reported(state(executor("a", time=2.0), executor("b", time=2.0)))  # taken before a admitted it
    assert sent.view()["a"].requests == 1
    assert choose_executor(s, set(), "m", unreported=sent.view()) == "b"
    sent.asking("b")
    sent.not_admitted("a")  # refused, or no answer came: nothing sent a
    assert choose_executor(s, set(), "m", unreported=sent.view()) == "a"
    sent.admitted("b", 3.0, 1)
    sent.forget_reported(state(executor("a", time=2.5), executor("b", time=2.5)))
    assert {name: v.requests for name, v in sent.view().items()} == {"b": 1}


@pytest.mark.parametrize("asked", [False, True], ids=["admitted at once", "asked, every answer to come"])
@given(st.integers(min_value=2, max_value=6), st.integers(min_value=1, max_value=40))
def test_identical_executors_between_two_states_take_turns(asked, n, arrivals):
    """Each request counted as admitted when routed (the simulator's admissions take no time), or as asked (the
    gateway routes a burst before the first answer is back, then counts each admitted with its pages)."""
    s = state(*(executor(f"e{i}", free=1000) for i in range(n)))
    sent, counts = Unreported(), {f"e{i}": 0 for i in range(n)}
    for t in range(arrivals):
        chosen = choose_executor(s, set(), "m", unreported=sent.view())
        if asked:
            sent.asking(chosen)
        else:
            sent.add(chosen, float(t + 1), 1)
        counts[chosen] += 1
    assert max(counts.values()) - min(counts.values()) <= 1
    for name, count in counts.items() if asked else ():
        for _ in range(count):
            sent.admitted(name, 1.0, 2)
    assert {name: (v.requests, v.pages) for name, v in sent.view().items() if v.requests} == {
        name: (count, (2 if asked else 1) * count) for name, count in counts.items() if count}


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.booleans()), min_size=1, max_size=8),
       st.dictionaries(st.integers(0, 7), st.tuples(st.integers(0, 3), st.integers(0, 30), st.booleans()),
                       max_size=4),
       st.sets(st.integers(0, 7), max_size=3))
def test_the_quick_walk_picks_what_weighing_every_executor_picks(executors, sends, excluded):
    from shared.core.router import Sent, kv_in_use
    s = state(*(executor(f"e{i}", free=free, waiting=waiting, suspect=suspect)
                for i, (free, waiting, suspect) in enumerate(executors)))
    sent = {f"e{i}": Sent(requests, pages, full) for i, (requests, pages, full) in sends.items()}
    exclude = {f"e{i}" for i in excluded}
    nothing = Sent()
    expected = min(((e.suspect, sent.get(e.executor, nothing).full,
                     e.telemetry.waiting + sent.get(e.executor, nothing).requests,
                     kv_in_use(e, sent.get(e.executor, nothing).pages), e.executor)
                    for e in s.executors if e.executor not in exclude), default=(None,))[-1]
    assert choose_executor(s, exclude, "m", unreported=sent) == expected


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.booleans(), st.sampled_from("mn")), min_size=1,
                max_size=8),
       st.lists(st.tuples(st.integers(0, 30), st.sets(st.integers(0, 7), max_size=3), st.sampled_from("mn"),
                          st.booleans()), min_size=1, max_size=30))
def test_a_state_routed_on_request_after_request_picks_what_weighing_every_executor_picks(executors, arrivals):
    """The router keeps its weighing between two states, each model's apart; every send, every refusal's
    exclusion and every refuser's mark still leave its choice the least loaded of all that serve the model
    asked for."""
    from shared.core.router import NOTHING_SENT, kv_in_use
    s = state(*(executor(f"e{i}", free=free, waiting=waiting, suspect=suspect, model=model)
                for i, (free, waiting, suspect, model) in enumerate(executors)))
    sent = Unreported()
    for t, (pages, excluded, model, refuses) in enumerate(arrivals):
        exclude = {f"e{i}" for i in excluded}
        view = sent.view()
        expected = min(((e.suspect, (v := view.get(e.executor, NOTHING_SENT)).full, e.telemetry.waiting + v.requests,
                         kv_in_use(e, v.pages), e.executor)
                        for e in s.executors if e.executor not in exclude and e.telemetry.model == model),
                       default=(None,))[-1]
        chosen = choose_executor(s, exclude, model, unreported=view)
        assert chosen == expected
        if chosen is not None and refuses:
            sent.refused(chosen, float(t + 1))
        elif chosen is not None:
            sent.add(chosen, float(t + 1), pages)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.booleans()), min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 30)), min_size=1, max_size=40))
def test_requests_walking_past_refusers_in_turn_each_get_the_least_loaded_they_have_not_tried(executors, steps):
    """Three requests' retry walks interleave (as the gateway's admissions do, each awaiting a reply): each call
    passes its request's own set of executors tried so far, grown by one each time, and gets the least loaded of
    those it has not tried, as weighing every executor would pick; a request that found none starts again."""
    from shared.core.router import NOTHING_SENT, kv_in_use
    s = state(*(executor(f"e{i}", free=free, waiting=waiting, suspect=suspect)
                for i, (free, waiting, suspect) in enumerate(executors)))
    sent, tried = Unreported(), [set(), set(), set()]
    for t, (walker, refuses, pages) in enumerate(steps):
        exclude, view = tried[walker], sent.view()
        expected = min(((e.suspect, (v := view.get(e.executor, NOTHING_SENT)).full, e.telemetry.waiting + v.requests,
                         kv_in_use(e, v.pages), e.executor) for e in s.executors if e.executor not in exclude),
                       default=(None,))[-1]
        chosen = choose_executor(s, exclude, "m", unreported=view)
        assert chosen == expected
        if chosen is None:
            tried[walker] = set()
        elif refuses:
            sent.refused(chosen, float(t + 1))
            exclude.add(chosen)
        else:
            sent.add(chosen, float(t + 1), pages)
            tried[walker] = set()
