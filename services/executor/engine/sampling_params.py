"""Per-request sampling parameters, with vLLM/OpenAI meanings and OpenAI-style validation.

Validation lives here, next to the fields, so that the API layer can reject a request with a
message naming the offending field before the request ever reaches the scheduler, and the
sampler can trust every value it reads.
"""

from dataclasses import dataclass, field

from services.executor.engine.errors import InvalidRequestError

# Temperatures this small make softmax overflow-prone and are meant as greedy anyway (vLLM's rule).
SAMPLING_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# torch.Generator.manual_seed accepts exactly this range.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disable it
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: generate until the context window is full
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs; 0 returns only the chosen token's
    skip_special_tokens: bool = True

    def __post_init__(self):
        # OpenAI accepts a bare string for `stop`; normalise so the rest of the engine sees a list.
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first out-of-range field."""
        _check_int("n", self.n, 1, MAX_N)
        _check_number("temperature", self.temperature, 0, 2)
        _check_number("top_p", self.top_p, 0, 1, low_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", f"top_k must be -1 (disabled) or at least 0, got {self.top_k!r}")
        _check_number("min_p", self.min_p, 0, 1)
        _check_number("presence_penalty", self.presence_penalty, -2, 2)
        _check_number("frequency_penalty", self.frequency_penalty, -2, 2)
        _check_number("repetition_penalty", self.repetition_penalty, 0, 2, low_open=True)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.max_tokens is None:
            if not _is_int(self.min_tokens) or self.min_tokens < 0:
                _fail("min_tokens", f"min_tokens must be at least 0, got {self.min_tokens!r}")
        else:
            _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, high_name="max_tokens")
        self._validate_stops(vocab_size)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            _fail("seed", f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")

    def _validate_stops(self, vocab_size: int) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            _fail("stop", "stop must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            _fail("stop", "stop strings must be non-empty")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or not 0 <= token_id < vocab_size:
                _fail(
                    "stop_token_ids",
                    f"stop_token_ids must be in [0, {vocab_size}) (the vocabulary), got {token_id!r}",
                )


def _fail(param: str, message: str):
    raise InvalidRequestError(message, param=param)


def _is_int(value) -> bool:
    # bool is an int subclass, but `"n": true` in a request is a client bug, not n=1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return _is_int(value) or isinstance(value, float)


def _check_int(name: str, value, low: int, high: int, high_name: str | None = None) -> None:
    if not _is_int(value) or not low <= value <= high:
        upper = f"{high_name}={high}" if high_name else f"{high}"
        _fail(name, f"{name} must be an integer in [{low}, {upper}], got {value!r}")


def _check_number(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    # Written as a positive range test so that NaN, which fails every comparison, is rejected.
    in_range = _is_number(value) and (low < value if low_open else low <= value) and value <= high
    if not in_range:
        _fail(name, f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")
