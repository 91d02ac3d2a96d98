"""The regimes `morphling bench --regime` names: the memory each executor has and the requests' lengths.

MorphServe's premise (its §3) is a saturation point where memory runs short: a device whose weights fill most of
its memory, so that a burst's KV is what runs out, as Llama-3-8B on a 24 GB L4 (weights 67% of it) or Llama-3-70B
TP2 on two 80 GB GPUs (88%). `memory-bound` gives each executor the arena in which the model's decoder weights, at
the dtype the device serves, are `weight_share` of it, and requests of a quarter of the trace's lengths (the
default regime's are a tenth), so that a burst fills the KV that is left. `default` is `morphling up`'s budget
with today's lengths, where weights are a minority of the arena and KV rarely runs out.

Flags given explicitly (`--memory-budget`, `--len-scale`, `--max-len`) win over the regime's.
"""

import math
from dataclasses import dataclass

from services.tools.bench.modes import ModeError, model_shape
from shared.config import EngineConfig

MIB = 1 << 20


class RegimeError(ValueError):
    """A regime that cannot be set up for the model asked for."""


@dataclass(frozen=True)
class Regime:
    weight_share: float | None  # decoder weights as a share of each executor's arena; None: up's default budget
    len_scale: float
    max_len: int


REGIMES: dict[str, Regime] = {
    "default": Regime(None, 0.1, 512),
    "memory-bound": Regime(0.70, 0.25, 1024),
}


def weight_bytes(model: str, device: str) -> int:
    """Bytes of the model's decoder layers at the dtype the device serves (float32 on CPU, bfloat16 on CUDA)."""
    shape = model_shape(model)
    return shape.num_layers * shape.layer_params * (4 if device == "cpu" else 2)


def arena_for(model: str, device: str, weight_share: float) -> int:
    """The arena, rounded up to a MiB, whose decoder weights are `weight_share` of it."""
    if not 0 < weight_share < 1:
        raise RegimeError(f"a weight share must lie in (0, 1), got {weight_share}")
    return math.ceil(weight_bytes(model, device) / weight_share / MIB) * MIB


def apply_regime(args) -> None:
    """Fill the flags the regime sets and the caller left unset; record the regime's figures in `args`."""
    regime = REGIMES[args.regime]
    if args.len_scale is None:
        args.len_scale = regime.len_scale
    if args.max_len is None:
        args.max_len = regime.max_len
    if args.memory_budget is None:
        if regime.weight_share is None:
            args.memory_budget = str(EngineConfig().memory_budget)
        else:
            try:
                args.memory_budget = str(arena_for(args.model, args.device, regime.weight_share))
            except ModeError as e:
                raise RegimeError(f"--regime {args.regime}: {e}") from e
