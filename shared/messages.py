"""Every message on the bus, as a pydantic model with a schema version (DESIGN.md, "The bus").

Bodies travel as MessagePack (see shared/bus.py). A message whose `v` is not SCHEMA_VERSION, or that
fails validation, is logged and dropped by the receiver. Unknown fields are refused so that a typo on
one side fails loudly in tests instead of being silently ignored.
"""

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.errors import InvalidCommandError
from shared.sampling import SamplingOptions

SCHEMA_VERSION = 8


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    v: int = SCHEMA_VERSION


class Part(BaseModel):
    """A piece of a message (not sent on its own, so it carries no version)."""
    model_config = ConfigDict(extra="forbid")


# --- inference ------------------------------------------------------------------------------------
class ResumedCompletion(Part):
    """What the client already has of one of a request's n completions, when the gateway continues the
    request on another executor: its tokens are prefilled, not generated again."""
    index: int = Field(ge=0)
    token_ids: list[int] = Field(default_factory=list)
    text_chars: int = Field(default=0, ge=0)  # characters of its text already sent (the rest was held back)


class GenerateRequest(Message):
    request_id: str
    gateway: str  # the gateway id: token batches go to tokens.<gateway>
    prompt: str | list[int] | None = None  # completions
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the model's own template
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    arrival_time: float
    deadline: float | None = None  # absolute time.time(); the executor abandons the request after it
    # Absolute time.time() after which the gateway no longer waits for the admission: an executor that
    # reaches the request later refuses it instead of running it for nobody.
    admit_by: float | None = None
    # Set when a stream moves to this executor: only these completions go on (the others finished).
    resume: list[ResumedCompletion] | None = None


# ErrorInfo.code of an admission refused because the executor reached it after its admit_by.
ADMISSION_EXPIRED = "admission_expired"
# ErrorInfo.code of a completion ended because the instance computing it lost a member: the gateway moves
# a request that has streamed nothing yet to another instance, and ends one that has with this error.
INSTANCE_BROKEN = "instance_broken"
# ErrorInfo.code of a completion ended before it started: its executor answered the admission at once but could
# not add the request by the time its engine thread reached it (it joined another's instance, stopped, or holds
# less KV since). Nothing of it was generated, so the gateway moves it to another executor.
NOT_STARTED = "not_started"
# ErrorInfo.code of an admission refused because the request's KV (prompt plus max_tokens, else up to
# max_model_len) is more than the instance holds even empty: the gateway has instances merged for it
# (AMOEBAs) instead of answering 400. The Admission's prompt_tokens says how long its prompt is.
KV_CAPACITY = "kv_capacity"


class ErrorInfo(Part):
    message: str
    type: Literal["invalid_request_error", "queue_full", "unavailable", "internal_error"]
    param: str | None = None
    code: str | None = None


class Admission(Message):
    """The executor's reply to a GenerateRequest: admitted (tokens will follow) or refused, with why."""
    request_id: str
    executor: str
    accepted: bool
    prompt_tokens: int = 0
    error: ErrorInfo | None = None


class TokenizeRequest(Message):
    """Token ids of a prompt (or of chat messages rendered with the model's template), as the engine
    would see them."""
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    return_token_strs: bool = False


class TokenizeReply(Message):
    executor: str
    tokens: list[int] = Field(default_factory=list)
    token_strs: list[str] | None = None
    max_model_len: int = 0
    error: ErrorInfo | None = None


class DetokenizeRequest(Message):
    tokens: list[int]


class DetokenizeReply(Message):
    executor: str
    prompt: str = ""
    error: ErrorInfo | None = None


class TopLogprob(Part):
    token_id: int
    token: str
    logprob: float


class LogprobEntry(Part):
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class TokenDelta(Part):
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    text: str
    timestamps: list[float]
    logprobs: list[LogprobEntry] | None = None
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | deadline | error
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: ErrorInfo | None = None  # set when the executor failed the request after admitting it


class TokenBatch(Message):
    """All deltas of one engine step for one gateway."""
    executor: str
    deltas: list[TokenDelta]


class Cancel(Message):
    request_id: str


GATEWAY_HEARTBEAT_S = 1.0


class GatewayHeartbeat(Message):
    """A gateway lives (every GATEWAY_HEARTBEAT_S): the executors drop the earlier requests of one that restarted."""
    gateway: str
    incarnation: str  # new at every process start


class GatewayGone(Message):
    """The monitor has not heard `gateway` beat for its dead_after: the executors drop the requests it sent."""
    gateway: str


