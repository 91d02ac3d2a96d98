"""The synthetic executors `morphling bench-bus` loads the bus with (services/tools/bench/bus_scale.py measures).

Each stands in for an executor on another machine: it sends a real ExecutorTelemetry on its own subject every
interval through shared.bus, as an executor's heartbeat does, and answers its command subject: quantize and
restore change the layer bits and KV pages it reports, ping answers with its load, anything else is refused.
Its KV demand swings on a cycle of its own, so that some executors are under pressure at any moment, preempt
now and then, and the controller has something to decide. They run as asyncio tasks in publishing processes
of their own (Publishers).
"""

import asyncio
import math
import multiprocessing
import os
import random
import time
import uuid
from dataclasses import dataclass

from shared import subjects
from shared.bus import Bus, BusError, Incoming
from shared.core.memory.ledger import LedgerSnapshot
from shared.core.telemetry import Queue, Served, executor_telemetry
from shared.errors import InvalidCommandError
from shared.messages import (Command, CommandResult, ExecutorTelemetry, PingArgs, QuantizeArgs,
                             RequestLatency, RestoreArgs)

# The publishers stand in for executors on other machines: on a shared machine they take the CPU the monitor and the
# controller leave, so that what is measured is what those sustain; what the publishers then lack shows as an
# offered rate below the target.
PUBLISHER_NICENESS = 10

