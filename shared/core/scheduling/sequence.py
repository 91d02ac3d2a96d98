"""A sequence: one stream of tokens being generated, with its place in the KV cache.

A request with n > 1 starts as one sequence; when its prompt has been computed it forks into n that
share the prompt's pages by reference count (copy-on-write for the partly filled last block).
"""

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.sampling import SamplingOptions


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n completions
    prompt_ids: list[int]
    params: SamplingOptions
    arrival_time: float
    deadline: float | None = None  # absolute time.time() after which the request is abandoned
    fork_into: int = 1  # completions to fork into when the prompt is done (n for the first sequence)
    generator: object | None = None  # the sampler's torch.Generator; the rules never touch it
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # page ids, position p lives in block p // block_size
    num_computed: int = 0  # tokens whose KV is in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """True until the prompt (and, after a preemption, the tokens generated so far) is back in cache."""
        return self.num_uncomputed > 1

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]


def finish_reason(token: int, stop_string: Callable[[int], str | None], seq: Sequence, eos_token_ids: tuple[int, ...],
                  max_model_len: int) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) once `seq` has `token` appended, as OpenAI's API names them; (None, None) while
    it goes on. `stop_string` adds the token to the sequence's text and returns a stop string it completed; it is
    asked only where no stop token ended the sequence first."""
    params = seq.params
    if token in eos_token_ids and not params.ignore_eos:
        return "stop", None
    if token in params.stop_token_ids:
        return "stop", token
    if (matched := stop_string(token)) is not None:
        return "stop", matched
    if len(seq.output_ids) >= (params.max_tokens or max_model_len) or seq.num_tokens >= max_model_len:
        return "length", None
    return None, None
