"""What the engine reports each step, and the text side of a sequence: detokenizing and stop strings."""

from dataclasses import dataclass, field

from services.executor.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.sampling import SamplingOptions


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens, best first


@dataclass
class CompletionDelta:
    """One sequence's news from one engine step (or its end after an abort or deadline)."""
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    timestamps: list[float]  # time.time() at which each token was sampled
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # stop | length | abort | deadline
    stop_reason: int | str | None  # the stop string or stop token id that ended it
    num_prompt_tokens: int
    num_output_tokens: int
    first_scheduled: float | None = None  # time.time() when the request was first scheduled, once it was


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    timestamps: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Completion:
    request_id: str
    num_prompt_tokens: int
    outputs: list[CompletionOutput]

    def add(self, delta: CompletionDelta) -> None:
        out = self.outputs[delta.index]
        out.token_ids += delta.token_ids
        out.text += delta.text
        out.timestamps += delta.timestamps
        if delta.logprobs is not None:
            out.logprobs = (out.logprobs or []) + delta.logprobs
        if delta.finished:
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason


class TextStream:
    """Incremental text of one sequence, cut at the first stop string.

    While stop strings are set, the last (longest stop - 1) characters are held back: they might be the
    start of a stop string that the next token completes, and text once streamed cannot be taken back.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingOptions):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = params.stop
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, token_id: int) -> str | None:
        """Append a token's text; returns the stop string it completed, if any (text is cut before it)."""
        before = len(self.text)
        self.detok.add(token_id)
        self.text = self.detok.text
        if not self.stops:
            return None
        start = max(0, before - self.holdback)
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) != -1]
        if not hits:
            return None
        at, stop = min(hits)
        self.text = self.text[:at]
        return stop

    def resume(self, token_ids: list[int], emitted_chars: int) -> None:
        """Replay tokens another executor generated, of whose text the client already has `emitted_chars`
        characters: the rest (held back or incomplete) comes out with the next tokens, as it would have."""
        for token_id in token_ids:
            self.detok.add(token_id)
        self.text = self.detok.text
        self.emitted = min(emitted_chars, len(self.text))

    def take(self, finished: bool) -> str:
        """The text not yet emitted that is safe to emit now."""
        ready = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:ready]
        self.emitted = ready
        return delta
