"""A plan's bits are served as planned: an instance whose placed layers are INT8 and INT4 on the members
that hold them (real processes in a gloo world, `fabric/offline.py`) generates what one executor does with
the same layers quantized by its swapper."""

import json

from services.executor.engine.engine import LLMEngine
from services.executor.fabric.offline import Shape, instance_engine
from shared.config import EngineConfig
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama_8kv

PROMPTS = ["The quick brown fox", "In 1990 the city", "Hello there, how are", "A B C D E F G"]


def test_planned_bits_on_placed_layers_generate_what_one_executor_does(tmp_path):
    model = write_tiny_llama_8kv(tmp_path / "tiny")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"instances": [{"members": ["exec0", "exec1"], "layers": [
        {"placement": ["exec0"]}, {"placement": ["exec1"], "bits": 8}, {"placement": ["exec1"], "bits": 4},
        {"placement": ["exec0", "exec1"], "bits": 8}]}]}))
    config = EngineConfig(model=str(model), memory_budget=8 << 20, block_size=8, max_model_len=256)
    params = SamplingOptions(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = LLMEngine(config, progress=False)
    alone.swapper.set_bits([1, 3], 8)
    alone.swapper.set_bits([2], 4)
    expected = [c.outputs[0].token_ids for c in alone.generate(PROMPTS, params)]
    with instance_engine(config, Shape(2, plan_file=str(plan)), timeout_s=60) as leader:
        got = [c.outputs[0].token_ids for c in leader.generate(PROMPTS, params)]
        held = [i for i, layer in enumerate(leader.model.layers) if layer is not None]
        assert held == [0, 3] and [leader.model.layer_bits[i] for i in held] == [32, 8]  # and a replica of 3
        assert leader.stats().ledger.pages_kv_used == 0  # every block given back
    assert got == expected
