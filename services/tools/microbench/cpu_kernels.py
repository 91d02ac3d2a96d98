"""`morphling bench-cpu-kernels`: which low-bit linear beats float32 on this CPU, at which rows of a batch.

A decode step reads every decoder layer's weights once, from DRAM, for a handful of rows; a prefill multiplies
hundreds of rows by the same weights. So each candidate runs the whole model's linears (every layer's own
weights, as a step does, not one weight that stays in cache) at each row count, and its time is set against
float32's in the same run:

    float32          F.linear on the full-precision weight (the baseline)
    int8_reference   our W8A16 torch reference: the codes cast to float32, then F.linear
    int8_served      w8a16_linear as the engine calls it, on the codes as its slot holds them (down_proj
                     input-major): torch's packed int8 kernel in bfloat16 at decode rows
    int8pack_fp32    torch._weight_int8pack_mm with float32 activations (to 16 rows: past them it runs for
                     seconds a pass, 30-70x float32)
    int4_reference   our W4A16 torch reference: unpack, dequantize, F.linear
    int4_served      INT4 as the engine stores and calls it on CPU: torch's CPU int4 kernel in bfloat16 on its own
                     layout, down_proj one matrix per FFN piece (decoder.int4_tensors)
    bfloat16         F.linear in bfloat16 (weights and activations; AMX where the CPU has it): not a variant the
                     engine stores, the dtype it could serve in
    int8_w8a8        the INT8 codes against activations quantized per row (symmetric, their max over 127), through
                     torch._int_mm (int8 x int8 -> int32; AMX-INT8 where the CPU has it), then both scales: not
                     what the engine serves (W8A16), the CPU's analogue of an FP8 rung
    int8_compiled    torch.compile of the INT8 reference (--compile-rows only: each shape compiles apart)
    int4_compiled    torch.compile of the INT4 reference

The FFN is the shape's own intermediate width in `FFN_PIECES` pieces (a shape whose pieces the engine would pad
is refused). Prints a table of milliseconds per model pass and each candidate's speed-up over float32, and
writes JSON and a PNG.
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.core.planner.shapes import SHAPES
from shared.provenance import provenance

ROWS = (1, 4, 16, 64, 256)


def engine_config(shape):
    """The engine's ModelConfig for a planner shape: what decides how a variant is laid out."""
    from services.executor.engine.model.config import ModelConfig

    return ModelConfig(**{f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}, architecture="llama",
                       rms_norm_eps=1e-5, rope_theta=1e4)


def layer_weights(shape, layers: int, gen: torch.Generator) -> list[dict]:
    """Each layer's linears, in every format a candidate reads."""
    from services.executor.engine.model.decoder import INPUT_MAJOR, TORCH_CPU, ffn_piece_width, int4_group_of
    from services.executor.engine.morphing.quant import quantize_int4, quantize_int8
    from services.executor.engine.morphing.variants import int4_variant

    cfg = engine_config(shape)
    width = ffn_piece_width(cfg.intermediate_size, cfg.ffn_pieces)
    if width * cfg.ffn_pieces != cfg.intermediate_size:
        raise SystemExit(f"--shape {shape.name}: its FFN would be padded to {width * cfg.ffn_pieces} channels; "
                         f"this bench runs unpadded weights")
    out = []
    for _ in range(layers):
        layer = {}
        for name, (n, k) in shape.linears.items():
            w = torch.randn(n, k, generator=gen) * 0.02
            q4 = quantize_int4(w, int4_group_of(name, k, cfg))
            q8 = quantize_int8(w)
            served8 = q8.qweight.t().contiguous().t() if name == INPUT_MAJOR else q8.qweight
            layer[name] = dict(name=name, w=w, w16=w.bfloat16(), q8=q8, q8t=q8.qweight.t().contiguous(), q4=q4,
                               served8=served8, served4=int4_variant(name, q4, cfg, TORCH_CPU))
        out.append(layer)
    return out


