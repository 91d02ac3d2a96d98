"""Configuration of every Morphling process, in one place. No torch import here."""

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = PROJECT_ROOT / "docs" / "results"  # where recorded benchmark and evaluation results live


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what `--model default` serves

# The largest message the bus carries (nats-server's max_payload; deploy/nats.conf says the same). The cluster
# state holds every executor's report, ~0.9 KiB each: NATS's default of 1 MiB stops the monitor publishing
# at ~1,180 executors, 8 MiB (the most NATS advises) at ~9,000 (docs/benchmarks.md, "The monitor and
# controller at 1,000 executors").
BUS_MAX_PAYLOAD_BYTES = 8 << 20


def served_model_name(model: str) -> str:
    """The name a model is served and reported under: the default's own name, else the path's basename."""
    if model == "default":
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(os.path.expanduser(model)))


def read_swap_order(path: str) -> tuple[int, ...]:
    """The "order" of a `morphling profile` JSON file: layer indices, most swappable first. The executor
    takes its swap order from one, the controller an order that overrides the executors'."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the swap order from {path}: {exc}") from exc
    order = data.get("order") if isinstance(data, dict) else None
    if (not isinstance(order, list) or not order
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in order)):
        raise ValueError(f"{path} has no swap order: expected {{\"order\": [layer indices]}}")
    return tuple(order)


def data_dir() -> Path:
    """The shared data folder (traces, corpora, prompts): $MORPHLING_DATA, else ../shared/data beside the
    checkout."""
    return Path(os.environ.get("MORPHLING_DATA", PROJECT_ROOT.parent / "shared" / "data"))


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str | int) -> int:
    """'1.5GiB', '800M', '1048576' -> bytes (binary units, as memory budgets are)."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "")
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits):]
    try:
        number = float(digits)
    except ValueError:
        number = None
    if number is None or unit not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: expected a number with an optional unit like 1.5GiB")
    return int(number * _UNITS[unit])


