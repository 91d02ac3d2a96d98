"""An executor's answer to an admission, and the cancels that may come before it.

An admission is answered at once, on the asyncio side, and never waits for a step: a prefill step or a layer swap
can outlast the gateway's admission timeout, and a request refused for that is refused for nothing (vLLM's front
end validates and queues a request the same way, without its engine). The answer reads what the engine thread
leaves in its snapshot and the engine's own `check_request`, which changes nothing.

A gateway that stopped waiting for an admission (its request/reply timed out) cancels it, and the request must then
never run behind its client's back. The admission may arrive after the cancel: a cancel that finds nothing is
remembered (a bounded number of them) and refuses the admission when it comes.
"""

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from services.executor.tokenization import render
from shared.core.admission import admits, predicted_wait_s, waiting_ahead
from shared.core.errors import KvCapacityError, QueueFullError
from shared.errors import InvalidRequestError
from shared.messages import KV_CAPACITY, Admission, ErrorInfo, GenerateRequest

if TYPE_CHECKING:  # annotations only
    from services.executor.engine.engine import LLMEngine

log = logging.getLogger(__name__)

# Cancels that found no request, remembered in case the admission they meant is still on its way; a
# gateway cancels an admission only after giving up on it, within seconds, so a few thousand cover it.
UNMATCHED_CANCEL_MEMORY = 4096

Prompt = tuple[str | list[int], list[int]]  # a request's prompt as rendered, and as token ids


def rejection(executor: str, req: GenerateRequest, kind: str, message: str, param: str | None = None,
              code: str | None = None) -> Admission:
    return Admission(request_id=req.request_id, executor=executor, accepted=False,
                     error=ErrorInfo(type=kind, message=message, param=param, code=code))


def answer(executor: str, req: GenerateRequest, engine: "LLMEngine", waiting: int, running: int, max_num_seqs: int,
           departures: tuple[int, float], max_queue_wait_s: float) -> tuple[Admission, Prompt | None, bool]:
    """The answer to `req` from an engine with `waiting` requests ahead of it (those accepted and not yet added
    among them) and `running` in its batch; for an accepted request its prompt, and whether a full queue
    refused it (pressure the controller hears of)."""
    try:  # a bad request is told so (400) whatever the queue holds
        prompt = render(engine.tokenizer, req.prompt, req.messages, req.chat_template_kwargs)
        prompt_ids = engine.check_request(prompt, req.sampling, req.resume)
    except InvalidRequestError as exc:
        return rejection(executor, req, "invalid_request_error", str(exc), exc.param), None, False
    except KvCapacityError as exc:
        refused = rejection(executor, req, "unavailable", str(exc), code=KV_CAPACITY)
        return refused.model_copy(update={"prompt_tokens": exc.prompt_tokens}), None, False
    except Exception as exc:
        log.exception("executor %s: admitting %s failed", executor, req.request_id)
        return rejection(executor, req, "internal_error", f"admission failed: {type(exc).__name__}"), None, False
    ahead = waiting_ahead(waiting, running, max_num_seqs)
    # A request moving here mid-stream has a client already reading it: it is not refused for the wait.
    if not req.resume and not admits(ahead, *departures, max_queue_wait_s):
        wait = predicted_wait_s(ahead, *departures)
        return rejection(executor, req, "queue_full",
                         f"the waiting queue would hold the request about {wait:.0f} s ({ahead} requests "
                         f"ahead), longer than the {max_queue_wait_s:g} s bound"), None, True
    if waiting >= (max_waiting := engine.scheduler.max_waiting):
        return rejection(executor, req, "queue_full", str(QueueFullError(waiting, max_waiting))), None, True
    return (Admission(request_id=req.request_id, executor=executor, accepted=True, prompt_tokens=len(prompt_ids)),
            (prompt, prompt_ids), False)


class Cancels:
    """Cancels on their way to the engine thread, and those that found no request, for an admission still on its
    way; either thread may call."""

    def __init__(self):
        self._pending: set[str] = set()
        self._unmatched: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        """Never refused: a lost cancel keeps generating for a client that left. Repeats collapse."""
        with self._lock:
            self._pending.add(request_id)

    def take(self) -> set[str]:
        with self._lock:
            pending, self._pending = self._pending, set()
        return pending

    def unmatched(self, request_id: str) -> None:
        """`request_id`'s cancel found nothing: finished already, or its admission not here yet."""
        with self._lock:
            self._unmatched[request_id] = None
            while len(self._unmatched) > UNMATCHED_CANCEL_MEMORY:
                self._unmatched.popitem(last=False)

    def came_before(self, request_id: str) -> bool:
        """Whether a cancel came for `request_id` before it reached the engine (forgotten once asked)."""
        with self._lock:
            if request_id not in self._unmatched:
                return False
            del self._unmatched[request_id]
            return True
