"""Turns the scheduler's decision into the model's packed batch, runs it, returns logits to sample."""

import logging
from collections.abc import Callable

import torch

from morphling_kernels.block_copy import copy_blocks
from services.executor.engine.graphs import DecodeGraphs, warm_linears
from services.executor.engine.memory.arena import Arena, ArenaGeometry
from services.executor.engine.model.checkpoint import Checkpoint
from services.executor.engine.model.decoder import DecodeGroup, DecoderModel, ForwardBatch, PrefillChunk, layer_layout
from shared.config import EngineConfig
from shared.core.errors import ReshapeRefused
from shared.core.memory.ledger import LedgerSnapshot, PageLedger
from shared.core.scheduling.scheduler import ScheduledChunk, SchedulerOutput

log = logging.getLogger(__name__)

# Decode attention gathers every sequence's context padded to the longest in its group; a new group
# starts where padding would exceed this share of a sequence's context. Each group costs a few more
# small ops per layer, so their number is capped.
MAX_PADDING = 0.25
MAX_DECODE_GROUPS = 4


def length_groups(lengths: list[int]) -> list[int]:
    """Sizes of consecutive groups of `lengths` (sorted longest first) that keep padding small."""
    sizes: list[int] = []
    group_max = None
    for n in lengths:
        if group_max is None or (n < (1 - MAX_PADDING) * group_max and len(sizes) < MAX_DECODE_GROUPS):
            sizes.append(0)
            group_max = n
        sizes[-1] += 1
    return sizes


def batch_order(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """The order of the chunks' rows in the packed batch: decodes, longest context first, then prefills."""
    return [*sorted((c for c in chunks if c.length == 1), key=lambda c: -c.start), *(c for c in chunks if c.length > 1)]


class ModelRunner:
    """The model on this executor alone: its KV blocks are the arena's pages. It is the engine's placement: an
    instance's leader runs the fabric's InstanceRunner instead, whose blocks are the instance's, and a TP merge or
    split hands the engine the other one (LLMEngine.lead_instance, serve_alone)."""

    member = None  # the instance this runner leads (InstanceRunner); none alone

    def __init__(self, model: DecoderModel, block_size: int, device: torch.device | str,
                 graphs: DecodeGraphs | None = None):
        """`graphs`: decode steps they cover replay them (CUDA); the rest run eagerly."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.graphs = graphs

    @property
    def kv_pages(self) -> PageLedger:
        """Where the engine's block manager takes its KV blocks from."""
        return self.model.arena.ledger

    def kv_capacity_blocks(self) -> int:
        """KV blocks there are when no sequence holds any."""
        return self.model.arena.ledger.snapshot().pages_kv

    def ledger(self) -> LedgerSnapshot:
        return self.model.arena.ledger.snapshot()

    def reshape(self, op, scheduler) -> dict:
        raise ReshapeRefused("this executor serves alone: its layers have no other member to go to")

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Logits `[S, vocab]` (float32) for the chunks that complete their sequence, and those chunks."""
        kv_cache = self.model.arena.kv_cache
        if out.fresh_pages:
            kv_cache[self._tensor(out.fresh_pages, torch.int64)] = 0
        if out.copies:
            src, dst = zip(*out.copies)
            copy_blocks(kv_cache, self._tensor(src, torch.int64), self._tensor(dst, torch.int64))
        if self.graphs is not None and self.graphs.covers(out.chunks):
            chunks = batch_order(out.chunks)
            logits = self.graphs.run(chunks)
            rows = [row for row, c in enumerate(chunks) if c.completes]
            if len(rows) < len(chunks):  # a prompt's one-token chunk that does not end it samples nothing
                logits = logits[self._tensor(rows, torch.int64)]
            return logits, [chunks[row] for row in rows]
        batch, sampled = self.build(out.chunks)
        return self.model.forward(batch), sampled

    def keepalive(self) -> None:
        """Called while there is no work: a runner alone has nobody to tell that it lives."""

    def forget(self, request_id: str) -> None:
        """A request ended; a runner alone keeps nothing about it."""

    def build(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[ScheduledChunk]]:
        bs = self.block_size
        chunks = batch_order(chunks)
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
        groups, row = [], 0
        for size in length_groups([c.start + 1 for c in decodes]):
            members = decodes[row:row + size]
            width = max(len(c.seq.block_table) for c in members)
            # padding repeats a page of the sequence itself: attention may read it and needs finite values
            tables = [c.seq.block_table + c.seq.block_table[:1] * (width - len(c.seq.block_table))
                      for c in members]
            groups.append(DecodeGroup(row, size, self._tensor(tables, torch.int32),
                                      self._tensor([c.start + 1 for c in members], torch.int32)))
            row += size
        batch = ForwardBatch(
            input_ids=self._tensor(ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            slot_mapping=self._tensor(slots, torch.int64),
            decodes=groups,
            prefills=prefill_chunks,
            logits_rows=self._tensor(logits_rows, torch.int64),
        )
        return batch, sampled

    def _tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)


def alone(config: EngineConfig) -> Callable[[Checkpoint, torch.dtype, int, bool], ModelRunner]:
    """The placement of an executor that holds the whole model: an arena of its own, and on CUDA the linears warmed
    and decode graphs captured where the config asks."""
    def place(checkpoint: Checkpoint, dtype: torch.dtype, max_model_len: int, progress: bool) -> ModelRunner:
        cfg = checkpoint.config
        geometry = ArenaGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, dtype)
        arena = Arena(geometry, config.memory_budget, layer_layout(cfg, dtype)[1],
                      config.min_kv_tokens or max_model_len, config.device)
        snap = arena.ledger.snapshot()
        log.info("arena: %d pages of %d bytes, %d in layer slots, %d KV (%d tokens); max_model_len %d",
                 snap.pages_total, arena.page_bytes, snap.pages_slot, snap.pages_kv, snap.pages_kv * config.block_size,
                 max_model_len)
        model = DecoderModel(cfg, arena, checkpoint, dtype, config.device, max_model_len, progress)
        graphs = None
        if torch.device(config.device).type == "cuda":
            warm_linears(model, config.variant_bits, config.max_num_batched_tokens)
            if config.cuda_graphs:
                graphs = DecodeGraphs(model, config.block_size, max_model_len, config.max_num_seqs,
                                      config.variant_bits, capture=True, progress=progress)
        return ModelRunner(model, config.block_size, config.device, graphs)

    return place