def seconds(allow_zero: bool = False) -> Callable[[str], float]:
    """An argparse type for a duration flag: a number of seconds above 0 (or from 0, where 0 means off)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not (value >= 0 if allow_zero else value > 0):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if allow_zero else 'more than 0'} seconds: "
                                             f"{text!r}")
        return value

    return parse


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # "default" (SmolLM2-135M-Instruct GGUF), a HF directory or a .gguf file
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    memory_budget: int = parse_size("1GiB")  # bytes of the page arena (weights of the decoder layers + KV)
    block_size: int = 16  # tokens per KV block (= per page)
    max_model_len: int | None = None  # None: the model's own context length
    # KV tokens the arena must hold beside the weights; None: one sequence of max_model_len. An executor in a
    # world of several may hold less: a TP merge holds the longest sequence (AMOEBAs; process.cluster_check).
    min_kv_tokens: int | None = None
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunks)
    max_waiting: int = 256  # bounded waiting queue; a full queue rejects at admission
    seed: int = 0  # seeds unseeded sampling, so that a whole run is reproducible
    variant_bits: tuple[int, ...] = (8, 4)  # the quantized variants a layer can swap to
    awq: bool = False  # activation-aware (AWQ-style) scaling of the variants, calibrated on wikitext-2
    variant_cache_dir: str | None = None  # None: ~/.cache/morphling/variants
    host_memory_cap: int | None = None  # bytes of host memory for held variants; None: no cap
    prepare_variants: bool = False  # build/load every variant at start (the executor does); False: at first swap
    cuda_graphs: bool = True  # on CUDA, decode steps replay graphs captured at start (vLLM's enforce_eager: False)

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"


def _env_list(name: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in os.environ.get(name, "").split(",") if k.strip())


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "0.0.0.0"
    port: int = 8000
    gateway_id: str = "gw0"
    api_keys: tuple[str, ...] = ()  # MORPHLING_API_KEYS, comma-separated; empty = auth off
    admin_keys: tuple[str, ...] = ()  # MORPHLING_ADMIN_KEYS, for /v1/cluster*
    max_body_bytes: int = 4 << 20
    admission_timeout_s: float = 2.0  # an executor answers admission within this
    request_timeout_s: float = 600.0  # default per-request deadline
    retry_after_s: int = 1  # Retry-After on every 429 and 503
    drain_timeout_s: float = 30.0
    # How long a request whose executor was lost keeps trying to move to another (or to the same one,
    # restarted) before its stream ends with executor_lost.
    failover_timeout_s: float = 10.0
    # MORPHLING_STREAM_BUFFER: token deltas held per request for a client that reads slower than the
    # executor generates; one more cancels the request (services/gateway/dispatch.py). A healthy client
    # reads within a few deltas, so this only ever fills for one that stopped reading.
    stream_buffer: int = 1024
    # MORPHLING_BUS_OUTAGE_S: once the bus has been gone this long, requests in flight end (503
    # bus_unavailable) instead of waiting for a reconnect; new ones are refused at once while it is gone.
    bus_outage_s: float = 3.0
    # AMOEBAs (§3.3): how requests are placed and which instances merge for one that fits nowhere: amoebas
    # (the paper's scheduler), rr or llf (its baselines: round-robin, least-load-first), off (no merges: a
    # request no instance holds is a 503). A merged instance whose long requests are done takes no new ones
    # until this share of its KV is free, and then splits (the controller sends the split).
    tp_scheduler: str = "amoebas"
    split_free_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.tp_scheduler not in ("amoebas", "rr", "llf", "off"):
            raise ValueError(f"tp_scheduler must be amoebas, rr, llf or off, got {self.tp_scheduler!r}")
        if self.stream_buffer < 1:
            raise ValueError(f"stream_buffer must be at least 1 delta, got {self.stream_buffer}")
        if not self.bus_outage_s > 0:
            raise ValueError(f"bus_outage_s must be more than 0 seconds, got {self.bus_outage_s}")

    @classmethod
    def from_env(cls, **overrides) -> "GatewayConfig":
        env = {"api_keys": _env_list("MORPHLING_API_KEYS"), "admin_keys": _env_list("MORPHLING_ADMIN_KEYS")}
        if (buffer := os.environ.get("MORPHLING_STREAM_BUFFER")) is not None:
            if not buffer.strip().isdigit():
                raise ValueError(f"MORPHLING_STREAM_BUFFER must be a whole number of deltas, got {buffer!r}")
            env["stream_buffer"] = int(buffer)
        if (outage := os.environ.get("MORPHLING_BUS_OUTAGE_S")) is not None:
            try:
                env["bus_outage_s"] = float(outage)
            except ValueError:
                raise ValueError(f"MORPHLING_BUS_OUTAGE_S must be a number of seconds, got {outage!r}") from None
        return cls(**(env | overrides))


@dataclass(frozen=True)
class ExecutorConfig:
    executor_id: str = "exec0"
    nats_url: str = "nats://127.0.0.1:4222"
    engine: EngineConfig = EngineConfig()
    telemetry_interval_s: float = 0.1
    latency_window_s: float = 10.0  # queue delay / TTFT / TPOT averages are over this window
    outbox_limit: int = 4096  # sends the engine thread may have queued and unsent before it waits
    flush_timeout_s: float = 5.0  # at stop, how long the sends still queued may take before they are dropped
    # Once the bus has been gone this long, every request in flight is aborted: nobody can receive its
    # tokens any more, and its pages are better freed for the requests that come after the reconnect.
    bus_outage_s: float = 3.0
    # A new request is refused (queue_full) when the wait predicted for it, from the requests ahead of it
    # and the rate requests recently left the waiting queue, is longer than this; 0 turns the bound off.
    max_queue_wait_s: float = 30.0
    # A `morphling profile --latency` JSON measured for this model on this device: the telemetry then reports a
    # layer's seconds at each width over its recent steps (`layer_seconds`), which the morph rung reads before
    # it quantizes for a queue. None: none reported, and the rung takes fewer bits to be faster (MorphServe's view).
    latency_profile: str | None = None

    def __post_init__(self) -> None:
        if self.outbox_limit < 1:
            raise ValueError(f"outbox_limit must be at least 1 send, got {self.outbox_limit}")
        if not self.bus_outage_s > 0:
            raise ValueError(f"bus_outage_s must be more than 0 seconds, got {self.bus_outage_s}")
        if not self.max_queue_wait_s >= 0:
            raise ValueError(f"max_queue_wait_s must not be negative, got {self.max_queue_wait_s}")


@dataclass(frozen=True)
class EventStreamConfig:
    """The JetStream stream that keeps morphling.events: the monitor creates it, `morphling events` reads it."""
    name: str = "MORPHLING_EVENTS"
    max_age_s: float = 7 * 24 * 3600.0  # older events are dropped...
    max_bytes: int = parse_size("256MiB")  # ...and the oldest ones too once the stream holds this much


@dataclass(frozen=True)
class MonitorConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    publish_interval_s: float = 0.2  # ClusterState at >= 4 Hz
    ewma_half_life_s: float = 1.0
    # Silence (telemetry comes every ~0.1 s) before an executor gets no new requests, and before its
    # requests are given up: far enough apart that a several-second stall on a busy 2-core machine is
    # only suspect. A process that is gone is found sooner (the monitor's probe: nobody answers).
    suspect_after_s: float = 1.0
    dead_after_s: float = 6.0
    # CoCoServe's SLO-violation rate (shared/core/monitor/slo.py): the share of the requests finished over the
    # last slo_window_s whose TTFT or TPOT is over its SLO. The SLOs suit the default model on this CPU: an
    # executor alone takes ~70 ms a token, a two-executor instance at low load ~120 ms (docs/benchmarks.md).
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.15
    slo_window_s: float = 10.0
    # Seconds between its "stats" events (telemetry taken in, states published, the time building and sending
    # them took), so that how far it is from keeping up can be read off the bus; 0: none.
    stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.stats_interval_s < 0:
            raise ValueError(f"stats_interval_s must not be negative, got {self.stats_interval_s}")
        if not 0 < self.suspect_after_s <= self.dead_after_s:
            raise ValueError(f"need 0 < suspect_after_s <= dead_after_s, got {self.suspect_after_s} and "
                             f"{self.dead_after_s}")
        if min(self.slo_ttft_s, self.slo_tpot_s, self.slo_window_s) <= 0:
            raise ValueError(f"the SLOs and their window must be positive, got slo_ttft_s={self.slo_ttft_s}, "
                             f"slo_tpot_s={self.slo_tpot_s}, slo_window_s={self.slo_window_s}")
    events: EventStreamConfig = EventStreamConfig()  # kept where the NATS server runs JetStream


# The controller's levers (DESIGN.md, "The controller's ladder"): quantize and restore layers (MorphServe);
# replicate, migrate, evict and cut the batch (CoCoServe); merge and split tensor parallelism (AMOEBAs).
LEVERS = ("quantize", "replicate", "tp")


def parse_levers(text: str) -> tuple[str, ...]:
    """'quantize,tp' -> ('quantize', 'tp'), in LEVERS' order; 'none' or '' -> ()."""
    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
    unknown = sorted(set(names) - set(LEVERS))
    if unknown:
        raise ValueError(f"unknown lever(s) {', '.join(unknown)}: the levers are {', '.join(LEVERS)} (or none)")
    return tuple(lever for lever in LEVERS if lever in names)


