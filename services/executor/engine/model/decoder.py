"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a packed batch of tokens.

Decoder-layer weights are views into the layer's arena slot, laid out by `layer_layout`; q/k/v and
gate/up are fused so that each step does one matmul where the checkpoint has two or three.

The FFN is stored so that a tensor-parallel shard of it is a contiguous run of bytes in every tensor
(AMOEBAs §3.2: a merge cuts it in place and frees the rest of the slot). Its intermediate width is cut
into `cfg.ffn_pieces` equal pieces, each zero-padded to `ffn_piece_width` channels; gate_up holds, piece
after piece, that piece's gate rows then its up rows, and down_proj is stored input-major (transposed),
so a piece's input channels are consecutive rows. The views a layer hands out are the logical `[out, in]`
tensors whatever the storage (`slot_views`), so every matmul, quantizer and evaluator sees one shape.
Zero gate/up rows give silu(0)·0 = 0 and zero down columns add nothing: padding changes no result.

INT4 variants come in one of two packings (`int4_packing`): our nibbles (morphling_kernels/w4a16.py), or on CPU torch's
int4 layout, for its kernel. That layout is blocked by output rows, so gate_up's pieces stay whole blocks
and down_proj is stored as one matrix per piece (a cut keeps whole matrices).

Its element-wise steps (RMSNorm with the residual add, RoPE with the K/V write, SiLU·mul) are fused kernels on
CUDA (morphling_kernels/fused.py), rounding where torch rounds; `layer` takes a layer's views and bits as arguments, so
that decode graphs (graphs.py) can capture a layer at every width its slot can hold.

The batch is flat: single-token decodes first (paged decode attention over their block tables, in groups
of similar context length), then prefill chunks (attention over the chunk and the context already in
cache). Only rows that sample get logits.
"""

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from morphling_kernels.fused import add_rms_norm, rms_norm, rope_write_kv, rotate, silu_mul
from morphling_kernels.kv_write import write_kv
from morphling_kernels.paged_attention import DecodeGather, decode_gather, paged_decode_attention
from morphling_kernels.prefill_attention import prefill_attention
from morphling_kernels.w4a16 import w4a16_linear, w4a16_linear_cpu_packed
from morphling_kernels.w8a16 import w8a16_linear
from services.executor.engine.memory.arena import Arena, align
from services.executor.engine.model.checkpoint import Checkpoint
from services.executor.engine.model.config import ModelConfig
from services.executor.engine.morphing.quant import cpu_int4_fits, int4_group

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
BIAS_OF = {name: name.removesuffix("_proj") + "_bias" for name in LINEARS}  # the slot's name for a linear's bias
INPUT_MAJOR = "down_proj"  # its 2-D tensors (weight, INT8/INT4 codes, INT4 scales and zeros) are stored transposed
PIECE_MULTIPLE = 32  # channels: a piece holds whole INT4 groups (int4_group of the piece width) and bytes
NIBBLES, TORCH_CPU = "nibbles", "torch-cpu"  # INT4 packings: ours, and torch's CPU int4 kernel's


def int4_packing(device: torch.device | str) -> str:
    """How INT4 variants are packed on `device`: for torch's CPU int4 kernel on CPU (1.4-6.5x float32 over the
    default model's linears, where our reference is slower than float32), our nibbles elsewhere (the Triton
    kernels read those)."""
    on_cpu = torch.device(device).type == "cpu"
    return TORCH_CPU if on_cpu and hasattr(torch, "_weight_int4pack_mm_for_cpu") else NIBBLES


def ffn_piece_width(intermediate: int, pieces: int) -> int:
    """Channels of one padded FFN piece: the largest real piece, rounded up to PIECE_MULTIPLE."""
    largest = -(-intermediate // pieces)
    return -(-largest // PIECE_MULTIPLE) * PIECE_MULTIPLE


def layer_layout(cfg: ModelConfig, dtype: torch.dtype) -> tuple[dict[str, tuple[int, tuple[int, ...]]], int]:
    """Byte offset and logical shape of each tensor in a layer slot, and the slot's size in bytes."""
    ffn = cfg.ffn_pieces * ffn_piece_width(cfg.intermediate_size, cfg.ffn_pieces)
    shapes = {
        "qkv_proj": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
        "o_proj": (cfg.hidden_size, cfg.q_size),
        "gate_up_proj": (2 * ffn, cfg.hidden_size),
        "down_proj": (cfg.hidden_size, ffn),
        "input_norm": (cfg.hidden_size,),
        "post_attn_norm": (cfg.hidden_size,),
    }
    if cfg.attention_bias:
        shapes["qkv_bias"] = (cfg.q_size + 2 * cfg.kv_size,)
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout, offset = {}, 0
    for name, shape in shapes.items():
        layout[name] = (offset, shape)
        offset = align(offset + math.prod(shape) * itemsize)
    return layout, offset


