"""Typed engine errors. Each carries the context a caller needs to report it without parsing text.

Invalid requests raise shared.errors.InvalidRequestError, which the gateway raises for the same rules.
"""

from shared.errors import InvalidRequestError


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model file or directory is missing, malformed or inconsistent."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"cannot load model from {path}: {problem}")
        self.path = path
        self.problem = problem


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is well-formed but describes an architecture or feature we do not serve."""


class MemoryBudgetError(EngineError):
    """The arena cannot hold the weights plus one full-length sequence."""


class LedgerError(EngineError):
    """A page was about to be used twice, or freed while not in use: a bug, never a user error."""


class ReshapeRefused(EngineError):
    """A CoCoServe operation cannot apply (a layer not there, no memory for it, no other member); nothing changed."""


class OutOfPagesError(EngineError):
    """An operation needs more free KV pages than there are; nothing was changed."""

    def __init__(self, needed: int, free: int, what: str):
        super().__init__(f"{what} needs {needed} free KV pages, but only {free} are free")
        self.needed = needed
        self.free = free


class QueueFullError(EngineError):
    """The waiting queue is at its bound; the request was not admitted."""

    def __init__(self, waiting: int, limit: int):
        super().__init__(f"waiting queue is full ({waiting}/{limit} requests)")
        self.waiting = waiting
        self.limit = limit


class KvCapacityError(EngineError):
    """A request whose KV is more than this engine's instance holds even empty: not invalid (a merged
    instance may hold it, AMOEBAs), so not admitted here."""

    def __init__(self, prompt_tokens: int, tokens: int, blocks: int, capacity: int):
        super().__init__(f"the request's {tokens} tokens ({prompt_tokens} in the prompt) need {blocks} KV blocks, "
                         f"but this instance holds {capacity}")
        self.prompt_tokens, self.tokens, self.blocks, self.capacity = prompt_tokens, tokens, blocks, capacity


class DuplicateRequestError(InvalidRequestError):
    """A request id the engine already holds: a caller's bug, reported like any invalid request."""

    def __init__(self, request_id: str):
        super().__init__(f"request id {request_id!r} is already in the engine", param="request_id")
        self.request_id = request_id
