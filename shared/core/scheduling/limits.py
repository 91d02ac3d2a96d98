"""Whether an engine, as it is now, can take a request: the checks that refuse it before it costs anything (the
executor asks them outside the engine thread, the engine again when the request is added)."""

from dataclasses import dataclass

from shared.core.errors import KvCapacityError
from shared.core.scheduling.growth import blocks_at_end
from shared.errors import InvalidRequestError
from shared.sampling import SamplingOptions


@dataclass(frozen=True)
class EngineLimits:
    vocab: int
    max_num_seqs: int  # the sequences it runs at once
    max_model_len: int
    block_size: int
    capacity_blocks: int  # KV blocks when empty: the most one sequence can take


def check_request(prompt_ids: list[int], params: SamplingOptions, limits: EngineLimits,
                  resume: list[tuple[int, list[int]]] = ()) -> None:
    """InvalidRequestError or KvCapacityError where the engine cannot take a request of `prompt_ids`; `resume`:
    (index, tokens so far) of the completions it goes on with, started elsewhere."""
    vocab, max_model_len = limits.vocab, limits.max_model_len
    if any(t >= vocab for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab}) (the vocabulary), got "
                                  f"{params.stop_token_ids}", param="stop_token_ids")
    if params.n > limits.max_num_seqs:  # its n sequences start together, so it could never run
        raise InvalidRequestError(f"n must be at most {limits.max_num_seqs} (the sequences this engine "
                                  f"runs at once), got {params.n}", param="n")
    if not prompt_ids:
        raise InvalidRequestError("prompt must contain at least one token", param="prompt")
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    wanted = len(prompt_ids) + (params.max_tokens or 1)
    if wanted > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({len(prompt_ids)} in the prompt, {wanted - len(prompt_ids)} for the "
            f"completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens" if params.max_tokens else "prompt")
    blocks = blocks_at_end(len(prompt_ids), params.max_tokens or None, max_model_len, limits.block_size)
    if blocks > limits.capacity_blocks:
        raise KvCapacityError(len(prompt_ids), wanted if params.max_tokens else max_model_len, blocks,
                              limits.capacity_blocks)
    if resume:
        _check_resume(resume, len(prompt_ids), params, limits)


def _check_resume(resume: list[tuple[int, list[int]]], prompt_len: int, params: SamplingOptions,
                  limits: EngineLimits) -> None:
    indices = [index for index, _ in resume]
    if len(set(indices)) != len(indices) or max(indices) >= params.n:
        raise InvalidRequestError(f"resume must name distinct completions below n={params.n}, got {indices}",
                                  param="resume")
    for index, tokens in resume:
        if any(not 0 <= t < limits.vocab for t in tokens):
            raise InvalidRequestError(f"resumed token ids must be in [0, {limits.vocab})", param="resume")
        if len(tokens) >= (params.max_tokens or limits.max_model_len - prompt_len):
            raise InvalidRequestError(f"completion {index} already has all its tokens", param="resume")