def int4_group_of(name: str, in_features: int, cfg: ModelConfig) -> int:
    """INT4 group size of linear `name`: down_proj's divides the FFN piece width, so groups never straddle pieces."""
    return int4_group(ffn_piece_width(cfg.intermediate_size, cfg.ffn_pieces) if name == INPUT_MAJOR else in_features)


def int4_tensors(name: str, out: int, inp: int, cfg: ModelConfig, dtype: torch.dtype, packing: str
                 ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Name, logical shape and dtype of linear `name`'s INT4 tensors: torch's CPU layout (`.q` and `.sz`) where
    `packing` asks for it and its kernel takes the shape, our nibbles (`.q`, `.scale`, `.zero`) otherwise."""
    if packing not in (NIBBLES, TORCH_CPU):
        raise ValueError(f"no INT4 packing {packing!r}: {NIBBLES} or {TORCH_CPU}")
    width = ffn_piece_width(cfg.intermediate_size, cfg.ffn_pieces)
    k = width if name == INPUT_MAJOR else inp  # down_proj's matrices are its pieces
    group = int4_group_of(name, inp, cfg)
    if packing == TORCH_CPU and cpu_int4_fits(out, k, group):
        if name == INPUT_MAJOR:  # a matrix per piece: a TP cut runs over its inputs
            return [(f"{name}.q", (cfg.ffn_pieces, out, k // 2), torch.uint8),
                    (f"{name}.sz", (cfg.ffn_pieces, k // group, out, 2), torch.bfloat16)]
        return [(f"{name}.q", (out, k // 2), torch.uint8), (f"{name}.sz", (k // group, out, 2), torch.bfloat16)]
    groups = inp // group
    return [(f"{name}.q", (out, inp // 2), torch.uint8), (f"{name}.scale", (out, groups), dtype),
            (f"{name}.zero", (out, groups), dtype)]


def variant_layout(cfg: ModelConfig, dtype: torch.dtype, bits: int, packing: str
                   ) -> tuple[dict[str, tuple[int, tuple[int, ...], torch.dtype]], int]:
    """Byte offset, shape and dtype of each tensor of a layer's INT8 or INT4 variant (INT4 in `packing`),
    packed from the start of its slot, and the variant's size in bytes. Norms and biases stay in the serving
    dtype."""
    fp, _ = layer_layout(cfg, dtype)
    tensors: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name in LINEARS:
        out, inp = fp[name][1]
        if bits == 8:
            tensors += [(f"{name}.q", (out, inp), torch.int8), (f"{name}.scale", (out,), dtype)]
        elif bits == 4:
            tensors += int4_tensors(name, out, inp, cfg, dtype, packing)
        else:
            raise ValueError(f"no {bits}-bit variant: layers quantize to 8 or 4 bits")
    tensors += [(name, fp[name][1], dtype) for name in ("input_norm", "post_attn_norm", "qkv_bias") if name in fp]
    layout, offset = {}, 0
    for name, shape, tdtype in tensors:
        layout[name] = (offset, shape, tdtype)
        offset = align(offset + math.prod(shape) * torch.empty((), dtype=tdtype).element_size())
    return layout, offset


def slot_layout(cfg: ModelConfig, dtype: torch.dtype, bits: int, packing: str
                ) -> tuple[dict[str, tuple[int, tuple[int, ...], torch.dtype]], int]:
    """Byte offset, shape and dtype of each tensor a layer's slot holds at `bits` (the dtype's own width:
    full precision; INT4 in `packing`), and the bytes they fill from the slot's start."""
    if bits == torch.finfo(dtype).bits:
        layout, nbytes = layer_layout(cfg, dtype)
        return {name: (offset, shape, dtype) for name, (offset, shape) in layout.items()}, nbytes
    return variant_layout(cfg, dtype, bits, packing)


