"""A sequence handed from one engine to another (a TP merge's handover) goes on exactly where it was: its
tokens, its computed KV count, its sampler's random state and the text its client already has."""

import torch

from services.executor.engine.engine import LLMEngine
from services.executor.engine.scheduling import handover
from shared.config import EngineConfig
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3


def test_a_packed_sequence_unpacks_to_the_same_state_and_the_same_next_draws(tmp_path):
    engine = LLMEngine(EngineConfig(model=str(write_tiny_llama3(tmp_path / "tiny")), memory_budget=4 << 20,
                                    block_size=8, max_model_len=128, prepare_variants=False), progress=False)
    params = SamplingOptions(temperature=0.8, max_tokens=20, stop=["zz"])
    engine.add_request("r", "The quick brown fox", params)
    text = ""
    for _ in range(5):
        text += "".join(d.text for d in engine.step())
    (seq,) = engine._requests["r"]
    packed = handover.pack(seq, engine._text[seq.seq_id])
    copy, stream = handover.unpack(packed, [7, 8], engine.tokenizer, "cpu")
    for field in ("request_id", "index", "prompt_ids", "params", "arrival_time", "output_ids", "num_computed",
                  "fork_into", "first_scheduled_time"):
        assert getattr(copy, field) == getattr(seq, field), field
    assert copy.block_table == [7, 8] and stream.emitted == len(text)
    assert torch.equal(torch.rand(4, generator=copy.generator), torch.rand(4, generator=seq.generator))