def candidates(rows: int, compiled: bool) -> dict:
    from morphling_kernels.w4a16 import w4a16_linear_ref
    from morphling_kernels.w8a16 import w8a16_linear, w8a16_linear_ref
    from services.executor.engine.model.decoder import linear

    found = {
        "float32": lambda x, t: F.linear(x, t["w"]),
        "int8_reference": lambda x, t: w8a16_linear_ref(x, t["q8"].qweight, t["q8"].scale),
        "int8_served": lambda x, t: w8a16_linear(x, t["served8"], t["q8"].scale),
        "int4_reference": lambda x, t: w4a16_linear_ref(x, t["q4"].packed, t["q4"].scale, t["q4"].zero,
                                                        t["q4"].group_size),
        "int4_served": lambda x, t: linear(x, t["served4"], t["name"], 4),
        "bfloat16": lambda x, t: F.linear(x.bfloat16(), t["w16"]),
        "int8_w8a8": lambda x, t: _w8a8(x, t["q8t"], t["q8"].scale),
    }
    if rows <= 16:
        found["int8pack_fp32"] = lambda x, t: torch._weight_int8pack_mm(x, t["q8"].qweight, t["q8"].scale)
    if compiled:
        c8, c4 = torch.compile(w8a16_linear_ref, dynamic=False), torch.compile(w4a16_linear_ref, dynamic=False)
        found["int8_compiled"] = lambda x, t: c8(x, t["q8"].qweight, t["q8"].scale)
        found["int4_compiled"] = lambda x, t: c4(x, t["q4"].packed, t["q4"].scale, t["q4"].zero, t["q4"].group_size)
    return found


def _w8a8(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W^T with x quantized per row to int8 (symmetric) and W's per-channel int8 codes (`qweight_t`: [in, out])."""
    x_scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
    xq = torch.round(x / x_scale).clamp_(-127, 127).to(torch.int8)
    return torch._int_mm(xq, qweight_t).float().mul_(x_scale).mul_(scale)


def model_pass_ms(fns: dict, layers: list[dict], inputs: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of one pass over every layer's linears, per candidate, after two untimed passes each.
    The candidates take turns pass by pass, so that a slow spell of the host (this one shows steal time) falls on
    all of them alike rather than on whichever ran then."""
    def one(fn) -> float:
        began = time.perf_counter()
        for layer in layers:
            for name, tensors in layer.items():
                fn(inputs[name], tensors)
        return (time.perf_counter() - began) * 1e3

    for fn in fns.values():
        one(fn), one(fn)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(one(fn))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["kernel"] for r in rows if r["kernel"] != "float32"):
        mine = [r for r in rows if r["kernel"] == name]
        ax.plot([r["rows"] for r in mine], [r["speedup_vs_float32"] for r in mine], marker="o", label=name)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("rows of the batch")
    ax.set_ylabel("speed-up over float32 (the model's linears)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="morphling bench-cpu-kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=SHAPES, help="the model whose linears are run")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="batch rows, comma-separated")
    ap.add_argument("--compile-rows", default="1,16", help="rows the torch.compile candidates run at ('' for none)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=9, help="timed passes per candidate, taken in turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-out/cpu-kernels"))
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    rows_asked = [int(r) for r in args.rows.split(",") if r]
    compile_rows = {int(r) for r in args.compile_rows.split(",") if r}
    shape = SHAPES[args.shape]
    layers = layer_weights(shape, shape.num_layers, torch.Generator().manual_seed(args.seed))
    results = []
    for m in rows_asked:
        inputs = {name: torch.randn(m, k) for name, (_, k) in shape.linears.items()}
        timed = model_pass_ms(candidates(m, m in compile_rows), layers, inputs, args.repeats)
        for name, ms in timed.items():
            results.append({"rows": m, "kernel": name, "ms": ms, "speedup_vs_float32": timed["float32"] / ms})
        print(f"  {m:>4} rows: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in timed.items()), file=sys.stderr,
              flush=True)
    names = list(dict.fromkeys(r["kernel"] for r in results))
    print(f"{'kernel':<15}" + "".join(f"{m:>16}" for m in rows_asked))
    for name in names:
        cells = {r["rows"]: r for r in results if r["kernel"] == name}
        print(f"{name:<15}" + "".join(f"{cells[m]['ms']:8.2f} ({cells[m]['speedup_vs_float32']:4.2f}x)"
                                      if m in cells else f"{'-':>16}" for m in rows_asked))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_kernels.json").write_text(json.dumps({"rows": results, **provenance(args)}, indent=1,
                                                          default=str))
    plot(results, args.out / "cpu_kernels.png")
    print(f"wrote {args.out / 'cpu_kernels.json'} and {args.out / 'cpu_kernels.png'}")
    return 0