# --- the executors' fabric ------------------------------------------------------------------------
class ScaleRequest(Message):
    """`morphling scale`: have this many executors (`morphling up` adds them, or drains and removes the newest)."""
    executors: int = Field(ge=1)


class ScaleReply(Message):
    ok: bool
    executors: list[str]  # those serving once it is done
    added: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


class PeerAnnouncement(Message):
    """An executor of a fabric says it lives, where its rendezvous is, and whether it serves yet (heartbeat)."""
    executor: str
    incarnation: str  # new at every process start: its groups of an earlier life are void
    rank: int  # its place in the start-time order
    rendezvous: str  # HOST:PORT of the store it hosts
    model: str
    world: str  # the world's name (its instance prefix): worlds sharing a bus keep apart
    serving: bool = False  # its role has started: a restarted peer does not wait for it to form a start plan


# --- telemetry and state --------------------------------------------------------------------------
class KvPages(Part):
    pages_total: int  # pages in the arena (weights and KV)
    pages_slot: int  # pages inside decoder-layer weight slots
    pages_free: int  # free KV pages
    pages_used: int  # KV pages holding live blocks
    pages_base: int  # KV pages that were never part of a slot
    pages_extension: int  # KV pages released from slot tails by quantization


class GpuStats(Part):
    memory_used: int
    memory_total: int
    utilization_pct: float


class LayerPlan(Part):
    """Where one decoder layer is computed and at which bits (DESIGN.md, "Instances across executors")."""
    placement: list[str] = Field(min_length=1)  # all members: TP shards; one: placed there; several: replicas
    bits: Literal[16, 8, 4] = 16


class InstancePlan(Part):
    """A group of executors serving one copy of the model: the shape `--tp`, `--plan FILE`, GET
    /v1/cluster and the planner share (shared/core/plans.py reads and checks it)."""
    id: str
    leader: str
    members: list[str] = Field(min_length=1)
    tp: int = Field(default=1, ge=1)
    layers: list[LayerPlan]
    # Formed at run time by tp_merge (AMOEBAs) rather than planned: it splits back once its long requests end.
    merged: bool = False
    # "all": every member keeps a slot for every layer, so CoCoServe can bring any layer to any member.
    # "placed": a member keeps slots only for the layers placed on it (a SplitQuant plan: `morphling plan`),
    # so a small device need not hold the whole model's slots; its layers then cannot move.
    slots: Literal["all", "placed"] = "all"


class KvUnits(Part):
    """KV head units an executor would hold outside its slots as a member of a TP-`tp` instance (AMOEBAs'
    capacity: a block takes one unit per KV head a member holds; shared/core/tp_scheduler.py)."""
    tp: int
    units: int


class RequestLatency(Part):
    """One finished request's latencies, for the monitor's SLO windows (shared/core/monitor/slo.py)."""
    ttft_s: float  # admitted -> first token
    tpot_s: float  # mean seconds per output token after the first (0 for a one-token completion)


class ExecutorTelemetry(Message):
    executor: str
    instance: str  # new at every process start, so that a restart is told from a stall
    time: float
    model: str
    max_model_len: int
    block_size: int
    page_bytes: int
    kv: KvPages
    layers: list[int]  # bits per decoder layer, in order
    swap_order: list[int]  # the order its layers are quantized in (its LIS profile, else front to back)
    running: int
    waiting: int
    max_waiting: int
    preemptions: int
    prompt_tokens: int
    generated_tokens: int
    queue_delay_s: float  # mean wait before first scheduling, over the last window
    ttft_s: float  # mean time to first token, over the last window
    tpot_s: float  # mean time per output token, over the last window
    draining: bool = False
    gpu: GpuStats | None = None
    plan: InstancePlan | None = None  # the instance it serves in; only a plan's leader takes requests
    max_num_seqs: int = 0  # the batch cap now (the `batch` command moves it; 0: not a leader)
    requests: list[RequestLatency] = Field(default_factory=list)  # finished since the previous report
    layer_pages: int = 0  # pages of one full-precision layer slot: a replica's size (CoCoServe's r)
    # Pages neither in a slot nor holding the instance's KV blocks: room for replicas without shrinking
    # the instance's KV (only members of a TP1 instance of several executors have any).
    spare_pages: int = 0
    pages_growth: int = 0  # KV pages the running sequences still take before they reach their max_tokens
    busy: float = 0.0  # share of the last second spent computing steps (leader: whole steps; member: its part)
    # AMOEBAs: the executors it can merge with (its world; none outside one), its KV head units at each TP
    # degree that world can form, and the KV blocks of the longest sequence its instance runs.
    world: list[str] = Field(default_factory=list)
    kv_units: list[KvUnits] = Field(default_factory=list)
    longest_blocks: int = 0
    kv_heads: int = 0  # the model's KV heads
    merge_hold_s: float = 0.0  # a merged instance's leader: seconds before a split may be considered
    # Hard signs of memory pressure, counted since the process started: steps in which the head of the waiting
    # queue could not be admitted for want of free KV pages, and requests refused for a full queue. With
    # `preemptions` they make `pressure_events`, whose growth wakes the monitor and the controller at once.
    admission_blocked: int = 0
    rejected: int = 0
    # One decoder layer's seconds at each width over its steps of the latency window (its means' 10 s), as the latency
    # profile it was given predicts them (SplitQuant's, `morphling profile --latency`); empty without one. The
    # morph rung reads it: quantizing answers a queue that waits on compute only where fewer bits are faster
    # (policies/morph.py).
    layer_seconds: dict[int, float] = Field(default_factory=dict)
    # What a request joining the waiting queue now should wait, at the rate requests left it lately
    # (admission.queue_wait_s); None while that rate is unknown. A burst raises it at its first report, while
    # queue_delay_s, a mean over waits already over, rises only as they end: the controller's early sign of a queue.
    predicted_wait_s: float | None = None

    @property
    def pressure_events(self) -> int:
        return pressure_events(self.preemptions, self.admission_blocked, self.rejected)

    def pressure_since(self, instance: str, count: int) -> int:
        """Pressure events since a report of `instance` counted `count`; a new process counts from zero."""
        return pressure_since(self.pressure_events, self.instance, instance, count)


