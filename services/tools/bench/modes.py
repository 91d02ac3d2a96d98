"""What each mode of `morphling bench` is: which levers the controller may move, at which bits the layers
start, and on how many executors in which shape, so that every mode gets the same total memory.

    fp16       full precision as loaded, nothing morphs        (`morphling up --mode off`)
    int8/int4  every decoder layer at 8/4 bits, fixed           (`--static-bits 8|4`)
    morph      MorphServe: quantize under pressure, restore     (`--levers quantize`)
    cocoserve  CoCoServe: one instance with its layers on one executor and idle peers, replicated onto
               them, migrated, evicted, the batch cut             (`--levers replicate`, a spare plan)
    amoebas    AMOEBAs: executors alone, merged into a TP instance for a request none holds alone and split
               after                                             (`--levers tp`)
    ladder     every lever on the executors alone: quantize, merge and split (replicate moves nothing in this
               shape: it needs an instance of several executors)  (`--levers quantize,replicate,tp`)

("fp16" names the full-precision baseline whatever its dtype: float32 on the CPU, bfloat16 on CUDA.)

Executors: `--executors N` runs every mode on N; a mode whose lever needs several (cocoserve, amoebas) runs on
at least two. The memory is the same in every mode: N times the per-executor budget (`morphling up`'s
default unless `--memory-budget` says), shared evenly by the executors the mode runs.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from shared.config import LEVERS, parse_size
from shared.core.planner.shapes import SHAPES, ModelShape


@dataclass(frozen=True)
class Mode:
    name: str
    levers: tuple[str, ...] = ()
    static_bits: int = 16
    min_executors: int = 1
    spare: bool = False  # CoCoServe's start: instances of two, every layer on the first, the second idle


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("fp16"), Mode("int8", static_bits=8), Mode("int4", static_bits=4),
    Mode("morph", ("quantize",)),
    Mode("cocoserve", ("replicate",), min_executors=2, spare=True),
    Mode("amoebas", ("tp",), min_executors=2),
    Mode("ladder", LEVERS, min_executors=2),
)}


class ModeError(ValueError):
    """A mode that cannot run as asked (an unknown name, an odd executor count for a spare plan)."""


def executors_for(mode: Mode, executors: int) -> int:
    count = max(executors, mode.min_executors)
    if mode.spare and count % 2:
        raise ModeError(f"{mode.name} runs instances of two executors (one serving, one idle to take replicas): "
                        f"--executors {executors} gives {count}; use an even number")
    return count


def budget_per_executor(mode: Mode, executors: int, per_executor: str) -> int:
    """Bytes of each executor's arena: the total (`executors` budgets) shared by those the mode runs."""
    return executors * parse_size(per_executor) // executors_for(mode, executors)


def model_shape(model: str) -> ModelShape:
    """`model`'s shape, read without loading it (Hugging Face config.json keys): the spare plan names every layer,
    the memory-bound regime sizes the arena by its weights."""
    if model == "default":
        return SHAPES["smollm2-135m"]
    config = Path(model).expanduser() / "config.json"
    try:
        c = json.loads(config.read_text())
        heads = int(c["num_attention_heads"])
        return ModelShape(Path(model).name, int(c["num_hidden_layers"]), int(c["hidden_size"]),
                          int(c["intermediate_size"]), heads, int(c.get("num_key_value_heads", heads)),
                          int(c.get("head_dim") or c["hidden_size"] // heads), int(c["vocab_size"]),
                          bool(c.get("tie_word_embeddings", False)), int(c.get("max_position_embeddings", 0)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModeError(f"the model's shape is read from {config}, which does not give it: {e}") from e


def spare_plan(count: int, layers: int) -> dict:
    """Instances of two executors, every layer on the first (CoCoServe's scale-up starts from idle peers)."""
    instances = []
    for i in range(0, count, 2):
        leader, spare = f"exec{i}", f"exec{i + 1}"
        instances.append({"id": f"i{i // 2}", "leader": leader, "members": [leader, spare], "tp": 1,
                          "layers": [{"placement": [leader], "bits": 16} for _ in range(layers)]})
    return {"instances": instances}


def up_args(mode: Mode, executors: int, per_executor: str, morph_mode: str, model: str, plan_dir: Path) -> list[str]:
    """The `morphling up` flags that make `mode` (model, ports, logs and lengths are the caller's)."""
    count = executors_for(mode, executors)
    out = ["--executors", str(count), "--memory-budget", str(budget_per_executor(mode, executors, per_executor)),
           "--static-bits", str(mode.static_bits), "--levers", ",".join(mode.levers) or "none",
           "--mode", morph_mode if mode.levers else "off"]
    if mode.spare:
        plan_dir.mkdir(parents=True, exist_ok=True)
        path = plan_dir / f"{mode.name}-plan.json"
        path.write_text(json.dumps(spare_plan(count, model_shape(model).num_layers), indent=1))
        out += ["--plan", str(path)]
    return out
