"""What a plan costs in memory on a device: the paper's model (§IV-A), and this runtime's page arena.

Both answer the same three questions, which is all the ILP's memory constraints (12)-(13) need:
- `layer_bytes(bits)`: M_{i,b}, what one decoder layer placed on a device at `bits` takes there;
- `reserve(first, prefill_batch)`: what a device takes whatever layers it holds (the first stage also
  holds the embeddings and the LM head, M_emb);
- `floor`: the least memory a device must have to take part at all (`floor_why` says what it is);
- `held_bytes`, `start_reserve`: what a placed layer takes while the executor starts, whatever its bits,
  and what the device keeps beside (0 where starting costs nothing more than serving).

PaperMemory is SplitQuant's: a layer's weights at its bits plus that layer's KV for the whole batch at the
longest context (s·κ + n), the peak activation of a prefill micro-batch on every device, and the
embeddings on the first. It fits the paper's per-layer memory, as vLLM-style runtimes allocate it.

ArenaMemory is `morphling up`'s page arena: a page holds one KV block for all layers, and a quantized layer
gives its slot's tail pages back as KV. A plan's members keep slots for their placed layers only
(InstancePlan.slots "placed"), so a placed layer takes the pages its variant fills, and the batch's KV the
same pages on every member (the reserve; also the floor, since a member holding no layer still holds it).
At start a member's slots are full precision until it quantizes them as planned, beside one sequence of KV:
the start constraint. Embeddings live outside the arena. A plan for a checkpoint is checked against it,
since this runtime serves that plan.
"""

import functools
import math
from dataclasses import dataclass

from shared.core.planner.shapes import ModelShape

FULL_BITS = 16
INT4_GROUP = 128  # the INT4 variants' group of input channels (engine/morphing/quant.py)
LOGIT_BYTES = 4  # the sampler reads float32 logits


@dataclass(frozen=True)
class Workload:
    """An offline batch (§IV-C): B sequences padded to prompts of κ chunks of s tokens, n generated each."""
    batch: int  # B, the global batch (most concurrent sequences)
    prompt: int  # s, tokens of one prompt chunk
    output: int  # n, tokens generated per sequence
    chunks: int = 1  # κ

    @property
    def context(self) -> int:
        """s·κ + n: the longest a sequence gets, what its KV is reserved for."""
        return self.prompt * self.chunks + self.output


@functools.cache  # pure, and asked for on every simulated step
def weight_bytes(shape: ModelShape, bits: int, full_bytes: int) -> int:
    """One decoder layer's weights at `bits` (FULL_BITS: the serving dtype, `full_bytes` an element), with the
    quantizers' scales: INT8 one per output channel, INT4 a scale and a zero per group; norms stay full."""
    norms = 2 * shape.hidden_size * full_bytes
    if bits == FULL_BITS:
        return shape.layer_params * full_bytes + norms
    if bits == 8:
        return shape.layer_params + sum(o for o, _ in shape.linears.values()) * full_bytes + norms
    if bits == 4:
        groups = sum(o * math.ceil(i / INT4_GROUP) for o, i in shape.linears.values())
        return shape.layer_params // 2 + groups * 2 * full_bytes + norms
    raise ValueError(f"no weight format for {bits} bits (16, 8 or 4)")


@dataclass(frozen=True)
class PaperMemory:
    shape: ModelShape
    workload: Workload
    full_bytes: int = 2  # FP16/BF16 weights and KV

    floor = 0
    floor_why = ""
    held_bytes = 0  # nothing is held at another size while starting
    start_reserve = 0

    def layer_bytes(self, bits: int) -> int:
        kv = 2 * self.workload.batch * self.workload.context * self.shape.kv_size * self.full_bytes
        return weight_bytes(self.shape, bits, self.full_bytes) + kv

    def reserve(self, first: bool, prefill_batch: int) -> int:
        s = self.shape
        # The widest point of a layer over a prefill micro-batch: its input, q/k/v, and the FFN's gate and up.
        width = 2 * s.hidden_size + s.q_size + 2 * s.kv_size + 2 * s.intermediate_size
        activations = prefill_batch * self.workload.prompt * width * self.full_bytes
        if not first:
            return activations
        embeddings = s.embedding_params * self.full_bytes + s.hidden_size * self.full_bytes
        logits = self.workload.batch * s.vocab_size * LOGIT_BYTES
        return activations + embeddings + logits


@dataclass(frozen=True)
class ArenaMemory:
    """`slot_bytes[bits]`: the pages a layer's slot fills at `bits`, in bytes (the engine's layouts rounded up
    to pages); `page_bytes`: one KV block of `block_size` tokens for every layer. The plan's members keep slots
    for their placed layers only (InstancePlan.slots "placed")."""
    num_layers: int
    page_bytes: int
    block_size: int
    slot_bytes: dict[int, int]
    workload: Workload

    def layer_bytes(self, bits: int) -> int:
        return self.slot_bytes[bits]

    def reserve(self, first: bool, prefill_batch: int) -> int:
        blocks = self.workload.batch * math.ceil(self.workload.context / self.block_size)
        return blocks * self.page_bytes

    @property
    def floor(self) -> int:
        return self.reserve(False, 0)

    floor_why = "the KV of the whole batch, which every member keeps pages for"

    # At start a member's slots hold full precision until it quantizes them as planned, beside one sequence.
    @property
    def held_bytes(self) -> int:
        return self.slot_bytes[FULL_BITS]

    @property
    def start_reserve(self) -> int:
        return math.ceil(self.workload.context / self.block_size) * self.page_bytes
