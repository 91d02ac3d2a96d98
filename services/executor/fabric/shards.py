"""What one member of an instance holds: its decoder layers, and of each its tensor-parallel shard.

Attention heads. Query heads are split in contiguous ranges that keep GQA groups whole, so every member
runs ordinary grouped attention over its own KV heads:
- TP ≤ KV heads: the KV heads are split as evenly as possible and each takes its query heads along; where
  they don't divide (the default model: 3 KV heads, 9 query heads, TP2 → 2+1 KV heads, 6+3 query heads) the
  split is uneven. vLLM refuses such a TP; an uneven split only costs balance, and TP2 of the default model
  is worth having.
- TP > KV heads: every KV head is replicated on TP / KV-heads members, which split its query heads, as vLLM
  does; that needs TP to be a multiple of the KV heads and the group to split evenly.

FFN (AMOEBAs §3.2). The decoder stores every layer's intermediate width in `ffn_pieces` zero-padded pieces
(decoder.layer_layout), the same for every TP degree; a TP-k member holds pieces / k consecutive ones, which
are one contiguous run of each FFN tensor of the whole layer's slot. So a member loaded at TP-k holds exactly
what a merge to TP-k cuts in place, and a split never moves a weight inside a piece.

`MemberCheckpoint` presents a checkpoint as the member sees it: a ModelConfig with its heads and FFN width,
and tensors sliced (and padded) to match, so DecoderModel, the arena, the variant store and the swapper
work on a shard exactly as on a whole model. Which layers a member holds is the plan's business, not the
checkpoint's: layer i keeps its index everywhere (DecoderModel's `held`).
"""

from dataclasses import dataclass, replace

import torch

from services.executor.engine.model.checkpoint import Checkpoint
from services.executor.engine.model.decoder import even_ranges, ffn_piece_width, pad_channels
from shared.core.errors import ModelLoadError
from shared.core.plans import FFN_PIECES


@dataclass(frozen=True)
class HeadShard:
    q: range  # global query heads
    kv: range  # global KV heads


def head_shards(num_heads: int, num_kv_heads: int, tp: int) -> list[HeadShard]:
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        return [HeadShard(range(kv.start * group, kv.stop * group), kv) for kv in even_ranges(num_kv_heads, tp)]
    copies = tp // num_kv_heads
    if tp % num_kv_heads or group % copies:
        raise ModelLoadError("tensor parallelism", f"TP{tp} cannot split {num_heads} query heads over "
                                                   f"{num_kv_heads} KV heads: above the KV heads, TP must be a "
                                                   f"multiple of them that splits each group of {group} evenly")
    per = group // copies
    return [HeadShard(range(r * per, (r + 1) * per), range(r // copies, r // copies + 1)) for r in range(tp)]


def ffn_shard(intermediate: int, tp: int, rank: int, pieces: int = FFN_PIECES) -> tuple[list[range], int]:
    """The real intermediate channels member `rank` holds (one range per piece, each followed by zero
    padding up to the piece width) and that width."""
    if pieces % tp:
        raise ModelLoadError("tensor parallelism", f"TP{tp} cannot split the FFN's {pieces} pieces evenly")
    per_member = pieces // tp
    real = even_ranges(intermediate, pieces)[rank * per_member:(rank + 1) * per_member]
    return real, ffn_piece_width(intermediate, pieces)


@dataclass(frozen=True)
class Shard:
    """Member `rank` of a TP-`tp` instance."""
    tp: int = 1
    rank: int = 0

    def describe(self) -> str:
        return f"tp{self.tp}.{self.rank}"


class MemberCheckpoint(Checkpoint):
    """`checkpoint` as `shard` sees it: its config and its slices of every tensor, read lazily."""

    def __init__(self, checkpoint: Checkpoint, shard: Shard):
        cfg = checkpoint.config
        self.base, self.shard = checkpoint, shard
        if shard.tp > 1:
            self.heads = head_shards(cfg.num_heads, cfg.num_kv_heads, shard.tp)[shard.rank]
            self.ffn_real, self.ffn_width = ffn_shard(cfg.intermediate_size, shard.tp, shard.rank, cfg.ffn_pieces)
            local = replace(cfg, num_heads=len(self.heads.q), num_kv_heads=len(self.heads.kv),
                            intermediate_size=self.ffn_width * len(self.ffn_real), ffn_pieces=len(self.ffn_real))
        else:
            self.heads = None
            local = cfg
        super().__init__(local, checkpoint.path, checkpoint._files)

    def fingerprint(self) -> str:
        return f"{self.base.fingerprint()}-{self.shard.describe()}"

    def _read(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if parts[0] != "layers":
            return self.base.get(name)
        full = self.base.get(name)
        kind = parts[2]
        if self.heads is None:
            return full
        hd = self.base.config.head_dim
        q = slice(self.heads.q.start * hd, self.heads.q.stop * hd)
        kv = slice(self.heads.kv.start * hd, self.heads.kv.stop * hd)
        if kind in ("q_proj", "q_bias"):
            return full[q]
        if kind in ("k_proj", "v_proj", "k_bias", "v_bias"):
            return full[kv]
        if kind == "o_proj":
            return full[:, q]
        if kind in ("gate_proj", "up_proj"):
            return pad_channels(full, self.ffn_real, self.ffn_width, 0)
        if kind == "down_proj":
            return pad_channels(full, self.ffn_real, self.ffn_width, 1)
        return full  # the norms: every member applies them to the whole hidden state
