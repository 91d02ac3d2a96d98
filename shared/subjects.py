"""Every NATS subject Morphling uses, in one place (DESIGN.md, "The bus")."""

PREFIX = "morphling"

STATE = f"{PREFIX}.state"  # monitor -> gateway, controller: ClusterState
EVENTS = f"{PREFIX}.events"  # anyone -> anyone: Event
TELEMETRY_ALL = f"{PREFIX}.telemetry.*"
GATEWAYS = f"{PREFIX}.gateways"  # gateway -> executors, monitor, every GATEWAY_HEARTBEAT_S: GatewayHeartbeat
GATEWAYS_GONE = f"{PREFIX}.gateways.gone"  # monitor -> executors: GatewayGone
SCALE = f"{PREFIX}.scale"  # `morphling scale` -> `morphling up`, request/reply: ScaleRequest -> ScaleReply
PEERS = f"{PREFIX}.peers"  # executor -> executors of a fabric, every PEER_HEARTBEAT_S: PeerAnnouncement


def infer(executor: str) -> str:
    """gateway -> executor, request/reply: GenerateRequest -> Admission."""
    return f"{PREFIX}.infer.{executor}"


def tokenize(executor: str) -> str:
    """gateway -> executor, request/reply: TokenizeRequest -> TokenizeReply (the served model's tokenizer)."""
    return f"{PREFIX}.tokenize.{executor}"


def detokenize(executor: str) -> str:
    """gateway -> executor, request/reply: DetokenizeRequest -> DetokenizeReply."""
    return f"{PREFIX}.detokenize.{executor}"


def tokens(gateway: str) -> str:
    """executor -> gateway: TokenBatch."""
    return f"{PREFIX}.tokens.{gateway}"


def cancel(executor: str) -> str:
    """gateway -> executor: Cancel."""
    return f"{PREFIX}.cancel.{executor}"


def telemetry(executor: str) -> str:
    """executor -> monitor, every ~100 ms (doubles as heartbeat): ExecutorTelemetry."""
    return f"{PREFIX}.telemetry.{executor}"


def command(executor: str) -> str:
    """controller/admin -> executor, request/reply: Command -> CommandResult."""
    return f"{PREFIX}.cmd.{executor}"


def executor_of(subject: str) -> str:
    """The executor id at the end of a per-executor subject."""
    return subject.rsplit(".", 1)[-1]