def pressure_since(events: int, instance: object, earlier_instance: object, earlier_events: int) -> int:
    """Pressure events a report of `instance` counting `events` adds to an earlier report's count; a new process
    (another instance) counts from zero. The monitor asks it of reports it has not validated yet."""
    return events - (earlier_events if instance == earlier_instance else 0)


def pressure_events(preemptions: int, admission_blocked: int, rejected: int) -> int:
    """The hard signs of memory pressure an executor counts (ExecutorTelemetry's fields of those names), as one
    number whose growth wakes the monitor and the controller at once."""
    return preemptions + admission_blocked + rejected


class SloWindow(Part):
    """Requests finished over the monitor's SLO window, against the configured TTFT and TPOT SLOs."""
    requests: int = 0
    violation_rate: float = 0.0  # share of them over either SLO
    ttft_p50_s: float = 0.0
    ttft_p95_s: float = 0.0
    tpot_p50_s: float = 0.0
    tpot_p95_s: float = 0.0


class ExecutorState(Part):
    executor: str
    alive: bool  # False once dead: its requests are lost
    suspect: bool = False  # silent for a while: gets no new requests, but its requests go on
    restarts: int = 0  # times it came back as a new process
    last_seen: float
    kv_usage: float  # smoothed used / total KV pages
    queue_delay_s: float  # smoothed
    waiting: float  # smoothed
    telemetry: ExecutorTelemetry  # the latest raw report
    slo: SloWindow = Field(default_factory=SloWindow)


class ClusterState(Message):
    time: float
    executors: list[ExecutorState]
    instances: list[InstancePlan] = Field(default_factory=list)  # of the live leaders


# --- commands and events --------------------------------------------------------------------------
# Each command kind has its arguments' model; `kind` names it. The issuer builds a Command from one
# (Command.of), the executor reads it back with Command.parsed_args, which refuses a bad kind or field
# with InvalidCommandError, so that a bad command is answered with a rejected CommandResult.
class CommandArgs(Part):
    model_config = ConfigDict(extra="forbid", strict=True)
    kind: ClassVar[str]


class PingArgs(CommandArgs):
    """Answer with the executor's load; changes nothing."""
    kind: ClassVar[str] = "ping"


class DrainArgs(CommandArgs):
    """Stop admitting requests; those in flight finish."""
    kind: ClassVar[str] = "drain"


class QuantizeArgs(CommandArgs):
    """Bring layers to `bits` in place; the freed slot tails become KV pages."""
    kind: ClassVar[str] = "quantize"
    layers: int | list[int]  # a count, taken in the executor's swap order, or layer indices
    bits: Literal[8, 4]


class RestoreArgs(CommandArgs):
    """Bring layers back to full precision, moving live KV out of the slot tails they take back."""
    kind: ClassVar[str] = "restore"
    layers: int | list[int]  # a count, the most recently quantized first, or layer indices


