"""Decode without launch overhead: decode steps replayed from CUDA graphs.

On a GPU a decode step is launch-bound: hundreds of small kernels, each queued by the host (issue 15
measured 615 launches and 13.6 ms for a 1B step whose kernels take 2.4 ms). So, as vLLM and gpt-fast do,
the step is captured once per batch-size bucket and replayed, its inputs copied into static buffers first.
A batch runs in the smallest bucket that holds it; the spare rows are padding, with no KV slot and no
context: they write nothing, and their outputs are dropped.

The graphs are piecewise: one for the embedding and the rotary tables, one per (decoder layer, bits the
layer can hold), one for the LM head. A swap then selects the layer's other graph and invalidates none: a
graph holds the addresses of the views it reads, and the arena's never move, whatever a slot holds or
however many of its pages are KV. Every (layer, bits) graph is captured when the engine starts, after one
eager run of each has compiled its Triton kernels, so the first step after a swap compiles nothing.

`capture=False` runs the same pieces eagerly over the same static buffers; that is how the CPU tests check
the padding and the bucketing token for token.

Prefill is not captured (its shapes vary), but `warm_linears` runs every linear at every bits and power of two
of rows once when the engine starts, so that no low-bit kernel compiles or is tuned after a swap either.
"""

import math
from collections.abc import Callable, Collection, Hashable

import torch
from tqdm import tqdm

from services.executor.engine.model.decoder import (LINEARS, DecodeGroup, DecoderModel, ForwardBatch, layer_layout,
                                                    linear, slot_views)
from shared.core.scheduling.scheduler import ScheduledChunk


