"""Request traces for `morphling bench`: arrival times and token counts, nothing else.

Two formats are read, told apart by their header:

- the Azure LLM inference traces (Splitwise): `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps
  as `2023-11-16 18:15:46.6805900` (seven fractional digits, which `datetime` will not parse), CRLF;
- BurstGPT: `Timestamp` in seconds, `Request tokens`, `Response tokens` (among other columns). Its
  failed requests have 0 response tokens; they are skipped, since there is nothing to ask for.

A window of the trace (`start`, `duration`, in trace seconds from its first row) is cut out and its
arrival times are divided by `rate_scale`, so the burstiness is kept and only the clock changes:
rate_scale 0.1 plays a 12-second window over 120 seconds. Token counts are multiplied by
`len_scale` and capped so that prompt + output fits `max_len`, the context the model serves.
"""

import csv
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


class TraceError(ValueError):
    """A trace that cannot be read, or a window of it that holds nothing."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the replay starts, already scaled
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceRow:
    time_s: float  # seconds after the trace's first row
    prompt_tokens: int
    output_tokens: int


def _azure_time(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": fromisoformat takes at most 6 fractional digits
    whole, _, fraction = text.strip().partition(".")
    return datetime.fromisoformat(whole).replace(tzinfo=timezone.utc).timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def read_rows(path: Path) -> list[TraceRow]:
    """Every row of an Azure or BurstGPT CSV, times relative to the first row, in arrival order."""
    path = Path(path)
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from e
    with f:
        reader = csv.DictReader(f)
        header = tuple(name.strip() for name in reader.fieldnames or ())
        if all(c in header for c in AZURE_COLUMNS):
            when, prompt, output = AZURE_COLUMNS
            parse_time = _azure_time
        elif all(c in header for c in BURSTGPT_COLUMNS):
            when, prompt, output = BURSTGPT_COLUMNS
            parse_time = float
        else:
            raise TraceError(f"{path}: header {', '.join(header) or '(none)'} has neither the Azure columns "
                             f"({', '.join(AZURE_COLUMNS)}) nor BurstGPT's ({', '.join(BURSTGPT_COLUMNS)})")
        raw = []
        for line, row in enumerate(reader, start=2):
            row = {k.strip(): v for k, v in row.items() if k is not None}
            try:
                raw.append((parse_time(row[when]), int(float(row[prompt])), int(float(row[output]))))
            except (TypeError, ValueError) as e:
                raise TraceError(f"{path}, line {line}: {e}") from e
    if not raw:
        raise TraceError(f"{path} has a header but no requests")
    raw.sort(key=lambda r: r[0])
    first = raw[0][0]
    return [TraceRow(t - first, p, o) for t, p, o in raw if o > 0 and p >= 0]


def scale_lengths(prompt: int, output: int, len_scale: float, max_len: int) -> tuple[int, int]:
    """Token counts scaled by len_scale, at least one of each, prompt + output <= max_len.

    The output is capped first at half the context, so that a long answer never squeezes its
    prompt to nothing; the prompt then takes what is left."""
    out = min(max(1, math.ceil(output * len_scale)), max(1, max_len // 2))
    prompt = min(max(1, math.ceil(prompt * len_scale)), max_len - out)
    return prompt, out


def load_trace(path: Path, start_s: float, duration_s: float, rate_scale: float = 1.0, len_scale: float = 1.0,
               max_len: int = 2048) -> list[TraceRequest]:
    """The requests arriving in [start_s, start_s + duration_s) of the trace, replay-ready."""
    if rate_scale <= 0 or len_scale <= 0:
        raise TraceError(f"rate and length scales must be positive, got {rate_scale} and {len_scale}")
    if start_s < 0 or duration_s <= 0:
        raise TraceError(f"need start >= 0 and duration > 0, got {start_s} and {duration_s}")
    if max_len < 2:
        raise TraceError(f"max_len must leave room for a prompt and an output token, got {max_len}")
    rows = read_rows(path)
    window = [r for r in rows if start_s <= r.time_s < start_s + duration_s]
    if not window:
        raise TraceError(f"{path}: no request arrives in [{start_s:g}, {start_s + duration_s:g}) s; "
                         f"the trace spans {rows[-1].time_s:.0f} s")
    requests = []
    for r in window:
        prompt, output = scale_lengths(r.prompt_tokens, r.output_tokens, len_scale, max_len)
        requests.append(TraceRequest((r.time_s - start_s) / rate_scale, prompt, output))
    return requests


def arrival_rate(arrivals: list[float], bin_s: float, until_s: float) -> list[float]:
    """Requests per second in consecutive bins of bin_s, from 0 to until_s."""
    bins = [0] * max(1, math.ceil(until_s / bin_s))
    for t in arrivals:
        if 0 <= t < until_s:
            bins[int(t // bin_s)] += 1
    return [n / bin_s for n in bins]
