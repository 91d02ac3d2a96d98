"""The layer-variant store: every decoder layer's full-precision copy and INT8/INT4 variants, made ahead.

Why: quantizing a layer when the controller first asks for it puts seconds of work on the critical path
exactly when memory is short. The store builds every variant once, at executor start, keeps the result
on disk keyed by the model and the settings (a restart loads instead of quantizing), and holds it in host
memory (pinned on CUDA, so that writing a variant into its slot is a plain host-to-device copy).

Host-memory cap: entries are (layer, kind), kind being a variant's bits or the full precision. When they do
not all fit the cap, the store holds what fits, first fit in swap order (the layers the controller
quantizes first), a layer's variants ahead of its full-precision copy (quantizing happens under memory
pressure, restoring once it has passed), and reads the others from the disk cache on demand. Held bytes
never exceed the cap; an entry read on demand belongs to its caller, which copies it into a slot and drops
it, so it is working memory of one layer at a time, as is a layer being built.

AWQ-style scaling (awq=True): calibration windows run through the full-precision model record each input
channel's mean |activation| at qkv_proj (after input_norm) and gate_up_proj (after post_attn_norm). With
s = a^alpha, normalised to a geometric mean of max and min of 1, the variant quantizes W·diag(s) and
carries the preceding norm divided by s, so in exact arithmetic the layer computes the same function while
the channels that matter most lose less to rounding. o_proj and down_proj have no norm to fold into and
stay unscaled. Variants carry their own norms (variant_layout puts them in the slot), so a scaled norm is
swapped in and out together with its layer.
"""

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from morphling_kernels.prefill_attention import prefill_attention
from services.executor.engine.model.config import ModelConfig
from services.executor.engine.model.decoder import (INPUT_MAJOR, LINEARS, DecoderModel, int4_group_of, int4_tensors,
                                                    layer_layout, mlp, rotate, variant_layout)
from services.executor.engine.morphing.quant import (INT4_GROUP, Int4Weight, quantize_int4, quantize_int8,
                                                     to_cpu_int4pack)
from shared.config import data_dir

# Bump when what a cache directory holds changes meaning. 2: AWQ scales INT4 only; 3: the FFN in padded pieces;
# 4: INT4 groups powers of two where they divide, and torch's CPU int4 layout on CPU.
FORMAT_VERSION = 4
DEFAULT_CACHE_DIR = Path("~/.cache/morphling/variants")
DEFAULT_CORPUS = data_dir() / "corpora" / "wikitext-2-test.txt"
AWQ_ALPHA = 0.5
SCALED = {"qkv_proj": "input_norm", "gate_up_proj": "post_attn_norm"}  # linear -> the norm that feeds it


