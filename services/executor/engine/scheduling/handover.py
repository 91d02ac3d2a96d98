"""A sequence as another engine can go on with it exactly where it is: its tokens, how far its KV is
computed, its sampler's random state and how much of its text the client has. A TP merge hands a
follower's sequences to the leader this way (fabric/transform.py); its block table is renamed by the taker."""

import torch

from services.executor.engine.model.tokenizer import Tokenizer
from services.executor.engine.scheduling.outputs import TextStream
from shared.core.scheduling.sequence import Sequence, Status
from shared.sampling import SamplingOptions


def pack(seq: Sequence, text: TextStream) -> dict:
    return dict(request_id=seq.request_id, index=seq.index, prompt_ids=list(seq.prompt_ids),
                params=seq.params.model_dump(), arrival_time=seq.arrival_time, deadline=seq.deadline,
                fork_into=seq.fork_into, output_ids=list(seq.output_ids), block_table=list(seq.block_table),
                num_computed=seq.num_computed, running=seq.status is Status.RUNNING,
                first_scheduled_time=seq.first_scheduled_time, num_preemptions=seq.num_preemptions,
                generator=None if seq.generator is None else seq.generator.get_state().tolist(),
                text_chars=text.emitted)


def preempted(packed: dict) -> dict:
    """`packed` as a sequence preempted after the tokens it has: no KV, waiting for its prefill again."""
    return {**packed, "block_table": [], "num_computed": 0, "running": False}


def unpack(packed: dict, block_table: list[int], tokenizer: Tokenizer, device: str) -> tuple[Sequence, TextStream]:
    params = SamplingOptions.model_validate(packed["params"])
    generator = None
    if packed["generator"] is not None:
        generator = torch.Generator(device=device)
        generator.set_state(torch.tensor(packed["generator"], dtype=torch.uint8))
    seq = Sequence(packed["request_id"], packed["index"], packed["prompt_ids"], params, packed["arrival_time"],
                   packed["deadline"], fork_into=packed["fork_into"], generator=generator,
                   output_ids=list(packed["output_ids"]), block_table=block_table,
                   num_computed=packed["num_computed"], first_scheduled_time=packed["first_scheduled_time"],
                   num_preemptions=packed["num_preemptions"])
    text = TextStream(tokenizer, seq.prompt_ids, params)
    text.resume(seq.output_ids, packed["text_chars"])
    return seq, text
