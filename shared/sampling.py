"""How one request samples: the fields and their rules, defined once for every process.

The gateway builds SamplingOptions from an OpenAI request, the bus carries them inside a
GenerateRequest (revalidated on decode by these same rules), and the engine samples with them. Range
rules follow vLLM/OpenAI; a rule that is broken raises InvalidRequestError naming the field, so the
gateway answers 400 with `param` before a request travels anywhere. Only what needs the model stays
with the engine: stop token ids are checked against the real vocabulary there.
"""

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator,
                      model_validator)

from shared.errors import InvalidRequestError

# Temperatures this small make softmax overflow-prone and are meant as greedy anyway (vLLM's rule).
SAMPLING_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# torch.Generator.manual_seed accepts exactly this range.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1

Number = StrictInt | float  # strict: `"temperature": true` is a client bug, not 1.0


class SamplingOptions(BaseModel):
    # strict: a bool where a number belongs, or a float where an integer does, is refused, not coerced.
    model_config = ConfigDict(extra="forbid", strict=True)

    n: StrictInt = 1
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0  # 0 or -1 disable it
    min_p: Number = 0.0
    seed: StrictInt | None = None
    repetition_penalty: Number = 1.0
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    max_tokens: StrictInt | None = 16  # None: generate until the context window is full
    min_tokens: StrictInt = 0
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    logprobs: StrictInt | None = None  # number of top logprobs; 0 returns only the chosen token's
    skip_special_tokens: StrictBool = True

    @classmethod
    def checked(cls, **fields) -> "SamplingOptions":
        """Build from loose values, raising InvalidRequestError for a wrong type as for a wrong range."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = str(err["loc"][0]) if err["loc"] else None
            raise InvalidRequestError(f"{param} is invalid: {err['msg']}, got {err.get('input')!r}", param) from exc

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value):
        # OpenAI accepts a bare string for `stop`; the rest of the system sees a list.
        return [value] if isinstance(value, str) else value

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @model_validator(mode="after")
    def _check_ranges(self) -> "SamplingOptions":
        _check_int("n", self.n, 1, MAX_N)
        _check_number("temperature", self.temperature, 0, 2)
        _check_number("top_p", self.top_p, 0, 1, low_open=True)
        if self.top_k < -1:
            _fail("top_k", f"top_k must be -1 (disabled) or at least 0, got {self.top_k!r}")
        _check_number("min_p", self.min_p, 0, 1)
        _check_number("presence_penalty", self.presence_penalty, -2, 2)
        _check_number("frequency_penalty", self.frequency_penalty, -2, 2)
        _check_number("repetition_penalty", self.repetition_penalty, 0, 2, low_open=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.max_tokens is None:
            if self.min_tokens < 0:
                _fail("min_tokens", f"min_tokens must be at least 0, got {self.min_tokens!r}")
        else:
            _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, high_name="max_tokens")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            _fail("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", f"stop_token_ids must be token ids (>= 0), got {self.stop_token_ids!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            _fail("seed", f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        return self


def _fail(param: str, message: str):
    raise InvalidRequestError(message, param=param)


def _check_int(name: str, value: int, low: int, high: int, high_name: str | None = None) -> None:
    if not low <= value <= high:
        upper = f"{high_name}={high}" if high_name else f"{high}"
        _fail(name, f"{name} must be an integer in [{low}, {upper}], got {value!r}")


def _check_number(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    # Written as a positive range test so that NaN, which fails every comparison, is rejected.
    if not ((low < value if low_open else low <= value) and value <= high):
        _fail(name, f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")