def calibration_windows(tokenizer, corpus: str | Path = DEFAULT_CORPUS, max_tokens: int = 2048,
                        window: int = 512) -> list[list[int]]:
    """The corpus's first `max_tokens` tokens in windows of `window` (one prefill each)."""
    text = Path(corpus).read_text(encoding="utf-8")
    chars = max_tokens * 6  # tokenizing the whole corpus to keep its start would be slow
    while True:
        ids = tokenizer.encode(text[:chars])
        if len(ids) > max_tokens or chars >= len(text):
            break
        chars *= 2
    ids = ids[:max_tokens]
    return [ids[s:s + window] for s in range(0, len(ids), window) if len(ids[s:s + window]) > 1]


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # rms_norm(x, w, eps) == w * _unit_rms(x, eps), bit for bit
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@torch.inference_mode()
def trace_linear_inputs(model: DecoderModel, windows: list[list[int]],
                        visit: Callable[[int, str, torch.Tensor, torch.Tensor], None]) -> None:
    """Run each window as one prefill through the full-precision layers, calling visit(layer, linear, xhat,
    norm) for qkv_proj and gate_up_proj, whose input is norm * xhat as DecoderModel.forward forms it.
    A whole-window prefill attends only to itself, so no KV pages are needed."""
    cfg, device = model.cfg, model.embed_tokens.device
    no_pages = torch.empty(0, dtype=torch.int32, device=device)
    for ids in windows:
        n = len(ids)
        x = F.embedding(torch.tensor(ids, dtype=torch.int64, device=device), model.embed_tokens)
        cos, sin = model.cos[:n].unsqueeze(1), model.sin[:n].unsqueeze(1)
        for i, w in enumerate(model.layers):
            xhat = _unit_rms(x, cfg.rms_norm_eps)
            visit(i, "qkv_proj", xhat, w["input_norm"])
            qkv = F.linear(w["input_norm"] * xhat, w["qkv_proj"], w.get("qkv_bias"))
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = rotate(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
            k = rotate(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            attn = prefill_attention(q, k, v.view(n, cfg.num_kv_heads, cfg.head_dim), model.arena.kv_cache, i,
                                     no_pages, 0, model.scale)
            x = x + F.linear(attn.reshape(n, cfg.q_size), w["o_proj"])
            xhat = _unit_rms(x, cfg.rms_norm_eps)
            visit(i, "gate_up_proj", xhat, w["post_attn_norm"])
            x = x + mlp(w["post_attn_norm"] * xhat, w, model.full_bits, model.ffn_width)


def awq_scales(model: DecoderModel, windows: list[list[int]], alpha: float = AWQ_ALPHA
               ) -> list[dict[str, torch.Tensor]]:
    """Per layer, the float32 per-input-channel scale of qkv_proj and gate_up_proj."""
    sums: dict[tuple[int, str], torch.Tensor] = {}

    def visit(layer: int, name: str, xhat: torch.Tensor, norm: torch.Tensor) -> None:
        a = (norm * xhat).float().abs().sum(0)
        sums[layer, name] = sums[layer, name] + a if (layer, name) in sums else a

    trace_linear_inputs(model, windows, visit)
    tokens = sum(len(w) for w in windows)
    scales = [{} for _ in model.layers]
    for (layer, name), total in sums.items():
        s = (total / tokens).pow(alpha).clamp_min(1e-4)
        scales[layer][name] = (s / (s.max() * s.min()).sqrt()).cpu()
    return scales


def int4_variant(name: str, q4: Int4Weight, cfg: ModelConfig, packing: str) -> dict[str, torch.Tensor]:
    """Linear `name`'s INT4 tensors under variant_layout's names, in `packing` where its kernel takes the shape."""
    dtype = q4.scale.dtype
    names = [entry[0] for entry in int4_tensors(name, q4.packed.shape[0], q4.packed.shape[1] * 2, cfg, dtype, packing)]
    if f"{name}.sz" not in names:
        return {f"{name}.q": q4.packed, f"{name}.scale": q4.scale, f"{name}.zero": q4.zero}
    if name != INPUT_MAJOR:
        packed, sz = to_cpu_int4pack(q4)
        return {f"{name}.q": packed, f"{name}.sz": sz}
    # down_proj: one matrix per FFN piece (whole groups: they divide the piece width)
    pieces = cfg.ffn_pieces
    parts = [to_cpu_int4pack(Int4Weight(packed, scale, zero, q4.group_size)) for packed, scale, zero in
             zip(q4.packed.chunk(pieces, dim=1), q4.scale.chunk(pieces, dim=1), q4.zero.chunk(pieces, dim=1))]
    return {f"{name}.q": torch.stack([q for q, _ in parts]), f"{name}.sz": torch.stack([sz for _, sz in parts])}


def quantize_layer(fp: dict[str, torch.Tensor], bits: int, cfg: ModelConfig, packing: str,
                   scales: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A layer's `bits`-bit variant under variant_layout's names (INT4 in `packing`). Without `scales` every linear
    is exactly quant.py's quantization of the full-precision weight; with them, see the module docstring.
    down_proj's INT4 groups divide the FFN piece width, so that a tensor-parallel cut keeps whole groups."""
    scales = scales or {}
    variant = {}
    for name in LINEARS:
        w = fp[name] if name not in scales else fp[name].float() * scales[name].to(fp[name].device)
        if bits == 8:
            q8 = quantize_int8(w)
            variant |= {f"{name}.q": q8.qweight, f"{name}.scale": q8.scale.to(fp[name].dtype)}
        elif bits == 4:
            q4 = quantize_int4(w, int4_group_of(name, w.shape[1], cfg))
            q4 = Int4Weight(q4.packed, q4.scale.to(fp[name].dtype), q4.zero.to(fp[name].dtype), q4.group_size)
            variant |= int4_variant(name, q4, cfg, packing)
        else:
            raise ValueError(f"no {bits}-bit variant: layers quantize to 8 or 4 bits")
    variant |= {name: fp[name].clone() for name in ("input_norm", "post_attn_norm", "qkv_bias") if name in fp}
    for linear, norm in SCALED.items():
        if linear in scales:
            s = scales[linear].to(fp[norm].device)
            variant[norm] = (fp[norm].float() / s).to(fp[norm].dtype)
    return variant


def _nbytes(layout: dict, dtype: torch.dtype | None = None) -> int:
    return sum(math.prod(entry[1]) * torch.empty((), dtype=dtype or entry[2]).element_size()
               for entry in layout.values())


class VariantStore:
    """Full-precision copies and variants of every decoder layer: get(layer, bits), full(layer)."""

    def __init__(self, model: DecoderModel, fingerprint: str | None, bits: tuple[int, ...] = (8, 4),
                 awq: bool = False, cache_dir: str | Path | None = None, host_cap_bytes: int | None = None,
                 calibration: list[list[int]] | None = None, order: list[int] | None = None,
                 awq_alpha: float = AWQ_ALPHA):
        """fingerprint None keeps everything in memory (no disk cache); `order` is the swap order (default
        front to back, as the executor quantizes); `calibration` is token windows, required with awq."""
        cfg, n = model.cfg, model.cfg.num_layers
        if not bits or any(b not in (8, 4) for b in bits):
            raise ValueError(f"variants are 8 or 4 bits, not {bits}")
        if awq and not calibration:
            raise ValueError("AWQ scaling needs calibration windows")
        self.model, self.bits, self.full_bits = model, tuple(dict.fromkeys(bits)), model.full_bits
        self.awq, self.alpha, self.calibration = awq, awq_alpha, calibration
        self.pin = model.embed_tokens.device.type == "cuda"
        settings = dict(version=FORMAT_VERSION, fingerprint=fingerprint, dtype=str(model.dtype), layers=n,
                        bits=sorted(self.bits), int4_group=f"power of two from 32, else even, up to {INT4_GROUP}",
                        int4_packing=model.int4_packing,
                        awq=dict(alpha=awq_alpha, calibration=hashlib.sha256(
                            json.dumps(calibration).encode()).hexdigest()) if awq else False)
        self.key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
        self.settings = settings
        self.dir = (Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / self.key[:32]
                    if fingerprint is not None else None)
        sizes = {self.full_bits: _nbytes(layer_layout(cfg, model.dtype)[0], model.dtype)}
        sizes |= {b: _nbytes(variant_layout(cfg, model.dtype, b, model.int4_packing)[0]) for b in self.bits}
        self.entry_bytes = sizes
        self.total_bytes = n * sum(sizes.values())
        order = list(range(n)) if order is None else list(order)
        if sorted(order) != list(range(n)):
            raise ValueError(f"the swap order must name each of the {n} layers once: {order}")
        cap = math.inf if host_cap_bytes is None else host_cap_bytes
        self.host_cap = host_cap_bytes
        self.plan: set[tuple[int, int]] = set()  # the entries held in memory
        held = 0
        for layer in order:
            for kind in (*self.bits, self.full_bits):
                if held + sizes[kind] <= cap:
                    self.plan.add((layer, kind))
                    held += sizes[kind]
        if self.dir is None and len(self.plan) < n * len(sizes):
            raise ValueError(f"a host-memory cap of {host_cap_bytes} bytes holds less than the store's "
                             f"{self.total_bytes}; the rest needs the disk cache, which needs a fingerprint")
        self._held: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.prepared = False
        self.counters = dict(quantized=0, loaded=0, on_demand=0)  # layers built, entries read at prepare / later

    # --- reading ------------------------------------------------------------------------------
    def get(self, layer: int, bits: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s `bits`-bit variant, named as variant_layout names the slot's tensors."""
        if bits not in self.bits:
            raise KeyError(f"this store holds {self.bits}-bit variants, not {bits}")
        return self._entry(layer, bits)

    def full(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s full-precision tensors, named as layer_layout names them."""
        return self._entry(layer, self.full_bits)

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self._held.values() for t in e.values())

    def _entry(self, layer: int, kind: int) -> dict[str, torch.Tensor]:
        if not 0 <= layer < self.model.cfg.num_layers:
            raise KeyError(f"no layer {layer}")
        self.prepare(progress=False)
        if (layer, kind) in self._held:
            return self._held[layer, kind]
        self.counters["on_demand"] += 1
        return load_file(self._path(self.dir, layer, kind))

    # --- building -----------------------------------------------------------------------------
    def prepare(self, progress: bool = True) -> None:
        """Load every held entry from the disk cache, or build all of them (and the cache). Idempotent; must
        run while every layer's slot holds full precision, which the swapper ensures by asking first."""
        if self.prepared:
            return
        if self._cached():
            for layer, kind in tqdm(sorted(self.plan), desc="loading layer variants", unit="entry",
                                    disable=not progress):
                self._hold(layer, kind, load_file(self._path(self.dir, layer, kind)), mapped=True)
                self.counters["loaded"] += 1
        else:
            self._build(progress)
        self.prepared = True

    def _build(self, progress: bool) -> None:
        model = self.model
        if any(b != self.full_bits for b in model.layer_bits):
            raise RuntimeError("variants are built from full-precision layers; restore every layer first")
        scales = awq_scales(model, self.calibration, self.alpha) if self.awq else [{}] * len(model.layers)
        tmp = None
        if self.dir is not None:
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{self.key[:32]}-", dir=self.dir.parent))
        try:
            # A member of an instance holds some layers (the others are None): it builds variants of those.
            held = [i for i, w in enumerate(model.layers) if w is not None]
            for layer in tqdm(held, desc="building layer variants", unit="layer", disable=not progress):
                fp = {name: view.clone() for name, view in model.layers[layer].items()}
                # AWQ pays off at 4 bits only: at 8 it made gate_up_proj worse (docs/benchmarks.md)
                entries = {self.full_bits: fp} | {
                    b: quantize_layer(fp, b, model.cfg, model.int4_packing, scales[layer] if b == 4 else None)
                    for b in self.bits}
                self.counters["quantized"] += 1
                for kind, tensors in entries.items():
                    if tmp is not None:
                        save_file({k: t.contiguous().cpu() for k, t in tensors.items()}, self._path(tmp, layer, kind))
                    if (layer, kind) in self.plan:
                        self._hold(layer, kind, tensors)
            if tmp is not None:
                manifest = dict(key=self.key, settings=self.settings, entry_bytes=self.entry_bytes,
                                total_bytes=self.total_bytes)
                (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
                if self.dir.exists() and not self._cached():  # incomplete; a complete one is as good as ours
                    shutil.rmtree(self.dir, ignore_errors=True)
                try:
                    os.rename(tmp, self.dir)  # the manifest appears with a complete directory, or not at all
                    tmp = None
                except OSError:
                    pass  # another process published the same key first; its files are equally good
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _cached(self) -> bool:
        if self.dir is None:
            return False
        try:
            manifest = json.loads((self.dir / "manifest.json").read_text())
        except (OSError, ValueError):
            return False
        kinds = (*self.bits, self.full_bits)
        return manifest.get("key") == self.key and all(
            self._path(self.dir, layer, kind).is_file() for layer in range(len(self.model.layers)) for kind in kinds)

    def _hold(self, layer: int, kind: int, tensors: dict[str, torch.Tensor], mapped: bool = False) -> None:
        # load_file maps the file: copy, or "held" would mean pages the kernel may drop and fault back later
        self._held[layer, kind] = {k: t.cpu().pin_memory() if self.pin else t.clone() if mapped else t.cpu()
                                   for k, t in tensors.items()}

    def _path(self, directory: Path, layer: int, kind: int) -> Path:
        return directory / f"layer{layer:03d}-{'fp' if kind == self.full_bits else f'int{kind}'}.safetensors"