@dataclass(frozen=True)
class ControllerConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    controller_id: str = "ctl0"
    # An executor answers a command once it has applied it at a step boundary, so the answer can wait behind
    # a whole step: a burst's prefill on two CPU cores took 2 s here, and more on a loaded CI machine. A
    # shorter timeout calls a command failed that the executor went on to apply.
    command_timeout_s: float = 10.0
    command_retries: int = 2
    # The MorphServe policy (shared/core/policies/morph.py): a mode preset, scaled to each
    # executor's depth, then any MorphSettings field overridden by name, e.g. (("kv_high", 0.85),).
    morph_mode: str = "default"  # off | accuracy | default | performance
    morph_overrides: tuple[tuple[str, object], ...] = ()
    # CoCoServe's scale-up and scale-down (shared/core/policies/cocoserve.py) on instances of several
    # executors: a mode, then any CocoSettings field overridden by name, e.g. (("t_down", 0.2),).
    cocoserve_mode: str = "default"  # off | scale-down | default
    cocoserve_overrides: tuple[tuple[str, object], ...] = ()
    # The speed-up model's fitted costs (`morphling profile --speedup` JSON); None: speedup.DEFAULT_PROFILE.
    speedup_profile: str | None = None
    # AMOEBAs' split (shared/core/policies/amoebas.py): a TP merge the gateway formed for long requests
    # splits back once they are done and this share of its KV is free (GatewayConfig.split_free_fraction, which
    # stops it taking new requests meanwhile, must be the same). On whatever the modes above: merging costs
    # no quality, and a merge nothing needs only costs speed.
    amoebas: bool = True
    split_free_fraction: float = 0.5
    # The rungs the ladder may use (a subset of LEVERS): one lever alone is how each paper's system is run.
    levers: tuple[str, ...] = LEVERS
    # Seconds between its "stats" events (states received and planned, the time planning took); 0: none.
    stats_interval_s: float = 10.0
    # When it asks for more executors or fewer (shared/core/policies/capacity.py): CapacitySettings by name.
    capacity_overrides: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.stats_interval_s < 0:
            raise ValueError(f"stats_interval_s must not be negative, got {self.stats_interval_s}")
        unknown = set(self.levers) - set(LEVERS)
        if unknown:
            raise ValueError(f"unknown lever(s) {', '.join(sorted(unknown))}: the levers are {', '.join(LEVERS)}")
