"""The engine the executor service drives: add requests, abort them, step, read outputs and counters.

One step = schedule, run the model on the packed batch, sample, then turn new tokens into per-sequence
deltas (text, timestamps, logprobs, finish). Everything a request owns is freed the moment it finishes,
is aborted or passes its deadline.
"""

import itertools
import logging
import random
import time
from collections.abc import Callable
from typing import Protocol
from dataclasses import dataclass

import torch

from services.executor.engine.model.loader import load_checkpoint, resolve_model_path
from services.executor.engine.model.tokenizer import Tokenizer
from services.executor.engine.morphing.swapper import LayerSwapper
from services.executor.engine.morphing.variants import VariantStore, calibration_windows
from services.executor.engine.runner import ModelRunner, alone
from services.executor.engine.scheduling import handover
from services.executor.engine.scheduling.outputs import (Completion, CompletionDelta, CompletionOutput, TextStream,
                                                         TokenLogprob)
from services.executor.engine.scheduling.sampler import SamplingRow, sample, skip_draws
from shared.config import EngineConfig
from shared.core.errors import DuplicateRequestError
from shared.core.memory.block_manager import BlockManager
from shared.core.memory.ledger import LedgerSnapshot
from shared.core.scheduling.growth import blocks_at_end
from shared.core.scheduling.limits import EngineLimits, check_request
from shared.core.scheduling.phases import StepsLoad, phases
from shared.core.scheduling.scheduler import Scheduler
from shared.core.scheduling.sequence import Sequence, Status, finish_reason
from shared.messages import EvictArgs, MigrateArgs, QuantizeArgs, ReplicateArgs, RestoreArgs, ResumedCompletion
from shared.sampling import SamplingOptions

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_len(config: EngineConfig, cfg) -> int:
    """The longest sequence served: the configured one, capped by what the model can attend to exactly."""
    return min(config.max_model_len or cfg.max_context, cfg.max_context)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    preemptions: int
    admission_blocked: int  # steps in which the queue's head waited for KV pages alone
    prompt_tokens: int  # prefill tokens computed, recomputation included
    generated_tokens: int
    steps: int
    finished: int
    aborted: int
    expired: int  # requests dropped at their deadline
    ledger: LedgerSnapshot