def slot_views(arena: Arena, layer: int, layout: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The logical tensors of `layout` (layer_layout's or variant_layout's) as views into `layer`'s slot."""
    views = {}
    for name, (offset, shape, *dtype) in layout.items():
        dtype = dtype[0] if dtype else arena.geometry.dtype
        if name.startswith(INPUT_MAJOR) and len(shape) == 2:
            views[name] = arena.slot_view(layer, offset, shape[::-1], dtype).t()
        else:
            views[name] = arena.slot_view(layer, offset, shape, dtype)
    return views


def even_ranges(total: int, parts: int) -> list[range]:
    """`total` split in `parts` contiguous ranges, the larger ones first (7 in 3 → 3, 2, 2)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def pad_channels(w: torch.Tensor, real: list[range], width: int, dim: int) -> torch.Tensor:
    """The channels `real` of `w` along `dim`, each range zero-padded to `width` channels."""
    parts = []
    for r in real:
        piece = w.narrow(dim, r.start, len(r))
        pad = list(piece.shape)
        pad[dim] = width - len(r)
        parts += [piece, piece.new_zeros(pad)]
    return torch.cat(parts, dim=dim)


def fused_ffn(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, pieces: int, width: int
              ) -> dict[str, torch.Tensor]:
    """A checkpoint's gate, up and down projections as the slot's logical gate_up_proj and down_proj: the
    intermediate width in `pieces` even parts, each padded to `width`, gate and up rows piece by piece."""
    real = even_ranges(gate.shape[0], pieces)
    gate, up = (pad_channels(w, real, width, 0).view(pieces, width, -1) for w in (gate, up))
    return {"gate_up_proj": torch.stack([gate, up], dim=1).reshape(2 * pieces * width, -1),
            "down_proj": pad_channels(down, real, width, 1)}


def load_layer(views: dict[str, torch.Tensor], checkpoint: Checkpoint, layer: int) -> None:
    """Copy decoder layer `layer`'s full-precision weights from `checkpoint` into `views` (layer_layout's)."""
    def get(name: str) -> torch.Tensor:
        return checkpoint.get(f"layers.{layer}.{name}")

    cfg = checkpoint.config
    pieces, width = cfg.ffn_pieces, ffn_piece_width(cfg.intermediate_size, cfg.ffn_pieces)
    views["qkv_proj"].copy_(torch.cat([get("q_proj"), get("k_proj"), get("v_proj")]))
    views["o_proj"].copy_(get("o_proj"))
    for name, tensor in fused_ffn(get("gate_proj"), get("up_proj"), get("down_proj"), pieces, width).items():
        views[name].copy_(tensor)
    views["input_norm"].copy_(get("input_norm"))
    views["post_attn_norm"].copy_(get("post_attn_norm"))
    if "qkv_bias" in views:
        views["qkv_bias"].copy_(torch.cat([get("q_bias"), get("k_bias"), get("v_bias")]))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama 3 or linear scaling applied as transformers does."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def linear(x: torch.Tensor, w: dict, name: str, bits: int) -> torch.Tensor:
    """x @ W^T (+ its bias, where the layer has one: Qwen2's q/k/v) for a layer's weight `name` in whatever
    precision its slot holds now."""
    bias = w.get(BIAS_OF[name])
    if bits == 8:
        return w8a16_linear(x, w[f"{name}.q"], w[f"{name}.scale"], bias)
    if bits == 4 and f"{name}.sz" in w:
        return _cpu_int4_linear(x, w[f"{name}.q"], w[f"{name}.sz"], bias)
    if bits == 4:
        q = w[f"{name}.q"]
        return w4a16_linear(x, q, w[f"{name}.scale"], w[f"{name}.zero"], q.shape[1] * 2 // w[f"{name}.scale"].shape[1],
                            bias)
    return F.linear(x, w[name], bias)


def _cpu_int4_linear(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if q.dim() == 2:
        return w4a16_linear_cpu_packed(x, q, sz, bias)
    # down_proj, one matrix per FFN piece over the piece's inputs: their outputs add up (it has no bias)
    width = q.shape[2] * 2
    y = w4a16_linear_cpu_packed(x[..., :width], q[0], sz[0])
    for piece in range(1, q.shape[0]):
        y.add_(w4a16_linear_cpu_packed(x[..., piece * width:(piece + 1) * width], q[piece], sz[piece]))
    return y


def mlp(h: torch.Tensor, w: dict, bits: int, width: int) -> torch.Tensor:
    """down(silu(gate(h)) · up(h)) over the FFN pieces `w` holds (all of them, or a shard's)."""
    return linear(silu_mul(linear(h, w, "gate_up_proj", bits), width), w, "down_proj", bits)


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class PrefillChunk:
    row: int  # first row of the chunk in the packed batch
    length: int
    block_table: torch.Tensor  # int32 pages of the sequence ([blocks, local KV heads] of head units)
    context_start: int  # tokens of the sequence already in cache before the chunk


@dataclass
class DecodeGroup:
    """Single-token decodes of similar context length, attended together (padding stays small)."""
    row: int
    length: int
    block_tables: torch.Tensor  # [length, max_blocks] int32 (head units: [..., local KV heads])
    context_lens: torch.Tensor  # [length] int32, including the token itself
    max_context: int | None = None  # a bound on context_lens known on the host (a graph's); None: read them
    refilled: bool = False  # its tensors are refilled in place every step (a graph's static decode): no plan kept
    _gathers: dict[tuple[int, int], DecodeGather] = field(default_factory=dict, init=False, repr=False, compare=False)

    def gather_for(self, kv_cache: torch.Tensor) -> DecodeGather | None:
        """The CPU attention's gather plan over `kv_cache`'s geometry, built at the step's first layer."""
        if kv_cache.is_cuda:
            return None
        key = (kv_cache.shape[1], kv_cache.shape[4])
        if self.refilled:
            return decode_gather(self.block_tables, self.context_lens, *key)
        if key not in self._gathers:
            self._gathers[key] = decode_gather(self.block_tables, self.context_lens, *key)
        return self._gathers[key]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64, page * block_size + offset (head units: [N, local KV heads])
    decodes: list[DecodeGroup]  # cover rows [0, number of decodes)
    prefills: list[PrefillChunk]  # follow the decodes
    logits_rows: torch.Tensor  # [S] int64 rows whose next token is sampled


def head_batch(batch: ForwardBatch, head: int) -> ForwardBatch:
    """Of a batch in head units (a trailing dimension over the local KV heads), the slots and tables of one."""
    return ForwardBatch(
        input_ids=batch.input_ids, positions=batch.positions,
        slot_mapping=batch.slot_mapping[:, head].contiguous(),
        decodes=[DecodeGroup(g.row, g.length, g.block_tables[..., head].contiguous(), g.context_lens)
                 for g in batch.decodes],
        prefills=[PrefillChunk(p.row, p.length, p.block_table[..., head].contiguous(), p.context_start)
                  for p in batch.prefills],
        logits_rows=batch.logits_rows)


class DecoderModel:
    def __init__(self, cfg: ModelConfig, arena: Arena, checkpoint: Checkpoint, dtype: torch.dtype,
                 device: torch.device | str, max_positions: int, progress: bool = True,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, held: Collection[int] | None = None):
        """`reduce` sums a tensor-parallel shard's partial o_proj and down_proj outputs over the instance;
        `held`: the decoder layers loaded (all by default; a member of an instance holds some)."""
        self.cfg = cfg
        self.reduce = reduce or _unchanged
        self.arena = arena
        self.dtype = dtype
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        layout, _ = layer_layout(cfg, dtype)
        self.full_bits = torch.finfo(dtype).bits
        self.int4_packing = int4_packing(device)
        self.layer_bits = [self.full_bits] * cfg.num_layers  # what each layer's slot holds now
        self.layer_ready: list = [None] * cfg.num_layers  # CUDA event of a swap still copying into the slot
        self.layers: list[dict[str, torch.Tensor] | None] = [None] * cfg.num_layers
        held = range(cfg.num_layers) if held is None else sorted(held)
        self.ffn_width = ffn_piece_width(cfg.intermediate_size, cfg.ffn_pieces)
        self.kv_units: torch.Tensor | None = None  # the arena's KV by head unit, once use_head_units says so
        # (global query heads, global KV heads) a merged TP member computes out of whole attention weights
        self.heads: tuple[range, range] | None = None
        for i in tqdm(held, desc="loading layers", unit="layer", disable=not progress):
            views = slot_views(arena, i, layout)
            load_layer(views, checkpoint, i)
            self.layers[i] = views
        self.embed_tokens = checkpoint.get("embed_tokens").to(device=device, dtype=dtype)
        self.norm = checkpoint.get("norm").to(device=device, dtype=dtype)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                        else checkpoint.get("lm_head").to(device=device, dtype=dtype))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def slot_layout(self, bits: int) -> tuple[dict[str, tuple[int, tuple[int, ...], torch.dtype]], int]:
        """slot_layout of this model's layers at `bits`."""
        return slot_layout(self.cfg, self.dtype, bits, self.int4_packing)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.run_layers(self.embed(batch.input_ids), batch, range(len(self.layers)))
        return self.logits(x, batch.logits_rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, batch: ForwardBatch, layers: range) -> torch.Tensor:
        """The hidden states `x` (one row per token of `batch`) after this model's decoder layers `layers`."""
        cos, sin = self.rotary(batch.positions)
        # Head units: the batch's slots and tables name a unit per local KV head; one batch per head, once.
        per_head = None if self.kv_units is None else [head_batch(batch, j) for j in range(batch.slot_mapping.shape[1])]
        for index in layers:
            self.wait_for_swap(index)
            x = self.layer(x, index, self.layers[index], self.layer_bits[index], cos, sin, batch, per_head)
        return x

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin `[rows, 1, head_dim]` at `positions`."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def wait_for_swap(self, index: int) -> None:
        """Order this stream after a swap still copying into layer `index`'s slot (once per swap)."""
        if self.layer_ready[index] is not None:
            torch.cuda.current_stream().wait_event(self.layer_ready[index])
            self.layer_ready[index] = None

    def layer(self, x: torch.Tensor, index: int, w: dict[str, torch.Tensor], bits: int, cos: torch.Tensor,
              sin: torch.Tensor, batch: ForwardBatch, per_head: list[ForwardBatch] | None = None) -> torch.Tensor:
        """Decoder layer `index` over `x`, its weights `w` (views of its slot holding `bits`): the layer as it is
        now, or, when decode graphs are captured, as a swap would leave it."""
        cfg, kv_cache = self.cfg, self.arena.kv_cache
        h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
        q, k, v = self._heads(linear(h, w, "qkv_proj", bits))
        if per_head is None:
            q, k = rope_write_kv(q, k, v, cos, sin, kv_cache, index, batch.slot_mapping)
            attn = self._attend(q, k, v, kv_cache, index, batch)
        else:
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            group = q.shape[1] // k.shape[1]
            parts = []
            for j, b in enumerate(per_head):
                qj, kj, vj = q[:, j * group:(j + 1) * group], k[:, j:j + 1], v[:, j:j + 1]
                write_kv(kj, vj, self.kv_units, index, b.slot_mapping)
                parts.append(self._attend(qj, kj, vj, self.kv_units, index, b))
            attn = torch.cat(parts, dim=1)
        o = self.reduce(linear(self._o_input(attn.reshape(x.shape[0], -1)), w, "o_proj", bits))
        h, x = add_rms_norm(o, x, w["post_attn_norm"], cfg.rms_norm_eps)
        return x + self.reduce(mlp(h, w, bits, self.ffn_width))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[rows, heads, head_dim]` of the heads this model computes: all of its config's, or, in a
        merged TP member (`heads`), its share of the whole layer's."""
        cfg, n, hd = self.cfg, qkv.shape[0], self.cfg.head_dim
        if self.heads is None:
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            return (q.view(n, cfg.num_heads, hd), k.view(n, cfg.num_kv_heads, hd), v.view(n, cfg.num_kv_heads, hd))
        qh, kvh = self.heads
        k0, v0 = cfg.q_size, cfg.q_size + cfg.kv_size
        return (qkv[:, qh.start * hd:qh.stop * hd].reshape(n, len(qh), hd),
                qkv[:, k0 + kvh.start * hd:k0 + kvh.stop * hd].reshape(n, len(kvh), hd),
                qkv[:, v0 + kvh.start * hd:v0 + kvh.stop * hd].reshape(n, len(kvh), hd))

    def _o_input(self, attn: torch.Tensor) -> torch.Tensor:
        """o_proj's input: the attention output, in a merged TP member placed among zeros for the other
        members' heads, so that the whole o_proj (at any bits) gives this member's part of the sum."""
        if self.heads is None:
            return attn
        hd, qh = self.cfg.head_dim, self.heads[0]
        full = attn.new_zeros(attn.shape[0], self.cfg.q_size)
        full[:, qh.start * hd:qh.stop * hd] = attn
        return full

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, index: int,
                batch: ForwardBatch) -> torch.Tensor:
        """Attention of the rows' queries over their contexts, their own K and V already written at their slots."""
        parts = [paged_decode_attention(q[g.row:g.row + g.length], kv_cache, index, g.block_tables,
                                        g.context_lens, self.scale, g.max_context, g.gather_for(kv_cache))
                 for g in batch.decodes]
        for p in batch.prefills:
            rows = slice(p.row, p.row + p.length)
            parts.append(prefill_attention(q[rows], k[rows], v[rows], kv_cache, index, p.block_table,
                                           p.context_start, self.scale))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def use_head_units(self, on: bool) -> None:
        """Address KV by head unit (one KV head of one block; a page holds one per KV head of its layout) from
        now on, or by page again. A member of a merged TP instance keeps some heads of its pages and fills the
        units others left (fabric/kv_heads.py); its batches then name a unit per local KV head."""
        kv = self.arena.kv_cache
        self.kv_units = kv.view(kv.shape[0] * kv.shape[1], 1, *kv.shape[2:]) if on else None

    def logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x[rows], self.norm, self.cfg.rms_norm_eps), self.lm_head).float()
