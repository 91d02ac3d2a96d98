"""How a simulated executor steps (mixed into SimExecutor, executor.py, whose scheduler, requests and windows it
works on): a step is scheduled by the engine's own scheduler and lasts what the cost model says. A batch that only
decodes runs many steps as one (decode_run.py): `settle` brings it to whatever reads the executor, `cut` ends it
where the next step would schedule otherwise. A batch of decodes that admits waiting sequences beside them is
stepped without touching each sequence each step (decode_batch.py): `release_batch` writes its tokens before
anything else reads or changes the sequences.
"""

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.tools.simulator import costs, decode_run
from services.tools.simulator.decode_batch import DecodeBatch
from shared.core.scheduling.scheduler import SchedulerOutput
from shared.core.scheduling.sequence import Sequence

if TYPE_CHECKING:  # annotations only
    from services.tools.simulator.executor import SimRequest


class SimStepping:
    def start_step(self, now: float) -> float | None:
        """Schedule the next step, a run of decode steps (decode_run.py) or a decode batch's step (decode_batch.py);
        when it ends, or None when there is nothing to run."""
        phases = None
        if self.decode_runs and self.leads:
            if self.batch is None:
                rows = self.group.replica_rows() if self.group is not None else None
                self.batch = DecodeBatch.of(self.scheduler, self.blocks, self.max_model_len, self._written, rows)
                self.batch_mix = (self.layer_bits.count(8), self.layer_bits.count(4))
            if self.batch is not None:
                self.run = decode_run.plan_batch_run(self.batch, now, self._batch_timing)
            else:
                self.run = decode_run.plan_run(self.scheduler, self.blocks, self.max_model_len, now, self._run_timing)
            if self.run is not None:
                self.step_serial += 1
                if self.spec.reports_latency:  # a run cut short counts the steps it planned (64 at most)
                    batch, contexts, steps = *self.run_began, len(self.run.ends)
                    self.steps_load.add(batch, contexts + batch * (steps - 1) // 2, [], steps)
                self.settle(now)
                return self.run.ends[-1]
            if self.batch is not None and (planned := self.batch.step()) is not None:
                phases, out = planned
        self.batched = phases is not None
        if not self.batched:
            self.release_batch()
            out = self.scheduler.schedule()
            if not out.chunks:
                return None
        self.step_serial += 1
        self.stepping, self.step_started_s = out, now
        self.busy.begin(now)
        return now + self._step_seconds(now, out, phases)

    def release_batch(self) -> list[Sequence]:
        """Write back every token the decode batch holds and drop it, before anything but its own steps reads or
        changes its sequences: its members, in the batch's order."""
        if self.batch is None:
            return []
        members, self.batch = self.batch.write_all(), None
        return members

    def _written(self, seq: Sequence, tokens: int, last_s: float) -> None:
        """The decode batch wrote `tokens` of `seq`'s, the last at `last_s`: its request's record of them."""
        request = self.requests[seq.request_id]
        request.tokens += tokens
        bits = request.token_bits
        bits[self.batch_mix] = bits.get(self.batch_mix, 0) + tokens
        request.last_token_s = last_s

    def _step_seconds(self, now: float, out: SchedulerOutput, phases: tuple | None) -> float:
        """The step `out` beginning `now`, or a decode batch's step of `phases` (costs.phases) with `out` its
        admissions: its seconds, its instance's other members marked busy for their parts."""
        if self.spec.reports_latency:
            self.steps_load.add(*(costs.phases(out.chunks) if phases is None else phases))
        if self.group is None:
            return (costs.step_seconds(self.spec, self.layer_bits, out.chunks) if phases is None
                    else costs.phased_step_seconds(self.spec, self.layer_bits, *phases))
        seconds, parts = (self.group.step_seconds(out.chunks) if phases is None
                          else self.group.batch_step_seconds(self.batch, phases, out.chunks))
        self._members_busy([(now, parts)])
        return seconds

    def _members_busy(self, steps: Iterable[tuple[float, dict[str, float]]]) -> None:
        """The other members of its instance compute their parts of `steps` (each its start and the parts): each
        member's spans marked in one call."""
        spans: dict[str, list[tuple[float, float]]] = {}
        for start, parts in steps:
            for name, part in parts.items():
                if name != self.id and part > 0:
                    spans.setdefault(name, []).append((start, start + part))
        members = self.group.members
        for name, marked in spans.items():
            members[name].busy.spans(marked)

    def _run_timing(self, seqs: list[Sequence], base: list[int]):
        """A decode run's steps: (seconds, each other member's computing seconds) by step (decode_run.plan_run)."""
        if self.group is None:
            return self._batch_timing(len(seqs), sum(base) + len(seqs))
        self.run_began = (len(seqs), sum(base) + len(seqs))
        return self.group.decode_timing(seqs, base)

    def _batch_timing(self, batch: int, contexts: int):
        """A decode batch's run (decode_run.plan_batch_run): `batch` decodes whose contexts summed `contexts` at its
        first step."""
        self.run_began = (batch, contexts)
        if self.group is None:
            seconds = costs.decode_step_seconds(self.spec, self.layer_bits, batch)
            return lambda step: (seconds(int((contexts + batch * step) / batch)), {})
        return self.group.batch_run_timing(self.batch, contexts)

    def settle(self, now: float) -> None:
        """Bring a decode run to `now`: the steps begun by then have their pages and busy span, those ended have
        their tokens out, as single steps would have left them. Its last step is finish_step's."""
        run = self.run
        if run is None:
            return
        ended, began = run.finished, run.started
        started = max(began, run.begun_by(now))
        if run.batch is not None:
            for step in range(began, started):
                self._end_batch_steps(run, step)  # each step before it ended where it began
                run.batch.open_blocks()
        while run.reserved < len(run.pages) and run.pages[run.reserved][0] < started:
            step, i = run.pages[run.reserved]
            self.blocks.reserve(run.seqs[i], run.base[i] + step + 1)
            run.reserved += 1
        if self.group is not None:
            self._members_busy((run.start_of(step), run.parts[step]) for step in range(began, started))
        run.started = started
        if began == 0 and run.started:
            self.busy.begin(run.began)
        run.finished = max(ended, run.started - 1)  # each step but the last begun ends where the next begins
        self.busy.back_to_back(run.ends[ended:run.finished])
        if (steps := run.finished - ended) == 0:
            return
        if run.batch is not None:
            self._end_batch_steps(run, run.finished)
            self.counts["generated_tokens"] += steps * len(run.batch.marks)
            return
        mix, tokens = (self.layer_bits.count(8), self.layer_bits.count(4)), [0] * steps
        last = run.ends[run.finished - 1]
        for seq in run.seqs:
            seq.num_computed += steps
            seq.output_ids += tokens
            request = self.requests[seq.request_id]
            request.tokens += steps
            request.token_bits[mix] = request.token_bits.get(mix, 0) + steps
            request.last_token_s = last
        self.counts["generated_tokens"] += steps * len(run.seqs)

    @staticmethod
    def _end_batch_steps(run: decode_run.DecodeRun, upto: int) -> None:
        """A decode batch's run: its steps before the `upto`-th ended. Nobody ends in one but the run's last, which
        finish_step ends."""
        batch = run.batch
        while batch.tick < run.tick + upto:
            if batch.end_step(run.ends[batch.tick - run.tick]):
                raise RuntimeError(f"a decode batch's run ended a member at step {batch.tick - run.tick} of "
                                   f"{len(run.ends)}: runs end at their first member's last token")

    def cut(self, now: float) -> float | None:
        """Something changed what the next step would schedule: a decode run ends with the step in flight at `now`.
        When it now ends (its step_serial moved on), or None when nothing changed."""
        if self.run is None:
            return None
        self.settle(now)
        if not self.run.cut():
            return None
        self.step_serial += 1
        return self.run.ends[-1]

    def finish_step(self, now: float) -> list["SimRequest"]:
        """The step started by start_step ends at `now`: tokens out, finished requests freed and returned."""
        if (run := self.run) is not None:  # every step but its last settled; that one ends below
            self.settle(now)
            self.run, self.stepping, self.decoding = None, SchedulerOutput(), run.seqs
            self.step_started_s = run.start_of(len(run.ends) - 1)
            self.batched = run.batch is not None
        out, self.stepping, decoding, self.decoding = self.stepping, None, self.decoding, []
        batch, self.batched = self.batch if self.batched else None, False
        self.busy.end(now)
        done = []
        mix = (self.layer_bits.count(8), self.layer_bits.count(4))
        if self.cancelled:
            if batch is not None:  # a cancelled sequence takes no more tokens: this step's go one by one below
                decoding, batch = self.release_batch(), None
            out.chunks = [c for c in out.chunks if c.seq.request_id not in self.cancelled]
            decoding = [seq for seq in decoding if seq.request_id not in self.cancelled]
            self._drop_cancelled()
        # At a thousand executors these loops run for every sequence of every step: counts are summed locally.
        requests, started, max_model_len = self.requests, self.step_started_s, self.max_model_len
        generated = len(decoding)
        if batch is not None:
            generated += len(batch.marks)
            for seq in batch.end_step(now):
                self.scheduler.remove(seq)
                done.append(self._finish(seq.request_id, now))
        for seq in decoding:  # a run's last step's decodes: what the loop below does to a decode's chunk
            request = requests[seq.request_id]
            seq.num_computed += 1
            outputs = seq.output_ids
            outputs.append(0)
            request.tokens += 1
            bits = request.token_bits
            bits[mix] = bits.get(mix, 0) + 1
            request.last_token_s = now
            if len(outputs) >= seq.params.max_tokens or len(seq.prompt_ids) + len(outputs) >= max_model_len:
                self.scheduler.remove(seq)
                done.append(self._finish(seq.request_id, now))
        prompt_tokens = 0
        for chunk in out.chunks:
            seq, start, length = chunk.seq, chunk.start, chunk.length
            request = requests[seq.request_id]
            seq.num_computed += length
            prompt = len(seq.prompt_ids)
            if start < prompt:
                prompt_tokens += min(start + length, prompt) - start
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = request.first_scheduled_s = started
                self.departures.record(now)
                self.queue_delay.record(started - request.admitted_s, now)
            outputs = seq.output_ids
            if start + length != prompt + len(outputs):  # not the sequence's last token (ScheduledChunk.completes)
                continue
            outputs.append(0)
            generated += 1
            request.tokens += 1
            bits = request.token_bits
            bits[mix] = bits.get(mix, 0) + 1
            if request.first_token_s is None:
                request.first_token_s = now
                self.ttft.record(now - request.admitted_s, now)
            request.last_token_s = now
            if len(outputs) >= seq.params.max_tokens or prompt + len(outputs) >= max_model_len:
                self.scheduler.remove(seq)
                done.append(self._finish(seq.request_id, now))
            elif batch is not None:  # its prompt is in: it decodes with the batch from the next step
                batch.join(seq)
        if batch is not None and len(batch.marks) != len(self.scheduler.running):  # a prompt still going in
            self.release_batch()
        self.counts["prompt_tokens"] += prompt_tokens
        self.counts["generated_tokens"] += generated
        return done
