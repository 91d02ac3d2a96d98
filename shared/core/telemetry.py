"""What an executor reports (ExecutorTelemetry), built once for the executor service, a follower of an instance and
the simulator's executors: each gathers its facts from its own parts, and the rules of what a report says of them
live here.

A member of an instance reports its plan's layers (its instance swaps as a whole, front to back) and the pages its
arena has free beside the instance's KV (room for replicas); a follower has no queue of its own (its leader's
requests are the leader's to report), and what a request joining a queue would wait is worked out here alone.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.core.admission import queue_wait_s
from shared.core.kv_report import kv_fields
from shared.core.memory.ledger import LedgerSnapshot
from shared.messages import ExecutorTelemetry, GpuStats, InstancePlan, KvPages, KvUnits, Message, RequestLatency


@dataclass(frozen=True, slots=True)
class Served:
    """What an executor serves, fixed while its process runs."""
    executor: str
    instance: str  # new at every process start
    model: str
    max_model_len: int
    block_size: int
    page_bytes: int
    layer_pages: int  # pages of one full-precision layer slot
    kv_heads: int
    max_waiting: int


@dataclass(frozen=True, slots=True)
class Queue:
    """Its requests, as an executor that takes them has them (alone, or leading an instance)."""
    running: int
    waiting: int
    max_num_seqs: int
    preemptions: int
    admission_blocked: int
    rejected: int
    prompt_tokens: int
    generated_tokens: int
    queue_delay_s: float
    ttft_s: float
    tpot_s: float
    departures: tuple[int, float]  # Departures.recent(): requests that left the waiting queue lately
    pages_growth: int
    longest_blocks: int
    requests: list[RequestLatency] = field(default_factory=list)  # finished since the previous report


NO_QUEUE = Queue(running=0, waiting=0, max_num_seqs=0, preemptions=0, admission_blocked=0, rejected=0, prompt_tokens=0,
                 generated_tokens=0, queue_delay_s=0.0, ttft_s=0.0, tpot_s=0.0, departures=(0, 0.0), pages_growth=0,
                 longest_blocks=0)


def validated(message: type[Message], **fields) -> Message:
    return message(**fields)


def executor_telemetry(served: Served, now: float, pages: LedgerSnapshot, queue: Queue, *, layers: list[int],
                       swap_order: list[int], member_of: InstancePlan | None, plan: InstancePlan | None,
                       free_pages: int, busy: float, draining: bool, hold_s: float = 0.0,
                       world: list[str] | None = None, kv_units: list[KvUnits] | None = None,
                       layer_seconds: dict[int, float] | None = None, gpu: GpuStats | None = None,
                       build: Callable[..., Message] = validated) -> ExecutorTelemetry:
    """The report of an executor at `now`. `member_of`: the instance it is a member of, else None; `plan`: the plan
    it serves, as the monitor should see it; `hold_s`: how long its merged instance is held yet. `build` constructs
    the messages (the simulator's skips validation)."""
    if member_of is not None:
        layers, swap_order = [layer.bits for layer in member_of.layers], list(range(len(member_of.layers)))
    return build(
        ExecutorTelemetry, executor=served.executor, instance=served.instance, time=now, model=served.model,
        max_model_len=served.max_model_len, block_size=served.block_size, page_bytes=served.page_bytes,
        kv=build(KvPages, **kv_fields(pages)), layers=layers, swap_order=swap_order, plan=plan,
        running=queue.running, waiting=queue.waiting, max_waiting=served.max_waiting, preemptions=queue.preemptions,
        admission_blocked=queue.admission_blocked, rejected=queue.rejected, prompt_tokens=queue.prompt_tokens,
        generated_tokens=queue.generated_tokens, queue_delay_s=queue.queue_delay_s, ttft_s=queue.ttft_s,
        tpot_s=queue.tpot_s, draining=draining, gpu=gpu, max_num_seqs=queue.max_num_seqs, requests=queue.requests,
        pages_growth=queue.pages_growth, busy=busy, layer_pages=served.layer_pages,
        spare_pages=free_pages if member_of is not None else 0,
        world=list(world or []), kv_units=list(kv_units or []),
        longest_blocks=queue.longest_blocks, kv_heads=served.kv_heads,
        merge_hold_s=hold_s,
        layer_seconds=layer_seconds or {},
        predicted_wait_s=queue_wait_s(queue.waiting, queue.running, queue.max_num_seqs, *queue.departures))