@torch.inference_mode()
def warm_linears(model: DecoderModel, bits: Collection[int], max_rows: int) -> None:
    """Run each linear of a layer at each of `bits` once per power of two of rows up to `max_rows` (a step's
    tokens): every kernel a variant can hit compiles and is tuned (morphling_kernels/tuning.py) now, not in the first
    step after a swap. Layers share shapes, so one layer's slot serves, whatever it holds: nothing is kept."""
    layer = next(i for i, w in enumerate(model.layers) if w is not None)
    widths = {name: shape[1] for name, (_, shape) in layer_layout(model.cfg, model.dtype)[0].items()
              if name in LINEARS}
    device = model.embed_tokens.device
    for b in sorted({model.full_bits, *bits}):
        views = slot_views(model.arena, layer, model.slot_layout(b)[0])
        rows = 1
        while rows < 2 * max_rows:
            for name, width in widths.items():
                linear(torch.zeros(min(rows, max_rows), width, dtype=model.dtype, device=device), views, name, b)
            rows *= 2


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, then every multiple of 8, and max_num_seqs (vLLM's)."""
    return sorted({b for b in (1, 2, 4, *range(8, max_num_seqs, 8)) if b < max_num_seqs} | {max_num_seqs})


class StaticDecode:
    """One bucket's buffers: a graph reads its inputs from these and leaves its outputs in them. The activations
    are the first rows of the largest bucket's (`largest`), since one bucket runs at a time."""

    def __init__(self, model: DecoderModel, rows: int, max_blocks: int, max_context: int,
                 largest: "StaticDecode | None" = None):
        device, cfg = model.embed_tokens.device, model.cfg
        self.rows = rows
        # Inputs travel in two host-to-device copies, of all the int64 and of all the int32.
        self.longs = torch.zeros(3 * rows, dtype=torch.int64, device=device)
        self.ints = torch.zeros(rows * (1 + max_blocks), dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self._longs_host = torch.zeros(3 * rows, dtype=torch.int64, pin_memory=pinned)
        self._ints_host = torch.zeros(rows * (1 + max_blocks), dtype=torch.int32, pin_memory=pinned)
        ids, positions, slots = self.longs.view(3, rows)
        context_lens, tables = self.ints[:rows], self.ints[rows:].view(rows, max_blocks)
        group = DecodeGroup(0, rows, tables, context_lens, max_context, refilled=True)
        self.batch = ForwardBatch(input_ids=ids, positions=positions, slot_mapping=slots, decodes=[group], prefills=[],
                                  logits_rows=torch.arange(rows, device=device))
        if largest is None:
            self.hidden = torch.zeros(rows, cfg.hidden_size, dtype=model.dtype, device=device)
            self.cos = torch.zeros(rows, 1, cfg.head_dim, dtype=model.dtype, device=device)
            self.sin = torch.zeros_like(self.cos)
            self.logits = torch.zeros(rows, cfg.vocab_size, dtype=torch.float32, device=device)
        else:
            self.hidden, self.cos, self.sin, self.logits = (t[:rows] for t in (largest.hidden, largest.cos,
                                                                               largest.sin, largest.logits))
        self.fill([], 1)

    def fill(self, decodes: list[ScheduledChunk], block_size: int) -> None:
        """Copy the decodes' inputs in; the rows past them become padding (slot -1: no KV written; no context)."""
        n, rows = len(decodes), self.rows
        longs = self._longs_host.view(3, rows)
        longs[:, n:] = 0
        longs[2, n:] = -1
        ints = self._ints_host
        ints.zero_()
        tables = ints[rows:].view(rows, -1)
        for row, c in enumerate(decodes):
            table = c.seq.block_table
            longs[0, row] = c.seq.token_at(c.start)
            longs[1, row] = c.start
            longs[2, row] = table[c.start // block_size] * block_size + c.start % block_size
            ints[row] = c.start + 1
            tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
        # The host buffers are written again only once this step's logits were read, which waits for these.
        self.longs.copy_(self._longs_host, non_blocking=True)
        self.ints.copy_(self._ints_host, non_blocking=True)


class DecodeGraphs:
    def __init__(self, model: DecoderModel, block_size: int, max_model_len: int, max_num_seqs: int,
                 bits: Collection[int], capture: bool, progress: bool = True):
        """Graphs (or, with `capture=False`, their eager twins) of decode steps of up to `max_num_seqs`
        sequences, for every layer at full precision and at each of `bits`."""
        self.model = model
        self.block_size = block_size
        self.capture = capture
        self.bits = sorted({model.full_bits, *bits})
        with torch.inference_mode():
            max_blocks = math.ceil(max_model_len / block_size)
            sizes = buckets(max_num_seqs)
            largest = StaticDecode(model, sizes[-1], max_blocks, max_model_len)
            self.static = {b: StaticDecode(model, b, max_blocks, max_model_len, largest) for b in sizes[:-1]}
            self.static[sizes[-1]] = largest
        self.pieces: dict[Hashable, Callable[[StaticDecode], None]] = {"embed": self._embed}
        for index in range(len(model.layers)):
            for b in self.bits:
                views = slot_views(model.arena, index, model.slot_layout(b)[0])
                self.pieces[index, b] = self._layer_piece(index, views, b)
        self.pieces["logits"] = self._logits
        self.graphs: dict[tuple[int, Hashable], torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture(progress)

    def covers(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a step of `chunks` can run here: single tokens only, few enough, every layer whole and at
        a captured width."""
        model = self.model
        return (0 < len(chunks) <= max(self.static) and all(c.length == 1 for c in chunks)
                and model.kv_units is None and model.heads is None
                and all(w is not None for w in model.layers) and all(b in self.bits for b in model.layer_bits))

    @torch.inference_mode()
    def run(self, decodes: list[ScheduledChunk]) -> torch.Tensor:
        """Logits `[len(decodes), vocab]` (float32) of a step of single-token chunks, in their order. The
        tensor is a view of a static buffer: the next step overwrites it."""
        static = self.prepare(decodes)
        for index, bits in enumerate(self.model.layer_bits):
            self.play_layer(static, index, bits)
        self._play(static, "logits")
        return static.logits[:len(decodes)]

    @torch.inference_mode()
    def prepare(self, decodes: list[ScheduledChunk]) -> StaticDecode:
        """The smallest bucket that holds `decodes`, their inputs copied in and embedded: ready for its layers."""
        static = self.static[min(b for b in self.static if b >= len(decodes))]
        static.fill(decodes, self.block_size)
        self._play(static, "embed")
        return static

    @torch.inference_mode()
    def play_layer(self, static: StaticDecode, index: int, bits: int) -> None:
        """Decoder layer `index` at `bits` over the prepared bucket, once its swap has landed."""
        self.model.wait_for_swap(index)
        self._play(static, (index, bits))

    def _play(self, static: StaticDecode, key: Hashable) -> None:
        if self.capture:
            self.graphs[static.rows, key].replay()
        else:
            self.pieces[key](static)

    # --- the pieces ---------------------------------------------------------------------------
    def _embed(self, static: StaticDecode) -> None:
        static.hidden.copy_(self.model.embed(static.batch.input_ids))
        cos, sin = self.model.rotary(static.batch.positions)
        static.cos.copy_(cos)
        static.sin.copy_(sin)

    def _layer_piece(self, index: int, views: dict[str, torch.Tensor], bits: int) -> Callable[[StaticDecode], None]:
        def piece(static: StaticDecode) -> None:
            static.hidden.copy_(self.model.layer(static.hidden, index, views, bits, static.cos, static.sin,
                                                 static.batch))
        return piece

    def _logits(self, static: StaticDecode) -> None:
        static.logits.copy_(self.model.logits(static.hidden, static.batch.logits_rows))

    # --- capture ------------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture(self, progress: bool) -> None:
        # The largest bucket first, so that the smaller ones reuse its memory in the shared pool; each piece
        # runs once before its capture, since compiling a Triton kernel cannot happen inside one.
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        todo = [(rows, key) for rows in sorted(self.static, reverse=True) for key in self.pieces]
        for rows, key in tqdm(todo, desc="capturing decode graphs", unit="graph", disable=not progress):
            static = self.static[rows]
            with torch.cuda.stream(side):
                self.pieces[key](static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                self.pieces[key](static)
            self.graphs[rows, key] = graph
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