# A synthetic executor reports what the default model (SmolLM2-135M, float32 on a CPU) on a 1 GiB arena does.
MODEL = "SmolLM2-135M-Instruct"
DEPTH = 30  # decoder layers
SLOT_PAGES = 20  # pages of one full-precision layer slot
PAGE_BYTES = 737280
BASE_KV_PAGES = 800  # KV pages outside the slots
FREED_PAGES = {8: SLOT_PAGES // 2, 4: SLOT_PAGES * 3 // 4}  # of a slot, by the bits its layer went to
DEMAND_CYCLE_S = (20.0, 60.0)  # each executor's KV demand swings with a period drawn from this range


class BenchBusError(RuntimeError):
    """The system under test did not come up, or a publishing process failed."""


# --- the synthetic executors ------------------------------------------------------------------------
class SyntheticExecutor:
    """One executor's telemetry and command answers, without an engine."""

    def __init__(self, name: str, rng: random.Random):
        self.name = name
        self.instance = uuid.UUID(int=rng.getrandbits(128)).hex[:12]
        self.served = Served(executor=self.name, instance=self.instance, model=MODEL, max_model_len=8192,
                             block_size=16, page_bytes=PAGE_BYTES, layer_pages=SLOT_PAGES, kv_heads=3, max_waiting=256)
        self.rng = rng
        self.cycle_s = rng.uniform(*DEMAND_CYCLE_S)
        self.phase = rng.uniform(0, 2 * math.pi)
        self.bits = [16] * DEPTH
        self.quantized: list[int] = []  # layers in the order they were quantized
        self.swap_order = list(range(DEPTH))
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.answers: dict[tuple[str, int], CommandResult] = {}  # a retried command is answered from here

    def demand(self, now: float) -> float:
        """KV pages the running sequences want, as a share of the pages outside the slots: up to 0.97."""
        return 0.55 + 0.42 * math.sin(2 * math.pi * now / self.cycle_s + self.phase)

    @property
    def extension_pages(self) -> int:
        return sum(FREED_PAGES[b] for b in self.bits if b in FREED_PAGES)

    def telemetry(self, now: float) -> ExecutorTelemetry:
        capacity = BASE_KV_PAGES + self.extension_pages
        wanted = round(self.demand(now) * BASE_KV_PAGES)
        used = min(wanted, capacity)
        short = wanted - used
        # A sequence takes ~20 pages here: what does not fit waits, and a full arena preempts now and then.
        running, waiting = used // 20, -(-short // 20)
        if used > 0.93 * capacity and self.rng.random() < 0.2:
            self.preemptions += 1
        self.prompt_tokens += running * 8
        self.generated_tokens += running
        finished = [RequestLatency(ttft_s=self.rng.uniform(0.1, 1.5), tpot_s=self.rng.uniform(0.03, 0.12))
                    for _ in range(self.rng.random() < 0.2)]
        pages = LedgerSnapshot(pages_total=SLOT_PAGES * DEPTH + BASE_KV_PAGES,
                               pages_slot=SLOT_PAGES * DEPTH - self.extension_pages, pages_kv_free=capacity - used,
                               pages_kv_used=used, pages_base=BASE_KV_PAGES, pages_extension=self.extension_pages)
        queue = Queue(running=running, waiting=waiting, max_num_seqs=64, preemptions=self.preemptions,
                      admission_blocked=0, rejected=0, prompt_tokens=self.prompt_tokens,
                      generated_tokens=self.generated_tokens,
                      queue_delay_s=0.05 + 2.0 * max(0.0, self.demand(now) - 0.9), ttft_s=0.3, tpot_s=0.07,
                      departures=(0, 0.0), pages_growth=0, longest_blocks=0, requests=finished)
        return executor_telemetry(self.served, now, pages, queue, layers=list(self.bits), swap_order=self.swap_order,
                                  member_of=None, plan=None, free_pages=0, busy=min(1.0, running / 40),
                                  draining=False)

    def answer(self, command: Command) -> CommandResult:
        key = (command.issuer, command.seq)
        if key not in self.answers:
            self.answers[key] = self._apply(command)
        return self.answers[key]

    def _apply(self, command: Command) -> CommandResult:
        result = CommandResult(seq=command.seq, issuer=command.issuer, executor=self.name, kind=command.kind, ok=True)
        try:
            args = command.parsed_args()
        except InvalidCommandError as exc:
            return result.model_copy(update={"ok": False, "error": f"refused: {exc.message}"})
        if isinstance(args, PingArgs):
            result.state = {"running": 0, "waiting": 0, "draining": False}
        elif isinstance(args, QuantizeArgs):
            layers = args.layers if isinstance(args.layers, list) else \
                [i for i in self.swap_order if self.bits[i] > args.bits][:args.layers]
            for i in layers:
                self.bits[i] = args.bits
                self.quantized = [q for q in self.quantized if q != i] + [i]
            result.state = {"changed": layers, "bits": args.bits}
        elif isinstance(args, RestoreArgs):
            layers = args.layers if isinstance(args.layers, list) else self.quantized[::-1][:args.layers]
            for i in layers:
                self.bits[i] = 16
            self.quantized = [q for q in self.quantized if q not in layers]
            result.state = {"changed": layers, "bits": 16}
        else:
            return result.model_copy(update={"ok": False, "error": f"{command.kind}: a synthetic executor of "
                                                                   f"bench-bus applies quantize and restore only"})
        return result


def executor_names(n: int) -> list[str]:
    return [f"exec{i}" for i in range(n)]


def shares(names: list[str], per_process: int) -> list[list[str]]:
    """The executors each publishing process runs: as even as they come, none above `per_process`."""
    processes = -(-len(names) // per_process)
    return [names[k::processes] for k in range(processes)]


def publish(names: list[str], nats_url: str, interval_s: float, seed: int, sent, missed, ready, stop) -> None:
    """A publishing process: the synthetic executors `names`, until `stop` is set. `sent` and `missed` count
    reports sent and reports not sent on time (a tick more than a period late is dropped, not caught up)."""
    os.nice(PUBLISHER_NICENESS)
    asyncio.run(_publish(names, nats_url, interval_s, seed, sent, missed, ready, stop))


async def _publish(names, nats_url, interval_s, seed, sent, missed, ready, stop) -> None:
    bus = await Bus.connect(nats_url, f"bench-bus-{names[0]}")
    executors = [SyntheticExecutor(name, random.Random(f"{seed}-{name}")) for name in names]
    for executor in executors:
        await bus.subscribe(subjects.command(executor.name), Command, _answerer(executor))
    await bus.flush()
    ready.set()
    loop = asyncio.get_running_loop()

    async def beat(executor: SyntheticExecutor) -> None:
        # Spread over the period, as executors started independently are.
        due = loop.time() + executor.rng.uniform(0, interval_s)
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            try:
                await bus.publish(subjects.telemetry(executor.name), executor.telemetry(time.time()))
                sent.value += 1
            except BusError:
                missed.value += 1
            due += interval_s
            late = int((loop.time() - due) // interval_s)
            if late > 0:
                missed.value += late
                due += late * interval_s

    tasks = [asyncio.create_task(beat(e)) for e in executors]
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await bus.close()


def _answerer(executor: SyntheticExecutor):
    async def on_command(incoming: Incoming) -> None:
        if incoming.can_reply:
            await incoming.reply(executor.answer(incoming.message))
    return on_command


@dataclass
class Publishers:
    """The publishing processes and what they count."""
    processes: list
    sent: list
    missed: list
    stop: object

    @classmethod
    def start(cls, names: list[str], per_process: int, nats_url: str, interval_s: float, seed: int,
              timeout_s: float) -> "Publishers":
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no event loop or bus inherited
        stop = ctx.Event()
        processes, sent, missed, readies = [], [], [], []
        for share in shares(names, per_process):
            counters = ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False)  # written by one process only
            ready = ctx.Event()
            proc = ctx.Process(target=publish, args=(share, nats_url, interval_s, seed, *counters, ready, stop),
                               name=f"bench-bus-publish-{len(processes)}", daemon=True)
            proc.start()
            processes.append(proc)
            sent.append(counters[0])
            missed.append(counters[1])
            readies.append(ready)
        publishers = cls(processes, sent, missed, stop)
        deadline = time.monotonic() + timeout_s
        for proc, ready in zip(processes, readies):
            while not ready.wait(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    publishers.close()
                    raise BenchBusError(f"publishing process {proc.name} "
                                        f"{'exited' if not proc.is_alive() else 'did not connect'} at start")
        return publishers

    def counts(self) -> tuple[int, int]:
        return sum(c.value for c in self.sent), sum(c.value for c in self.missed)

    def close(self) -> None:
        self.stop.set()
        for proc in self.processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
