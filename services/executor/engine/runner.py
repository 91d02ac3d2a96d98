"""Turns the scheduler's decision into the model's packed batch, runs it, returns logits to sample."""

import torch

from kernels.block_copy import copy_blocks
from services.executor.engine.model import DecoderModel, ForwardBatch, PrefillChunk
from services.executor.engine.scheduler import ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(self, model: DecoderModel, block_size: int, device: torch.device | str):
        self.model = model
        self.block_size = block_size
        self.device = device

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Logits `[S, vocab]` (float32) for the chunks that complete their sequence, and those chunks."""
        if out.copies:
            src, dst = zip(*out.copies)
            kv_cache = self.model.arena.kv_cache
            copy_blocks(kv_cache, self._tensor(src, torch.int64), self._tensor(dst, torch.int64))
        batch, sampled = self.build(out.chunks)
        return self.model.forward(batch), sampled

    def build(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[ScheduledChunk]]:
        bs = self.block_size
        decodes = [c for c in chunks if c.length == 1]
        prefills = [c for c in chunks if c.length > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        for c in decodes:
            table = c.seq.block_table
            if c.completes:
                logits_rows.append(len(ids))
                sampled.append(c)
            ids.append(c.seq.token_at(c.start))
            positions.append(c.start)
            slots.append(table[c.start // bs] * bs + c.start % bs)
        prefill_chunks = []
        for c in prefills:
            table = c.seq.block_table
            prefill_chunks.append(PrefillChunk(len(ids), c.length, self._tensor(table, torch.int32), c.start))
            end = c.start + c.length
            ids += c.seq.tokens(c.start, end)
            positions += range(c.start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(c.start, end)]
            if c.completes:
                logits_rows.append(len(ids) - 1)
                sampled.append(c)
        width = max((len(c.seq.block_table) for c in decodes), default=0)
        tables = [c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in decodes]
        batch = ForwardBatch(
            input_ids=self._tensor(ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode=len(decodes),
            decode_block_tables=self._tensor(tables, torch.int32).view(len(decodes), width),
            decode_context_lens=self._tensor([c.start + 1 for c in decodes], torch.int32),
            prefills=prefill_chunks,
            logits_rows=self._tensor(logits_rows, torch.int64),
        )
        return batch, sampled

    def _tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)
