"""Engine outputs in bus form: CompletionDelta → TokenDelta, with token text for every logprob.

The gateway renders OpenAI logprobs from these, so each entry carries the token's own text decoded
with special tokens kept (a logprob for "<|im_end|>" must say so, not show an empty string).
"""

from shared.messages import LogprobEntry, TokenDelta, TopLogprob


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_delta(delta, tokenizer) -> TokenDelta:
    """One engine CompletionDelta as the TokenDelta the gateway receives."""
    logprobs = None
    if delta.logprobs is not None:
        logprobs = [LogprobEntry(token_id=lp.token_id, token=_token_text(tokenizer, lp.token_id), logprob=lp.logprob,
                                 top=[TopLogprob(token_id=t, token=_token_text(tokenizer, t), logprob=v)
                                      for t, v in lp.top])
                    for lp in delta.logprobs]
    return TokenDelta(request_id=delta.request_id, index=delta.index, token_ids=list(delta.token_ids),
                      text=delta.text, timestamps=list(delta.timestamps), logprobs=logprobs,
                      finished=delta.finished, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                      prompt_tokens=delta.num_prompt_tokens, output_tokens=delta.num_output_tokens)