class LayerRangeArgs(CommandArgs):
    """CoCoServe's operations on a running instance (DESIGN.md, "Instances across executors"), sent to its
    leader and applied by all its members at a step boundary. `layers` is an inclusive range [a, b]."""
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    instance: str
    layers: list[int] = Field(min_length=2, max_length=2)

    @model_validator(mode="after")
    def _ordered(self):
        a, b = self.layers
        if not 0 <= a <= b:
            raise ValueError(f"layers must be [a, b] with 0 <= a <= b, got {self.layers}")
        return self

    @property
    def span(self) -> range:
        return range(self.layers[0], self.layers[1] + 1)


class ReplicateArgs(LayerRangeArgs):
    """Add a replica of layers [a, b] on member `to`, which then takes a share of the batch there."""
    kind: ClassVar[str] = "replicate"
    to: str


class MigrateArgs(LayerRangeArgs):
    """Move layers [a, b], with their live KV, from member `from` to member `to`."""
    kind: ClassVar[str] = "migrate"
    source: str = Field(alias="from")
    to: str


class EvictArgs(LayerRangeArgs):
    """Drop member `from`'s replica of layers [a, b]; its sequences' KV moves to a surviving replica."""
    kind: ClassVar[str] = "evict"
    source: str = Field(alias="from")


class BatchArgs(CommandArgs):
    """Cap the sequences the instance runs at once (CoCoServe's scale-down phase 3); running ones go on."""
    kind: ClassVar[str] = "batch"
    instance: str
    max_num_seqs: int = Field(ge=1)


class TpMergeArgs(CommandArgs):
    """AMOEBAs: merge the TP1 instances of `executors` (2 or 4, the first leads) into the TP instance
    `instance`, between two steps, running requests keeping their KV. Every one of them gets this command
    and takes its part; where the KV does not fit, all refuse alike and nothing changes."""
    kind: ClassVar[str] = "tp_merge"
    executors: list[str] = Field(min_length=2, max_length=4)
    instance: str = Field(min_length=1)
    # Seconds the instance stays merged whatever its load, so that the request it was merged for is admitted
    # before anything could split it (the leader reports what is left as merge_hold_s).
    hold_s: float = Field(default=10.0, ge=0)


class TpSplitArgs(CommandArgs):
    """AMOEBAs: split the merged instance `instance` back into TP1 instances (sent to its leader)."""
    kind: ClassVar[str] = "tp_split"
    instance: str


class JoinArgs(CommandArgs):
    """CoCoServe onto an executor serving alone: join the TP1 instance `instance` that `leader` leads, holding no
    layer until the replicate or migrate its leader got beside this brings some (sent to the newcomer; it
    hands its requests to the leader and leaves once it holds no layer)."""
    kind: ClassVar[str] = "join"
    instance: str = Field(min_length=1)
    leader: str = Field(min_length=1)


COMMAND_ARGS: dict[str, type[CommandArgs]] = {a.kind: a for a in (PingArgs, DrainArgs, QuantizeArgs, RestoreArgs,
                                                                   ReplicateArgs, MigrateArgs, EvictArgs, BatchArgs,
                                                                   TpMergeArgs, TpSplitArgs, JoinArgs)}


class Command(Message):
    seq: int  # per issuer, increasing: a repeated seq is answered from the executor's record, not re-run
    issuer: str
    kind: str  # one of COMMAND_ARGS; anything else is answered with a rejected CommandResult
    args: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, seq: int, issuer: str, args: CommandArgs) -> "Command":
        return cls(seq=seq, issuer=issuer, kind=args.kind, args=args.model_dump(by_alias=True))

    def parsed_args(self) -> CommandArgs:
        """The typed arguments; InvalidCommandError names the culprit ("kind", "args.bits", ...)."""
        model = COMMAND_ARGS.get(self.kind)
        if model is None:
            raise InvalidCommandError(f"unknown command kind {self.kind!r}; this executor takes "
                                      f"{', '.join(COMMAND_ARGS)}", "kind")
        try:
            return model.model_validate(self.args)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = ".".join(["args", *(str(part) for part in err["loc"][:1])])
            raise InvalidCommandError(f"{name}: {err['msg']}", name) from exc


class CommandResult(Message):
    seq: int
    issuer: str
    executor: str
    kind: str
    ok: bool
    error: str | None = None
    state: dict[str, Any] = Field(default_factory=dict)


class Event(Message):
    kind: str  # e.g. command, executor_up, executor_down, request_rejected, morph_started, morph_finished
    source: str
    time: float
    data: dict[str, Any] = Field(default_factory=dict)