class Place(Protocol):
    """Builds the runner the engine steps, from the checkpoint: `runner.alone` for the whole model here, the fabric's
    `leader.seated` for an instance of several executors that it leads. The engine knows no fabric, only the runner
    it is handed."""

    def __call__(self, checkpoint, dtype: torch.dtype, max_model_len: int, progress: bool) -> ModelRunner: ...


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, place: Place | None = None):
        """`place`: where the model runs when this executor leads an instance that spans several executors; None
        for an executor that holds the whole model (runner.alone)."""
        self.config = config
        path = resolve_model_path(config.model)
        # Kept (read lazily) for layers that come back whole: replicas, and leaving an instance (fabric/enlist.py).
        self.checkpoint = checkpoint = load_checkpoint(path)
        self.model_config = cfg = checkpoint.config
        self.tokenizer = Tokenizer.load(path)
        self.eos_token_ids = tuple(cfg.eos_token_ids) or ((self.tokenizer.eos_token_id,)
                                                          if self.tokenizer.eos_token_id is not None else ())
        self.max_model_len = model_len(config, cfg)
        dtype = DTYPES[config.resolved_dtype()]
        whole = place is None  # the whole model here, not a share of an instance's
        self.runner = (place or alone(config))(checkpoint, dtype, self.max_model_len, progress)
        self.model, self.arena = self.runner.model, self.runner.model.arena
        self.blocks = BlockManager(self.runner.kv_pages, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_waiting)
        windows = calibration_windows(self.tokenizer, window=min(512, self.max_model_len)) if config.awq else None
        # An instance's members morph together (the fabric's transformations), never one shard on its own.
        self.variants = VariantStore(self.model, checkpoint.fingerprint() if whole else None,
                                     config.variant_bits, config.awq, config.variant_cache_dir,
                                     config.host_memory_cap, windows)
        if config.prepare_variants and whole:
            self.variants.prepare(progress)
        self.swapper = LayerSwapper(self.model, self.arena, self.scheduler, self.variants)
        self._rng = random.Random(config.seed)
        self._requests: dict[str, list[Sequence]] = {}
        self._text: dict[int, TextStream] = {}
        self._pending: list[CompletionDelta] = []
        self._counts = dict(prompt_tokens=0, generated_tokens=0, steps=0, finished=0, aborted=0, expired=0)
        # Its steps' phases, for the latency its telemetry reports: counted only once a service given a latency
        # profile asks for them (`count_steps`), so that a step pays nothing for what nobody reads.
        self.steps_load: StepsLoad | None = None
        self._generate_ids = itertools.count()

    @property
    def member(self):
        """The instance this engine leads (its runner's member); None while it serves alone."""
        return self.runner.member

    # --- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingOptions,
                    deadline: float | None = None, arrival_time: float | None = None,
                    resume: list[ResumedCompletion] | None = None) -> int:
        """Admit a request; returns its prompt length. Raises InvalidRequestError, KvCapacityError or
        QueueFullError. With `resume`, the request was started elsewhere: only the completions listed go on,
        each from the tokens it already has (prefilled with the prompt, not generated again)."""
        if request_id in self._requests:
            raise DuplicateRequestError(request_id)
        prompt_ids = self.check_request(prompt, params, resume)
        arrival = arrival_time or time.time()
        if resume:
            seqs = [self._resumed(Sequence(request_id, r.index, prompt_ids, params, arrival, deadline,
                                           generator=self._generator(params, r.index), output_ids=list(r.token_ids)),
                                  r.text_chars) for r in resume]
        else:
            seqs = [Sequence(request_id, 0, prompt_ids, params, arrival, deadline, fork_into=params.n,
                             generator=self._generator(params, 0))]
            self._text[seqs[0].seq_id] = TextStream(self.tokenizer, prompt_ids, params)
        for seq in seqs:
            self.scheduler.add(seq)
        self._requests[request_id] = seqs
        return len(prompt_ids)

    def check_request(self, prompt: str | list[int], params: SamplingOptions,
                      resume: list[ResumedCompletion] | None = None) -> list[int]:
        """The prompt's token ids if this engine, as it is now, can take the request; InvalidRequestError or
        KvCapacityError if not. It changes nothing, so the executor asks it outside the engine thread."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        limits = EngineLimits(vocab=self.model_config.vocab_size, max_num_seqs=self.config.max_num_seqs,
                              max_model_len=self.max_model_len, block_size=self.config.block_size,
                              capacity_blocks=self.kv_capacity_blocks())
        check_request(prompt_ids, params, limits, [(r.index, r.token_ids) for r in resume or []])
        return prompt_ids

    def _resumed(self, seq: Sequence, text_chars: int) -> Sequence:
        """`seq` goes on from tokens generated elsewhere: to the scheduler it is one preempted after them (their KV
        is recomputed), to the sampler and the text one that sampled them here."""
        if seq.generator is not None:
            skip_draws(seq.generator, self.model.lm_head.shape[0], len(seq.output_ids))
        self._text[seq.seq_id] = text = TextStream(self.tokenizer, seq.prompt_ids, seq.params)
        text.resume(seq.output_ids, text_chars)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its final deltas come out of the next step()."""
        if request_id not in self._requests:
            return False
        self._end_request(request_id, "abort")
        return True

    def has_request(self, request_id: str) -> bool:
        """Whether any sequence of the request is still running or waiting."""
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending)

    # --- stepping -----------------------------------------------------------------------------
    def count_steps(self) -> None:
        """Count every step's phases from now on (`steps_load`)."""
        self.steps_load = self.steps_load or StepsLoad()

    def step(self) -> list[CompletionDelta]:
        now = time.time()
        for request_id, seqs in list(self._requests.items()):
            if seqs[0].deadline is not None and now > seqs[0].deadline:
                self._end_request(request_id, "deadline")
        out, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.chunks:
            return out
        if self.steps_load is not None:
            self.steps_load.add(*phases(sched.chunks))
        logits, sampled = self.runner.run(sched)
        for chunk in sched.chunks:
            chunk.seq.num_computed += chunk.length
            if chunk.seq.first_scheduled_time is None:
                chunk.seq.first_scheduled_time = now
            self._counts["prompt_tokens"] += max(0, min(chunk.start + chunk.length, len(chunk.seq.prompt_ids))
                                                    - chunk.start)
        self._counts["steps"] += 1
        seqs, rows = [], []
        for row, chunk in enumerate(sampled):
            for seq in self._fork(chunk.seq):
                seqs.append(seq)
                rows.append(row)
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        result = sample(logits, [SamplingRow(s.params, s.generator, s.prompt_ids, s.output_ids, self.eos_token_ids)
                                 for s in seqs])
        stamp = time.time()
        for i, seq in enumerate(seqs):
            logprob = None
            if result.logprobs is not None and result.logprobs[i] is not None:
                logprob = [TokenLogprob(result.token_ids[i], result.logprobs[i], result.top_logprobs[i])]
            out.append(self._append_token(seq, result.token_ids[i], stamp, logprob))
        return out

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The parent of an n > 1 request becomes n sequences sharing its prompt pages."""
        if seq.fork_into == 1:
            return [seq]
        family = [seq]
        for index in range(1, seq.fork_into):
            child = Sequence(seq.request_id, index, seq.prompt_ids, seq.params, seq.arrival_time, seq.deadline,
                             generator=self._generator(seq.params, index), num_computed=seq.num_computed,
                             first_scheduled_time=seq.first_scheduled_time)
            self.blocks.fork(seq, child)
            self.scheduler.add_running(child)
            self._text[child.seq_id] = TextStream(self.tokenizer, seq.prompt_ids, seq.params)
            family.append(child)
        seq.fork_into = 1
        self._requests[seq.request_id] = family
        return family

    def _append_token(self, seq: Sequence, token: int, stamp: float, logprob) -> CompletionDelta:
        text = self._text[seq.seq_id]
        seq.output_ids.append(token)
        self._counts["generated_tokens"] += 1
        reason, stop_reason = finish_reason(token, text.add, seq, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self._finish(seq, reason, stop_reason)
        return self._delta(seq, [token], [stamp], logprob)

    def _end_request(self, request_id: str, reason: str) -> None:
        """Abort (reason "abort") or expire (reason "deadline") every live sequence of a request."""
        self._counts["aborted" if reason == "abort" else "expired"] += 1
        for seq in list(self._requests[request_id]):
            if seq.status is not Status.FINISHED:
                self._finish(seq, reason, None)
                self._pending.append(self._delta(seq, [], [], None))

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        """Free `seq`'s pages; the request is forgotten once all its sequences are done."""
        self.scheduler.remove(seq)
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if all(s.status is Status.FINISHED for s in self._requests[seq.request_id]):
            del self._requests[seq.request_id]
            self.runner.forget(seq.request_id)
            if reason in ("stop", "length"):
                self._counts["finished"] += 1

    def _delta(self, seq: Sequence, tokens: list[int], stamps: list[float], logprob) -> CompletionDelta:
        finished = seq.status is Status.FINISHED
        text = self._text[seq.seq_id].take(finished)
        if finished:
            del self._text[seq.seq_id]
        return CompletionDelta(seq.request_id, seq.index, tokens, text, stamps, logprob, finished,
                               seq.finish_reason, seq.stop_reason, len(seq.prompt_ids), len(seq.output_ids),
                               seq.first_scheduled_time)

    def _generator(self, params: SamplingOptions, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed + index if params.seed is not None else self._rng.randrange(1 << 62)
        return torch.Generator(device=self.config.device).manual_seed(seed)

    # --- CoCoServe's operations ---------------------------------------------------------------
    def reshape(self, op: ReplicateArgs | MigrateArgs | EvictArgs | QuantizeArgs | RestoreArgs) -> dict:
        """Replicate, migrate, evict, quantize or restore layers of the instance this engine leads, between
        two steps (an executor alone quantizes through its swapper)."""
        return self.runner.reshape(op, self.scheduler)

    # --- AMOEBAs' merge -----------------------------------------------------------------------
    def export_sequences(self) -> list[dict]:
        """Every live sequence, packed for another engine (handover.pack), block tables in our pages."""
        return [self.pack_sequence(s) for s in [*self.scheduler.running, *self.scheduler.waiting]]

    def pack_sequence(self, seq: Sequence) -> dict:
        return handover.pack(seq, self._text[seq.seq_id])

    def _place(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.blocks = BlockManager(runner.kv_pages, self.config.block_size)
        self.scheduler.blocks = self.blocks

    def lead_instance(self, runner: ModelRunner, block_ids: Callable[[int, list[int]], list[int]],
                      handed: list[tuple[int, dict]]) -> None:
        """Step the merged instance `runner` runs from now on: our sequences' block tables become instance block
        ids (`block_ids(0, pages)`), and the sequences member r handed over (packed) join with theirs."""
        self._place(runner)
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            seq.block_table = block_ids(0, seq.block_table)
        for rank, packed in handed:
            self.adopt(packed, block_ids(rank, packed["block_table"]))

    def serve_alone(self, pages: Callable[[list[int]], list[int]], keep: Callable[[Sequence], bool],
                    handed: list[dict]) -> None:
        """Serve alone again after a TP split: the sequences `keep` says stay get their block tables back in
        our pages (`pages(block ids)`), the others are another engine's now, and `handed` (packed, in block
        ids) join."""
        self._place(ModelRunner(self.model, self.config.block_size, self.config.device))
        for queue in (self.scheduler.running, self.scheduler.waiting):
            for seq in list(queue):
                if keep(seq):
                    seq.block_table = pages(seq.block_table)
                    continue
                queue.remove(seq)
                self._text.pop(seq.seq_id, None)
                family = [s for s in self._requests.get(seq.request_id, []) if s is not seq]
                self._requests[seq.request_id] = family
                if not family:
                    del self._requests[seq.request_id]
        for packed in handed:
            self.adopt(packed, pages(packed["block_table"]))

    def adopt(self, packed: dict, block_table: list[int]) -> None:
        """A sequence another engine packed (handover.pack) goes on here."""
        seq, text = handover.unpack(packed, block_table, self.tokenizer, self.config.device)
        self._text[seq.seq_id] = text
        self._requests.setdefault(seq.request_id, []).append(seq)
        if packed["running"]:
            self.scheduler.add_running(seq)
        else:
            self.scheduler.waiting.append(seq)

    def hand_over(self) -> None:
        """Forget every sequence: another engine goes on with them (export_sequences)."""
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self._requests.clear()
        self._text.clear()

    # --- reading ------------------------------------------------------------------------------
    def keepalive(self) -> None:
        """Called while there is nothing to step: an instance's leader tells its members it lives."""
        self.runner.keepalive()

    def kv_blocks_at_end(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """KV blocks a sequence holds once it ends: at max_tokens, else (it may grow so far) max_model_len. Its
        last token is sampled but never written to the cache."""
        return blocks_at_end(prompt_tokens, max_tokens or None, self.max_model_len, self.config.block_size)

    def kv_capacity_blocks(self) -> int:
        """KV blocks the instance holds when empty: the most one sequence can take."""
        return self.runner.kv_capacity_blocks()

    def stats(self) -> EngineStats:
        ledger = self.runner.ledger()
        return EngineStats(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                           preemptions=self.scheduler.num_preemptions,
                           admission_blocked=self.scheduler.num_admission_blocked, ledger=ledger, **self._counts)

    def generate(self, prompts: list[str | list[int]], params: SamplingOptions | list[SamplingOptions]
                 ) -> list[Completion]:
        """Offline generation of a whole batch (tests and benchmarks); returns completions in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        done: dict[str, Completion] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            rid = f"generate-{next(self._generate_ids)}"
            n_prompt = self.add_request(rid, prompt, p)
            done[rid] = Completion(rid, n_prompt, [CompletionOutput(j) for j in range(p.n)])
        while self.has_unfinished():
            for delta in self.step():
                done[delta.request_id].add(delta)
        return list(done.values())
